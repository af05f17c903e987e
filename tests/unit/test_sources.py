from __future__ import annotations

import json

import fsspec
import pandas as pd
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from pivotrl.data.schema import Message, ToolCall, ToolSpec, Trajectory
from pivotrl.data.sources import load_trajectories, save_trajectories_jsonl
from pivotrl.core.errors import ConfigError, DataError, StorageError

TOOL = {
    "type": "function",
    "function": {
        "name": "cd",
        "description": "change dir",
        "parameters": {"type": "object", "properties": {"folder": {"type": "string"}}},
    },
}


def good(tid="t1"):
    return {
        "id": tid,
        "category": "demo",
        "messages": [
            {"role": "user", "content": "go to docs"},
            {"role": "assistant", "content": "", "tool_calls": [
                {"id": "c1", "type": "function", "function": {"name": "cd", "arguments": "{\"folder\": \"docs\"}"}}]},
            {"role": "tool", "tool_call_id": "c1", "content": "ok"},
            {"role": "assistant", "content": "Done."},
        ],
        "tools": [TOOL],
    }


def write_lines(path, lines):
    path.write_bytes(b"\n".join(line if isinstance(line, bytes) else line.encode() for line in lines) + b"\n")
    return str(path)


def test_round_trip_local_and_memory(tmp_path):
    trajs = [
        Trajectory(
            id="a",
            messages=(
                Message("user", "héllo"),
                Message("assistant", tool_calls=(ToolCall("cd", {"folder": "x"}, "c0"),)),
                Message("tool", "ok", tool_call_id="c0"),
                Message("assistant", "Done."),
            ),
            tools=(ToolSpec("cd", "change", {"type": "object", "properties": {"folder": {}}}),),
            source="demo", category="c", env={"kind": "bfcl", "initial_config": {}, "involved_classes": ["MathAPI"]},
            meta={"k": [1, 2]},
        ),
        Trajectory.from_dict(good("b")),
    ]
    for url in (str(tmp_path / "sub" / "trajs.jsonl"), "memory://pivotrl-test/trajs.jsonl"):
        assert save_trajectories_jsonl(trajs, url) == 2
        assert load_trajectories(url) == trajs
    assert sorted(p.name for p in (tmp_path / "sub").iterdir()) == ["trajs.jsonl"]  # no temporary left


def test_parquet_json_string_and_nested_columns(tmp_path):
    g = good("p1")
    strings = pd.DataFrame([{"id": "p1", "messages": json.dumps(g["messages"]), "tools": json.dumps(g["tools"]),
                             "category": "demo"}])
    p1 = tmp_path / "strings.parquet"
    strings.to_parquet(p1)
    nested = pa.Table.from_pylist([{"id": "p2", "messages": good()["messages"], "tools": [TOOL]}])
    p2 = tmp_path / "nested.parquet"
    pq.write_table(nested, p2)
    (a,) = load_trajectories(str(p1))
    (b,) = load_trajectories(str(p2))
    assert a.id == "p1" and a.category == "demo" and a.messages == Trajectory.from_dict(g).messages
    assert b.id == "p2" and b.messages[1].tool_calls[0] == ToolCall("cd", {"folder": "docs"}, "c1")
    assert b.tools[0].parameters["properties"] == {"folder": {"type": "string"}}


def test_parquet_missing_column(tmp_path):
    p = tmp_path / "bad.parquet"
    pd.DataFrame([{"id": "x"}]).to_parquet(p)
    with pytest.raises(DataError, match=r"bad\.parquet: Parquet column\(s\) messages missing"):
        load_trajectories(str(p))


def bad_records():
    no_match = good("orphan")
    no_match["messages"][2]["tool_call_id"] = "zzz"
    unknown_tool = good("unknown")
    unknown_tool["messages"][1]["tool_calls"][0]["function"]["name"] = "rm"
    bad_role = good("role")
    bad_role["messages"][0]["role"] = "robot"
    hyphen = good("hyphen")
    hyphen["tools"] = [TOOL, {"type": "function", "function": {"name": "get-weather"}}]
    return [
        json.dumps(good("ok1")),                       # line 1
        '{"id": "broken", "messages": [',              # line 2 malformed JSON
        b'{"id": "latin", "messages": "caf\xe9"}',     # line 3 not UTF-8
        json.dumps({"id": "empty", "messages": []}),   # line 4 empty trajectory
        json.dumps(no_match),                          # line 5 tool message without a call
        json.dumps(unknown_tool),                      # line 6 call to an undeclared tool
        json.dumps(bad_role),                          # line 7 bad role
        json.dumps(good("ok1")),                       # line 8 duplicate id
        json.dumps(good("ok2")),                       # line 9
        json.dumps(hyphen),                            # line 10 tool name the action format cannot write
    ]


