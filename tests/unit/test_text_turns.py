"""No reward for arbitrary text: stop decisions, explicit answer rules, and rule-less text turns."""

from __future__ import annotations

import json
import random
import string

import pytest

from pivotrl.data.schema import Message, ToolCall, ToolSpec, Trajectory
from pivotrl.data.states import candidate_kinds_for_pivots, extract_turn_states, states_to_frame
from pivotrl.core.errors import DataError
from pivotrl.pivots.filter import probe_stats
from pivotrl.pipeline.probe import candidate_kind_column, select_candidates
from pivotrl.verifiers import get_verifier

TOOLS = (ToolSpec("lookup", "find a fact", {"type": "object", "properties": {"q": {"type": "string"}}}),)


def chat(meta: dict | None = None, answer: str = "The capital of France is Paris.") -> Trajectory:
    return Trajectory(
        id="t1",
        messages=(
            Message("user", "What is the capital of France?"),
            Message("assistant", tool_calls=(ToolCall("lookup", {"q": "capital of France"}, id="c1"),)),
            Message("tool", "Paris", tool_call_id="c1", name="lookup"),
            Message("assistant", answer),
        ),
        tools=TOOLS,
        meta=meta or {},
    )


def random_texts(n: int, seed: int = 0) -> list[str]:
    rng = random.Random(seed)
    alphabet = string.ascii_letters + string.digits + string.punctuation + " \n"
    return ["".join(rng.choice(alphabet) for _ in range(rng.randint(1, 80))).strip() or "x" for _ in range(n)]


def test_a_text_state_without_a_rule_never_becomes_a_pivot():
    states = extract_turn_states(chat())
    assert [s.verifier_context["candidate_kind"] for s in states] == ["call", "text_no_rule"]
    frame = states_to_frame(states).assign(split="pivot")
    for include_stop in (False, True):
        kept = select_candidates(frame, "pivot", None, 0, kinds=candidate_kinds_for_pivots(include_stop))
        assert list(kept["state_id"]) == ["t1#0"]
    # Even if it were probed: every text scores 0, so σ̂² = 0 and the filter cannot keep it.
    text_state = states[1]
    rewards = [r.reward for r in get_verifier("tool_name").score(text_state, [text_state.demo_action.content,
                                                                             *random_texts(15)])]
    assert rewards == [0.0] * 16
    mu, var = probe_stats(rewards)
    assert (mu, var) == (0.0, 0.0)


@pytest.mark.parametrize("rule, right", [
    ({"required": ["Paris"]}, "It is Paris."),
    ({"regex": r"[A-Z][a-z]+ is the capital\."}, "Paris is the capital."),
    ({"json_schema": {"type": "object", "properties": {"city": {"const": "Paris"}}, "required": ["city"]}},
     '{"city": "Paris"}'),
    ({"required": ["paris", "france"], "regex": r".*\.$"}, "Paris, France."),
])
def test_random_text_never_scores_one_where_a_rule_exists(rule, right):
    (state,) = [s for s in extract_turn_states(chat({"answer_rule": rule})) if not s.demo_action.tool_calls]
    assert state.verifier_context["candidate_kind"] == "text_rule" and state.verifier_context["answer_rule"] == rule
    for name in ("tool_name", "arguments"):
        results = get_verifier(name).score(state, random_texts(500, seed=1))
        assert not any(r.accepted for r in results)
        assert {r.reason for r in results} <= {"rule_failed", "wrong_kind", "parse_error"}
        assert [(r.reward, r.reason) for r in get_verifier(name).score(state, [right, "[lookup(q='x')]"])] == [
            (1.0, "rule"), (0.0, "wrong_kind")]
    # A rule-carrying state is a pivot candidate.
    frame = states_to_frame([state]).assign(split="pivot")
    assert list(select_candidates(frame, "pivot", None, 0, kinds=candidate_kinds_for_pivots())["state_id"]) == ["t1#1"]


def test_rules_per_turn_index_and_malformed_rules():
    (s,) = [s for s in extract_turn_states(chat({"answer_rules": {"1": {"regex": "Paris"}}})) if not s.demo_action.tool_calls]
    assert s.verifier_context["answer_rule"] == {"regex": "Paris"}
    for meta, field in (({"answer_rule": {"contains": "x"}}, "meta.answer_rule"),
                        ({"answer_rule": {"regex": "("}}, "meta.answer_rule.regex"),
                        ({"answer_rule": {"json_schema": {"type": 3}}}, "meta.answer_rule.json_schema"),
                        ({"answer_rules": {"1": {"required": []}}}, "meta.answer_rules.1.required")):
        with pytest.raises(DataError, match=rf"trajectory 't1'\.{field.replace('.', chr(92) + '.')}"):
            extract_turn_states(chat(meta))


def test_old_candidate_rows_without_a_kind_are_read_conservatively():
    frame = states_to_frame(extract_turn_states(chat()))
    frame["verifier_context"] = [json.dumps({k: v for k, v in json.loads(c).items() if k != "candidate_kind"})
                                 for c in frame["verifier_context"]]
    assert list(candidate_kind_column(frame)) == ["call", "text_no_rule"]
