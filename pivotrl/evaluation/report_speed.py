"""The report's speed summary: model FLOPs utilization (MFU) of the warm start and the PivotRL trainer.

:func:`training_speed` summarises the trainer's per-step metrics (``model_tflop`` and timings, see
:func:`pivotrl.runtime.mfu.summarize`; {} without them); :func:`warm_start_speed` reads the warm
start's ``time_s`` (seconds), ``tokens_per_s``, ``model_tflop``, ``peak_gflops`` and ``mfu`` (a
fraction) from the run's meta; :func:`speed_lines` renders both as the report's "Speed" table
(no lines when neither is known).
"""

from __future__ import annotations

from typing import Any, Mapping

import pandas as pd

__all__ = ["speed_lines", "training_speed", "warm_start_speed"]


def training_speed(metrics_df: pd.DataFrame | None) -> dict[str, float]:
    """The trainer's speed over all steps (:func:`pivotrl.runtime.mfu.summarize`); {} without the columns."""
    from pivotrl.runtime.mfu import summarize

    if metrics_df is None or "model_tflop" not in metrics_df.columns:
        return {}
    return summarize(metrics_df.to_dict("records"))


def warm_start_speed(meta: Mapping[str, Any]) -> dict[str, float]:
    """The warm start's speed from ``meta["sft"]["metrics"]`` (time_s, tokens_per_s, model_tflop, mfu)."""
    m = ((meta.get("sft") or {}).get("metrics") or {}) if isinstance(meta.get("sft"), Mapping) else {}
    return {k: float(m[k]) for k in ("time_s", "tokens_per_s", "model_tflop", "peak_gflops", "mfu")
            if isinstance(m.get(k), (int, float))}


def speed_lines(train: Mapping[str, float], warm: Mapping[str, float]) -> list[str]:
    """The report's "Speed" lines: MFU = model FLOPs / time / calibrated peak (pivotrl.runtime.mfu)."""
    if not train and not warm:
        return []
    lines = ["", "### Speed (model FLOPs utilization)", "",
             "| stage | time (s) | tokens/s | model TFLOP | MFU |", "|---|---|---|---|---|"]
    pct = lambda v: "n/a" if v is None else f"{100 * v:.1f} %"  # noqa: E731
    if warm:
        lines.append(f"| warm start (forward+backward) | {warm.get('time_s', 0):.1f} | {warm.get('tokens_per_s', 0):.1f} "
                     f"| {warm.get('model_tflop', 0):.2f} | {pct(warm.get('mfu'))} |")
    if train:
        lines.append(f"| PivotRL trainer (policy forward+backward; π_ref forward) | {train['trainer_s']:.1f} "
                     f"| {train['policy_tokens_per_s']:.1f}; {train['ref_tokens_per_s']:.1f} "
                     f"| {train['model_tflop']:.2f} | {pct(train.get('mfu'))} |")
    lines += ["", "Model FLOPs: 6·N per trained token and 2·N per forward-only token (N = the transformer body; "
              "the output head only where logits are computed), plus causal attention; against the calibrated "
              "matmul peak of the compute dtype × the threads used (`pivotrl.runtime.mfu`)."]
    return lines

