"""BFCL source and simulated environments, on the real pinned BFCL data.

The wheel is fetched once into ``$PIVOTRL_CACHE_DIR`` (default ``~/.cache/pivotrl``) and reused.
"""

from __future__ import annotations

import ast
import json
import os
import shutil
from pathlib import Path

import pytest

from pivotrl.bfcl.data import load_bfcl
from pivotrl.bfcl.multi_turn import CLOSING_TEXT
from pivotrl.bfcl.wheel import ensure_bfcl
from pivotrl.data.schema import ToolCall
from pivotrl.bfcl.envs import BFCLEnvironment, replay
from pivotrl.core.errors import ConfigError, DataError

# Needs the pinned BFCL data (downloaded once into the cache): not in `make test-fast`.
pytestmark = pytest.mark.data


@pytest.fixture(scope="session")
def cache_dir() -> Path:
    return Path(os.environ.get("PIVOTRL_CACHE_DIR") or Path.home() / ".cache" / "pivotrl")


@pytest.fixture(scope="session")
def bfcl_root(cache_dir) -> Path:
    return ensure_bfcl(cache_dir)


@pytest.fixture(scope="session")
def trajs(bfcl_root, cache_dir):
    return {t.id: t for t in load_bfcl(["simple_python", "multiple", "multi_turn_base"], cache_dir)}


def by_category(trajs, category):
    return [t for t in trajs.values() if t.category == category]


def calls_of(traj):
    return [c for m in traj.messages for c in m.tool_calls]


# ---------------------------------------------------------------------------------------- download


def test_ensure_bfcl_layout_and_reuse(bfcl_root, cache_dir, monkeypatch):
    import pivotrl.bfcl.wheel

    assert (bfcl_root / "bfcl_eval" / "data" / "BFCL_v4_multi_turn_base.json").is_file()
    assert (bfcl_root / ".sha256").read_text().strip().startswith("3bb6dfa5")
    monkeypatch.setattr(pivotrl.bfcl.wheel.subprocess, "run", lambda *a, **k: pytest.fail(f"downloaded again: {a}"))
    assert ensure_bfcl(cache_dir) == bfcl_root  # reused, no download


def test_ensure_bfcl_rejects_wrong_checksum(tmp_path):
    fake = tmp_path / "bfcl_eval-2026.3.23-py3-none-any.whl"
    fake.write_bytes(b"PK not the wheel")
    cache = tmp_path / "cache"
    with pytest.raises(DataError, match="sha256 .* does not match"):
        ensure_bfcl(cache, wheel=fake)
    assert list(cache.iterdir()) == []  # nothing half-written is left behind


# ------------------------------------------------------------------------------------------ counts


def test_record_turn_and_call_counts(trajs):
    assert len(by_category(trajs, "simple_python")) == 400
    assert len(by_category(trajs, "multiple")) == 200
    mt = by_category(trajs, "multi_turn_base")
    assert len(mt) == 200
    assert sum(m.role == "user" for t in mt for m in t.messages) == 734
    assert sum(len(calls_of(t)) for t in mt) == 1142
    # one call per assistant message, one closing text per user turn
    assert all(len(m.tool_calls) <= 1 for t in mt for m in t.messages)
    assert sum(m.role == "assistant" and m.content == CLOSING_TEXT for t in mt for m in t.messages) == 734


def test_limit_and_unknown_category(cache_dir):
    got = load_bfcl(["multiple", "simple_python"], cache_dir, limit_per_category=2)
    assert [t.id for t in got] == ["multiple_0", "multiple_1", "simple_python_0", "simple_python_1"]
    with pytest.raises(ConfigError, match="unknown BFCL category 'simple_jav'; valid: simple_python"):
        load_bfcl(["simple_jav"], cache_dir)