@pytest.mark.parametrize(
    "index, pattern",
    [
        (1, r"line 2: malformed JSON \(Expecting value at column 31\)"),
        (2, r"line 2: not valid UTF-8 \(byte 32 of the line\)"),
        (3, r"line 2 'empty'\.messages: missing or empty"),
        (4, r"line 2 'orphan'\.messages\[2\]\.tool_call_id: 'zzz' does not match any earlier tool call"),
        (5, r"line 2 'unknown'\.messages\[1\]\.tool_calls\[0\]\.function\.name: 'rm' is not one of"),
        (6, r"line 2 'role'\.messages\[0\]\.role: 'robot' is not one of"),
        (7, r"line 2 'ok1'\.id: duplicate trajectory id 'ok1' \(first at line 1\)"),
        (9, r"line 2 'hyphen'\.tools\[1\]\.function\.name: 'get-weather' cannot be written as an action"),
    ],
)
def test_errors_name_file_line_record_and_field(tmp_path, index, pattern):
    recs = bad_records()
    url = write_lines(tmp_path / "demo.jsonl", [recs[0], recs[index]])  # a good line, then the bad one
    with pytest.raises(DataError, match=rf"demo\.jsonl {pattern}"):
        load_trajectories(url)


def test_json_errors_name_the_column_once(tmp_path):
    cut = good("cut")
    cut["messages"][1]["tool_calls"][0]["function"]["arguments"] = '{"folder": "docs'
    url = write_lines(tmp_path / "demo.jsonl", [json.dumps(good("ok")), '{"id": "x", "messages": "abc', json.dumps(cut)])
    q: list[dict] = []
    load_trajectories(url, on_invalid="quarantine", quarantine=q)
    assert [e["error"] for e in q] == [
        f"{url} line 2: malformed JSON (Unterminated string starting at column 25)",  # json's "...at", once
        f"{url} line 3 'cut'.messages[1].tool_calls[0].function.arguments: not valid JSON "
        "(Unterminated string starting at column 12)",
    ]


def test_a_utf8_byte_order_mark_at_the_start_of_a_file_is_accepted(tmp_path):
    url = write_lines(tmp_path / "bom.jsonl", [b"\xef\xbb\xbf" + json.dumps(good("a")).encode(), json.dumps(good("b"))])
    assert [t.id for t in load_trajectories(url)] == ["a", "b"]
    gz = str(tmp_path / "bom.jsonl.gz")
    with fsspec.open(gz, "wb", compression="gzip") as f:
        f.write(b"\xef\xbb\xbf" + json.dumps(good("z")).encode() + b"\n")
    assert [t.id for t in load_trajectories(gz)] == ["z"]
    # Only at the start of the file: inside a record it is a record's own problem.
    url = write_lines(tmp_path / "mid.jsonl", [json.dumps(good("a")), b"\xef\xbb\xbf" + json.dumps(good("b")).encode()])
    with pytest.raises(DataError, match=r"mid\.jsonl line 2: malformed JSON"):
        load_trajectories(url)


@pytest.mark.parametrize("messages, problem", [
    ("hello", "expected a list of messages, got str"),
    ({"role": "user"}, "expected a list of messages, got dict"),
    ([], "missing or empty"),
    (None, "missing or empty"),
])
def test_messages_that_are_not_a_list_are_named_as_such(messages, problem):
    with pytest.raises(DataError) as e:
        Trajectory.from_dict({"id": "t", "messages": messages}, where="demo.jsonl line 3")
    assert str(e.value) == f"demo.jsonl line 3 't'.messages: {problem}"


