"""BFCL's own AST checker as the judge of record for BFCL's single-turn categories.

Every gold answer of every single-turn category pivotrl loads is judged by BFCL's ``ast_checker``
(from the pinned wheel) on the pythonic text a policy would write; perturbed answers (a wrong
value, a missing required argument, a wrong function name) are rejected; the texts that pivotrl's
parser and BFCL's decoder read differently are counted by kind; and the evaluate stage's held-out
and out-of-domain greedy measures take BFCL's verdict with ``quality.judge: bfcl``.
"""

from __future__ import annotations

import dataclasses
import json
import os
from collections import Counter
from typing import Any

import pandas as pd
import pytest

from pivotrl.format.actions import format_action, format_call
from pivotrl.bfcl.data import load_bfcl

#: The four Python categories this file covers (the others: tests/integration/test_bfcl_categories.py).
SINGLE_TURN_CATEGORIES = ("simple_python", "multiple", "parallel", "parallel_multiple")
from pivotrl.bfcl.wheel import ensure_bfcl
from pivotrl.data.schema import ToolCall
from pivotrl.data.states import extract_turn_states
from pivotrl.bfcl.ast_decoder import DECODER_DIFFERENCES, decoder_difference
from pivotrl.bfcl.single import BFCLSingleTurnJudge
from pivotrl.bfcl.single_tables import AGREEMENT_KEYS, DIFFERENCE_KEYS, rejudge_local, single_turn_judge_markdown

# Every test here reads the pinned BFCL records (downloaded once into the cache).
pytestmark = pytest.mark.data


@pytest.fixture(scope="module")
def bfcl_root():
    return ensure_bfcl(os.environ["PIVOTRL_CACHE_DIR"])


@pytest.fixture(scope="module")
def states(bfcl_root) -> list[Any]:
    trajs = load_bfcl(SINGLE_TURN_CATEGORIES, os.environ["PIVOTRL_CACHE_DIR"])
    return [s for t in trajs for s in extract_turn_states(t)]


@pytest.fixture(scope="module")
def judge(bfcl_root) -> BFCLSingleTurnJudge:
    return BFCLSingleTurnJudge(bfcl_root)


def _record(judge: BFCLSingleTurnJudge, state: Any) -> tuple[list[dict], list[dict]]:
    return judge._category(state.category)[state.trajectory_id]


def _call_text(calls: list[tuple[str, dict]]) -> str:
    return "[" + ", ".join(format_call(ToolCall(name=n, arguments=a)) for n, a in calls) + "]"


def _bfcl_gold(functions: list[dict], possible: list[dict]) -> list[tuple[str, dict]]:
    """The gold as BFCL's data means it: a required parameter gets its first value that is not
    "may be omitted" (""); a parameter the function does not declare is left out when it may be."""
    calls = []
    for entry in possible:
        (name, params), = entry.items()
        schema = next(f for f in functions if f["name"] == name)["parameters"]
        props, required = schema.get("properties", {}), set(schema.get("required", []))
        args = {}
        for p, acceptable in params.items():
            if p in required:
                args[p] = next(v for v in acceptable if v != "")
            elif acceptable[0] != "" and not (p not in props and "" in acceptable):
                args[p] = acceptable[0]
        calls.append((name, {p: _first_values(v) for p, v in args.items()}))
    return calls


def _first_values(value: Any) -> Any:
    """BFCL's nested "dict of acceptable lists" → its first values (as pivotrl's loader reads it)."""
    if isinstance(value, dict):
        return {k: _first_values(v[0]) if isinstance(v, list) else _first_values(v)
                for k, v in value.items() if not (isinstance(v, list) and (not v or v[0] == ""))}
    if isinstance(value, list):
        return [_first_values(v) if isinstance(v, dict) else v for v in value]
    return value


