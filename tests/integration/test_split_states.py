from __future__ import annotations

import os
from collections import Counter
from pathlib import Path

import pandas as pd
import pytest

from pivotrl.bfcl.data import load_bfcl
from pivotrl.bfcl.multi_turn import CLOSING_TEXT
from pivotrl.data.schema import Message, ToolCall, Trajectory
from pivotrl.data.split import SPLIT_NAMES, split_trajectories
from pivotrl.data.states import extract_turn_states, frame_to_states, states_to_frame
from pivotrl.core.errors import ConfigError, DataError

# Needs the pinned BFCL data (downloaded once into the cache): not in `make test-fast`.
pytestmark = pytest.mark.data


@pytest.fixture(scope="session")
def trajs():
    cache = Path(os.environ.get("PIVOTRL_CACHE_DIR") or Path.home() / ".cache" / "pivotrl")
    return load_bfcl(["simple_python", "multiple", "multi_turn_base"], cache)


@pytest.fixture(scope="session")
def by_id(trajs):
    return {t.id: t for t in trajs}


def ids(split):
    return {name: {t.id for t in split[name]} for name in SPLIT_NAMES}


# -------------------------------------------------------------------------------------------- split


def test_split_is_a_partition_and_roughly_stratified(trajs):
    split = split_trajectories(trajs, fractions=(0.5, 0.3, 0.2), seed=0)
    sides = ids(split)
    assert sum(len(s) for s in sides.values()) == len(trajs) == 800
    assert not (sides["warm_start"] & sides["pivot"] or sides["warm_start"] & sides["heldout"]
                or sides["pivot"] & sides["heldout"])
    for category, n in (("simple_python", 400), ("multiple", 200), ("multi_turn_base", 200)):
        for name, f in zip(SPLIT_NAMES, (0.5, 0.3, 0.2)):
            k = sum(t.category == category for t in split[name])
            sd = (n * f * (1 - f)) ** 0.5
            assert abs(k - n * f) <= 4 * sd, (category, name, k)
    # each side keeps the input order
    order = {t.id: i for i, t in enumerate(trajs)}
    for name in SPLIT_NAMES:
        pos = [order[t.id] for t in split[name]]
        assert pos == sorted(pos)


def test_split_is_stable_when_trajectories_are_added_or_removed(trajs):
    base = split_trajectories(trajs[:500], (0.5, 0.3, 0.2), seed=7)
    grown = split_trajectories(trajs, (0.5, 0.3, 0.2), seed=7)
    shrunk = split_trajectories(trajs[100:500], (0.5, 0.3, 0.2), seed=7)
    side_of = {t.id: name for name in SPLIT_NAMES for t in grown[name]}
    assert all(side_of[t.id] == name for name in SPLIT_NAMES for t in base[name])
    assert all(side_of[t.id] == name for name in SPLIT_NAMES for t in shrunk[name])
    other_seed = split_trajectories(trajs, (0.5, 0.3, 0.2), seed=8)
    assert ids(other_seed) != ids(grown)


def test_split_degenerate_fractions_and_errors(trajs):
    assert len(split_trajectories(trajs, (1.0, 0.0, 0.0))["warm_start"]) == 800
    assert len(split_trajectories(trajs, (0.0, 0.0, 1.0))["heldout"]) == 800
    half = split_trajectories(trajs, (0.5, 0.5, 0.0))
    assert half["heldout"] == [] and len(half["warm_start"]) + len(half["pivot"]) == 800
    with pytest.raises(ConfigError, match="sum to 1"):
        split_trajectories(trajs, (0.5, 0.3, 0.3))
    with pytest.raises(ConfigError, match="three values"):
        split_trajectories(trajs, (0.5, 0.5))
    with pytest.raises(DataError, match="'simple_python_0': duplicate id"):
        split_trajectories([trajs[0], trajs[0]])


# ------------------------------------------------------------------------------------------- states


