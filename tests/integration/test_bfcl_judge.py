"""BFCL's own multi-turn checker as the judge of record, and where pivotrl's own judge departs from it.

The agreement check plays systematic variants of the gold outputs of BFCL multi_turn_base tasks
through the real full-task runner (a scripted policy whose action texts are the variant), once
judged by BFCL's ``multi_turn_checker`` (from the wheel) and once by pivotrl's own judge, and
compares task success and turns passed. ``PIVOTRL_JUDGE_AGREEMENT_OUT=<file>`` writes the table.
"""

from __future__ import annotations

import json
import os
from collections import Counter
from typing import Any, Callable

import pytest

from pivotrl.format.actions import format_call, format_value
from pivotrl.config import EvaluationSection
from pivotrl.bfcl.data import load_bfcl
from pivotrl.bfcl.multi_turn import CLOSING_TEXT
from pivotrl.bfcl.wheel import ensure_bfcl
from pivotrl.data.schema import ToolCall, Trajectory
from pivotrl.bfcl.judge import (
    BFCL_STEP_LIMIT,
    UNKNOWN_TOOL,
    bfcl_check,
    bfcl_step_limit,
    bfcl_test_entry,
    call_strings,
)
from pivotrl.evaluation.full_task import evaluate_full_tasks, split_user_turns
from pivotrl.rollout.base import Generation, SamplingConfig
from pivotrl.testing import tiny_tokenizer

# Every test here reads the pinned BFCL records (downloaded once into the cache).
pytestmark = pytest.mark.data

GREEDY = SamplingConfig(n=1, temperature=0.0, max_tokens=32)

#: One call per involved class that reads and changes no public state.
READ_ONLY = {
    "GorillaFileSystem": "pwd()", "MathAPI": "absolute_value(number=-1.0)", "MessageAPI": "list_users()",
    "TwitterAPI": "posting_get_login_status()", "TicketAPI": "ticket_get_login_status()",
    "TradingBot": "get_current_time()", "TravelAPI": "list_all_airports()",
    "VehicleControlAPI": "check_tire_pressure()",
}


@pytest.fixture(scope="module")
def bfcl_root():
    return ensure_bfcl(os.environ["PIVOTRL_CACHE_DIR"])


@pytest.fixture(scope="module")
def tasks(bfcl_root) -> list[Trajectory]:
    return load_bfcl(["multi_turn_base"], os.environ["PIVOTRL_CACHE_DIR"])


@pytest.fixture(scope="module")
def tok():
    return tiny_tokenizer()


class OneTaskScript:
    """A scripted policy for one task: each generate call answers with the next text (then "Done.")."""

    def __init__(self, tokenizer, texts: list[str]) -> None:
        self.tokenizer, self.texts = tokenizer, list(texts)

    def generate(self, prompts, sampling):
        assert len(prompts) == 1
        text = self.texts.pop(0) if self.texts else CLOSING_TEXT
        ids = [5, self.tokenizer.eos_token_id]  # token ids do not matter to the judge
        return [[Generation(token_ids=ids, text=text, rollout_logprobs=[0.0] * len(ids), finish_reason="stop")]]


# ------------------------------------------------------------------------------------ variants
# A variant maps a task's gold calls per turn to the policy's action texts per turn (each turn
# then ends with "Done."), or None when it does not apply to the task.

Turns = list[list[ToolCall]]


def _texts(turns: list[list[str]]) -> list[str]:
    return [t for turn in turns for t in (*turn, CLOSING_TEXT)]


def _one_per_step(turns: Turns) -> list[list[str]]:
    return [[f"[{format_call(c)}]" for c in turn] for turn in turns]


def _first(turns: Turns, pred: Callable[[ToolCall], Any]) -> tuple[int, int, Any] | None:
    for t, turn in enumerate(turns):
        for k, c in enumerate(turn):
            hit = pred(c)
            if hit is not None and hit is not False:
                return t, k, hit
    return None