def test_every_demonstrated_gold_is_accepted(states, judge):
    # The pythonic text the policy is taught (pivotrl's demonstration: each parameter's first
    # acceptable value, "" = left out unless required), judged by BFCL's decoder and ast_checker.
    assert {s.category for s in states} == set(SINGLE_TURN_CATEGORIES)
    assert len(states) == 1000 and all(judge.judges(s) for s in states)
    rejected = {s.trajectory_id: judge.judge(s, format_action(s.demo_action)).error_type for s in states}
    rejected = {k: v for k, v in rejected.items() if v}
    # BFCL's answers disagree with its checker on two records: simple_python_200 marks the required
    # 'fuel_efficiency' as omittable ("" first), parallel_multiple_26 gives a value for 'type', which
    # bank.calculate_balance does not declare. The loader gives a required parameter its first real
    # value and leaves undeclared ones out, so every demonstration is accepted.
    assert rejected == {}
    by_id = {s.trajectory_id: s.demo_action.tool_calls for s in states}
    assert "fuel_efficiency" in by_id["simple_python_200"][0].arguments
    assert all("type" not in c.arguments for c in by_id["parallel_multiple_26"] if c.name == "bank.calculate_balance")


def test_every_gold_answer_is_accepted_and_perturbed_ones_rejected(states, judge):
    counts: Counter[str] = Counter()
    for s in states:
        functions, possible = _record(judge, s)
        gold = _bfcl_gold(functions, possible)
        verdict = judge.judge(s, _call_text(gold))
        assert verdict.valid, (s.state_id, _call_text(gold), verdict)
        name, args = gold[0]
        schema = next(f for f in functions if f["name"] == name)["parameters"]
        # a wrong function name
        wrong = [(name + "_x", args)] + gold[1:]
        assert not judge.judge(s, _call_text(wrong)).valid, s.state_id
        counts["wrong_name"] += 1
        # a required argument missing
        req = [p for p in schema.get("required", []) if p in args]
        if req:
            missing = [(name, {k: v for k, v in args.items() if k != req[0]})] + gold[1:]
            assert not judge.judge(s, _call_text(missing)).valid, s.state_id
            counts["missing_required"] += 1
        # a wrong value of a scalar argument
        for p, v in args.items():
            bad = (v + 1000003 if isinstance(v, int) and not isinstance(v, bool) else v + 1000003.5
                   if isinstance(v, float) else "zq wrong value qz" if isinstance(v, str) else None)
            if bad is not None:
                changed = [(name, {**args, p: bad})] + gold[1:]
                verdict = judge.judge(s, _call_text(changed))
                assert not verdict.valid, (s.state_id, p)
                counts["wrong_value"] += 1
                break
    # each perturbation is tried on (almost) every record
    assert counts["wrong_name"] == 1000
    assert counts["missing_required"] >= 950 and counts["wrong_value"] >= 950, counts


def _state(states, rid):
    return next(s for s in states if s.trajectory_id == rid)


def test_decoder_differences_are_named_by_kind(states, bfcl_root):
    s = _state(states, "simple_python_0")  # calculate_triangle_area(base, height, unit)
    gold = "[calculate_triangle_area(base=10, height=5)]"
    cases = {
        gold: None,                                               # both read the same calls
        "The area is 25.": None,                                  # neither reads a call
        "[calculate_triangle_area(base=10, height=5)] done": None,  # both reject trailing prose
        "```python\n" + gold + "\n```": None,                    # pivotrl: a text answer; BFCL: no call
        "```\n" + gold + "\n```": "code_fence",                  # BFCL strips the fence and reads it
        "calculate_triangle_area(base=10, height=5)": "no_brackets",
        "[calculate_triangle_area(10, 5)]": "positional_args",     # BFCL drops 10 and 5
        "[calculate_triangle_area(10, height=5)]": "positional_args",
        "[calculate_triangle_area(base=(10, 2), height=5)]": "tuple_values",
        "\t" + gold: "only_pivotrl_reads",                        # BFCL strips only backticks, newlines, spaces
        gold + "\r\n": "only_pivotrl_reads",
        "[calculate_triangle_area(base=int(10), height=5)]": "only_bfcl_reads",  # BFCL: base='int(10)'
        "[calculate_triangle_area(base=+10, height=5)]": "other",  # BFCL reads every unary operator as minus
        "[calculate_triangle_area(**{'from': 1})]": "other",       # BFCL: a parameter named None
        "[calculate_triangle_area(base=10, height=5),]\n": None,
        "[calculate_triangle_area(base=[1, *x])]": None,           # neither reads it
    }
    got = {text: decoder_difference(text, s.tools, bfcl_root) for text in cases}
    assert got == cases
    assert {v for v in cases.values() if v} == set(DECODER_DIFFERENCES)


