"""Long trajectories in `pivotrl demos`: states that can never fit the context are skipped and
counted; a trajectory whose candidate table would exhaust memory fails at once, naming it."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from pivotrl.config import load_config
from pivotrl.errors import DataError
from pivotrl.pipeline.demos import build_demonstrations
from pivotrl.storage import ArtifactStore

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
from bench_long_trajectories import trajectory  # noqa: E402


def _config(tmp_path: Path, turns: int, *extra: str):
    src = tmp_path / "demos.jsonl"
    src.write_text(json.dumps(trajectory(turns)) + "\n" + json.dumps({**trajectory(3), "id": "short"}) + "\n")
    cfg = tmp_path / "c.yaml"
    cfg.write_text(f"run:\n  storage_root: {tmp_path / 'root'}\nwarm_start:\n  enabled: false\ndata:\n  sources:\n"
                   f"    - kind: chat\n      url: {src}\n  split:\n    warm_start: 0.0\n    pivot: 1.0\n    heldout: 0.0\n")
    return load_config(str(cfg), list(extra))


def test_states_longer_than_any_context_are_skipped_and_counted(tmp_path):
    cfg = _config(tmp_path, 100, "model.max_context=64", "rollout.max_tokens=16", "warm_start.max_len=64")
    out = build_demonstrations(cfg, ArtifactStore(cfg.run.storage_root))
    c = out["counts"]
    # History before assistant turn i has 2 + 2i messages: turns 0..31 fit 64, 68 of 100 cannot.
    assert c["assistant_turns"] == 103 and c["skipped_too_long"] == 68
    cand = ArtifactStore(cfg.run.storage_root).read_parquet(f"{out['key']}/candidates.parquet")
    assert len(cand) == 35 and max(len(json.loads(m)) for m in cand["messages"]) <= 64


def test_a_huge_trajectory_fails_fast_naming_the_record(tmp_path):
    cfg = _config(tmp_path, 5000)
    with pytest.raises(DataError, match=r"trajectory 'long-5000' \(10002 messages, 5000 assistant turns\).*GiB"):
        build_demonstrations(cfg, ArtifactStore(cfg.run.storage_root))
    assert not (Path(cfg.run.storage_root) / "demos").exists() or not list(Path(cfg.run.storage_root).rglob("*.parquet"))
