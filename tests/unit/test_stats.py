"""Report statistics against hand-computed values (pivotrl.evaluation.stats)."""

from __future__ import annotations

import math
from pathlib import Path

import pytest

from pivotrl.core.errors import ConfigError
from pivotrl.evaluation.stats import (
    PAIRED_TEST,
    bootstrap_mean_interval,
    mcnemar_exact,
    paired_binary,
    paired_bootstrap,
    paired_difference_interval,
    sign_flip_p,
    wilson_interval,
)

Z = 1.959963984540054


REPO = Path(__file__).resolve().parents[2]

def test_wilson_known_bounds():
    # 0/10: low 0, high z²/(n+z²) = 3.84146/13.84146.
    lo, hi = wilson_interval(0, 10)
    assert lo == pytest.approx(0.0, abs=1e-12) and hi == pytest.approx(Z * Z / (10 + Z * Z), abs=1e-12) and hi == pytest.approx(0.27753, abs=1e-5)
    # 5/10: symmetric around 0.5, the textbook [0.2366, 0.7634].
    lo, hi = wilson_interval(5, 10)
    assert (lo, hi) == (pytest.approx(0.23659, abs=1e-5), pytest.approx(0.76341, abs=1e-5))
    # 7/40 (the old report's local accuracy): centre 0.203477, half-width 0.116022 by hand.
    lo, hi = wilson_interval(7, 40)
    assert (lo, hi) == (pytest.approx(0.08745, abs=1e-5), pytest.approx(0.31950, abs=1e-5))
    assert wilson_interval(10, 10)[1] == 1.0
    assert all(math.isnan(x) for x in wilson_interval(0, 0))
    with pytest.raises(ConfigError, match="0 <= k <= n"):
        wilson_interval(11, 10)


def test_mcnemar_exact_values():
    assert mcnemar_exact(0, 0) == 1.0
    assert mcnemar_exact(0, 5) == pytest.approx(2 / 32)  # 2·(1/2)^5
    assert mcnemar_exact(1, 6) == pytest.approx(2 * 8 / 128)  # 2·(C(7,0)+C(7,1))/2^7 = 0.125
    assert mcnemar_exact(6, 1) == mcnemar_exact(1, 6)
    assert mcnemar_exact(2, 2) == 1.0  # 2·11/16 capped at 1
    assert mcnemar_exact(0, 10) == pytest.approx(2 / 1024)


def test_paired_binary_counts_discordant_pairs_only():
    a = [True, True, True, False, False, True, True, True]
    b = [False, False, False, False, True, True, False, False]
    r = paired_binary(a, b)
    assert (r.n, r.b, r.c) == (8, 5, 1)
    assert (r.low, r.high) == paired_difference_interval(1, 5, 1, 1)  # both, only A, only B, neither
    assert r.p_value == pytest.approx(2 * (1 + 6) / 64)  # 0.21875
    assert r.difference == pytest.approx(4 / 8) and not r.significant
    assert r.verdict == "no significant difference"
    strong = paired_binary([True] * 10, [False] * 10)
    assert strong.significant and strong.verdict == "A better"
    with pytest.raises(ConfigError, match="paired"):
        paired_binary([True], [True, False])


def test_newcombe_paired_difference_interval():
    # Published value: airway hyper-responsiveness before/after stem cell transplantation (Bentur et
    # al. 2009; both 1, before only 1, after only 7, neither 12): −0.507 to −0.026 for the Newcombe
    # square-and-add interval (Fagerland, Lydersen & Laake, "Statistical Analysis of Contingency
    # Tables", ch. 8).
    lo, hi = paired_difference_interval(1, 1, 7, 12)
    assert (round(lo, 3), round(hi, 3)) == (-0.507, -0.026)
    # Swapping A and B negates the interval.
    assert paired_difference_interval(1, 7, 1, 12) == pytest.approx((-hi, -lo))
    # No discordant pair, every unit a success: symmetric about 0, as wide as Wilson's 10/10 gap.
    w_lo, _ = wilson_interval(10, 10)
    assert paired_difference_interval(10, 0, 0, 0) == pytest.approx((-(1 - w_lo), 1 - w_lo))
    # A always, B never: Δ = 1 and the upper end at 1.
    lo, hi = paired_difference_interval(0, 10, 0, 0)
    assert hi == 1.0 and lo == pytest.approx(1 - ((1 - w_lo) ** 2 + wilson_interval(0, 10)[1] ** 2) ** 0.5)
    assert all(math.isnan(x) for x in paired_difference_interval(0, 0, 0, 0))
    with pytest.raises(ConfigError, match="counts"):
        paired_difference_interval(1, -1, 0, 0)