def test_bad_records_are_named_or_quarantined(bfcl_root, tmp_path):
    cache = tmp_path / "cache"
    shutil.copytree(bfcl_root, cache / bfcl_root.name)
    data = cache / bfcl_root.name / "bfcl_eval" / "data"
    answers = data / "possible_answer" / "BFCL_v4_simple_python.json"
    lines = answers.read_text().splitlines()
    answers.write_text("\n".join(lines[:1] + lines[2:3]) + "\n")  # drop simple_python_1's ground truth
    mt = data / "possible_answer" / "BFCL_v4_multi_turn_base.json"
    first, *rest = mt.read_text().splitlines()
    mt.write_text("\n".join([first.replace("mkdir(dir_name='temp')", "nosuch(dir_name='temp')")] + rest) + "\n")
    with pytest.raises(DataError, match=r"BFCL_v4_simple_python\.json 'simple_python_1': no ground truth"):
        load_bfcl(["simple_python"], cache, limit_per_category=3)
    q: list = []
    got = load_bfcl(["simple_python", "multi_turn_base"], cache, limit_per_category=3, on_invalid="quarantine",
                    quarantine=q)
    assert [t.id for t in got] == ["simple_python_0", "simple_python_2", "multi_turn_base_1", "multi_turn_base_2"]
    assert [e["record"] for e in q] == ["simple_python_1", "multi_turn_base_0"]
    assert "ground_truth[0][1]: \"nosuch(dir_name='temp')\" calls an unknown tool" in q[1]["error"]


# ------------------------------------------------------------------------------------- single-turn


def test_single_turn_by_hand(trajs):
    t = trajs["simple_python_0"]
    assert [m.role for m in t.messages] == ["user", "assistant"]
    assert t.messages[0].content == "Find the area of a triangle with a base of 10 units and height of 5 units."
    (call,) = t.messages[1].tool_calls
    assert (call.name, dict(call.arguments)) == ("calculate_triangle_area", {"base": 10, "height": 5, "unit": "units"})
    assert t.meta["possible_answers"] == [
        {"name": "calculate_triangle_area", "arguments": {"base": [10], "height": [5], "unit": ["units", ""]}}
    ]
    assert t.tools[0].parameters["type"] == "object" and t.env is None and t.category == "simple_python"
    # a parameter whose acceptable values start with "" is omitted; nested dicts take first values
    assert dict(trajs["simple_python_2"].messages[1].tool_calls[0].arguments) == {"x": 4, "y": 5}
    assert dict(trajs["simple_python_89"].messages[1].tool_calls[0].arguments)["conditions"] == {
        "department": "Science",
        "school": "Bluebird High School",
    }
    nested = trajs["simple_python_89"].tools[0].parameters["properties"]["conditions"]
    assert nested["type"] == "object"  # "dict" normalised inside nested schemas too


def test_no_dict_type_left_in_any_schema(trajs):
    text = json.dumps([t.to_dict()["tools"] for t in trajs.values()])
    assert '"type": "dict"' not in text


# -------------------------------------------------------------------------------------- multi-turn


def test_multi_turn_trajectory_by_hand(trajs):
    t = trajs["multi_turn_base_0"]
    assert t.env["kind"] == "bfcl" and t.env["involved_classes"] == ["TwitterAPI", "GorillaFileSystem"]
    assert len(t.tools) == 14 + 18  # posting_api.json + gorilla_file_system.json
    roles = [m.role for m in t.messages]
    assert roles[:8] == ["user", "assistant", "tool", "assistant", "tool", "assistant", "tool", "assistant"]
    assert len(t.messages) == 4 + 10 * 2 + 4  # users, calls with outputs, closing texts
    m1, m2 = t.messages[1], t.messages[2]
    assert (m1.tool_calls[0].name, dict(m1.tool_calls[0].arguments), m1.tool_calls[0].id) == (
        "cd", {"folder": "document"}, "call_0"
    )
    assert m2.tool_call_id == "call_0" and m2.content == '{"current_working_directory": "document"}'
    assert t.messages[4].content == "None"  # mkdir returns None; BFCL writes str(result)
    assert t.messages[7].content == CLOSING_TEXT and not t.messages[7].tool_calls
    grep_out = t.messages[12]
    assert t.messages[11].tool_calls[0].name == "grep"
    assert json.loads(grep_out.content) == {
        "matching_lines": ["Year2024 This is the final report content including budget analysis and other sections."]
    }


