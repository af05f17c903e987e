"""Turn states refer to their trajectory's history: the candidates table is linear in a trajectory's
length, and states rebuilt from it (and the pivot rows expanded from it) are exactly those of the
full, history-copying form: same JSON, same prompt text, same token ids."""

from __future__ import annotations

import json
import pickle
from pathlib import Path

import pandas as pd
import pytest

from pivotrl.data.schema import Message, MessagePrefix, ToolCall, ToolSpec, Trajectory
from pivotrl.data.states import (
    CANDIDATE_COLUMNS, STATE_COLUMNS, candidates_frame, expand_candidates, extract_turn_states, frame_to_states,
    states_to_frame,
)
from pivotrl.core.errors import DataError
from pivotrl.format.prompts import encode_state, render_prompt
from pivotrl.testing import tiny_chat_tokenizer, tiny_tokenizer

TOOLS = (ToolSpec("lookup", "Look a key up.", {"type": "object", "properties": {"key": {"type": "string"}, "b": {}},
                                                "required": ["key"]}),)


def _chat(turns: int, tid: str = "chat", env: dict | None = None) -> Trajectory:
    msgs = [Message("system", "Be careful."), Message("user", "Look every key up; é ünïcode.")]
    for i in range(turns):
        msgs.append(Message("assistant", "" if i % 3 else "thinking", tool_calls=(ToolCall("lookup", {"key": f"k{i}"}, id=f"c{i}"),)))
        msgs.append(Message("tool", f"value {i * 7 % 1000}", tool_call_id=f"c{i}", name="lookup"))
        if i % 4 == 3:
            msgs.append(Message("user", f"Next, from k{i + 1}."))
    msgs.append(Message("assistant", "Done."))
    meta = {"stop_text": "Done.", "possible_answers": [{"lookup": {"key": ["k0"]}}]}
    return Trajectory(tid, tuple(msgs), TOOLS, source="test", category="multi_turn_base" if env else "chat",
                      env=env, meta=meta)


TRAJS = [_chat(1, "one"), _chat(9, "nine"), _chat(6, "env", env={"kind": "bfcl", "initial_config": {"A": {"x": 1}},
                                                                   "involved_classes": ["A"]})]


def _hist(trajs):
    return {t.id: t.messages for t in trajs}


def test_states_share_their_trajectory_history():
    t = TRAJS[1]
    states = extract_turn_states(t)
    assert all(isinstance(s.messages, MessagePrefix) for s in states)
    assert [len(s.messages) for s in states][:3] == [2, 4, 6]
    s = states[4]
    pos = len(s.messages)
    assert s.messages == t.messages[:pos] and t.messages[:pos] == s.messages and list(s.messages) == list(t.messages[:pos])
    assert s.messages[1:3] == t.messages[1:3] and s.messages[-1] == t.messages[pos - 1] and s.messages[::-1] == t.messages[:pos][::-1]
    with pytest.raises(IndexError):
        s.messages[pos]
    back = pickle.loads(pickle.dumps(states))
    assert [b.to_dict() for b in back] == [a.to_dict() for a in states]


