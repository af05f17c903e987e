"""The data audit at load: the replay of BFCL gold (tests/integration/test_bfcl_records.py), and the
load-time rejections of chat records (each naming file, line, id and field; quarantinable)."""

from __future__ import annotations

import json

import pytest

from pivotrl.config import load_config
from pivotrl.data.audit import (audit_bfcl_replay, audit_bfcl_turn, failure_status, not_in_history_flags,
                                 underivable_values)
from pivotrl.data.sources import load_trajectories
from pivotrl.core.errors import DataError
from pivotrl.pipeline.demos import build_demonstrations, flag_kind
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


SEEN = ("Send 'hi' to Bob (user id USR001 is me). The number on my passport is P followed by 12345678. "
        '{"current_directory_content": ["report1.txt"]} {"order_id": 12446}')


@pytest.mark.parametrize("arguments, missing", [
    ({"receiver_id": "USR002", "message": "hi"}, [("receiver_id", "USR002", "USR002")]),  # an id never shown
    ({"receiver_id": "usr001"}, []),  # case-insensitive
    ({"source": "report1.txt"}, []), ({"source": "report2.txt"}, [("source", "report2.txt", "report2")]),
    ({"passport_number": "P12345678"}, []),  # letters around a long number may be spelled out
    ({"passport_number": "P9999"}, [("passport_number", "P9999", "P9999")]),
    ({"order_id": 12446}, []), ({"order_id": 54321}, [("order_id", 54321, "54321")]),  # an integer *_id
    ({"ticket_id": "ticket_007"}, [("ticket_id", "ticket_007", "007")]), ({"booking_id": "3426"}, [("booking_id", "3426", "3426")]),
    ({"ticket_id": "ticket_001"}, []),  # lenient: "001" occurs (in "USR001")
    # Not checked: free text, words, codes without digits, dates, other numbers, booleans.
    ({"message": "Meet at gate B12 at 9"}, []), ({"symbol": "NVDA", "travel_to": "LAX"}, []),
    ({"travel_date": "2026-12-15", "amount": 40, "budget_limit": 1234.5, "flag": True}, []),
    ({"file_name": "79.pdf"}, [("file_name", "79.pdf", "79")]),
    ({"updates": {"owner_id": "USR009"}, "tags": ["#ok"]}, [("updates.owner_id", "USR009", "USR009")]),
    ({"tags": ["#ok", "#z9"]}, [("tags[1]", "#z9", "z9")]),
])
def test_a_gold_value_the_history_does_not_hold_is_found(arguments, missing):
    assert underivable_values(arguments, SEEN) == missing


def test_not_in_history_flags_name_turn_call_value_and_token():
    (flag,) = not_in_history_flags("turn 2 call 0", "send_message(receiver_id='USR002')", {"receiver_id": "USR002"}, SEEN)
    assert flag == ("turn 2 call 0 \"send_message(receiver_id='USR002')\": not in the history: receiver_id='USR002' "
                    "(no 'USR002' in the user turns, earlier outputs and calls, or the tool schemas)")
    assert flag_kind(flag) == "not_in_history"
    assert not_in_history_flags("turn 0 call 0", "f(x='USR001')", {"x": "USR001"}, SEEN) == []


def test_a_turn_that_is_not_bfcls_ground_truth_is_flagged():
    assert audit_bfcl_turn(1, {}, []) == []
    state, outputs = audit_bfcl_turn(1, {"TwitterAPI": ["tweets"], "MessageAPI": ["inbox", "sent"]}, ["{'a': 1}"] * 4)
    assert state == "turn 1: not BFCL's ground truth: the replayed state differs in TwitterAPI.tweets, MessageAPI.inbox, MessageAPI.sent"
    assert outputs == "turn 1: not BFCL's ground truth: 4 ground-truth outputs are not among the replay's: " + ", ".join(
        [repr("{'a': 1}")] * 3)
    assert flag_kind(state) == flag_kind(outputs) == "not_ground_truth"
    assert [flag_kind(f) for f in ("turn 0 call 1 'a()': error status: nope", "replay does not reproduce: final state differs",
                                   "turn 3 call 0 'retweet(tweet_id=1)': no-op: retweet changes ...")] == [
        "failing_call", "not_reproduced", "no_op"]


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


def test_the_report_counts_the_flags_by_kind():
    from pivotrl.evaluation.trust import trust_sections

    counts = {"flagged": 2, "flagged_ids": ["a", "b"], "flags_by_kind": {"failing_call": 0, "no_op": 1,
              "not_reproduced": 0, "not_ground_truth": 1, "not_in_history": 3}}
    lines = trust_sections(load_config(None, []), counts, [])
    assert "- tasks flagged (pivotrl.data.audit): 2 (a, b)" in lines
    assert ("- flags by kind: failing_call 0, no_op 1, not_reproduced 0, not_ground_truth 1, not_in_history 3"
            in lines)
