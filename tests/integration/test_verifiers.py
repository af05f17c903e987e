"""Verifiers: hand-made rule cases, then real BFCL records (single-turn and multi-turn)."""

from __future__ import annotations

import dataclasses
import os
from pathlib import Path

import pytest

from pivotrl.format.actions import format_action
from pivotrl.data.schema import Message, ToolCall, ToolSpec, TurnState
from pivotrl.envs.sandbox import SandboxPool
from pivotrl.core.errors import ConfigError, DataError, VerifierError
from pivotrl.verifiers import VERIFIERS, VerifierResult, get_verifier
from pivotrl.verifiers.arguments import normalise_string

TOOLS = (
    ToolSpec("cd", "", {"type": "object", "properties": {"folder": {"type": "string"}}, "required": ["folder"]}),
    ToolSpec(
        "area",
        "",
        {
            "type": "object",
            "properties": {"base": {"type": "integer"}, "height": {"type": "float"}, "unit": {"type": "string"}},
            "required": ["base", "height"],
        },
    ),
)


def _state(demo: Message, **ctx) -> TurnState:
    context = {"demo_calls": [c.to_dict() for c in demo.tool_calls], "default_verifier": "arguments", **ctx}
    return TurnState("s#0", "s", 0, (Message("user", "do it"),), TOOLS, demo, verifier_context=context)


def _rewards(verifier, state, actions):
    return [(r.reward, r.reason) for r in get_verifier(verifier).score(state, actions)]


CD_DOCS = Message("assistant", tool_calls=(ToolCall("cd", {"folder": "docs"}),))


def test_registry_and_result():
    assert VERIFIERS.names() == ["arguments", "auto", "execution", "tool_name"]
    with pytest.raises(ConfigError, match="valid names: arguments, auto, execution, tool_name"):
        get_verifier("exact_text")
    with pytest.raises(ConfigError, match="unknown option.s. threshold; valid: .none."):
        get_verifier("tool_name", threshold=0.5)
    # Options a run configuration passes to any verifier are ignored where they mean nothing.
    assert type(get_verifier("tool_name", timeout_s=5, retries=1)).__name__ == "ToolNameVerifier"
    assert get_verifier("execution", timeout_s=5, retries=1).retries == 1
    r = VerifierResult(1.0, True, "match")
    with pytest.raises(dataclasses.FrozenInstanceError):
        r.reward = 0.0  # type: ignore[misc]


def test_tool_name_verifier():
    state = _state(CD_DOCS)
    actions = ["[cd(folder='docs')]", "[cd(folder='elsewhere')]", "[cd('docs'), cd('x')]", "[ls()]", "I went there.", "[cd(", "  "]
    assert _rewards("tool_name", state, actions) == [
        (1.0, "match"),
        (1.0, "match"),
        (0.0, "wrong_tool"),
        (0.0, "wrong_tool"),
        (0.0, "wrong_kind"),
        (0.0, "parse_error"),
        (0.0, "parse_error"),
    ]


def test_stop_decision_accepts_no_call_and_rejects_calls():
    state = _state(Message("assistant", "Done."), candidate_kind="stop")
    for name in ("tool_name", "arguments"):
        assert _rewards(name, state, ["All finished!", "[cd(folder='x')]", "[x"]) == [
            (1.0, "stop"),
            (0.0, "wrong_kind"),
            (0.0, "parse_error"),
        ]


def test_text_demo_without_a_rule_rewards_no_text():
    # No reward for arbitrary text: without an explicit rule nothing is accepted (and such a state
    # never becomes a pivot: tests/unit/test_text_turns.py).
    for ctx in ({}, {"candidate_kind": "text_no_rule"}):
        state = _state(Message("assistant", "The answer is 42."), **ctx)
        for name in ("tool_name", "arguments"):
            assert _rewards(name, state, ["The answer is 42.", "anything", "[cd(folder='x')]"]) == [
                (0.0, "no_rule"), (0.0, "no_rule"), (0.0, "wrong_kind"),
            ]


