"""Sharded probing (``scale_out``): shards by trajectory, merged into exactly the unsharded probe
table and pivot set; every sample kept so pass rates can be re-derived without new rollouts."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pandas as pd
import pytest

from pivotrl.pipeline import stages
from pivotrl.pipeline.results import ProbeResult
from pivotrl.pipeline.demos import build_demonstrations
from pivotrl.pipeline.probe import rederive_pivots
from pivotrl.pipeline.shards import merge_probe_shards, plan_probe_shards, probe_shard
from pivotrl.storage import ArtifactStore

from smoke_runs import smoke_config


@pytest.fixture(scope="module")
def unsharded(smoke_run):
    """The session's smoke run (conftest.py): its demonstrations, reference and unsharded probing."""
    return smoke_run[:5]


def _tables(store: ArtifactStore, probe) -> tuple[pd.DataFrame, pd.DataFrame]:
    probe = ProbeResult.of(probe)  # a stage's result, or its dict from the merge
    return (store.read_parquet(f"{probe.probes_key}/probes.parquet"),
            store.read_parquet(f"{probe.pivots_key}/pivots.parquet"))


@pytest.mark.integration
@pytest.mark.parametrize("shard_size", [1, 2])
def test_sharded_probing_equals_the_unsharded_run(unsharded, tiny_model, tmp_path, shard_size):
    cfg0, store0, _, _, probe0 = unsharded
    # The demonstrations and the warm start as published by the unsharded run: only probing is new.
    for published in ("demos", "models"):
        shutil.copytree(Path(cfg0.run.storage_root) / published, tmp_path / published)
    cfg = smoke_config(tmp_path, tiny_model, f"scale_out.probe_shard_size={shard_size}")
    store = ArtifactStore(cfg.run.storage_root)
    demos = build_demonstrations(cfg, store)
    ref = stages.stage_reference(cfg, store, demos)
    plan = plan_probe_shards(cfg, store, demos, ref)
    trajs = [t for s in plan["shards"] for t in s["trajectories"]]
    assert len(trajs) == len(set(trajs)) and all(len(s["trajectories"]) <= shard_size for s in plan["shards"])
    assert sum(s["states"] for s in plan["shards"]) == probe0.stats["total"]["candidates"] == 17
    results = [probe_shard(cfg, store, demos, ref, s) for s in plan["shards"]]
    assert [r["probed"] for r in results] == [s["states"] for s in plan["shards"]]
    out = merge_probe_shards(cfg, store, demos, ref, plan, results)
    probes, pivots = _tables(store, out)
    probes0, pivots0 = _tables(store0, probe0)
    pd.testing.assert_frame_equal(probes, probes0)
    pd.testing.assert_frame_equal(pivots, pivots0)
    assert out["stats"] == probe0.stats and out["probes_key"] == probe0.probes_key
    # A second pass finds every shard's table: nothing is probed again.
    assert [probe_shard(cfg, store, demos, ref, s)["probed"] for s in plan["shards"]] == [0] * len(plan["shards"])


@pytest.mark.integration  # it reads the session's smoke run
def test_every_sample_is_kept_and_pass_rates_rederive_without_rollouts(unsharded):
    cfg, store, _, _, probe = unsharded
    df = store.read_parquet(f"{probe.probes_key}/probes.parquet")
    m = cfg.probing.num_probes
    ok = df[df["status"] == "ok"]
    for col in ("rewards", "reasons", "samples", "sample_tokens"):
        assert all(len(json.loads(v)) == m for v in ok[col]), col
    lengths = [json.loads(v) for v in ok["sample_tokens"]]
    assert all(1 <= n <= cfg.rollout.max_tokens for ls in lengths for n in ls)
    assert list(ok["action_tokens_mean"]) == pytest.approx([sum(ls) / m for ls in lengths])
    # Same m and λ: exactly the stored pivot set.
    again = rederive_pivots(df, cfg.probing.lambda_diff)
    pivots = store.read_parquet(f"{probe.pivots_key}/pivots.parquet")
    assert sorted(again.loc[again["decision"] == "kept", "state_id"]) == sorted(pivots["state_id"])
    # Another m: μ̂ from the first 2 samples of each state, by hand.
    two = rederive_pivots(df, 0.5, num_probes=2)
    for (_, a), (_, b) in zip(ok.iterrows(), two[two["status"] == "ok"].iterrows()):
        r = json.loads(a["rewards"])[:2]
        assert b["mu"] == pytest.approx(sum(r) / 2)
        assert b["var"] == pytest.approx(sum((x - sum(r) / 2) ** 2 for x in r) / 2)
        assert len(json.loads(b["samples"])) == 2
    assert set(two["decision"]) <= {"kept", "all_fail", "all_pass", "above_threshold"}
    with pytest.raises(ValueError, match="fewer than"):
        rederive_pivots(df, 0.5, num_probes=m + 1)
