"""The warm rollout engine a shard worker keeps (pivotrl.pipeline.warm_engine.shard_engine): evaluation
shards reuse it across policies and shards; a probe shard never gets one whose weights were swapped."""

from __future__ import annotations

from pathlib import Path

from pivotrl.config import load_config
from pivotrl.pipeline import common, warm_engine as shards
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


def test_a_warm_engine_is_kept_exactly_while_the_settings_it_was_built_with_hold(tmp_path):
    """The warm key is what the engine is built with (rollout_engine_settings): a change that reaches
    the engine rebuilds it, one that only reaches the requests (rollout.max_tokens) keeps it; every
    vLLM setting, prefix caching and threads included, is in the key."""
    tiny = save_tiny_checkpoint(tmp_path / "tiny")
    cfg = load_config(str(REPO / "configs" / "smoke.yaml"), [f"run.storage_root={tmp_path}", f"model.source={tiny}"])

    def with_(section: str, **update):
        return cfg.model_copy(update={section: getattr(cfg, section).model_copy(update=update)})

    try:
        first, _ = shards.shard_engine(cfg, tiny, True)
        assert shards.shard_engine(with_("rollout", max_tokens=cfg.rollout.max_tokens + 7), tiny, True) == (first, True)
        other, reused = shards.shard_engine(with_("model", max_context=cfg.model.max_context // 2), tiny, True)
        assert not reused and other is not first and list(shards._WARM.values()) == [other]
    finally:
        for engine in shards._WARM.values():
            engine.close()
        shards._WARM.clear()
        shards._SWAPPED.clear()
    vllm = with_("rollout", engine="vllm")
    name, kwargs = common.rollout_engine_settings(vllm)
    assert name == "vllm" and kwargs["block_size"] == vllm.rollout.block_size
    for section, update in (("rollout", {"enable_prefix_caching": not vllm.rollout.enable_prefix_caching}),
                            ("rollout", {"num_threads": 1 + (vllm.rollout.num_threads or 1)}),
                            ("rollout", {"kv_cache_gib": 1 + (vllm.rollout.kv_cache_gib or 1)}),
                            ("run", {"seed": vllm.run.seed + 1})):
        changed = vllm.model_copy(update={section: getattr(vllm, section).model_copy(update=update)})
        assert common.rollout_engine_settings(changed) != (name, kwargs), (section, update)