def test_bfcl_never_evaluates_model_text(states, judge):
    s = _state(states, "simple_python_0")
    for text in ("[calculate_triangle_area(base=__import__('os').getpid() + 1, height=5)]",
                 "[calculate_triangle_area(base=2 ** 99999999, height=5)]",
                 "[calculate_triangle_area(base=(lambda: 1)(), height=5)]"):
        verdict = judge.judge(s, text)
        assert (verdict.valid, verdict.error_type) == (False, "ast_decoder:unsafe_expression"), text
    # arithmetic on literals is what BFCL's decoder evaluates itself: 5 + 5 is read as 10
    assert judge.judge(s, "[calculate_triangle_area(base=5 + 5, height=5)]").valid


def _frame(rows: list[tuple[Any, list[tuple[str, float]]]]) -> pd.DataFrame:
    out = []
    for s, samples in rows:
        acc = sum(r for _, r in samples)
        out.append({"state_id": s.state_id, "trajectory_id": s.trajectory_id, "turn_index": s.turn_index,
                    "category": s.category, "status": "ok", "n_samples": len(samples), "n_accepted": int(acc),
                    "accuracy": acc / len(samples), "parse_errors": 0, "tokens_generated": 3, "reasons": {},
                    "samples": json.dumps([{"text": t, "tokens": 1, "reward": r, "reason": "x"} for t, r in samples])})
    return pd.DataFrame(out)


def test_rejudge_local_makes_bfcl_the_judge_of_record(states, judge):
    a, b = _state(states, "simple_python_0"), _state(states, "multiple_0")
    gold_a, gold_b = format_action(a.demo_action), format_action(b.demo_action)
    # a state of another source: same category name, an id BFCL does not have -> pivotrl's verdict
    other = dataclasses.replace(a, state_id="mine#0", trajectory_id="mine")
    frame = _frame([
        (a, [(gold_a, 1.0), ("```\n" + gold_a + "\n```", 0.0), ("[calculate_triangle_area(10, 5)]", 1.0),
             ("[calculate_triangle_area(base=3, height=5)]", 0.0)]),
        (b, [(gold_b, 1.0)]),
        (other, [("whatever", 1.0)]),
    ])
    summary = {"n_states": 3, "n_samples": 6, "n_accepted": 4, "accuracy": 4 / 6}
    df, out = rejudge_local(frame, summary, [a, b, other], judge)
    assert list(df["judge"]) == ["bfcl_ast", "bfcl_ast", "pivotrl"]
    assert list(df["n_accepted"]) == [2, 1, 1] and list(df["pivotrl_accepted"]) == [2, 1, 1]
    assert json.loads(df.at[0, "agreement"]) == {"both_accept": 1, "only_bfcl": 1, "only_pivotrl": 1, "neither": 1}
    assert json.loads(df.at[0, "decoder_differences"]) == {"code_fence": 1, "positional_args": 1}
    assert json.loads(df.at[0, "bfcl_errors"]) == {"simple_function_checker:missing_required": 1,
                                                   "value_error:others": 1}
    samples = json.loads(df.at[0, "samples"])
    assert [x["bfcl_valid"] for x in samples] == [True, True, False, False]
    assert [x["decoder_difference"] for x in samples] == [None, "code_fence", "positional_args", None]
    assert out["n_accepted"] == 4 and out["accuracy"] == pytest.approx(4 / 6)
    assert out["pivotrl_accuracy"] == pytest.approx(4 / 6)
    assert out["bfcl_judged_states"] == 2 and out["bfcl_judged_samples"] == 5
    assert {k: out[k] for k in AGREEMENT_KEYS} == {"agree_both_accept": 2, "agree_only_bfcl": 1,
                                                   "agree_only_pivotrl": 1, "agree_neither": 1}
    assert out["decoder_diff_code_fence"] == 1 and out["decoder_diff_positional_args"] == 1
    assert sum(out[k] for k in DIFFERENCE_KEYS) == 2
    lines = single_turn_judge_markdown({"pivotrl": {"local": out, "out_of_domain": None}})
    text = "\n".join(lines)
    assert lines[0] == "## BFCL single-turn judge"
    assert "| pivotrl | held-out, greedy | 2 | 5 | 0.667 | 0.667 | 2 | 1 | 1 | 1 |" in text
    assert "prompt: pivotrl's renderer" in text and "parser: BFCL's Python decoder" in text
    assert single_turn_judge_markdown({"pivotrl": {"local": summary}}) == []


