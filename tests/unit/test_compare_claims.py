"""The paper's three claims as ``pivotrl compare`` words them, from paired tests and the ledgers."""

from __future__ import annotations

from pivotrl.runtime.ledger import CostLedger
from pivotrl.pipeline.compare_eval import _e2e_budget, claims


def _test(diff: float, p: float) -> dict:
    return {"difference": diff, "p_value": p, "n": 12, "test": "exact McNemar",
            "verdict": "significant" if p < 0.05 else "no significant difference"}


def _stats(e2e_diff: float, e2e_p: float) -> dict:
    pair = {"a": "e2e", "b": "pivotrl", "task_success": _test(-e2e_diff, e2e_p)}
    local = {"pairs": [{"a": "pivotrl", "b": "sft", **_test(0.1, 0.01)}]}
    return {"full_task": {"pairs": [pair]}, "local": {"heldout_greedy": local,
                                                      "out_of_domain_greedy": {"pairs": []}}}


def _ledgers(calls_pivotrl: int, calls_e2e: int) -> dict[str, CostLedger]:
    return {"pivotrl": CostLedger(name="pivotrl", model_calls=calls_pivotrl, generated_tokens=10 * calls_pivotrl),
            "e2e": CostLedger(name="e2e", model_calls=calls_e2e, generated_tokens=10 * calls_e2e)}


def test_claim_three_needs_fewer_model_calls_than_e2e():
    # A tie in success, but PivotRL spent more model calls: "fewer rollout turns" is not shown.
    third = claims(_stats(0.0, 1.0), _ledgers(1536, 21))[2]
    assert "(the paper: 4× fewer): is not shown: PivotRL used 73.1× E2E RL's model calls, not fewer; " in third
    assert "E2E RL made 21 model calls (210 generated tokens), PivotRL 1536 (15360)" in third
    # Fewer calls and no significant difference: not contradicted; significantly better: holds.
    assert "is not contradicted (4.0× fewer model calls" in claims(_stats(0.0, 1.0), _ledgers(100, 400))[2]
    assert "holds (4.0× fewer model calls, significantly higher success)" in claims(_stats(0.3, 0.01),
                                                                                   _ledgers(100, 400))[2]
    # E2E RL significantly better: the claim does not hold, whatever the cost.
    assert "does not hold" in claims(_stats(-0.3, 0.01), _ledgers(100, 400))[2]
    # Claims 1 and 2 from the local pairs; a missing pair cannot be checked.
    one, two, _ = claims(_stats(0.0, 1.0), _ledgers(1, 1))
    assert "in-domain (the paper: +4.17 points): holds here" in one
    assert "cannot be checked" in two


def test_the_e2e_budget_is_stated_as_run():
    assert _e2e_budget({"budget": "wall_time", "budget_wall_s": 565.2, "wall_s": 590.0, "steps": 9}) == (
        "same wall time as PivotRL's probing and training (565 s; E2E RL spent 590 s in 9 steps)")
    assert _e2e_budget({"budget": "generated_tokens", "budget_tokens": 34017, "generated_tokens": 289, "steps": 2,
                        "budget_reached": False}).endswith("generated 289 in 2 steps, stopped by compare.e2e_max_steps)")
