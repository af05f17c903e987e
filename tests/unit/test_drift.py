"""Pivot drift table and the zero-variance warning, against hand-computed values."""

from __future__ import annotations

import pandas as pd
import pytest

from pivotrl.evaluation.drift import drift_markdown, drift_table, zero_variance_summary


def test_drift_table_counts_each_outcome_per_category():
    reprobe = pd.DataFrame({
        "category": ["a", "a", "a", "b", "b"],
        "status": ["ok", "ok", "ok", "ok", "too_long"],
        "mu": [0.25, 1.0, 0.0, 0.75, float("nan")],
        "var": [0.1875, 0.0, 0.0, 0.1875, float("nan")],
    })
    t = drift_table(reprobe, lambda_diff=0.5)
    assert t["a"] == {"n": 3, "stayed": 1, "all_pass": 1, "all_fail": 1, "above_threshold": 0, "skipped": 0}
    assert t["b"] == {"n": 2, "stayed": 0, "all_pass": 0, "all_fail": 0, "above_threshold": 1, "skipped": 1}
    assert t["total"]["n"] == 5 and t["total"]["stayed"] == 1
    md = "\n".join(drift_markdown(t, None, 8))
    assert "| a | 3 | 1 | 1 | 1 | 0 | 0 |" in md and "| total | 5 | 1 | 1 | 1 | 1 | 1 |" in md


def test_zero_variance_warning_when_k_is_too_small():
    # μ̂ = 0.125 for every pivot: P(zero variance) = 0.125^K + 0.875^K; K=4: 0.5864; K=5: 0.5129; K=6: 0.4488.
    metrics = pd.DataFrame({"step": [1, 2], "zero_variance_frac": [0.75, 0.5]})
    z = zero_variance_summary(metrics, 4, [0.125] * 3)
    assert z["expected"] == pytest.approx(0.125 ** 4 + 0.875 ** 4) and z["observed_mean"] == pytest.approx(0.625)
    assert z["per_step"] == [[1.0, 0.75], [2.0, 0.5]]
    assert "K=4 is too small" in z["warning"] and "K ≥ 6" in z["warning"]
    ok = zero_variance_summary(pd.DataFrame({"step": [1], "zero_variance_frac": [0.25]}), 8, [0.5, 0.5])
    assert ok["warning"] is None and ok["expected"] == pytest.approx(2 * 0.5 ** 8)