@pytest.mark.parametrize("traj", TRAJS, ids=[t.id for t in TRAJS])
def test_candidates_round_trip_to_the_full_form_byte_for_byte(traj, tmp_path):
    states = extract_turn_states(traj)
    full = states_to_frame(states).assign(split="pivot")
    cand = candidates_frame(states).assign(split="pivot")
    assert list(cand.columns) == [*CANDIDATE_COLUMNS, "split"]
    if traj.env is not None:  # prior_calls is derived from the history, not stored
        assert all("prior_calls" not in json.loads(c) for c in cand["verifier_context"])
        assert json.loads(full["verifier_context"].iloc[-1])["prior_calls"]
    cand.to_parquet(tmp_path / "c.parquet")
    cand = pd.read_parquet(tmp_path / "c.parquet")
    # The pivot rows expanded from candidates: the same table, the same Parquet bytes.
    sub = cand.iloc[::2].merge(pd.DataFrame({"state_id": cand["state_id"], "mu": 0.25, "var": 0.1875}), on="state_id")
    expanded = expand_candidates(sub.sort_values("state_id").reset_index(drop=True), _hist([traj]))
    want = full.iloc[::2].merge(pd.DataFrame({"state_id": full["state_id"], "mu": 0.25, "var": 0.1875}), on="state_id")
    want = want.sort_values("state_id").reset_index(drop=True)
    pd.testing.assert_frame_equal(expanded, want)
    expanded.to_parquet(tmp_path / "a.parquet")
    want.to_parquet(tmp_path / "b.parquet")
    assert (tmp_path / "a.parquet").read_bytes() == (tmp_path / "b.parquet").read_bytes()
    # States read back from either form are the same states.
    a, b = frame_to_states(cand, _hist([traj])), frame_to_states(full)
    assert [s.to_dict() for s in a] == [s.to_dict() for s in b] == [s.to_dict() for s in states]


def test_prompts_rendered_and_encoded_from_candidates_are_identical():
    qwen = tiny_chat_tokenizer("qwen2.5", (Path(__file__).resolve().parents[1] / "fixtures" / "chat_templates" / "qwen2.5.jinja").read_text())
    toks = {"pythonic": (tiny_tokenizer(), {}), "qwen2.5": (qwen, {"format": "auto", "tool_parser": "auto"})}
    states = [s for t in TRAJS for s in extract_turn_states(t)]
    new, old = frame_to_states(candidates_frame(states), _hist(TRAJS)), frame_to_states(states_to_frame(states))
    assert len(new) == len(old) == len(states) == 2 + 10 + 7
    for a, b in zip(new, old):
        assert isinstance(a.messages, MessagePrefix) and isinstance(b.messages, tuple)
        assert render_prompt(a.messages, a.tools) == render_prompt(b.messages, b.tools)
        for tok, kw in toks.values():
            ids = encode_state(a, tok, max_len=10**6, **kw)
            assert ids == encode_state(b, tok, max_len=10**6, **kw) and len(ids) > 10


def test_a_candidate_row_without_its_trajectory_names_the_row():
    cand = candidates_frame(extract_turn_states(TRAJS[1]))
    with pytest.raises(DataError, match=r"row 0 \(state 'nine#0'\).*needs its trajectory's messages"):
        frame_to_states(cand)
    with pytest.raises(DataError, match=r"row 0 \(state 'nine#0'\): trajectory 'nine' is not among"):
        frame_to_states(cand, {"other": TRAJS[0].messages})
    bad = cand.assign(history_len=[999] + list(cand["history_len"][1:]))
    with pytest.raises(DataError, match=r"row 0 \(state 'nine#0'\)\.history_len: 999, but trajectory 'nine' has 23 messages"):
        expand_candidates(bad, _hist(TRAJS))
    assert set(STATE_COLUMNS) - set(CANDIDATE_COLUMNS) == {"messages"}


@pytest.mark.data
def test_real_bfcl_states_are_the_same_from_either_form():
    import os

    from pivotrl.bfcl.data import load_bfcl

    cache = Path(os.environ.get("PIVOTRL_CACHE_DIR") or Path.home() / ".cache" / "pivotrl")
    trajs = load_bfcl(["simple_python", "multi_turn_base"], cache, limit_per_category=4)
    states = [s for t in trajs for s in extract_turn_states(t)]
    assert any("prior_calls" in s.verifier_context for s in states)
    full, cand = states_to_frame(states), candidates_frame(states)
    pd.testing.assert_frame_equal(expand_candidates(cand, _hist(trajs)), full)
    tok = tiny_tokenizer()
    for a, b in zip(frame_to_states(cand, _hist(trajs)), frame_to_states(full)):
        assert a.to_dict() == b.to_dict() and encode_state(a, tok, max_len=10**6) == encode_state(b, tok, max_len=10**6)
