"""Every loaded BFCL category: each gold answer is accepted by its judge of record, a perturbed one
rejected; refused categories say why; an accepted action that is not the demonstrated one is counted."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pandas as pd
import pytest

from pivotrl.bfcl.data import IRRELEVANCE_CATEGORIES, REFUSED_CATEGORIES, SINGLE_TURN_CATEGORIES, load_bfcl
from pivotrl.bfcl.single import BFCLSingleTurnJudge
from pivotrl.bfcl.wheel import ensure_bfcl
from pivotrl.core.errors import ConfigError
from pivotrl.data.states import extract_turn_states
from pivotrl.format.actions import format_call, parse_action

pytestmark = pytest.mark.data

_CACHE = Path(os.environ.get("PIVOTRL_CACHE_DIR") or Path.home() / ".cache" / "pivotrl")


@pytest.fixture(scope="module")
def root() -> Path:
    return ensure_bfcl(_CACHE)


def test_every_wheel_category_is_loaded_or_refused(root):
    from pivotrl.bfcl.data import MULTI_TURN_CATEGORIES
    from pivotrl.config.sections import BFCL_REFUSED, BFCLCategory
    from typing import get_args

    shipped = {p.name[len("BFCL_v4_"):-len(".json")] for p in (root / "bfcl_eval" / "data").glob("BFCL_v4_*.json")}
    assert shipped == set(SINGLE_TURN_CATEGORIES) | set(MULTI_TURN_CATEGORIES) | set(REFUSED_CATEGORIES)
    assert set(get_args(BFCLCategory)) == set(SINGLE_TURN_CATEGORIES) | set(MULTI_TURN_CATEGORIES)
    assert set(BFCL_REFUSED) == set(REFUSED_CATEGORIES)
    for c in REFUSED_CATEGORIES:
        with pytest.raises(ConfigError, match=f"{c}' is not supported: "):
            load_bfcl([c], _CACHE)


@pytest.mark.parametrize("category", SINGLE_TURN_CATEGORIES)
def test_single_turn_gold_accepted_and_perturbed_rejected(root, category):
    judge = BFCLSingleTurnJudge(root)
    skipped: list[dict] = []
    trajs = load_bfcl([category], _CACHE, quarantine=skipped)
    assert len(trajs) > 10 and len(skipped) <= 5, [s["error"] for s in skipped]
    for t in trajs:
        state = extract_turn_states(t)[0]
        msg = state.demo_action
        if category in IRRELEVANCE_CATEGORIES:
            assert judge.judge(state, msg.content, None).valid, t.id
            continue
        text = "[" + ", ".join(format_call(c) for c in msg.tool_calls) + "]"
        verdict = judge.judge(state, text, parse_action(text, state.tools).tool_calls)
        assert verdict.valid, (t.id, text, verdict)
    # a perturbed answer: irrelevance -> a call; otherwise the first call's name changed
    state = extract_turn_states(trajs[0])[0]
    if category in IRRELEVANCE_CATEGORIES:
        bad = f"[{state.tools[0].name}()]" if state.tools else "[f()]"
        assert not judge.judge(state, bad, parse_action(bad, state.tools).tool_calls).valid
    else:
        c = state.demo_action.tool_calls[0]
        bad = "[" + format_call(type(c)(name=c.name + "_x", arguments=c.arguments)) + "]"
        assert not judge.judge(state, bad, parse_action(bad).tool_calls).valid


@pytest.mark.parametrize("category", ["multi_turn_miss_param", "multi_turn_long_context"])
def test_multi_turn_gold_accepted_and_perturbed_rejected(root, category):
    from pivotrl.bfcl.judge import bfcl_check, bfcl_test_entry, call_strings

    trajs = load_bfcl([category], _CACHE, limit_per_category=8)
    assert len(trajs) == 8
    for t in trajs:
        entry, gt = bfcl_test_entry(t)
        names = {x.name for x in t.tools}
        steps: list[list[list[str]]] = []
        for m in t.messages:
            if m.role == "user":
                steps.append([])
            elif m.role == "assistant" and m.tool_calls:
                steps[-1].append(call_strings(m.tool_calls, names))
        assert bfcl_check(entry, gt, steps, root, category=category).valid, t.id
        if category == "multi_turn_long_context":
            assert t.env["long_context"] is True
    dropped = [[s[:-1] for s in turn] if turn else turn for turn in steps]  # the last call of each turn gone
    assert not bfcl_check(entry, gt, dropped, root, category=category).valid


def test_an_accepted_action_that_is_not_the_demonstration_is_counted(root):
    from pivotrl.envs.sandbox import SandboxPool
    from pivotrl.pipeline.probe import pivot_stats
    from pivotrl.verifiers import get_verifier
    from pivotrl.verifiers.base import NOT_DEMONSTRATED, count_not_demonstrated

    (t,) = load_bfcl(["multi_turn_base"], _CACHE, limit_per_category=1)
    state = extract_turn_states(t)[0]  # demo: cd(folder='document')
    assert format_call(state.demo_action.tool_calls[0]) == "cd(folder='document')"
    with SandboxPool(timeout_s=30.0, bfcl_root=root) as pool:
        results = get_verifier("execution", pool=pool).score(
            state, ["[cd(folder='document')]", "[cd(folder='document/')]", "[cd(folder='archive')]"])
    assert [(r.accepted, r.reason) for r in results] == [
        (True, "match"), (True, NOT_DEMONSTRATED), (False, "different_state_and_output")]
    assert count_not_demonstrated([r.reason for r in results]) == 1
    probes = pd.DataFrame([{"state_id": state.state_id, "category": state.category, "turn_index": 0,
                            "rewards": json.dumps([r.reward for r in results]),
                            "reasons": json.dumps([r.reason for r in results]), "mu": 2 / 3, "var": 0.2,
                            "status": "ok", "decision": "kept", "verifier_retries": 0}])
    stats = pivot_stats(probes, 0.9)
    assert stats["total"]["accepted_samples"] == 2 and stats["total"]["accepted_not_demonstrated"] == 1
