"""The rollout engine a shard worker keeps warm between shards.

A Ray worker runs many probe and evaluation shards; building a vLLM engine costs tens of seconds,
so the worker keeps one engine per (model directory, engine settings) and hands it to its next
shard; the settings are what the engine is built with (``rollout_engine_settings``), so a setting
that reaches the engine also decides whether a warm one fits. An evaluation shard swaps policies' weights into it, so such an engine is marked as holding
other weights than its directory's, and a probe shard (which must sample the reference) rebuilds it.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from pivotrl.config import RunConfig
from pivotrl.core.hashing import content_hash
from pivotrl.pipeline.common import make_rollout_engine, rollout_engine_settings

# One warm engine per worker process: key (model dir, the engine's settings as built) → engine.
_WARM: dict[str, Any] = {}
# Keys of warm engines that hold other weights than their model dir's (an evaluation shard swapped them).
_SWAPPED: set[str] = set()


def shard_engine(cfg: RunConfig, model_dir: Path, warm: bool, *, any_weights: bool = False) -> tuple[Any, bool]:
    """``(engine, reused)``: the rollout engine on ``model_dir``; with ``warm``, the one this process
    keeps for its shards (built on first use; an engine on another model is closed first).

    ``any_weights``: the caller loads the weights it needs itself (evaluation shards swap policies),
    so a warm engine built on ``model_dir`` is reused whatever it holds, and is marked as holding
    other weights; without it such an engine is rebuilt (a probe shard never sees swapped weights).
    """
    if not warm:
        return make_rollout_engine(cfg, model_dir), False
    key = f"{Path(model_dir).resolve()}|{content_hash(rollout_engine_settings(cfg))}"
    if key in _WARM and (any_weights or key not in _SWAPPED):
        if any_weights:
            _SWAPPED.add(key)
        return _WARM[key], True
    close_warm_engines()  # a new reference: free the old engine first
    _WARM[key] = make_rollout_engine(cfg, model_dir)
    if any_weights:
        _SWAPPED.add(key)
    return _WARM[key], False


def close_warm_engines() -> None:
    """Close every engine this process keeps warm."""
    for old in _WARM.values():
        old.close()
    _WARM.clear()
    _SWAPPED.clear()
