"""Long trajectories in `pivotrl demos`: the candidates table grows linearly with a trajectory's
length (states refer to its history); states that can never fit the context are skipped and
counted; a record too big to hold fails at once, naming its file and record."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pandas as pd
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from pivotrl.config import load_config
from pivotrl.data import sources
from pivotrl.data.states import frame_to_states
from pivotrl.core.errors import DataError
from pivotrl.pipeline.demos import build_demonstrations, read_histories
from pivotrl.storage import ArtifactStore

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))
from bench_long_trajectories import trajectory  # noqa: E402


def _config(tmp_path: Path, records: list[dict] | int | Path, *extra: str, on_invalid: str = "error"):
    tmp_path.mkdir(parents=True, exist_ok=True)
    if isinstance(records, int):
        records = [trajectory(records), {**trajectory(3), "id": "short"}]
    src = records if isinstance(records, Path) else tmp_path / "demos.jsonl"
    if not isinstance(records, Path):
        src.write_text("".join(json.dumps(r) + "\n" for r in records))
    cfg = tmp_path / "c.yaml"
    cfg.write_text(f"run:\n  storage_root: {tmp_path / 'root'}\nwarm_start:\n  enabled: false\ndata:\n  sources:\n"
                   f"    - kind: chat\n      url: {src}\n  on_invalid: {on_invalid}\n"
                   "  split:\n    warm_start: 0.0\n    pivot: 1.0\n    heldout: 0.0\n")
    return load_config(str(cfg), list(extra))


def _demos(cfg):
    store = ArtifactStore(cfg.run.storage_root)
    return store, build_demonstrations(cfg, store)


def test_states_longer_than_any_context_are_skipped_and_counted(tmp_path):
    cfg = _config(tmp_path, 100, "model.max_context=64", "rollout.max_tokens=16", "warm_start.max_len=64")
    store, out = _demos(cfg)
    c = out["counts"]
    # History before assistant turn i has 2 + 2i messages: turns 0..31 fit 64, 68 of 100 cannot.
    assert c["assistant_turns"] == 103 and c["skipped_too_long"] == 68
    cand = store.read_parquet(f"{out['key']}/candidates.parquet")
    assert len(cand) == 35 and cand["history_len"].max() == 64
    states = frame_to_states(cand, read_histories(store, out["key"]))
    assert max(len(s.messages) for s in states) == 64 and states[0].messages[0].role == "system"


def test_the_candidates_table_grows_linearly_with_the_trajectory(tmp_path):
    # Copying each state's history made this table grow with the square of the length (2,000
    # turns: ~100x the table of 200 turns); referring to it, ~10x.
    sizes, rows = {}, {}
    for turns in (200, 2000):
        store, out = _demos(_config(tmp_path / str(turns), turns))
        sizes[turns] = store.read_manifest(f"{out['key']}/candidates.parquet").size
        cand = store.read_parquet(f"{out['key']}/candidates.parquet")
        rows[turns] = int(cand.memory_usage(deep=True).sum())
        assert out["counts"]["skipped_too_long"] == 0 and len(cand) == turns + 3
    assert sizes[2000] / sizes[200] < 12 and rows[2000] / rows[200] < 12, (sizes, rows)
    traj = store.read_parquet(f"{out['key']}/trajectories.parquet")
    assert sizes[2000] < 2 * len(traj["record"].iloc[0])  # about the size of the trajectory itself


def _huge(n_bytes: int) -> dict:
    rec = trajectory(2)
    rec["id"] = "huge"
    rec["messages"][1]["content"] = "x" * n_bytes
    return rec


def test_a_huge_record_fails_naming_the_file_and_record(tmp_path, monkeypatch):
    monkeypatch.setattr(sources, "MAX_RECORD_BYTES", 1 << 20)
    cfg = _config(tmp_path, [trajectory(3), _huge(3 << 20)])
    with pytest.raises(DataError, match=r"demos\.jsonl line 2 'huge': the record is 3 MiB, more than the 1 MiB"):
        _demos(cfg)
    assert not list((tmp_path / "root").rglob("*.parquet"))
    # Quarantined like any bad record: the rest loads.
    cfg = _config(tmp_path / "q", [trajectory(3), _huge(3 << 20)], on_invalid="quarantine")
    store, out = _demos(cfg)
    assert out["counts"]["trajectories"] == 1 and out["counts"]["quarantined"] == 1
    q = store.read_text(f"{out['key']}/quarantine.jsonl")
    assert '"record": "line 2"' in q and '"id": "huge"' in q and "3 MiB" in q


def test_a_huge_parquet_record_names_the_row(tmp_path, monkeypatch):
    monkeypatch.setattr(sources, "MAX_RECORD_BYTES", 1 << 20)
    rows = [trajectory(3), _huge(2 << 20)]
    path = tmp_path / "demos.parquet"
    pd.DataFrame([{"id": r["id"], "messages": json.dumps(r["messages"]), "tools": json.dumps(r["tools"])}
                  for r in rows]).to_parquet(path)
    with pytest.raises(DataError, match=r"demos\.parquet row 1 column messages 'huge': the record is 2 MiB"):
        sources.load_trajectories(str(path))
    # Nested values cannot be measured before they are read: the trajectory table's check names them.
    nested = tmp_path / "nested.parquet"
    pq.write_table(pa.Table.from_pylist([{"id": r["id"], "messages": r["messages"], "tools": json.dumps(r["tools"])}
                                         for r in rows]), nested)
    cfg = _config(tmp_path / "n", nested)
    with pytest.raises(DataError, match=r"trajectory 'huge' of data\.sources\[0\] \(.*nested\.parquet\): the record is 2 MiB"):
        _demos(cfg)