def _replace(turns: Turns, t: int, k: int, call: ToolCall | None) -> Turns:
    out = [list(x) for x in turns]
    if call is None:
        del out[t][k]
    else:
        out[t][k] = call
    return out


def v_gold(turns: Turns, traj: Trajectory) -> list[str]:
    return _texts(_one_per_step(turns))


def v_parallel(turns: Turns, traj: Trajectory) -> list[str]:
    return _texts([[("[" + ", ".join(format_call(c) for c in turn) + "]")] if turn else [] for turn in turns])


def v_drop_first(turns: Turns, traj: Trajectory) -> list[str] | None:
    hit = _first(turns, lambda c: True)
    return None if hit is None else _texts(_one_per_step(_replace(turns, hit[0], hit[1], None)))


def v_drop_last(turns: Turns, traj: Trajectory) -> list[str] | None:
    t = max((i for i, turn in enumerate(turns) if turn), default=None)
    return None if t is None else _texts(_one_per_step(_replace(turns, t, len(turns[t]) - 1, None)))


def _changed(value: Any) -> Any:
    if isinstance(value, bool):
        return not value
    if isinstance(value, (int, float)):
        return value + 1
    if isinstance(value, str):
        return value + "_changed"
    return None


def v_arg_changed(turns: Turns, traj: Trajectory) -> list[str] | None:
    def pick(c: ToolCall):
        return next((k for k, v in sorted(c.arguments.items()) if _changed(v) is not None), None)

    hit = _first(turns, pick)
    if hit is None:
        return None
    t, k, arg = hit
    call = turns[t][k]
    new = ToolCall(call.name, {**call.arguments, arg: _changed(call.arguments[arg])})
    return _texts(_one_per_step(_replace(turns, t, k, new)))


def v_int_float(turns: Turns, traj: Trajectory) -> list[str] | None:
    def pick(c: ToolCall):
        return next((k for k, v in sorted(c.arguments.items())
                     if (isinstance(v, int) and not isinstance(v, bool)) or (isinstance(v, float) and v.is_integer())), None)

    hit = _first(turns, pick)
    if hit is None:
        return None
    t, k, arg = hit
    call = turns[t][k]
    v = call.arguments[arg]
    new = ToolCall(call.name, {**call.arguments, arg: float(v) if isinstance(v, int) else int(v)})
    return _texts(_one_per_step(_replace(turns, t, k, new)))


def v_tuple_list(turns: Turns, traj: Trajectory) -> list[str] | None:
    hit = _first(turns, lambda c: next((k for k, v in sorted(c.arguments.items()) if isinstance(v, list) and v), None))
    if hit is None:
        return None
    t, k, arg = hit
    call = turns[t][k]
    parts = []
    for name in sorted(call.arguments):
        v = call.arguments[name]
        if name == arg:
            parts.append(f"{name}=(" + ", ".join(format_value(x) for x in v) + ("," if len(v) == 1 else "") + ")")
        else:
            parts.append(f"{name}={format_value(v)}")
    texts = _one_per_step(turns)
    texts[t][k] = f"[{call.name}({', '.join(parts)})]"
    return _texts(texts)


def v_extra_read_only(turns: Turns, traj: Trajectory) -> list[str]:
    texts = _one_per_step(turns)
    texts[0].append(f"[{READ_ONLY[traj.env['involved_classes'][0]]}]")
    return _texts(texts)


def v_empty_first_turn(turns: Turns, traj: Trajectory) -> list[str] | None:
    hit = _first(turns, lambda c: True)
    if hit is None:
        return None
    texts = _one_per_step(turns)
    texts[hit[0]] = []
    return _texts(texts)


def v_call_one_turn_early(turns: Turns, traj: Trajectory) -> list[str] | None:
    if len(turns) < 2 or not turns[1]:
        return None
    moved = [list(x) for x in turns]
    moved[0].append(moved[1].pop(0))
    return _texts(_one_per_step(moved))


