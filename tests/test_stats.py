"""Report statistics against hand-computed values (pivotrl.evaluation.stats)."""

from __future__ import annotations

import math

import pytest

from pivotrl.errors import ConfigError
from pivotrl.evaluation.stats import (
    bootstrap_mean_interval,
    mcnemar_exact,
    paired_binary,
    paired_bootstrap,
    wilson_interval,
)

Z = 1.959963984540054


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
    assert r.p_value == pytest.approx(2 * (1 + 6) / 64)  # 0.21875
    assert r.difference == pytest.approx(4 / 8) and not r.significant
    assert r.verdict == "no significant difference"
    strong = paired_binary([True] * 10, [False] * 10)
    assert strong.significant and strong.verdict == "A better"
    with pytest.raises(ConfigError, match="paired"):
        paired_binary([True], [True, False])


def test_bootstrap_interval_is_seeded_and_covers_the_estimate():
    values = [0, 1, 2, 1, 0, 3, 1, 2]
    weights = [3, 2, 4, 1, 2, 3, 2, 3]
    est, lo, hi = bootstrap_mean_interval(values, weights, n_boot=500, seed=1)
    assert est == pytest.approx(10 / 20) and lo <= est <= hi
    assert bootstrap_mean_interval(values, weights, n_boot=500, seed=1) == (est, lo, hi)
    # A constant gives a zero-width interval.
    assert bootstrap_mean_interval([0.25] * 5) == (0.25, 0.25, 0.25)
    assert all(math.isnan(x) for x in bootstrap_mean_interval([]))


def test_paired_bootstrap_identical_and_shifted():
    same = paired_bootstrap([0.1, 0.5, 0.9], [0.1, 0.5, 0.9])
    assert same.p_value == 1.0 and same.difference == 0.0 and not same.significant
    up = paired_bootstrap([1.0] * 30, [0.0] * 15 + [1.0] * 15, n_boot=1000)
    assert up.difference == pytest.approx(0.5) and up.p_value < 0.01 and up.verdict == "A better"
    assert up.low > 0