def test_newcombe_interval_covers_the_true_difference_about_95_percent_of_the_time():
    import random

    rng = random.Random(0)
    probs, n, reps = (0.3, 0.2, 0.1, 0.4), 30, 2000  # both, only A, only B, neither; Δ = 0.1
    covered = 0
    for _ in range(reps):
        counts = [0, 0, 0, 0]
        for k in rng.choices(range(4), weights=probs, k=n):
            counts[k] += 1
        lo, hi = paired_difference_interval(*counts)
        covered += lo <= 0.1 <= hi
    assert 0.93 <= covered / reps <= 0.98, covered / reps


def test_bootstrap_interval_is_seeded_and_covers_the_estimate():
    values = [0, 1, 2, 1, 0, 3, 1, 2]
    weights = [3, 2, 4, 1, 2, 3, 2, 3]
    est, lo, hi = bootstrap_mean_interval(values, weights, n_boot=500, seed=1)
    assert est == pytest.approx(10 / 20) and lo <= est <= hi
    assert bootstrap_mean_interval(values, weights, n_boot=500, seed=1) == (est, lo, hi)
    # A constant gives a zero-width interval.
    assert bootstrap_mean_interval([0.25] * 5) == (0.25, 0.25, 0.25)
    assert all(math.isnan(x) for x in bootstrap_mean_interval([]))


def test_sign_flip_p_values_are_exact_for_few_units():
    assert sign_flip_p([0.5]) == 1.0  # one unit: both signs tie, nothing can be concluded
    assert sign_flip_p([0.0, 0.0]) == 1.0
    assert sign_flip_p([1, 2, 3, 4]) == pytest.approx(2 / 16)  # only all-plus and all-minus reach |10|
    assert sign_flip_p([1, -1, 2]) == pytest.approx(6 / 8)  # |±1 ±1 ±2| ≥ 2 but for the two sums of 0
    assert sign_flip_p([1.0] * 6) == pytest.approx(2 / 64)
    # Many units: Monte Carlo, (hits + 1) / (draws + 1), seeded.
    many = [1.0] * 20
    assert sign_flip_p(many, n_draws=500, seed=3) == pytest.approx(1 / 501) == sign_flip_p(many, n_draws=500, seed=3)


def test_paired_bootstrap_with_one_unit_or_one_difference_claims_nothing():
    """A paired bootstrap p-value was 0 ("significant") for one unit with any non-zero difference,
    and its interval had zero width; now p = 1 and there is no interval."""
    one = paired_bootstrap([0.5], [0.0])
    assert (one.difference, one.p_value, one.significant) == (0.5, 1.0, False)
    assert math.isnan(one.low) and math.isnan(one.high)
    flat = paired_bootstrap([0.25, 0.25, 0.25], [0.0, 0.0, 0.0])
    assert flat.p_value == pytest.approx(2 / 8) and math.isnan(flat.low) and flat.test == PAIRED_TEST


def test_paired_bootstrap_identical_and_shifted():
    same = paired_bootstrap([0.1, 0.5, 0.9], [0.1, 0.5, 0.9])
    assert same.p_value == 1.0 and same.difference == 0.0 and not same.significant
    up = paired_bootstrap([1.0] * 30, [0.0] * 15 + [1.0] * 15, n_boot=1000)
    assert up.difference == pytest.approx(0.5) and up.p_value < 0.01 and up.verdict == "A better"
    assert up.low > 0


