"""The data audit at load: the replay of BFCL gold (tests/integration/test_bfcl_records.py), and the
load-time rejections of chat records (each naming file, line, id and field; quarantinable)."""

from __future__ import annotations

import json

import pytest

from pivotrl.config import load_config
from pivotrl.data.audit import audit_bfcl_replay, failure_status
from pivotrl.data.sources import load_trajectories
from pivotrl.errors import DataError
from pivotrl.pipeline.demos import build_demonstrations
from pivotrl.storage import ArtifactStore


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
    # The bad records only: the source's "all quarantined" note is in quarantine.jsonl, not in the count.
    assert out["counts"]["trajectories"] == 2 and out["counts"]["quarantined"] == len(REJECTIONS)


# ------------------------------------------- every demonstration action parses with the run's parser
def chat(rid: str, *assistant: dict) -> str:
    msgs = [{"role": "user", "content": "area of 2 by 3?"}]
    for a in assistant:
        msgs += [{"role": "assistant", **a}, {"role": "user", "content": "and?"}]
    return json.dumps({"id": rid, "tools": [TOOL], "messages": msgs[:-1]})


CALL = {"content": "", "tool_calls": [{"id": "c1", "type": "function",
                                       "function": {"name": "area", "arguments": '{"w": 2, "h": 3}'}}]}
PARSER_CASES = [  # (record, the parser, None if it loads, else the error's pattern)
    (chat("bracket", {"content": "[1] is the first footnote."}), "pythonic",
     r"'bracket'\.messages\[1\]\.content: the text turn '\[1\] is the first footnote\.' does not parse "
     r"with the pythonic parser"),
    (chat("a-call-as-text", {"content": "[area(w=1, h=1)]"}), "pythonic",
     r"'a-call-as-text'\.messages\[1\]\.content: the text turn .* reads as tool calls with the pythonic parser"),
    (chat("empty", {"content": "Let me compute."}, {"content": "  "}), "pythonic",
     r"'empty'\.messages\[3\]\.content: an empty assistant message \(no text, no tool call\) is not an action"),
    (chat("tagged", {"content": 'Use <tool_call>{"name": "area", "arguments": {}}</tool_call> to ask.'}), "hermes",
     r"'tagged'\.messages\[1\]\.content: the text turn .* reads as tool calls with the hermes parser"),
    (chat("bracket-under-hermes", {"content": "[1] is the first footnote."}), "hermes", None),
    (chat("call", CALL, {"content": "It is 6."}), "hermes", None),
    (chat("call", CALL, {"content": "It is 6."}), "pythonic", None),
]


@pytest.mark.parametrize("line, parser, pattern", PARSER_CASES,
                         ids=[f"{json.loads(c[0])['id']}-{c[1]}" for c in PARSER_CASES])
def test_every_demonstration_action_parses_with_the_runs_parser(tmp_path, line, parser, pattern):
    src = tmp_path / "demo.jsonl"
    src.write_text(line + "\n")
    if pattern is None:
        (traj,) = load_trajectories(str(src), tool_parser=parser)
        assert traj.id == json.loads(line)["id"]
        return
    with pytest.raises(DataError, match=rf"demo\.jsonl line 1 {pattern}"):
        load_trajectories(str(src), tool_parser=parser)
    quarantine: list[dict] = []
    assert load_trajectories(str(src), on_invalid="quarantine", quarantine=quarantine, tool_parser=parser) == []
    assert [q["id"] for q in quarantine] == [json.loads(line)["id"]]


def test_the_demonstrations_are_audited_with_the_configured_parser(tmp_path):
    """A text turn starting with '[' is quarantined under the default (auto: pythonic) and kept
    when the run's parser is hermes; the count names only the bad record."""
    src = tmp_path / "demo.jsonl"
    src.write_text(chat("bracket", {"content": "[1] is the first footnote."}) + "\n"
                   + chat("ok", CALL, {"content": "It is 6."}) + "\n")
    counts = {}
    for parser in ("auto", "hermes"):
        cfg = load_config(None, [f"run.storage_root={tmp_path / parser}", "data.on_invalid=quarantine",
                                 f"data.sources=[{{kind: chat, url: '{src}'}}]", f"prompt.tool_parser={parser}",
                                 "warm_start.enabled=false", "data.split.warm_start=0.0", "data.split.pivot=0.5",
                                 "data.split.heldout=0.5"])
        out = build_demonstrations(cfg, ArtifactStore(cfg.run.storage_root))
        counts[parser] = (out["counts"]["trajectories"], out["counts"]["quarantined"])
    assert counts == {"auto": (1, 1), "hermes": (2, 0)}
