"""The warm rollout engine a shard worker keeps (pivotrl.pipeline.warm_engine.shard_engine): evaluation
shards reuse it across policies and shards; a probe shard never gets one whose weights were swapped."""

from __future__ import annotations

from pathlib import Path

from pivotrl.config import load_config
from pivotrl.pipeline import warm_engine as shards
from pivotrl.testing import save_tiny_checkpoint

REPO = Path(__file__).resolve().parents[2]


def test_a_warm_engine_with_swapped_weights_is_rebuilt_for_probing(tmp_path):
    tiny = save_tiny_checkpoint(tmp_path / "tiny")
    cfg = load_config(str(REPO / "configs" / "smoke.yaml"), [f"run.storage_root={tmp_path}", f"model.source={tiny}"])
    try:
        first, reused = shards.shard_engine(cfg, tiny, True, any_weights=True)  # an evaluation shard
        assert not reused
        again, reused = shards.shard_engine(cfg, tiny, True, any_weights=True)  # the next one: warm
        assert reused and again is first
        probe, reused = shards.shard_engine(cfg, tiny, True)  # a probe shard on the same model
        assert not reused and probe is not first and list(shards._WARM.values()) == [probe]
        assert shards.shard_engine(cfg, tiny, True) == (probe, True)
    finally:
        for engine in shards._WARM.values():
            engine.close()
        shards._WARM.clear()
        shards._SWAPPED.clear()