# ------------------------------------------------------------------------ report comparisons
def test_compare_policies_pairs_on_the_same_tasks_and_states():
    import pandas as pd

    from pivotrl.evaluation.comparison import compare_policies, comparison_markdown, verdict, verdict_lines

    a = [1, 1, 1, 1, 1, 0, 0, 0, 0, 0]  # pivotrl: 5/10
    b = [1, 0, 0, 0, 0, 0, 0, 0, 0, 0]  # reference: 1/10; only-a 4, only-b 0 → p = 2/16
    rows = []
    for policy, succ in (("pivotrl", a), ("reference", b)):
        for i, s in enumerate(succ):
            rows.append({"policy": policy, "seed": 0, "task_id": f"t{i}", "success": bool(s),
                         "turns_passed": 2 * s, "n_turns": 4})
    local = pd.DataFrame([{"policy": p, "seed": 0, "kind": "heldout_greedy", "state_id": f"s{i}", "status": "ok",
                           "n_samples": 1, "n_accepted": int(i < k)} for p, k in (("pivotrl", 3), ("reference", 3))
                          for i in range(6)])
    stats = compare_policies(pd.DataFrame(rows), local, ["pivotrl", "reference"])
    full = stats["full_task"]
    ts = full["per_policy"]["pivotrl"]["task_success"]
    assert (ts["k"], ts["n"], ts["rate"]) == (5, 10, 0.5)
    assert (ts["low"], ts["high"]) == (pytest.approx(0.23659, abs=1e-5), pytest.approx(0.76341, abs=1e-5))
    assert full["per_policy"]["pivotrl"]["turn_pass"]["rate"] == pytest.approx(10 / 40)
    (pair,) = full["pairs"]
    assert pair["task_success"]["test"] == "exact McNemar"
    assert (pair["task_success"]["only_a"], pair["task_success"]["only_b"]) == (4, 0)
    assert pair["task_success"]["p_value"] == pytest.approx(0.125)
    assert pair["task_success"]["verdict"] == "no significant difference"
    assert pair["turn_fraction"]["test"] == PAIRED_TEST and pair["turn_fraction"]["difference"] == pytest.approx(0.2)
    (lp,) = stats["local"]["heldout_greedy"]["pairs"]
    assert (lp["only_a"], lp["only_b"], lp["p_value"], lp["verdict"]) == (0, 0, 1.0, "no significant difference")
    md = "\n".join(comparison_markdown(stats))
    assert "| pivotrl | 0.500 (5/10, 95% CI 0.237–0.763) |" in md and "no significant difference" in md
    lo, hi = paired_difference_interval(1, 4, 0, 5)
    assert (f"- pivotrl vs reference (task success): A − B +0.400 (95% CI {lo:+.3f}–{hi:+.3f}; n = 10; only A 4, "
            "only B 0); exact McNemar p = 0.125: no significant difference") in md.splitlines()
    assert max(len(line) for line in md.splitlines() if line.startswith("|")) <= 100  # fits the Prefect UI
    # The report's opening verdict: PivotRL against the reference, each measure with Δ, interval, test, p, n.
    lo, hi = paired_difference_interval(1, 4, 0, 5)
    opening = verdict_lines(stats, names={"reference": "π_ref"})
    assert opening[:3] == ["## Verdict", "", "pivotrl against π_ref on the same held-out items (A − B):"]
    assert opening[4] == (f"- full-task success: 0.500 vs 0.100, +0.400 (95% CI {lo:+.3f}–{hi:+.3f}; exact McNemar "
                          "p = 0.125; n = 10 tasks): **no significant difference**")
    assert opening[5].startswith("- turns passed per task: 0.250 vs 0.050, +0.200 (95% CI ")
    assert opening[6].startswith("- local accuracy, held-out states (greedy): 0.500 vs 0.500, +0.000 (95% CI ")
    assert opening[6].endswith("exact McNemar p = 1; n = 6 states): **no significant difference**")
    # Nothing significant: the verdict says what this size could resolve and where a run sized to show it is.
    rows = verdict(stats)
    best = min((v for v in rows if v["test"] == "exact McNemar"), key=lambda v: v["high"] - v["low"])
    note = opening[-2]
    assert opening[-1] == "" and note.startswith(f"No measure separates pivotrl from π_ref. The most precise one here "
                                                 f"({best['measure']}, n = {best['n']} ")
    assert f"±{(best['high'] - best['low']) / 2:.3f} wide" in note and "`configs/showcase.yaml`" in note
    assert (REPO / "configs" / "showcase.yaml").is_file()
    # Asked the other way round, every difference and interval flips.
    flipped = verdict_lines(stats, a="reference", b="pivotrl")
    assert f"-0.400 (95% CI {-hi:+.3f}–{-lo:+.3f}; exact McNemar p = 0.125; n = 10 tasks)" in flipped[4]
    assert verdict_lines(stats, a="pivotrl", b="e2e") == []
    (first, *_) = verdict(stats)  # the same rows, as report.json holds them
    assert {k: first[k] for k in ("measure", "a", "b", "rate_a", "rate_b", "n", "test", "better", "decision")} == {
        "measure": "full-task success", "a": "pivotrl", "b": "reference", "rate_a": 0.5, "rate_b": 0.1, "n": 10,
        "test": "exact McNemar", "better": None, "decision": "no significant difference"}
    assert (first["difference"], first["low"], first["high"]) == (pytest.approx(0.4), lo, hi)