class _Script:
    """A scripted policy: answers the prompts of each generate call, in order, with the next texts."""

    def __init__(self, tokenizer: Any, texts: list[str]) -> None:
        self.tokenizer, self.texts = tokenizer, list(texts)

    def generate(self, prompts, sampling):
        from pivotrl.rollout.base import Generation

        ids = [5, self.tokenizer.eos_token_id]  # token ids do not matter to the judges
        return [[Generation(token_ids=ids, text=self.texts.pop(0), rollout_logprobs=[0.0] * len(ids),
                            finish_reason="stop")] for _ in prompts]


@pytest.mark.parametrize("judge_name", ["bfcl", "pivotrl"])
def test_the_evaluate_stage_takes_bfcl_verdict_on_single_turn_states(states, bfcl_root, tmp_path, judge_name):
    from pivotrl.config import load_config
    from pivotrl.pipeline.common import make_verifier
    from pivotrl.pipeline.evaluate import EvalStates, StateParts, policy_state_results
    from pivotrl.testing import tiny_tokenizer

    cfg = load_config(None, [f"run.storage_root={tmp_path}", f"quality.judge={judge_name}"])
    tok = tiny_tokenizer()
    a, b = _state(states, "simple_python_0"), _state(states, "simple_python_1")
    ood = _state(states, "multiple_0")
    texts = ["```\n" + format_action(a.demo_action) + "\n```",   # BFCL reads the fenced call; pivotrl: text
             format_action(b.demo_action),                         # both accept
             "[triangle_properties.get(5, 4, 3)]"]  # positional values: pivotrl names them, BFCL drops them
    chosen = EvalStates(local=[a, b], stop=[], ood=[ood], pivots=[])
    parts = StateParts(chosen.counts())
    verifier = make_verifier(cfg, bfcl_root, tok)
    try:
        policy_state_results(cfg, _Script(tok, texts), tok, chosen, verifier, "pivotrl", parts,
                             measures=("heldout_greedy", "out_of_domain_greedy"))
    finally:
        verifier.close()
    local = parts.results["pivotrl"]["local_heldout_runs"][0]
    ood_summary = parts.results["pivotrl"]["out_of_domain_runs"][0]
    frame = pd.concat(parts.local_frames)
    if judge_name == "bfcl":
        assert (local["n_accepted"], local["pivotrl_accuracy"], local["bfcl_judged_states"]) == (2, 0.5, 2)
        assert local["agree_only_bfcl"] == 1 and local["agree_both_accept"] == 1
        assert local["decoder_diff_code_fence"] == 1
        assert list(frame["judge"]) == ["bfcl_ast", "bfcl_ast", "bfcl_ast"]
        assert list(frame["n_accepted"]) == [1, 1, 0] and list(frame["pivotrl_accepted"]) == [0, 1, 1]
        assert ood_summary["decoder_diff_positional_args"] == 1 and ood_summary["agree_only_pivotrl"] == 1
        assert (ood_summary["accuracy"], ood_summary["pivotrl_accuracy"]) == (0.0, 1.0)
    else:  # pivotrl's verifier stays the judge
        assert local["n_accepted"] == 1 and "bfcl_judged_states" not in local
        assert "judge" not in frame and list(frame["n_accepted"]) == [0, 1, 1]


def test_states_of_no_single_turn_category_are_left_to_pivotrl(states):
    from pivotrl.config import load_config
    from pivotrl.pipeline.evaluate import _bfcl_rejudge

    other = dataclasses.replace(_state(states, "simple_python_0"), category="multi_turn_base")
    frame, summary, made = _frame([(other, [("[x()]", 1.0)])]), {"n_accepted": 1}, []
    out = _bfcl_rejudge(load_config(None, []), None, frame, summary, [other], made)
    assert out[0] is frame and out[1] is summary and made == []  # no judge made, the wheel never read