def test_arguments_without_possible_answers_uses_the_demo_values_exactly():
    state = _state(Message("assistant", tool_calls=(ToolCall("area", {"base": 10, "height": 5.0}),)))
    actions = [
        "[area(base=10, height=5.0)]",
        "[area(height=5, base=10.0)]",  # int/float equivalence, keyword order free
        "[area(10, 5)]",  # positional arguments named from the schema
        "[area(base=10, height=5, unit='cm')]",
        "[area(base=10)]",
        "[area(base=11, height=5)]",
        "[area(base='10', height=5)]",
        "[area(base=True, height=5)]",
    ]
    assert _rewards("arguments", state, actions) == [
        (1.0, "match"),
        (1.0, "match"),
        (1.0, "match"),
        (0.0, "unexpected_argument:unit"),
        (0.0, "missing_argument:height"),
        (0.0, "wrong_value:base"),
        (0.0, "wrong_value:base"),
        (0.0, "wrong_value:base"),
    ]
    # Strings are exact without possible answers.
    assert _rewards("arguments", _state(CD_DOCS), ["[cd(folder='Docs')]", '[cd(folder="docs")]']) == [
        (0.0, "wrong_value:folder"),
        (1.0, "match"),
    ]


def test_arguments_with_possible_answers_follows_bfcl_semantics():
    possible = [{"name": "area", "arguments": {"base": [10], "height": [5.0, 6], "unit": ["units", "cm", ""]}}]
    demo = Message("assistant", tool_calls=(ToolCall("area", {"base": 10, "height": 5.0}),))
    state = _state(demo, possible_answers=possible)
    actions = [
        "[area(base=10, height=5)]",
        "[area(base=10, height=6.0, unit='cm')]",
        "[area(base=10.0, height=5, unit=' Units')]",  # normalised string, float for int
        "[area(base=10, height=5, unit='')]",  # '' is the omission marker, not a value
        "[area(base=10, height=7)]",
        "[area(base=10, height=5, scale=2)]",
        "[area(base=10)]",
        "[area(base=10, height=5), area(base=10, height=5)]",
    ]
    assert _rewards("arguments", state, actions) == [
        (1.0, "match"),
        (1.0, "match"),
        (1.0, "match"),
        (0.0, "wrong_value:unit"),
        (0.0, "wrong_value:height"),
        (0.0, "unexpected_argument:scale"),
        (0.0, "missing_argument:height"),
        (0.0, "wrong_call_count"),
    ]
    assert normalise_string("New-York, NY.") == normalise_string("new york ny") == "newyorkny"


def test_arguments_nested_dicts_lists_and_parallel_calls_match_as_a_bijection():
    possible = [
        {"name": "cd", "arguments": {"folder": ["a"]}},
        {"name": "cd", "arguments": {"folder": ["b", "B2"]}},
        {"name": "area", "arguments": {"base": [[1, 2]], "height": [{"x": [1], "y": ["", 2]}]}},
    ]
    demo = Message("assistant", tool_calls=(ToolCall("cd", {"folder": "a"}),))
    state = _state(demo, possible_answers=possible)
    ok = "[area(base=[1, 2], height={'x': 1.0}), cd(folder='b2'), cd(folder='a')]"
    assert _rewards("arguments", state, [ok]) == [(1.0, "match")]
    bad = [
        "[cd(folder='a'), cd(folder='a'), area(base=[1, 2], height={'x': 1})]",  # 'a' twice: no bijection
        "[cd(folder='b'), cd(folder='a'), area(base=[2, 1], height={'x': 1})]",  # list order matters
        "[cd(folder='b'), cd(folder='a'), area(base=[1, 2], height={'x': 1, 'z': 0})]",
        "[cd(folder='b'), cd(folder='a')]",
        "[cd(folder='b'), cd(folder='a'), cd(folder='c')]",
    ]
    assert [r for r, _ in _rewards("arguments", state, bad)] == [0.0] * 5
    assert [why for _, why in _rewards("arguments", state, bad)][3:] == ["wrong_call_count", "wrong_tool"]


def test_auto_dispatches_on_the_default_verifier():
    auto = get_verifier("auto")
    state = _state(CD_DOCS, default_verifier="tool_name")
    assert [r.reward for r in auto.score(state, ["[cd(folder='x')]"])] == [1.0]
    state = _state(CD_DOCS, default_verifier="arguments")
    assert [r.reward for r in auto.score(state, ["[cd(folder='x')]"])] == [0.0]
    with pytest.raises(DataError, match="default_verifier='nope'"):
        auto.score(_state(CD_DOCS, default_verifier="nope"), ["x"])
    with pytest.raises(ConfigError, match="neither a shared option"):
        get_verifier("auto", exact={})
    auto = get_verifier("auto", timeout_s=7.0, retries=4, execution={"retries": 1})
    assert auto.verifier_for(_state(CD_DOCS, default_verifier="execution")).retries == 1


