"""The paper's three claims as ``pivotrl compare`` words them, from paired tests, the ledgers and the
held-out curves against rollout turns; the budget options of the baselines."""

from __future__ import annotations

import pytest

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


# ------------------------------------------------------------ claim 3 from the held-out curves
def _curve(points: list[tuple[int, int, int]], n: int = 20) -> list[dict]:
    """Curve points (step, rollout turns, accepted of n) as learning_curve writes them."""
    from pivotrl.evaluation.stats import wilson_interval

    out = []
    for step, turns, k in points:
        lo, hi = wilson_interval(k, n)
        out.append({"step": step, "rollout_turns": turns, "rollout_tokens": None, "accepted": k, "n": n,
                    "accuracy": k / n, "low": lo, "high": hi})
    return out


def test_turns_to_target_reads_the_first_point_at_or_above_pi_ref_plus_the_smaller_gain():
    from pivotrl.evaluation.turn_curves import first_reach, turns_to_target

    # PivotRL: 640 probe turns before step 0, then 256 per step; ends at 9/20 (+0.25).
    pivot = _curve([(0, 640, 4), (2, 1152, 7), (4, 1664, 9)])
    # E2E RL: starts at the same 4/20, 1500 turns per 4 steps; ends at 7/20 (+0.15) past the budget.
    e2e = _curve([(0, 0, 4), (4, 1500, 5), (8, 3000, 6), (12, 4500, 7), (13, 4800, 7)])
    r = turns_to_target(pivot, e2e, budget_turns=1664)
    assert r["status"] == "both_gained" and r["n_states"] == [20, 20]
    assert r["reference_accuracy"] == 0.2 and r["final"]["pivotrl"]["gain"] == pytest.approx(0.25)
    assert r["target"] == pytest.approx(0.35)  # π_ref 0.20 + the smaller gain 0.15
    # the first measured point at or above 0.35 (7/20), no interpolation: PivotRL's step 2, E2E RL's step 12
    assert r["reached"]["pivotrl"] == {"step": 2, "rollout_turns": 1152, "accuracy": 0.35}
    assert r["reached"]["e2e"]["rollout_turns"] == 4500
    assert r["ratio"] == pytest.approx(4500 / 1152)
    assert ("π_ref + the smaller final gain (+0.150) = 0.350: PivotRL reached it at 1,152 rollout turns (step 2), "
            "E2E RL reached it at 4,500 rollout turns (step 12); E2E RL / PivotRL turns = 3.9×") in r["sentence"]
    assert "n = 20 held-out states per point" in r["sentence"] and "equal turn budget 1,664" in r["sentence"]
    assert first_reach(pivot, 0.5) is None and first_reach(pivot, 0.2)["step"] == 0


def test_curves_that_cross_give_the_turns_where_each_first_reached_the_target():
    from pivotrl.evaluation.turn_curves import turns_to_target

    # E2E RL is ahead early (+0.30 at 200 turns), PivotRL overtakes it (+0.60 at the end): the target
    # π_ref + 0.30 is reached by E2E RL first, with fewer turns (ratio < 1).
    pivot = _curve([(0, 100, 2), (1, 300, 3), (2, 500, 8)], n=10)
    e2e = _curve([(0, 0, 2), (1, 200, 5), (2, 400, 5)], n=10)
    r = turns_to_target(pivot, e2e)
    assert r["target"] == pytest.approx(0.5)
    assert (r["reached"]["pivotrl"]["rollout_turns"], r["reached"]["e2e"]["rollout_turns"]) == (500, 200)
    assert r["ratio"] == pytest.approx(0.4)
    assert "E2E RL / PivotRL turns = 0.4×" in r["sentence"]
    assert "E2E RL's budget was not PivotRL's rollout turns" in r["sentence"]


def test_e2e_that_never_reaches_the_target_and_curves_without_a_gain():
    from pivotrl.evaluation.turn_curves import turns_to_target

    pivot = _curve([(0, 640, 4), (4, 1664, 9)])
    flat = _curve([(0, 0, 4), (4, 900, 3), (8, 1800, 4)])  # E2E RL ends where it started: no gain
    r = turns_to_target(pivot, flat, budget_turns=1664)
    assert r["status"] == "pivotrl_only" and r["target"] == pytest.approx(0.45)
    assert r["reached"]["e2e"] is None and r["ratio"] is None
    assert "only PivotRL gained (E2E RL ended at +0.000)" in r["sentence"]
    assert "E2E RL never reached it within 1,800 turns" in r["sentence"]
    # Neither gained: no target, said so.
    none = turns_to_target(_curve([(0, 640, 4), (4, 1664, 4)]), flat)
    assert none["status"] == "none_gained" and none["target"] is None
    assert "neither method gained over π_ref by the end of its curve" in none["sentence"]
    # A method without a curve (training.eval_every = 0, or old metrics without turns): cannot be read.
    old = [dict(p, rollout_turns=None) for p in pivot]
    missing = turns_to_target(old, flat)
    assert missing["status"] == "no_curve" and "for PivotRL" in missing["sentence"]
    assert turns_to_target([], [])["reason"].startswith("no held-out curve with rollout turns for PivotRL and E2E RL")