def test_bootstrap_of_all_zero_or_all_one_units_is_not_zero_width():
    """0 turns passed on every task is not certainty: the interval is Wilson over the units."""
    est, lo, hi = bootstrap_mean_interval([0.0] * 12, [3.0] * 6 + [4.0] * 6, proportion=True)
    assert (est, lo) == (0.0, 0.0) and hi == pytest.approx(wilson_interval(0, 12)[1]) and hi > 0.2
    est, lo, hi = bootstrap_mean_interval([1.0] * 10, proportion=True)
    assert (est, hi) == (1.0, 1.0) and lo == pytest.approx(wilson_interval(10, 10)[0]) and lo < 0.75
    # a constant rate that is not 0 or 1 and a mean that is not a rate keep their (zero-width)
    # bootstrap; a paired difference of 0 everywhere gets no interval (paired_bootstrap)
    assert bootstrap_mean_interval([0.25] * 5, proportion=True) == (0.25, 0.25, 0.25)
    assert bootstrap_mean_interval([0.0] * 12) == (0.0, 0.0, 0.0)
    from pivotrl.evaluation.stats import paired_bootstrap

    same = paired_bootstrap([0.5, 0.0, 0.25], [0.5, 0.0, 0.25])
    assert (same.difference, same.p_value) == (0.0, 1.0) and math.isnan(same.low) and math.isnan(same.high)


def test_turn_pass_of_a_policy_that_passed_nothing_says_which_interval():
    import pandas as pd

    from pivotrl.evaluation.comparison import compare_policies

    rows = [{"policy": p, "seed": 0, "task_id": f"t{i}", "success": False, "turns_passed": k * (i % 2),
             "n_turns": 3} for p, k in (("base", 0), ("pivotrl", 1)) for i in range(12)]
    stats = compare_policies(pd.DataFrame(rows), None, ["base", "pivotrl"])
    base = stats["full_task"]["per_policy"]["base"]["turn_pass"]
    assert base["rate"] == 0.0 and base["high"] == pytest.approx(wilson_interval(0, 12)[1])
    assert base["interval"].startswith("Wilson over units")
    assert stats["full_task"]["per_policy"]["pivotrl"]["turn_pass"]["interval"] == "bootstrap over units 95%"


