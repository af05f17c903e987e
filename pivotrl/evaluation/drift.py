"""Pivot drift (PivotRL §5: after updates a pivot may stop satisfying the filter) and the
zero-variance share of training groups.

* :func:`drift_table` compares each pivot's decision under the reference (the probe that selected
  it) with a re-probe under the trained policy with the same m (``probing.num_probes``), per
  category: ``stayed`` (still σ̂² > 0 and μ̂ < λ_diff), ``all_pass``, ``all_fail``,
  ``above_threshold``, ``skipped`` (too long / verifier error).
* :func:`zero_variance_summary` reads ``zero_variance_frac`` per training step and compares it with
  what the pivots' μ̂ predicts for a group of K = ``training.group_size`` binary rewards:
  P(zero variance | μ) = μ^K + (1 − μ)^K, averaged over the pivots. When that expectation (or the
  observed mean) exceeds 0.5, most groups carry no gradient and the summary warns, naming the
  smallest K that brings the expectation to 0.5 or below.
"""

from __future__ import annotations

from typing import Any, Sequence

import pandas as pd

from pivotrl.pivots.filter import pivot_decision

__all__ = ["drift_markdown", "drift_table", "zero_variance_summary"]

_OUTCOMES = ("stayed", "all_pass", "all_fail", "above_threshold", "skipped")


def drift_table(reprobe: pd.DataFrame, lambda_diff: float) -> dict[str, dict[str, int]]:
    """``{category: {n, stayed, all_pass, all_fail, above_threshold, skipped}}`` plus ``"total"``.

    ``reprobe`` is :func:`pivotrl.pipeline.probe.probe_states`'s table for the pivot states under
    the trained policy (columns ``category``, ``status``, ``mu``, ``var``).
    """
    out: dict[str, dict[str, int]] = {}
    for cat, status, mu, var in zip(reprobe["category"], reprobe["status"], reprobe["mu"], reprobe["var"]):
        if status != "ok":
            outcome = "skipped"
        else:
            d = pivot_decision(float(mu), float(var), lambda_diff)
            outcome = "stayed" if d == "kept" else d
        for key in (str(cat), "total"):
            row = out.setdefault(key, {"n": 0, **{o: 0 for o in _OUTCOMES}})
            row["n"] += 1
            row[outcome] += 1
    return out


def _p_zero(mus: Sequence[float], k: int) -> float:
    return sum(m ** k + (1 - m) ** k for m in mus) / len(mus) if mus else float("nan")


def zero_variance_summary(metrics_df: pd.DataFrame | None, group_size: int, pivot_mus: Sequence[float]) -> dict[str, Any]:
    """Per-step zero-variance fractions, the fraction expected from the pivots' μ̂, and a warning
    (None when K is large enough); see the module docstring."""
    steps: list[list[float]] = []
    if metrics_df is not None and "zero_variance_frac" in metrics_df.columns:
        steps = [[float(s), float(z)] for s, z in zip(metrics_df["step"], metrics_df["zero_variance_frac"]) if z == z]
    observed = sum(z for _, z in steps) / len(steps) if steps else None
    expected = _p_zero(list(pivot_mus), group_size) if pivot_mus else None
    warning = None
    worst = max(x for x in (observed, expected) if x is not None) if (observed, expected) != (None, None) else None
    if worst is not None and worst > 0.5:
        need = next((k for k in range(group_size, 257) if pivot_mus and _p_zero(list(pivot_mus), k) <= 0.5), None)
        warning = (f"group_size K={group_size} is too small for the pivots' μ̂ (mean "
                   f"{sum(pivot_mus) / len(pivot_mus):.3f}): expected zero-variance fraction "
                   f"{expected if expected is not None else float('nan'):.3f}, observed "
                   f"{observed if observed is not None else float('nan'):.3f}; most groups give no gradient. "
                   + (f"K ≥ {need} brings the expectation to ≤ 0.5." if need else "No K ≤ 256 does."))
    return {"group_size": group_size, "per_step": steps, "observed_mean": observed, "expected": expected,
            "warning": warning}


def drift_markdown(drift: dict[str, dict[str, int]] | None, zero_var: dict[str, Any] | None, num_probes: int) -> list[str]:
    """Markdown lines for the report's "Pivot drift" section."""
    lines = ["## Pivot drift and zero-variance groups", ""]
    if drift:
        lines += [f"Pivots re-probed under the trained policy with the same m = {num_probes}:", "",
                  "| category | pivots | stayed in the filter | all-pass | all-fail | above λ_diff | skipped |",
                  "|---|---|---|---|---|---|---|"]
        for cat in sorted(k for k in drift if k != "total") + ["total"]:
            r = drift[cat]
            lines.append(f"| {cat} | {r['n']} | {r['stayed']} | {r['all_pass']} | {r['all_fail']} | "
                         f"{r['above_threshold']} | {r['skipped']} |")
    else:
        lines.append("No pivots to re-probe.")
    if zero_var:
        lines += ["", f"Zero-variance groups per training step (K = {zero_var['group_size']}): "
                  + (", ".join(f"{int(s)}: {z:.2f}" for s, z in zero_var["per_step"]) or "no steps")
                  + (f"; expected from the pivots' μ̂: {zero_var['expected']:.3f}" if zero_var["expected"] is not None else "")
                  + "."]
        if zero_var["warning"]:
            lines += ["", f"**Warning:** {zero_var['warning']}"]
    lines.append("")
    return lines