def test_claim_three_carries_the_curve_reading_and_claim_one_the_wall_time_sft():
    from pivotrl.evaluation.turn_curves import turns_to_target

    r = turns_to_target(_curve([(0, 640, 4), (4, 1664, 9)]), _curve([(0, 0, 4), (8, 1800, 6)]))
    third = claims(_stats(0.0, 1.0), _ledgers(100, 400), r)[2]
    assert "; on the held-out curves (greedy, n = 20 held-out states per point; π_ref 0.200)" in third
    assert third.endswith("E2E RL reached it at 1,800 rollout turns (step 8); E2E RL / PivotRL turns = 1.1× "
                          "(final gains: PivotRL +0.250 at 1,664 rollout turns, E2E RL +0.100 at 1,800 rollout turns; "
                          "E2E RL's budget was not PivotRL's rollout turns).")
    stats = _stats(0.0, 1.0)
    stats["local"]["heldout_greedy"]["pairs"].append({"a": "sft_wall", "b": "pivotrl", **_test(0.2, 0.02)})
    one = claims(stats, _ledgers(1, 1), sft={"wall_steps": 40, "wall_s": 612.3, "budget_wall_s": 600.0})[0]
    assert "holds here at matched optimiser steps; PivotRL − SFT, held-out local accuracy +0.100" in one
    assert "; at matched wall time (SFT 40 steps in 612 s against PivotRL's 600 s) it is not shown: " \
           "PivotRL − SFT (wall), held-out local accuracy -0.200" in one


def test_the_budgets_with_rollout_turns_and_sft_wall_time_are_stated():
    from pivotrl.pipeline.compare_eval import _sft_budget

    assert _e2e_budget({"budget": "rollout_turns", "budget_model_calls": 1664, "model_calls": 1800, "steps": 8}) == (
        "same rollout turns as PivotRL's probing and training (1664 model calls; E2E RL made 1800 in 8 steps)")
    assert _sft_budget({"budget": "optimizer_steps", "target_steps": 4}) == "same optimiser steps as PivotRL (4)"
    assert _sft_budget({"budget": "wall_time", "target_steps": 4, "budget_wall_s": 600.0, "wall_s": 601.2,
                        "wall_steps": 90, "wall_reached": True}) == (
        "same optimiser steps as PivotRL (4) for `sft`, and PivotRL's probing and training wall time for `sft_wall` "
        "(600 s; SFT spent 601 s in its optimiser steps, 90 steps)")


def test_the_turn_curves_plot_says_n_and_draws_both_curves(tmp_path):
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    from pivotrl.evaluation.plots import plot_turn_curves, png_bytes

    curves = {"PivotRL": _curve([(0, 640, 4), (4, 1664, 9)]), "E2E RL": _curve([(0, 0, 4), (8, 1800, 6)])}
    fig = Figure()
    FigureCanvasAgg(fig)
    plot_turn_curves(fig, curves, target=0.3, budget=1664)
    labels = fig.axes[0].get_legend_handles_labels()[1]
    assert "PivotRL (n = 20 states per point)" in labels and "E2E RL (n = 20 states per point)" in labels
    assert any(lbl.startswith("target 0.300") for lbl in labels) and "equal turn budget (1,664)" in labels
    assert png_bytes(lambda f: plot_turn_curves(f, curves))[:4] == b"\x89PNG"


def test_the_new_budget_options_are_validated():
    from pivotrl.config import load_config
    from pivotrl.core.errors import ConfigError

    cfg = load_config(None, ["compare.e2e_budget=rollout_turns", "compare.sft_budget=wall_time",
                             "compare.sft_max_steps=50"])
    assert (cfg.compare.e2e_budget, cfg.compare.sft_budget, cfg.compare.sft_max_steps) == ("rollout_turns", "wall_time", 50)
    with pytest.raises(ConfigError, match=r"compare\.e2e_budget"):
        load_config(None, ["compare.e2e_budget=turns"])
    with pytest.raises(ConfigError, match=r"compare\.sft_budget"):
        load_config(None, ["compare.sft_budget=generated_tokens"])
    with pytest.raises(ConfigError, match=r"compare\.sft_max_steps"):
        load_config(None, ["compare.sft_max_steps=0"])