def test_bootstrap_difference_of_two_independent_samples():
    from pivotrl.evaluation.stats import bootstrap_difference_interval

    # Two units a side: a resampled mean takes min, mid or max (p = 1/4, 1/2, 1/4), so the 2.5 % and
    # 97.5 % points of the difference are (min a − max b) and (max a − min b), each of probability 1/16.
    est, lo, hi = bootstrap_difference_interval([0.09375, 0.40625], [0.15625, 0.1875])
    assert est == pytest.approx(0.25 - 0.171875)
    assert (lo, hi) == (pytest.approx(0.09375 - 0.1875), pytest.approx(0.40625 - 0.15625))
    # Fewer than two units, or no spread at all: no interval (a zero-width one would claim certainty).
    assert math.isnan(bootstrap_difference_interval([0.5], [0.1, 0.2])[1])
    est, lo, hi = bootstrap_difference_interval([0.0, 0.0, 0.0], [0.0, 0.0])
    assert est == 0.0 and math.isnan(lo) and math.isnan(hi)
    assert all(math.isnan(x) for x in bootstrap_difference_interval([], [1.0]))
    # Seeded: the same call gives the same interval; a clear shift excludes 0.
    a, b = [0.6, 0.7, 0.8, 0.65, 0.75], [0.1, 0.2, 0.15, 0.05, 0.1]
    assert bootstrap_difference_interval(a, b, seed=3) == bootstrap_difference_interval(a, b, seed=3)
    assert bootstrap_difference_interval(a, b)[1] > 0


def test_a_significant_verdict_has_no_too_small_note():
    import pandas as pd

    from pivotrl.evaluation.comparison import compare_policies, verdict_lines

    local = pd.DataFrame([{"policy": p, "seed": 0, "kind": "heldout_greedy", "state_id": f"s{i}", "status": "ok",
                           "n_samples": 1, "n_accepted": int(i < k)} for p, k in (("pivotrl", 30), ("reference", 5))
                          for i in range(40)])
    sampled = pd.DataFrame([{"policy": p, "seed": 0, "kind": "heldout_sampled", "state_id": f"s{i}", "status": "ok",
                             "n_samples": 4, "n_accepted": a} for p, a in (("pivotrl", 3), ("reference", 1))
                            for i in range(40)])
    lines = verdict_lines(compare_policies(None, pd.concat([local, sampled]), ["pivotrl", "reference"]))
    assert "**pivotrl better**" in lines[4] and not any(line.startswith("No measure separates") for line in lines)
    # The sampled held-out measure is in the verdict too: per-state accuracy over m samples, paired by state.
    assert lines[5].startswith("- local accuracy, held-out states (m samples per state at the probe temperature): "
                               "0.750 vs 0.250, +0.500") and "n = 40 states" in lines[5]


def test_the_too_small_note_reads_its_resolution_off_a_0_1_measure_not_a_collapsed_bootstrap():
    """As in a default run: greedy accuracy equal on every state (5/40 each), sampled accuracy nearly
    equal; the bootstrap interval of the sampled measure is ±0.005 because the policies agree, which is
    no resolution: the note gives Newcombe's ±0.081 of the 40 greedy outcomes."""
    import pandas as pd

    from pivotrl.evaluation.comparison import compare_policies, verdict, verdict_lines

    local = pd.DataFrame([{"policy": p, "seed": 0, "kind": "heldout_greedy", "state_id": f"s{i}", "status": "ok",
                           "n_samples": 1, "n_accepted": int(i < 5)} for p in ("pivotrl", "reference")
                          for i in range(40)])
    sampled = pd.DataFrame([{"policy": p, "seed": 0, "kind": "heldout_sampled", "state_id": f"s{i}", "status": "ok",
                             "n_samples": 8, "n_accepted": int(i < 3) + int(p == "pivotrl" and i == 0)}
                            for p in ("pivotrl", "reference") for i in range(40)])
    stats = compare_policies(None, pd.concat([local, sampled]), ["pivotrl", "reference"])
    rows = {v["measure"]: v for v in verdict(stats)}
    greedy = rows["local accuracy, held-out states (greedy)"]
    sampled_row = next(v for m, v in rows.items() if m.startswith("local accuracy, held-out states (m samples"))
    assert sampled_row["high"] - sampled_row["low"] < greedy["high"] - greedy["low"]  # the collapsed one is narrower
    half = (greedy["high"] - greedy["low"]) / 2
    assert half == pytest.approx(0.081, abs=0.002)
    (note,) = [line for line in verdict_lines(stats) if line.startswith("No measure separates")]
    assert "(local accuracy, held-out states (greedy), n = 40 states)" in note
    assert f"±{half:.3f} wide, so a true difference smaller than about {half:.3f} cannot show" in note