def test_candidate_counts_per_category(trajs):
    states = [s for t in trajs for s in extract_turn_states(t)]
    counts = Counter((s.category, s.verifier_context["default_verifier"]) for s in states)
    assert counts == {
        ("simple_python", "arguments"): 400,
        ("multiple", "arguments"): 200,
        ("multi_turn_base", "execution"): 1142,
        ("multi_turn_base", "tool_name"): 734,
    }


def test_single_turn_state(by_id):
    (s,) = extract_turn_states(by_id["simple_python_0"])
    assert s.state_id == "simple_python_0#0" and s.turn_index == 0 and s.trajectory_id == "simple_python_0"
    assert [m.role for m in s.messages] == ["user"]
    assert s.verifier_context == {
        "demo_calls": [{"id": "call_0", "type": "function", "function": {
            "name": "calculate_triangle_area", "arguments": '{"base":10,"height":5,"unit":"units"}'}}],
        "default_verifier": "arguments",
        "candidate_kind": "call",
        "possible_answers": [{"name": "calculate_triangle_area",
                              "arguments": {"base": [10], "height": [5], "unit": ["units", ""]}}],
    }


def test_multi_turn_states(by_id):
    t = by_id["multi_turn_base_0"]
    states = extract_turn_states(t)
    assert len(states) == 10 + 4
    assert [s.state_id for s in states[:3]] == ["multi_turn_base_0#0", "multi_turn_base_0#1", "multi_turn_base_0#2"]
    for s in states:
        n = len(s.messages)
        assert 0 < n < len(t.messages) and s.messages == t.messages[:n]  # strict prefix
        assert t.messages[n] == s.demo_action and s.tools == t.tools
    closing = states[3]
    assert closing.demo_action.content == CLOSING_TEXT
    assert closing.verifier_context["default_verifier"] == "tool_name"
    assert closing.verifier_context["demo_calls"] == []
    assert [ToolCall.from_dict(c).name for c in closing.verifier_context["prior_calls"]] == ["cd", "mkdir", "mv"]
    s4 = states[4]
    assert s4.messages[-1].role == "user" and s4.verifier_context["default_verifier"] == "execution"
    assert s4.verifier_context["env"] == dict(t.env)
    assert [ToolCall.from_dict(c).name for c in states[-1].verifier_context["prior_calls"]] == [
        "cd", "mkdir", "mv", "cd", "grep", "sort", "cd", "mv", "cd", "diff"
    ]


def test_assistant_without_history_is_rejected():
    t = Trajectory(id="x", messages=(Message("assistant", "hi"),))
    with pytest.raises(DataError, match=r"trajectory 'x'\.messages\[0\]"):
        extract_turn_states(t)


def test_frame_round_trip_through_parquet_keeps_property_order(by_id, tmp_path):
    states = extract_turn_states(by_id["multi_turn_base_52"]) + extract_turn_states(by_id["multiple_8"])
    df = states_to_frame(states)
    assert list(df.columns)[:4] == ["state_id", "trajectory_id", "turn_index", "category"]
    assert isinstance(df.loc[0, "messages"], str) and df["turn_index"].dtype == "int64"
    path = tmp_path / "states.parquet"
    df.to_parquet(path)
    back = frame_to_states(pd.read_parquet(path))
    assert back == states
    post = next(tool for tool in back[0].tools if tool.name == "post_tweet")
    assert list(post.parameters["properties"]) == ["content", "tags", "mentions"]


def test_frame_errors(by_id):
    df = states_to_frame(extract_turn_states(by_id["simple_python_0"]))
    with pytest.raises(DataError, match="column\\(s\\) tools missing"):
        frame_to_states(df.drop(columns=["tools"]))
    df.loc[0, "verifier_context"] = "{not json"
    with pytest.raises(DataError, match=r"row 0 \(state 'simple_python_0#0'\)\.verifier_context: not a JSON"):
        frame_to_states(df)