def test_execution_needs_an_environment():
    ex = get_verifier("execution", bfcl_root=".")
    # Nothing to execute: decided without a sandbox.
    assert _rewards_obj(ex, _state(CD_DOCS), ["text", "[x("]) == [(0.0, "wrong_kind"), (0.0, "parse_error")]
    with pytest.raises(DataError, match="needs verifier_context.env"):
        ex.score(_state(CD_DOCS), ["[cd(folder='docs')]"])


def _rewards_obj(verifier, state, actions):
    return [(r.reward, r.reason) for r in verifier.score(state, actions)]


# ------------------------------------------------------------------------------- real BFCL data


def _cache_dir() -> Path:
    return Path(os.environ.get("PIVOTRL_CACHE_DIR") or Path.home() / ".cache" / "pivotrl")


@pytest.fixture(scope="module")
def bfcl():
    from pivotrl.bfcl import data as mod
    from pivotrl.bfcl.wheel import ensure_bfcl

    # Fetches the pinned, hash-checked bfcl-eval wheel on first use (no skip on a fresh machine).
    root = ensure_bfcl(_cache_dir())
    trajs = mod.load_bfcl(["multi_turn_base", "simple_python"], _cache_dir(), limit_per_category=4)
    from pivotrl.data.states import extract_turn_states

    states = {s.state_id: s for t in trajs for s in extract_turn_states(t)}
    return root, states


@pytest.fixture(scope="module")
def execution(bfcl):
    root, _ = bfcl
    with SandboxPool(timeout_s=30.0, bfcl_root=root) as pool:
        yield get_verifier("execution", pool=pool)


@pytest.mark.data
def test_demo_actions_are_accepted_by_all_three_verifiers(bfcl, execution):
    _, states = bfcl
    multi = [s for s in states.values() if s.category == "multi_turn_base"]
    assert len(multi) > 30
    verifiers = [get_verifier("tool_name"), get_verifier("arguments"), execution]
    for state in multi:
        demo = format_action(state.demo_action)
        for v in verifiers:
            (r,) = v.score(state, [demo])
            assert r.accepted, (state.state_id, type(v).__name__, r)
    for state_id in ("simple_python_0#0", "simple_python_1#0", "simple_python_3#0"):
        state = states[state_id]
        demo = format_action(state.demo_action)
        assert [r.accepted for v in verifiers[:2] for r in v.score(state, [demo])] == [True, True]


@pytest.mark.data
def test_functionally_equal_alternatives_pass_execution_but_not_arguments(bfcl, execution):
    _, states = bfcl
    arguments = get_verifier("arguments")
    cases = {
        # demo [cd(folder='document')]: the simulator strips a trailing slash.
        "multi_turn_base_0#0": "[cd(folder='document/')]",
        # demo [find(name='test', path='.')]: path='.' is find's default.
        "multi_turn_base_3#0": "[find(name='test')]",
        # demo [ls(a=True)]: the current directory has no hidden entries, so the output is the same.
        "multi_turn_base_1#0": "[ls()]",
    }
    for state_id, alternative in cases.items():
        state = states[state_id]
        assert format_action(state.demo_action) != alternative
        assert [r.accepted for r in execution.score(state, [alternative])] == [True], state_id
        (r,) = arguments.score(state, [alternative])
        assert not r.accepted and r.reason.startswith(("wrong_value", "missing_argument")), (state_id, r)


