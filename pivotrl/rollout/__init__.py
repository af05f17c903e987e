"""Rollout engines: sample K actions per turn state and score actions (log-probs).

Backends are imported lazily through :func:`make_engine`: importing this package never imports
vLLM. ``"transformers"`` → :class:`pivotrl.rollout.hf.TransformersEngine` (own sampling loop,
shared-prompt KV reuse); ``"vllm"`` → :class:`pivotrl.rollout.vllm.VLLMEngine`.
"""

from __future__ import annotations

from pivotrl.rollout.base import (
    FINISH_ABORT,
    FINISH_LENGTH,
    FINISH_STOP,
    ROLLOUT_ENGINES,
    Generation,
    RolloutEngine,
    SamplingConfig,
    make_engine,
)

__all__ = [
    "FINISH_ABORT",
    "FINISH_LENGTH",
    "FINISH_STOP",
    "ROLLOUT_ENGINES",
    "Generation",
    "RolloutEngine",
    "SamplingConfig",
    "make_engine",
]
