"""Unit tests of pivotrl.pivots.filter (Stage 1: pivot selection from reference probes)."""

from __future__ import annotations

import itertools

import pytest
import torch

from pivotrl.core.errors import ConfigError
from pivotrl.pivots.filter import (
    DEFAULT_LAMBDA_DIFF,
    PIVOT_DECISIONS,
    is_pivot,
    pivot_decision,
    pivot_decisions,
    probe_stats,
)


def test_binary_rewards_variance_is_mu_times_one_minus_mu():
    # Every outcome pattern of m = 8 binary probes.
    rows = torch.tensor(list(itertools.product([0.0, 1.0], repeat=8)))
    mu, var = probe_stats(rows)
    assert mu.shape == var.shape == (256,)
    torch.testing.assert_close(var, mu * (1 - mu), rtol=0, atol=1e-15)
    kept = [d == "kept" for d in pivot_decisions(mu, var, 0.5)]
    successes = rows.sum(dim=1)
    assert kept == [1 <= int(s) <= 3 for s in successes]  # 1–3 successes of 8 with λ_diff = 0.5


def test_two_dimensional_matches_rows():
    rewards = torch.tensor([[1, 0, 0, 0], [1, 1, 1, 1], [0, 0, 0, 0], [1, 1, 0, 0]])
    mu, var = probe_stats(rewards)
    assert mu.dtype == torch.float64
    assert mu.tolist() == [0.25, 1.0, 0.0, 0.5]
    assert var.tolist() == [0.1875, 0.0, 0.0, 0.25]
    assert pivot_decisions(mu, var) == ["kept", "all_pass", "all_fail", "above_threshold"]
    for row, m, v in zip(rewards, mu, var):
        assert probe_stats(row) == (m.item(), v.item())


def test_graded_rewards_use_population_variance():
    mu, var = probe_stats([0.2, 0.4, 0.9])
    assert mu == pytest.approx(0.5)
    assert var == pytest.approx(((0.3**2) + (0.1**2) + (0.4**2)) / 3)  # divide by m, not m − 1
    assert pivot_decision(mu, var, 0.6) == "kept"
    assert pivot_decision(mu, var, 0.5) == "above_threshold"


def test_equal_graded_rewards_have_exactly_zero_variance():
    # 0.1 * 3 / 3 is not exactly 0.1 in floating point: the variance must still be exactly 0.
    mu, var = probe_stats([0.1, 0.1, 0.1])
    assert var == 0.0
    assert pivot_decision(mu, var, 0.5) == "all_fail"
    assert pivot_decision(0.7, 0.0, 0.5) == "all_pass"


def test_threshold_is_strict_and_lambda_one_keeps_every_mixed_state():
    assert pivot_decision(0.5, 0.25, 0.5) == "above_threshold"
    assert pivot_decision(0.499, 0.25, 0.5) == "kept"
    assert pivot_decision(0.875, 0.109375, 1.0) == "kept"
    assert pivot_decision(1.0, 0.0, 1.0) == "all_pass"


def test_defaults_and_tensor_inputs():
    assert DEFAULT_LAMBDA_DIFF == 0.5
    assert set(PIVOT_DECISIONS) == {"kept", "all_fail", "all_pass", "above_threshold"}
    assert is_pivot(torch.tensor(0.25), torch.tensor(0.1875))
    assert probe_stats(torch.tensor([True, False, False, False])) == (0.25, 0.1875)


@pytest.mark.parametrize("bad", ["0.0", "-0.1", "1.5", ".nan", "half"])
def test_lambda_diff_is_bounded_by_the_config_schema(bad):
    """0 < λ_diff ≤ 1 is checked once, where the config is validated (the filter does not check it again)."""
    from pivotrl.config import load_config

    with pytest.raises(ConfigError, match=r"probing\.lambda_diff"):
        load_config(None, [f"probing.lambda_diff={bad}"])


def test_num_probes_is_bounded_by_the_config_schema():
    from pivotrl.config import load_config

    with pytest.raises(ConfigError, match=r"probing\.num_probes = 1: must be ≥ 2"):
        load_config(None, ["probing.num_probes=1"])
    # the filter itself: a single probe has no variance, so it is never a pivot
    assert probe_stats([1.0]) == (1.0, 0.0) and pivot_decision(1.0, 0.0, 0.5) == "all_pass"
    mu, var = probe_stats(torch.ones(3, 1))
    assert var.tolist() == [0.0, 0.0, 0.0]


def test_bad_rewards_and_stats():
    with pytest.raises(ValueError, match="NaN"):
        probe_stats([1.0, float("nan")])
    with pytest.raises(ValueError, match="shape"):
        probe_stats(torch.ones(2, 2, 2))
    with pytest.raises(ValueError, match="var"):
        pivot_decision(0.5, -0.1, 0.5)
    with pytest.raises(ValueError, match="mu"):
        pivot_decision(float("inf"), 0.1, 0.5)
    with pytest.raises(ValueError, match="single value"):
        pivot_decision(torch.tensor([0.1, 0.2]), 0.1, 0.5)


def test_rewards_equal_within_the_tolerance_count_as_equal():
    noisy = [0.3, 0.1 + 0.2, 0.3, 0.3]  # 0.1 + 0.2 = 0.30000000000000004
    assert len(set(noisy)) == 2
    mu, var = probe_stats(noisy)
    assert var == 0.0 and mu == pytest.approx(0.3)
    assert pivot_decision(mu, var, 0.5) == "all_fail"
    rows = torch.tensor([noisy, [0.3, 0.3 + 5e-10, 0.3, 0.3], [0.3, 0.3 + 1e-6, 0.3, 0.3]], dtype=torch.float64)
    mu, var = probe_stats(rows)
    assert var[:2].tolist() == [0.0, 0.0] and var[2].item() > 0
    assert pivot_decisions(mu, var, 0.5) == ["all_fail", "all_fail", "kept"]
    # A σ̂² of float noise given directly (e.g. read from an older probe table) is no mixed outcome.
    assert pivot_decision(0.3, 2.3e-33, 0.5) == "all_fail"
    assert pivot_decision(0.3, 1e-12, 0.5) == "kept"
