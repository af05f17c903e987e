"""Rollout engine contract: sampling settings, one generated sample, the engine protocol.

Shape legend (spec): K = group size (samples per prompt, ``SamplingConfig.n``), P = prompt
(state) tokens, T = action tokens.

``rollout_logprobs`` convention: every engine reports, for each sampled token, its log-probability
under the model's *unscaled* next-token distribution (``log_softmax(logits)``, temperature 1, no
top-p/top-k truncation), i.e. the same quantity a plain trainer forward pass computes. Sampling
itself uses the temperature / top-p / top-k of ``SamplingConfig``. Engine log-probs are for
diagnostics and agreement checks; PivotRL's π_old log-probs are recomputed by the trainer.
"""

from __future__ import annotations

import importlib
import math
from dataclasses import dataclass, field
from typing import Any, Callable, Protocol, Sequence, runtime_checkable

from pivotrl.core.errors import ConfigError
from pivotrl.core.registry import Registry

FINISH_STOP = "stop"  # eos or a stop string was produced
FINISH_LENGTH = "length"  # max_tokens (or the context limit) reached
FINISH_ABORT = "abort"  # stop_fn declared the partial output hopeless


@dataclass(frozen=True)
class SamplingConfig:
    """How to sample K = ``n`` actions per prompt.

    Attributes:
        n: samples per prompt (K ≥ 1).
        temperature: softmax temperature (> 0; 0 means greedy argmax).
        top_p: nucleus mass in (0, 1]; 1 disables.
        top_k: keep the k most likely tokens; 0 disables.
        max_tokens: maximum generated tokens per sample (≥ 1), eos included.
        seed: base seed; with a seed, outputs are reproducible for the same engine and inputs.
        stop: stop strings; generation ends once the decoded text contains one (the text is cut
            before it, the tokens are kept as produced).
    """

    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    max_tokens: int = 128
    seed: int | None = None
    stop: tuple[str, ...] = field(default_factory=tuple)

    def __post_init__(self) -> None:
        if not isinstance(self.n, int) or self.n < 1:
            raise ConfigError(f"sampling.n must be an integer >= 1, got {self.n!r}")
        if not (isinstance(self.temperature, (int, float)) and math.isfinite(self.temperature)) or self.temperature < 0:
            raise ConfigError(f"sampling.temperature must be >= 0 (0 = greedy), got {self.temperature!r}")
        if not 0.0 < self.top_p <= 1.0:
            raise ConfigError(f"sampling.top_p must be in (0, 1], got {self.top_p!r}")
        if not isinstance(self.top_k, int) or self.top_k < 0:
            raise ConfigError(f"sampling.top_k must be an integer >= 0 (0 = off), got {self.top_k!r}")
        if not isinstance(self.max_tokens, int) or self.max_tokens < 1:
            raise ConfigError(f"sampling.max_tokens must be an integer >= 1, got {self.max_tokens!r}")
        if isinstance(self.stop, str):
            raise ConfigError(f"sampling.stop must be a sequence of strings, got the string {self.stop!r}")
        object.__setattr__(self, "stop", tuple(self.stop))


@dataclass(frozen=True)
class Generation:
    """One sampled action.

    Attributes:
        token_ids: (T,) generated token ids, including the eos token if one was produced.
        text: decoded text without special tokens (cut before a matched stop string).
        rollout_logprobs: (T,) float log π(token | prefix) under the unscaled distribution
            (temperature 1), one per entry of ``token_ids``.
        finish_reason: "stop" (eos / stop string), "length" (max_tokens or context) or
            "abort" (``stop_fn`` rejected the partial text).
    """

    token_ids: list[int]
    text: str
    rollout_logprobs: list[float]
    finish_reason: str


StopFn = Callable[[str], bool]


@runtime_checkable
class RolloutEngine(Protocol):
    """What the prober, trainer and evaluator need from a sampler."""

    def generate(
        self, prompts: Sequence[list[int]], sampling: SamplingConfig
    ) -> list[list[Generation]]:
        """Sample ``sampling.n`` actions per prompt → ``[len(prompts)][n]`` generations."""
        ...

    def score(self, prompts: Sequence[list[int]], actions: Sequence[list[int]]) -> list[list[float]]:
        """Per-token log π(action_t | prompt, action_<t) (temperature 1) → ``[len(prompts)][T_i]``."""
        ...

    def load_weights(self, checkpoint_dir: str) -> None:
        """Replace the model's weights by those of an HF checkpoint with the same architecture."""
        ...

    def update_weights(self, block: str, meta: Sequence[Any]) -> None:
        """Replace the model's weights by those of a shared-memory block
        (``pivotrl.rollout.weight_sync.SharedWeights``: its name and tensor metadata)."""
        ...

    def close(self) -> None:
        """Release the engine's processes and memory."""
        ...