VARIANTS: dict[str, Callable[[Turns, Trajectory], list[str] | None]] = {
    "gold": v_gold, "gold_parallel": v_parallel, "drop_first_call": v_drop_first, "drop_last_call": v_drop_last,
    "argument_changed": v_arg_changed, "int_vs_float": v_int_float, "tuple_vs_list": v_tuple_list,
    "extra_read_only_call": v_extra_read_only, "empty_turn": v_empty_first_turn,
    "call_one_turn_early": v_call_one_turn_early,
}


def agreement(tasks: list[Trajectory], tok, bfcl_root) -> tuple[dict[str, Counter], list[dict[str, Any]]]:
    """Per variant: Counter of (bfcl success, pivotrl success, agree); and every disagreement."""
    table: dict[str, Counter] = {name: Counter() for name in VARIANTS}
    disagreements: list[dict[str, Any]] = []
    for traj in tasks:
        turns = [list(t.demo_calls) for t in split_user_turns(traj)[1]]
        for name, make in VARIANTS.items():
            texts = make(turns, traj)
            if texts is None:
                table[name]["not applicable"] += 1
                continue
            rows = {}
            for judge in ("bfcl", "pivotrl"):
                df, _ = evaluate_full_tasks(OneTaskScript(tok, texts), tok, [traj], bfcl_root=bfcl_root, sampling=GREEDY,
                                            max_context=1 << 20, judge=judge)
                rows[judge] = df.iloc[0]
            b, p = rows["bfcl"], rows["pivotrl"]
            same = bool(b.success) == bool(p.success) and int(b.turns_passed) == int(p.turns_passed)
            table[name]["bfcl pass" if b.success else "bfcl fail"] += 1
            table[name]["agree" if same else "disagree"] += 1
            if not same:
                disagreements.append({"task": traj.id, "variant": name, "bfcl": [bool(b.success), int(b.turns_passed), b.reason],
                                      "pivotrl": [bool(p.success), int(p.turns_passed), p.reason],
                                      "bfcl_detail": str(b.detail)[:300], "pivotrl_detail": str(p.detail)[:300]})
    return table, disagreements


# ----------------------------------------------------------------------------------------- tests


def test_step_limit_is_bfcls(bfcl_root):
    assert bfcl_step_limit(bfcl_root) == BFCL_STEP_LIMIT == 20
    assert EvaluationSection().max_steps_per_turn == BFCL_STEP_LIMIT


def test_gold_passes_bfcls_checker_on_all_200_tasks(tasks, bfcl_root):
    assert len(tasks) == 200
    for traj in tasks:
        entry, gt = bfcl_test_entry(traj)
        steps = [[[format_call(c)] for c in turn.demo_calls] for turn in split_user_turns(traj)[1]]
        verdict = bfcl_check(entry, gt, steps, bfcl_root)
        assert verdict.valid, (traj.id, verdict)
        # One turn short: BFCL's runner calls that force-terminated.
        short = bfcl_check(entry, gt, steps[:-1], bfcl_root)
        assert (short.valid, short.reason) == (False, "force_terminated")


def test_unknown_tools_never_reach_python(tasks, bfcl_root):
    traj = tasks[0]
    names = frozenset(t.name for t in traj.tools)
    strings = call_strings([ToolCall("open", {"file": "/etc/passwd"}), ToolCall("ls", {"a": True})], names)
    assert strings == [f"{UNKNOWN_TOOL}()", "ls(a=True)"]
    entry, gt = bfcl_test_entry(traj)
    verdict = bfcl_check(entry, gt[:1], [[strings]], bfcl_root)
    assert not verdict.valid and verdict.reason == "state_mismatch"


