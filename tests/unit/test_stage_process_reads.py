"""One probe stage process does each piece of set-up work once: it parses its config spec once,
resolves ``model.dtype: auto`` once (pivotrl.runtime.precision, memoised per process) and reads
the demonstrations' ``candidates.parquet`` once (pivotrl.pipeline.probe_stage.stage_probe passes
the table to the plan, the shards and the merge)."""

from __future__ import annotations

from collections import Counter
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def smoke_inputs(tmp_path_factory):
    """The smoke config (tiny model, no warm start, two probed states), its demonstrations and
    reference, built in this process before anything is counted."""
    from pivotrl.config import load_config
    from pivotrl.pipeline import stages
    from pivotrl.pipeline.demos import build_demonstrations
    from pivotrl.storage import ArtifactStore
    from pivotrl.testing import save_tiny_checkpoint

    tmp = tmp_path_factory.mktemp("reads")
    model = save_tiny_checkpoint(tmp / "tiny")
    cfg = load_config(str(REPO / "configs" / "smoke.yaml"),
                      [f"run.storage_root={tmp / 'root'}", f"model.source={model}", "model.dtype=auto",
                       "warm_start.enabled=false", "probing.max_states=2"])
    store = ArtifactStore(cfg.run.storage_root)
    demos = build_demonstrations(cfg, store)
    ref = stages.stage_reference(cfg, store, demos)
    return cfg, demos, ref


def test_a_probe_stage_process_parses_resolves_the_dtype_and_reads_the_candidates_once(smoke_inputs, monkeypatch):
    import pivotrl.config
    from pivotrl.pipeline.entry import run_stage
    from pivotrl.runtime import precision
    from pivotrl.storage.store import ArtifactStore

    cfg, demos, ref = smoke_inputs
    counts: Counter[str] = Counter()
    precision._resolved.cache_clear()  # as in a fresh stage process

    def counted(name, fn):
        def wrapper(*a, **k):
            counts[name] += 1
            return fn(*a, **k)
        return wrapper

    monkeypatch.setattr(precision, "resolve_precision", counted("dtype", precision.resolve_precision))
    monkeypatch.setattr(pivotrl.config, "parse_config", counted("parse", pivotrl.config.parse_config))
    read = ArtifactStore.read_parquet

    def read_parquet(self, key):
        counts[key.rsplit("/", 1)[-1]] += 1
        return read(self, key)

    monkeypatch.setattr(ArtifactStore, "read_parquet", read_parquet)
    out = run_stage("probe", cfg.model_dump(mode="json"), {"demos": demos, "reference": ref.to_dict()})
    assert out["pivots_key"].startswith("pivots/")
    assert counts["parse"] == 1
    assert counts["dtype"] == 1
    assert counts["candidates.parquet"] == 1