@pytest.mark.data
def test_wrong_actions_are_rejected_in_a_real_state(bfcl, execution):
    _, states = bfcl
    state = states["multi_turn_base_0#0"]  # demo: [cd(folder='document')]
    actions = [
        "[cd(folder='archive')]",  # wrong value (a real folder)
        "[mkdir(dir_name='document')]",  # wrong tool
        "[cd(folder='document'), ls()]",  # an extra call
        "I will move the report for you now.",  # prose
        "[cd(folder='document'",  # unparsable
        "[cd(folder='document')] now",  # trailing text
        "[rm_rf(path='/')]",  # not a tool of this state
    ]
    ex = [(r.reward, r.reason) for r in execution.score(state, actions)]
    assert ex == [
        (0.0, "different_state_and_output"),
        (0.0, "different_state_and_output"),
        (0.0, "different_output"),
        (0.0, "wrong_kind"),
        (0.0, "parse_error"),
        (0.0, "parse_error"),
        (0.0, "unknown_tool"),
    ]
    assert [r.reward for r in get_verifier("arguments").score(state, actions)] == [0.0] * 7
    assert [r.reward for r in get_verifier("tool_name").score(state, actions)] == [1.0] + [0.0] * 6


@pytest.mark.data
def test_execution_batches_one_sandbox_request_per_state(bfcl, execution):
    _, states = bfcl
    state = states["multi_turn_base_0#2"]  # after cd + mkdir; demo: mv final_report.pdf → temp
    demo = format_action(state.demo_action)
    before = execution.stats.calls
    results = execution.score(state, [demo] * 4 + ["[mv(source='final_report.pdf', destination='archive')]"] * 4)
    assert [r.reward for r in results] == [1.0] * 4 + [0.0] * 4
    assert execution.stats.calls == before + 1


@pytest.mark.data
def test_simple_python_alternative_acceptable_value(bfcl):
    _, states = bfcl
    state = states["simple_python_0#0"]  # base [10], height [5], unit ["units", ""]
    assert format_action(state.demo_action) == "[calculate_triangle_area(base=10, height=5, unit='units')]"
    arguments = get_verifier("arguments")
    actions = [
        "[calculate_triangle_area(base=10, height=5)]",  # unit may be omitted ("" is acceptable)
        "[calculate_triangle_area(10, 5.0, 'Units')]",
        "[calculate_triangle_area(base=10, height=5, unit='cm')]",
        "[calculate_triangle_area(base=5, height=10)]",
    ]
    assert [(r.reward, r.reason) for r in arguments.score(state, actions)] == [
        (1.0, "match"),
        (1.0, "match"),
        (0.0, "wrong_value:unit"),
        (0.0, "wrong_value:base"),
    ]
    assert get_verifier("auto").score(state, actions[:1])[0].accepted


@pytest.mark.data
def test_auto_uses_execution_for_multi_turn_calls_and_tool_name_for_text(bfcl):
    root, states = bfcl
    auto = get_verifier("auto", bfcl_root=str(root), timeout_s=30.0, retries=1)
    try:
        state = states["multi_turn_base_0#0"]
        assert state.verifier_context["default_verifier"] == "execution"
        assert [r.reason for r in auto.score(state, ["[cd(folder='document/')]", "[cd(folder='archive')]"])] == [
            "equivalent",  # same state and output, not the demonstrated call list
            "different_state_and_output",
        ]
        closing = states["multi_turn_base_0#3"]  # the "Done." that ends the first user turn
        assert closing.verifier_context["default_verifier"] == "tool_name"
        assert closing.verifier_context["candidate_kind"] == "stop"
        assert [r.reason for r in auto.score(closing, ["Moved it.", "[ls()]"])] == ["stop", "wrong_kind"]
    finally:
        auto.close()


@pytest.mark.data
def test_sandbox_failure_is_a_verifier_error_not_a_zero(bfcl):
    root, states = bfcl
    state = states["multi_turn_base_0#0"]
    # A limit no request can meet: every attempt times out, then the verifier gives up loudly.
    with SandboxPool(timeout_s=0.05, bfcl_root=root) as pool:
        ex = get_verifier("execution", pool=pool, retries=1, backoff_s=0.0)
        with pytest.raises(VerifierError, match="multi_turn_base_0#0"):
            ex.score(state, ["[cd(folder='document')]"])
        assert (ex.stats.retries, ex.stats.failures) == (1, 1)
    # A worker-side error (no simulator at bfcl_root) is not retried.
    with SandboxPool(timeout_s=30.0, bfcl_root=str(Path(root) / "missing")) as pool:
        ex = get_verifier("execution", pool=pool, retries=3, backoff_s=0.0)
        with pytest.raises(VerifierError, match="bfcl_eval"):
            ex.score(state, ["[cd(folder='document')]"])
        assert ex.stats.retries == 0