def test_step_limit_force_terminates_like_bfcl(tasks, tok, bfcl_root):
    traj = tasks[0]  # turn 0 needs cd, mkdir, mv: with a limit of 2 the third executing step quits the task
    turns = [list(t.demo_calls) for t in split_user_turns(traj)[1]]
    engine = OneTaskScript(tok, v_gold(turns, traj))
    df, summary = evaluate_full_tasks(engine, tok, [traj], bfcl_root=bfcl_root, sampling=GREEDY, max_context=1 << 20,
                                      max_steps_per_turn=2)
    row = df.iloc[0]
    # The quit turn is still judged (it passes: all three calls ran); the task then fails.
    assert (bool(row.success), row.turns_passed, row.reason, row.model_calls) == (False, 1, "force_terminated", 3)
    assert summary["judge"] == "bfcl" and summary["max_steps_per_turn"] == 2


def test_judges_agree_on_gold_variants_first_tasks(tasks, tok, bfcl_root):
    table, disagreements = agreement(tasks[:6], tok, bfcl_root)
    assert table["gold"]["bfcl pass"] == 6 and table["drop_first_call"]["bfcl fail"] == 6
    assert disagreements == [], disagreements


def _agreement_half(half: int) -> tuple[dict[str, Counter], list[dict[str, Any]]]:
    """The agreement check on every other task (``half`` = 0 or 1), in a fresh process."""
    root = ensure_bfcl(os.environ["PIVOTRL_CACHE_DIR"])
    tasks = load_bfcl(["multi_turn_base"], os.environ["PIVOTRL_CACHE_DIR"])
    return agreement(tasks[half::2], tiny_tokenizer(), root)


@pytest.mark.slow
def test_judge_agreement_on_all_200_tasks(tasks, bfcl_root):
    # Two fresh processes (spawned: this one runs threads a fork would copy mid-lock) judge every
    # other task each, on the two cores; the counts are summed.
    import multiprocessing

    assert len(tasks) == 200
    with multiprocessing.get_context("spawn").Pool(2) as pool:
        halves = pool.map(_agreement_half, [0, 1])
    table = {name: halves[0][0][name] + halves[1][0][name] for name in VARIANTS}
    disagreements = halves[0][1] + halves[1][1]
    out = os.environ.get("PIVOTRL_JUDGE_AGREEMENT_OUT")
    if out:
        with open(out, "w") as f:
            json.dump({"table": {k: dict(v) for k, v in table.items()}, "disagreements": disagreements}, f, indent=1)
    assert table["gold"] == Counter({"bfcl pass": 200, "agree": 200})
    assert {(d["task"], d["variant"]) for d in disagreements} == KNOWN_DISAGREEMENTS, disagreements


#: Every (task, variant) where pivotrl's own judge and BFCL's disagree (see README, "Judging").
KNOWN_DISAGREEMENTS: set[tuple[str, str]] = set()


def test_a_tuple_decoded_as_a_tuple_fails_bfcl_where_pivotrls_parser_reads_a_list(tasks, bfcl_root):
    # The decoder difference the report names: BFCL's decoder keeps `(1, 2)` a tuple, which the
    # simulators store, and the state check then differs from the gold list; pivotrl's action
    # parser reads tuples as lists (the tuple_vs_list variant above passes both judges).
    applicable, failed = 0, []
    for traj in tasks:
        turns = [list(t.demo_calls) for t in split_user_turns(traj)[1]]
        texts = v_tuple_list(turns, traj)
        if texts is None:
            continue
        applicable += 1
        steps: list[list[list[str]]] = [[]]
        for text in texts:
            if text == CLOSING_TEXT:
                steps.append([])
            else:
                steps[-1].append([text[1:-1]])  # "[call]" → "call", written with the tuple
        entry, gt = bfcl_test_entry(traj)
        verdict = bfcl_check(entry, gt, steps[:-1], bfcl_root)
        if not verdict.valid:
            failed.append((traj.id, verdict.reason))
    assert applicable == 66 and len(failed) == 18 and {r for _, r in failed} == {"state_mismatch"}