@pytest.mark.parametrize("call, problem", [
    ({"id": "c1", "type": "function"}, "function: missing (expected "
     '{"type": "function", "function": {"name": ..., "arguments": ...}})'),
    ({"id": "c1", "type": "function", "function": "cd"}, "function: expected an object, got str"),
    ({"id": "c1", "type": "function", "function": {"arguments": "{}"}}, "function.name: missing or not a non-empty string"),
])
def test_a_tool_call_without_its_function_object_is_named_as_such(tmp_path, call, problem):
    rec = good("t")
    rec["messages"][1]["tool_calls"] = [call]
    url = write_lines(tmp_path / "demo.jsonl", [json.dumps(rec)])
    with pytest.raises(DataError) as e:
        load_trajectories(url)
    assert str(e.value) == f"{url} line 1 't'.messages[1].tool_calls[0].{problem}"
    # The flat form (name and arguments at the top of the call) is still read.
    assert ToolCall.from_dict({"name": "cd", "arguments": {"folder": "x"}}) == ToolCall("cd", {"folder": "x"})
    tool = {"type": "function", "description": "change dir"}
    with pytest.raises(DataError, match=r"^tools\[0\]\.function: missing \(expected "):
        ToolSpec.from_dict(tool, "tools[0]")


def test_quarantine_skips_and_describes_bad_records(tmp_path):
    url = write_lines(tmp_path / "demo.jsonl", bad_records())
    q: list[dict] = []
    got = load_trajectories(url, on_invalid="quarantine", quarantine=q)
    assert [t.id for t in got] == ["ok1", "ok2"]
    assert [(e["record"], e["id"], e["field"]) for e in q] == [
        ("line 2", "", "record"),
        ("line 3", "", "record"),
        ("line 4", "empty", "messages"),
        ("line 5", "orphan", "messages[2].tool_call_id"),
        ("line 6", "unknown", "messages[1].tool_calls[0].function.name"),
        ("line 7", "role", "messages[0].role"),
        ("line 8", "ok1", "id"),
        ("line 10", "hyphen", "tools[1].function.name"),
    ]
    assert all(e["source"] == url and e["error"].startswith(url) for e in q)
    assert "not valid UTF-8" in q[1]["error"]


def test_bad_options_and_missing_file(tmp_path):
    with pytest.raises(ConfigError, match="on_invalid='skip'"):
        load_trajectories(str(tmp_path / "x.jsonl"), on_invalid="skip")
    with pytest.raises(StorageError, match="no such file") as err:
        load_trajectories(str(tmp_path / "missing.jsonl"))
    from pivotrl.pipeline.entry import is_permanent

    assert is_permanent(err.value)  # a missing source is not retried: it would fail the same way


def test_a_relative_source_not_found_names_the_directory_it_was_resolved_against(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    for name in ("data/missing.jsonl", "data/missing.parquet"):
        with pytest.raises(StorageError) as e:
            load_trajectories(name)
        assert str(e.value) == f"{name}: no such file (a relative path, resolved against the current directory {tmp_path})"
    with pytest.raises(StorageError) as e:
        load_trajectories(str(tmp_path / "missing.jsonl"))
    assert str(e.value) == f"{tmp_path / 'missing.jsonl'}: no such file"  # an absolute path says nothing more


def test_compressed_jsonl(tmp_path):
    url = str(tmp_path / "d.jsonl.gz")
    with fsspec.open(url, "wb", compression="gzip") as f:
        f.write((json.dumps(good("z")) + "\n").encode())
    assert [t.id for t in load_trajectories(url)] == ["z"]


def test_a_write_that_fails_midway_leaves_the_previous_file_whole(tmp_path):
    import fsspec

    first = [Trajectory.from_dict(good("a"))]

    def broken():
        yield Trajectory.from_dict(good("b"))
        raise RuntimeError("the producer failed")

    for url in (str(tmp_path / "trajs.jsonl"), "memory://pivotrl-atomic/trajs.jsonl"):
        assert save_trajectories_jsonl(first, url) == 1
        with pytest.raises(RuntimeError, match="producer failed"):
            save_trajectories_jsonl(broken(), url)
        assert load_trajectories(url) == first  # the old file, whole: never a half-written copy
    assert [p.name for p in tmp_path.iterdir()] == ["trajs.jsonl"]
    assert fsspec.filesystem("memory").find("/pivotrl-atomic") == ["/pivotrl-atomic/trajs.jsonl"]
