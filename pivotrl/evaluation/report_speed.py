"""The report's speed summary: model FLOPs utilization (MFU) of the warm start and the PivotRL trainer.

:func:`training_speed` summarises the trainer's per-step metrics (``model_tflop`` and timings, see
:func:`pivotrl.runtime.mfu.summarize`; {} without them); :func:`warm_start_speed` reads the warm
start's ``time_s`` (seconds), ``tokens_per_s``, ``model_tflop``, ``peak_gflops`` and ``mfu`` (a
fraction) from the run's meta; :func:`speed_lines` renders both as the report's "Speed" table
(no lines when neither is known). :func:`generation_speed` sums the rollout engine's generation
(``gen_*`` numbers, :mod:`pivotrl.runtime.generation`) of the training rollouts and the learning
curve (metrics.parquet) and of each policy's local evaluation (the report's policy rows), rendered
as further rows of the same table.
"""

from __future__ import annotations

import math
from typing import Any, Mapping, Sequence

import pandas as pd

__all__ = ["generation_speed", "speed_lines", "sum_generation", "training_speed", "warm_start_speed"]


def training_speed(metrics_df: pd.DataFrame | None) -> dict[str, float]:
    """The trainer's speed over all steps (:func:`pivotrl.runtime.mfu.summarize`); {} without the columns."""
    from pivotrl.runtime.mfu import summarize

    if metrics_df is None or "model_tflop" not in metrics_df.columns:
        return {}
    return summarize(metrics_df.to_dict("records"))


def sum_generation(rows: Sequence[Mapping[str, Any]], prefix: str) -> dict[str, float]:
    """``{prefix}*`` generation numbers of several rows together: prefill_tokens, tokens, tflop and
    s summed, tokens_per_s over the summed time and, when every row has a peak, mfu (Σ FLOPs / Σ
    time / the rows' mean peak). {} when no row has them."""
    use = [r for r in rows if isinstance(r.get(prefix + "s"), (int, float)) and r[prefix + "s"] > 0
           and isinstance(r.get(prefix + "tflop"), (int, float)) and math.isfinite(r[prefix + "s"])]
    if not use:
        return {}
    out = {k: sum(float(r.get(prefix + k) or 0.0) for r in use) for k in ("prefill_tokens", "tokens", "tflop", "s")}
    out["tokens_per_s"] = out["tokens"] / out["s"]
    peaks = [r.get(prefix + "peak_gflops") for r in use]
    if all(isinstance(p, (int, float)) and p > 0 for p in peaks):
        out["mfu"] = out["tflop"] * 1e3 / out["s"] / (sum(peaks) / len(peaks))
    return out


def generation_speed(metrics_df: pd.DataFrame | None, policies: Sequence[Mapping[str, Any]]) -> dict[str, dict[str, float]]:
    """Stage label → :func:`sum_generation`: training rollouts (``gen_*``), the learning curve
    (``heldout_gen_*``) and each policy's local evaluation (``local_gen_*`` of its report row)."""
    rows = [] if metrics_df is None else metrics_df.to_dict("records")
    out = {"training rollouts": sum_generation(rows, "gen_"), "learning curve": sum_generation(rows, "heldout_gen_")}
    for p in policies:
        out[f"evaluation: {p.get('policy')}"] = sum_generation([p], "local_gen_")
    return {k: v for k, v in out.items() if v}


def warm_start_speed(meta: Mapping[str, Any]) -> dict[str, float]:
    """The warm start's speed from ``meta["sft"]["metrics"]`` (time_s, tokens_per_s, model_tflop, mfu)."""
    m = ((meta.get("sft") or {}).get("metrics") or {}) if isinstance(meta.get("sft"), Mapping) else {}
    return {k: float(m[k]) for k in ("time_s", "tokens_per_s", "model_tflop", "peak_gflops", "mfu")
            if isinstance(m.get(k), (int, float))}


def speed_lines(train: Mapping[str, float], warm: Mapping[str, float],
                gen: Mapping[str, Mapping[str, float]] | None = None) -> list[str]:
    """The report's "Speed" lines: MFU = model FLOPs / time / calibrated peak (pivotrl.runtime.mfu);
    ``gen``: :func:`generation_speed` (one row per stage, generated tokens/s, forward FLOPs)."""
    if not train and not warm and not gen:
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
    for label, g in (gen or {}).items():
        lines.append(f"| generation, {label} ({g['prefill_tokens']:.0f} prompt tokens prefilled, {g['tokens']:.0f} "
                     f"generated; forward) | {g['s']:.1f} | {g['tokens_per_s']:.1f} | {g['tflop']:.3f} "
                     f"| {pct(g.get('mfu'))} |")
    lines += ["", "Model FLOPs: 6·N per trained token and 2·N per forward-only token (N = the transformer body; "
              "the output head only where logits are computed), plus causal attention; against the calibrated "
              "matmul peak of the compute dtype × the threads used (`pivotrl.runtime.mfu`). Generation: 2·N per "
              "prefilled or fed-back token, the head per generated token, attention over the context, over the "
              "engine calls' wall time (`pivotrl.runtime.generation`)."]
    return lines