def test_positional_ground_truth_resolved(trajs, bfcl_root):
    mt = by_category(trajs, "multi_turn_base")
    positional = [g for t in mt for turn in t.meta["ground_truth"] for g in turn if ast.parse(g, mode="eval").body.args]
    assert len(positional) == 40
    t = trajs["multi_turn_base_52"]
    post = next(c for c in calls_of(t) if c.name == "post_tweet")
    assert dict(post.arguments) == {
        "content": "Tires checked and engine purring smoothly!", "tags": ["#RoadTrip"], "mentions": ["@AutoUpdates"]
    }
    mean = next(c for c in calls_of(trajs["multi_turn_base_31"]) if c.name == "mean")
    assert dict(mean.arguments) == {"numbers": [37]}
    out = next(m for m in trajs["multi_turn_base_31"].messages if m.tool_call_id == mean.id)
    assert out.content == '{"result": 37.0}'


def test_empty_ground_truth_turns_are_user_then_closing_text(trajs):
    t = trajs["multi_turn_base_180"]
    assert t.meta["ground_truth"][3] == [] and t.meta["ground_truth"][4] == []
    users = [i for i, m in enumerate(t.messages) if m.role == "user"]
    for turn in (3, 4):
        nxt = t.messages[users[turn] + 1]
        assert nxt.role == "assistant" and nxt.content == CLOSING_TEXT


def test_replay_is_deterministic_and_reproduces_demo_outputs(trajs, bfcl_root):
    for t in by_category(trajs, "multi_turn_base"):
        calls = [c.to_dict() for c in calls_of(t)]
        a = replay(t.env, calls, bfcl_root)
        b = replay(t.env, calls, bfcl_root)
        assert a.snapshot() == b.snapshot(), t.id
        half = len(calls) // 2
        branch = replay(t.env, calls[:half], bfcl_root).copy()
        outs = branch.execute_all(ToolCall.from_dict(d) for d in calls[half:])
        assert outs == [m.content for m in t.messages if m.role == "tool"][half:], t.id
        assert branch.snapshot() == a.snapshot(), t.id
        json.dumps(a.snapshot())  # JSON-able


def test_snapshot_file_system_and_copy_independence(trajs, bfcl_root):
    t = trajs["multi_turn_base_0"]
    env = BFCLEnvironment.from_context(t.env, bfcl_root)
    assert env.snapshot()["GorillaFileSystem"]["_current_dir"] == "workspace"
    fork = env.copy()
    assert env.execute(ToolCall("cd", {"folder": "document"})) == '{"current_working_directory": "document"}'
    assert env.snapshot()["GorillaFileSystem"]["_current_dir"] == "workspace/document"
    assert fork.snapshot()["GorillaFileSystem"]["_current_dir"] == "workspace"
    root = env.snapshot()["GorillaFileSystem"]["root"]
    assert root["contents"]["document"]["parent"] == {"__ref__": "workspace"}
    assert sorted(root["contents"]["document"]["contents"]) == ["final_report.pdf", "previous_report.pdf"]


def test_execute_errors_become_outputs(trajs, bfcl_root):
    env = BFCLEnvironment.from_context(trajs["multi_turn_base_0"].env, bfcl_root)
    assert env.execute(ToolCall("rm_rf", {})).startswith("Error during execution: no tool named 'rm_rf'")
    out = env.execute(ToolCall("cd", {"nope": 1}))
    assert out.startswith("Error during execution: ") and "nope" in out
    assert env.execute(ToolCall("_load_scenario", {"scenario": {}})).startswith("Error during execution")


def test_bad_context(bfcl_root):
    with pytest.raises(DataError, match="expected kind 'bfcl'"):
        BFCLEnvironment.from_context({"kind": "other"}, bfcl_root)
    with pytest.raises(DataError, match="unknown BFCL class 'Nope'"):
        BFCLEnvironment.from_context({"kind": "bfcl", "involved_classes": ["Nope"]}, bfcl_root)