# name → "module:attribute" of a factory; modules are imported only when the name is used,
# so ``import pivotrl.rollout`` never imports vLLM.
ROLLOUT_ENGINES: Registry[str] = Registry("rollout engine")
ROLLOUT_ENGINES.register("transformers")("pivotrl.rollout.hf:TransformersEngine")
ROLLOUT_ENGINES.register("vllm")("pivotrl.rollout.vllm:VLLMEngine")


def make_engine(
    name: str, model_dir: str, *, dtype: str = "bf16", max_model_len: int = 8192, **kwargs: Any
) -> RolloutEngine:
    """Build the rollout engine registered as ``name`` ("transformers" or "vllm").

    ``model_dir`` is an HF checkpoint directory (see ``pivotrl.runtime.models.resolve_model``);
    ``dtype`` is "fp32" or "bf16"; further keyword arguments go to the engine's constructor.

    Raises:
        ConfigError: unknown engine name (lists the valid ones) or a bad option.
        ModelError: the checkpoint cannot be loaded.
    """
    target = ROLLOUT_ENGINES.get(name)
    module_name, attr = target.split(":")
    factory = getattr(importlib.import_module(module_name), attr)
    return factory(model_dir, dtype=dtype, max_model_len=max_model_len, **kwargs)


def generate_groups(engine: Any, groups: Sequence[tuple[Sequence[list[int]], SamplingConfig]],
                    on_done: Callable[[int], Any] | None = None) -> list[list[list[Generation]]]:
    """Several batches of prompts, each with its own sampling settings, as
    ``[engine.generate(prompts, sampling) for prompts, sampling in groups]`` would sample them (each
    prompt seeded by its position in its own batch).

    An engine with a ``generate_groups`` method serves them together (vLLM: one scheduler pass, so
    a batch of short greedy answers fills the tail of a batch of m samples); any other engine gets
    one ``generate`` call per batch. ``on_done(k)``: called as k more prompts have all their
    samples (vLLM: each prompt as it finishes inside the pass; otherwise each batch).

    Returns:
        ``[len(groups)][len(prompts)][n]`` generations.
    """
    own = getattr(engine, "generate_groups", None)
    if callable(own):
        import inspect

        takes = on_done is not None and "on_done" in inspect.signature(own).parameters
        out = own(groups, on_done=on_done) if takes else own(groups)
        if on_done is not None and not takes:
            on_done(sum(len(prompts) for prompts, _ in groups))
        return out
    out = []
    for prompts, sampling in groups:
        out.append(engine.generate(prompts, sampling))
        if on_done is not None:
            on_done(len(prompts))
    return out


def check_prompts(prompts: Sequence[list[int]], vocab_size: int, max_model_len: int) -> None:
    """Raise ConfigError for an empty prompt, an out-of-vocabulary id or P >= ``max_model_len``.

    Prompts need not leave room for ``max_tokens``: generation stops at ``max_model_len`` total
    tokens with finish_reason "length".
    """
    for i, prompt in enumerate(prompts):
        if len(prompt) == 0:
            raise ConfigError(f"prompt {i} is empty")
        if len(prompt) >= max_model_len:
            raise ConfigError(
                f"prompt {i} has {len(prompt)} tokens; max_model_len is {max_model_len} (prompt must be shorter)"
            )
        bad = [t for t in prompt if not 0 <= int(t) < vocab_size]
        if bad:
            raise ConfigError(f"prompt {i} has token ids outside [0, {vocab_size}): {bad[:5]}")


DTYPES = {"fp32": "float32", "bf16": "bfloat16", "float32": "float32", "bfloat16": "bfloat16"}


def normalise_dtype(dtype: str) -> str:
    """"fp32"/"float32" → "float32", "bf16"/"bfloat16" → "bfloat16"; ConfigError otherwise."""
    try:
        return DTYPES[dtype]
    except KeyError:
        raise ConfigError(f"engine dtype must be one of fp32, bf16; got {dtype!r}") from None
