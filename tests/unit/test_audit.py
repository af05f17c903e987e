"""The data audit at load: BFCL gold replayed (failing calls flagged and kept out), and the
load-time rejections of chat records (each naming file, line, id and field; quarantinable)."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from pivotrl.config import load_config
from pivotrl.data.audit import audit_bfcl_replay, failure_status, is_flagged
from pivotrl.data.bfcl import load_bfcl
from pivotrl.data.sources import load_trajectories
from pivotrl.errors import DataError
from pivotrl.pipeline.demos import build_demonstrations
from pivotrl.storage import ArtifactStore

#: multi_turn_base tasks whose gold calls report a failure when replayed (found by the audit).
FLAGGED = ["multi_turn_base_153", "multi_turn_base_154", "multi_turn_base_181", "multi_turn_base_188"]


def test_failure_status_reads_errors_and_false_statuses():
    assert failure_status("Error during execution: division by zero").startswith("execution error")
    assert failure_status('{"error": "No such file"}') == "error status: No such file"
    assert failure_status('{"authentication_status": false}') == "failure status: authentication_status=false"
    assert failure_status('{"success": false}') == "failure status: success=false"
    assert failure_status('{"success": true, "status": "ok"}') is None
    assert failure_status('{"current_working_directory": "document"}') is None
    assert failure_status("None") is None and failure_status("[1, 2]") is None


def test_a_replay_that_does_not_reproduce_is_flagged():
    where, calls = ["turn 0 call 0", "turn 0 call 1"], ["a()", "b()"]
    same = (["1", "2"], {"X": {"v": 1}})
    assert audit_bfcl_replay(same, same, where, calls) == []
    assert audit_bfcl_replay(same, (["1", "3"], {"X": {"v": 1}}), where, calls) == [
        "replay does not reproduce: output of turn 0 call 1 differs"]
    assert audit_bfcl_replay(same, (["1", "2"], {"X": {"v": 2}}), where, calls) == [
        "replay does not reproduce: final state differs"]
    failing = (['{"error": "nope"}', "2"], {})
    assert audit_bfcl_replay(failing, failing, where, calls) == ["turn 0 call 0 'a()': error status: nope"]


def test_bfcl_gold_is_replayed_and_failing_tasks_are_flagged():
    trajs = load_bfcl(["multi_turn_base"], os.environ["PIVOTRL_CACHE_DIR"])
    flagged = [t for t in trajs if is_flagged(t)]
    assert [t.id for t in flagged] == FLAGGED
    t188 = next(t for t in flagged if t.id == "multi_turn_base_188")
    assert t188.meta["audit_flags"] == [
        "turn 4 call 0 \"authenticate_twitter(password='michael_cant_smith_smith', username='michael_smith')\": "
        "failure status: authentication_status=false"]


def _bfcl_config(root: Path, *extra: str):
    return load_config(None, [f"run.storage_root={root}", "data.sources=[{kind: bfcl, categories: [multi_turn_base]}]",
                              *extra])


def test_flagged_tasks_are_counted_recorded_and_kept_out_unless_asked(tmp_path):
    cfg = _bfcl_config(tmp_path / "root")
    store = ArtifactStore(cfg.run.storage_root)
    out = build_demonstrations(cfg, store)
    c = out["counts"]
    assert (c["flagged"], c["flagged_ids"], c["flagged_kept"]) == (4, FLAGGED, False)
    assert c["trajectories_per_split"]["flagged"] == 4
    traj_df = store.read_parquet(f"{out['key']}/trajectories.parquet")
    cand = store.read_parquet(f"{out['key']}/candidates.parquet")
    assert set(traj_df[traj_df["id"].isin(FLAGGED)]["split"]) == {"flagged"}
    # No warm-start, pivot or held-out row comes from a flagged task.
    in_use = cand[cand["split"].isin(["warm_start", "pivot", "heldout"])]
    assert not in_use["trajectory_id"].isin(FLAGGED).any() and len(in_use) == len(cand) - (cand["split"] == "flagged").sum()
    # Recorded in lineage: an artifact with a manifest, listing each task and its flags.
    assert store.read_manifest(f"{out['key']}/flagged.jsonl").kind == "flagged"
    lines = [json.loads(x) for x in store.read_bytes(f"{out['key']}/flagged.jsonl").decode().splitlines()]
    assert [x["id"] for x in lines] == FLAGGED and all(x["flags"] for x in lines)
    # The setting keeps them (a different demonstrations key: nothing is reused across the two).
    kept_cfg = _bfcl_config(tmp_path / "root", "quality.keep_flagged=true")
    kept = build_demonstrations(kept_cfg, store)
    assert kept["key"] != out["key"] and kept["counts"]["flagged_kept"] is True
    assert "flagged" not in kept["counts"]["trajectories_per_split"]


# ---------------------------------------------------------------------------------- chat records
TOOL = {"type": "function", "function": {"name": "area", "description": "area of a rectangle", "parameters": {
    "type": "object", "properties": {"w": {"type": "number"}, "h": {"type": "integer", "minimum": 0}},
    "required": ["w", "h"]}}}


def record(rid: str, arguments: str, tool: dict = TOOL) -> str:
    return json.dumps({"id": rid, "tools": [tool], "messages": [
        {"role": "user", "content": "area of 2 by 3?"},
        {"role": "assistant", "content": "", "tool_calls": [
            {"id": "c1", "type": "function", "function": {"name": "area", "arguments": arguments}}]},
        {"role": "tool", "tool_call_id": "c1", "content": "6"}]})


BAD_SCHEMA = {"type": "function", "function": {"name": "area", "parameters": {"type": "object", "properties": {
    "w": {"type": "float"}}}}}

REJECTIONS = [
    (record("nan", '{"w": NaN, "h": 3}'),
     r"line 2 'nan'\.messages\[1\]\.tool_calls\[0\]\.function\.arguments\.w: NaN or Infinity"),
    (record("inf", '{"w": 2, "h": [Infinity]}'),
     r"line 2 'inf'\.messages\[1\]\.tool_calls\[0\]\.function\.arguments\.h\[0\]: NaN or Infinity"),
    (record("schema", '{"w": 2}', BAD_SCHEMA),
     r"line 2 'schema'\.tools\[0\]\.function\.parameters: not a valid JSON Schema"),
    (record("args", '{"w": 2, "h": -3}'),
     r"line 2 'args'\.messages\[1\]\.tool_calls\[0\]\.function\.arguments\.h: does not match the tool's parameters"),
    (record("missing", '{"w": 2}'),
     r"line 2 'missing'\.messages\[1\]\.tool_calls\[0\]\.function\.arguments: does not match .*'h' is a required"),
]


@pytest.mark.parametrize("line, pattern", REJECTIONS, ids=["nan", "inf", "schema", "args", "missing"])
def test_each_load_time_rejection_names_file_line_id_and_field(tmp_path, line, pattern):
    src = tmp_path / "demo.jsonl"
    src.write_text(record("ok", '{"w": 2.5, "h": 3}') + "\n" + line + "\n")
    with pytest.raises(DataError, match=rf"demo\.jsonl {pattern}"):
        load_trajectories(str(src))
    quarantine: list[dict] = []
    got = load_trajectories(str(src), on_invalid="quarantine", quarantine=quarantine)
    assert [t.id for t in got] == ["ok"]
    (q,) = quarantine
    assert (q["record"], q["id"]) == ("line 2", json.loads(line)["id"]) and q["field"] != "record"


def test_a_source_whose_records_are_all_rejected_is_reported_in_quarantine_mode(tmp_path):
    bad = tmp_path / "bad.jsonl"
    bad.write_text("".join(r[0] + "\n" for r in REJECTIONS))
    good = tmp_path / "good.jsonl"
    good.write_text(record("ok1", '{"w": 1, "h": 1}') + "\n" + record("ok2", '{"w": 2, "h": 2}') + "\n")
    cfg = load_config(None, [f"run.storage_root={tmp_path / 'root'}", "data.on_invalid=quarantine",
                             f"data.sources=[{{kind: chat, url: '{bad}'}}, {{kind: chat, url: '{good}'}}]",
                             "warm_start.enabled=false", "data.split.warm_start=0.0", "data.split.pivot=0.5",
                             "data.split.heldout=0.5"])
    out = build_demonstrations(cfg, ArtifactStore(cfg.run.storage_root))
    assert out["counts"]["trajectories"] == 2 and out["counts"]["quarantined"] == len(REJECTIONS) + 1
