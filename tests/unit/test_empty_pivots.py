"""An empty pivot set fails the train stage with the filter's counts, unless a setting allows it."""

from __future__ import annotations

import json

import pandas as pd
import pytest

from pivotrl.config import load_config
from pivotrl.core.errors import TrainingError
from pivotrl.pipeline.entry import is_permanent
from pivotrl.pipeline.probe import apply_pivot_filter, pivot_stats, stats_markdown
from pivotrl.pipeline.results import ProbeResult, ReferenceResult
from pivotrl.pipeline.train import stage_train
from pivotrl.storage import ArtifactStore


def _empty_pivot_set(store: ArtifactStore) -> ProbeResult:
    """A probe table in which no state passes the filter: 2 all fail, 1 all pass (a float-noise
    variance), 1 above λ_diff = 0.5, 1 too long."""
    rewards = [[0, 0, 0, 0], [0, 0, 0, 0], [0.6, 0.2 + 0.4, 0.6, 0.6], [1, 1, 1, 0], []]
    from pivotrl.pivots.filter import probe_stats

    stats = [probe_stats(r) if r else (float("nan"), float("nan")) for r in rewards]
    probes = pd.DataFrame({
        "state_id": [f"s{i}" for i in range(5)], "category": ["simple_python"] * 5, "turn_index": [0] * 5,
        "status": ["ok"] * 4 + ["too_long"], "rewards": [json.dumps(r) for r in rewards],
        "mu": [m for m, _ in stats], "var": [v for _, v in stats]})
    df = apply_pivot_filter(probes, 0.5)
    counts = pivot_stats(df, 0.5)
    assert counts["total"]["kept"] == 0
    store.write_artifact("pivots/p0/pivots.parquet", pd.DataFrame({"state_id": pd.Series([], dtype=str)}),
                         kind="pivots", inputs={}, config={"lambda_diff": 0.5})
    return ProbeResult("probes/p0", store.url("probes/p0/probes.parquet"), "pivots/p0",
                       store.url("pivots/p0/pivots.parquet"), counts, stats_markdown(counts))


def _cfg(tmp_path, *extra):
    return load_config("configs/smoke.yaml", [f"run.storage_root={tmp_path / 'runs'}", *extra])


REF = ReferenceResult(base_dir="unused", base_hash="0" * 64, ref_key=None, ref_hash="1" * 64)


def test_an_empty_pivot_set_fails_the_train_stage_naming_the_counts(tmp_path):
    cfg = _cfg(tmp_path)
    assert cfg.training.allow_empty_pivots is False
    store = ArtifactStore(cfg.run.storage_root)
    probe = _empty_pivot_set(store)
    with pytest.raises(TrainingError) as e:
        stage_train(cfg, store, probe, REF)
    msg = str(e.value)
    assert "\n" not in msg and is_permanent(e.value)
    assert f"the pivot set {probe.pivots} is empty" in msg
    assert ("5 candidate states: all_fail 2, all_pass 1, above_threshold 1 (μ̂ ≥ λ_diff = 0.5), "
            "skipped 1 (too long 1, verifier error 0)") in msg
    for setting in ("probing.max_states", "probing.lambda_diff", "warm_start.enabled",
                    "training.allow_empty_pivots: true"):
        assert setting in msg
    assert store.list("train") == []  # nothing written


def test_allow_empty_pivots_trains_nothing_and_keeps_the_reference(tmp_path):
    cfg = _cfg(tmp_path, "training.allow_empty_pivots=true")
    store = ArtifactStore(cfg.run.storage_root)
    result = stage_train(cfg, store, _empty_pivot_set(store), REF)
    assert result.policy_key is None and result.summary["steps"] == 0 and result.summary["policy"] == "reference"
