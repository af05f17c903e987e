"""The evaluation report's numbers: one row per policy, the training reward series, the probes' μ̂.

What :func:`pivotrl.evaluation.report.build_report` writes into ``report.json`` before anything is
rendered: :func:`policy_row` flattens a policy's local / full-task summaries into one row (rates as
floats in [0, 1] or None, counts as ints or None); :func:`reward_series` and :func:`mu_values` read
the training metrics and the probe table (one row per step / per probed candidate), naming the
columns present when a requested one is missing (ConfigError); :func:`jsonable` turns the result
into plain JSON (NaN/inf → None). :data:`POLICIES` is the table order of every report and
:data:`POLICY_ALIASES` the other spellings accepted for them.
"""

from __future__ import annotations

import math
import os
from typing import Any, Mapping, Sequence

import pandas as pd

from pivotrl.core.errors import ConfigError

__all__ = ["MU_COLUMNS", "POLICIES", "POLICY_ALIASES", "REWARD_COLUMNS", "histogram", "jsonable", "mu_values",
           "policy_row", "prompt_lengths", "reward_series"]

# The three policies every report compares, in table order.
POLICIES: tuple[str, ...] = ("base", "reference (SFT warm start)", "pivotrl")

# Other spellings accepted as keys of ``results``.
POLICY_ALIASES: dict[str, str] = {"reference": "reference (SFT warm start)", "sft": "reference (SFT warm start)"}

REWARD_COLUMNS: tuple[str, ...] = ("reward_mean", "rewards/mean", "train/reward_mean", "reward", "rewards")
MU_COLUMNS: tuple[str, ...] = ("mu", "mu_hat", "mean_reward", "reward_mean")


def policy_row(name: str, res: Mapping[str, Any] | None) -> dict[str, Any]:
    local = (res or {}).get("local") or {}
    full = (res or {}).get("full_task") or {}
    pivots = (res or {}).get("local_pivots") or {}
    return {
        "policy": name,
        "evaluated": bool(local or full),
        "local_pivot_accuracy": _num(local.get("accuracy")),
        "local_accepted": local.get("n_accepted"),
        "local_samples": local.get("n_samples"),
        "local_states": local.get("n_states"),
        "local_too_long": local.get("n_too_long"),
        "local_accepted_not_demonstrated": local.get("n_accepted_not_demonstrated"),
        "local_pivot_set_accuracy": _num(pivots.get("accuracy")),
        "local_pivot_set_accepted": pivots.get("n_accepted"),
        "local_pivot_set_samples": pivots.get("n_samples"),
        "model_calls": full.get("model_calls"),
        "format_errors": full.get("format_errors"),
        "full_task_success": _num(full.get("success_rate")),
        "tasks_succeeded": full.get("n_success"),
        "tasks": full.get("n_tasks"),
        "turn_pass_rate": _num(full.get("turn_pass_rate")),
        "turns_passed": full.get("turns_passed"),
        "turns_total": full.get("turns_total"),
        "format_error_rate": _num(full.get("format_error_rate")),
        # The local evaluation's generation (pivotrl.runtime.generation; the engine pass's, seeds averaged).
        **{f"local_{k}": _num(local.get(k)) for k in ("gen_prefill_tokens", "gen_tokens", "gen_tflop", "gen_s",
                                                      "gen_tokens_per_s", "gen_peak_gflops", "gen_mfu") if k in local},
    }


def _num(x: Any) -> float | None:
    if x is None:
        return None
    try:
        v = float(x)
    except (TypeError, ValueError):
        return None
    return v if math.isfinite(v) else None


def jsonable(obj: Any) -> Any:
    """NaN/inf → None, numpy scalars → Python, tuples → lists, keys → str."""
    if isinstance(obj, Mapping):
        return {str(k): jsonable(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [jsonable(v) for v in obj]
    if isinstance(obj, bool) or obj is None or isinstance(obj, str):
        return obj
    if isinstance(obj, int):
        return obj
    if isinstance(obj, float):
        return obj if math.isfinite(obj) else None
    if hasattr(obj, "item"):  # numpy / torch scalar
        return jsonable(obj.item())
    if isinstance(obj, os.PathLike):
        return os.fspath(obj)
    return str(obj)


def reward_series(df: pd.DataFrame | None, column: str | None) -> tuple[list[float], list[float], str] | None:
    if df is None or len(df) == 0:
        return None
    if column is None:
        column = next((c for c in REWARD_COLUMNS if c in df.columns), None)
        if column is None:
            return None
    elif column not in df.columns:
        raise ConfigError(f"build_report: metrics_df has no column {column!r}; columns: {list(df.columns)}")
    steps = df["step"] if "step" in df.columns else pd.Series(range(len(df)))
    pairs = [(float(s), float(r)) for s, r in zip(steps, df[column]) if _num(r) is not None]
    return [p[0] for p in pairs], [p[1] for p in pairs], column


def mu_values(df: pd.DataFrame | None, column: str | None) -> list[float] | None:
    if df is None:
        return None
    if column is None:
        column = next((c for c in MU_COLUMNS if c in df.columns), None)
        if column is None:
            return None
    elif column not in df.columns:
        raise ConfigError(f"build_report: probe_df has no column {column!r}; columns: {list(df.columns)}")
    return [float(v) for v in df[column] if _num(v) is not None]


def prompt_lengths(df: pd.DataFrame | None) -> dict[str, Any]:
    """Mean / max prompt length in tokens of the probed states (the probe table's ``prompt_tokens``;
    -1 marks a state never rendered), or {} when the table has no such column."""
    if df is None or "prompt_tokens" not in df.columns:
        return {}
    tokens = [int(x) for x in pd.to_numeric(df["prompt_tokens"], errors="coerce").dropna() if x >= 0]
    if not tokens:
        return {}
    return {"prompt_tokens_mean": sum(tokens) / len(tokens), "prompt_tokens_max": max(tokens),
            "prompt_tokens_n": len(tokens)}


def histogram(values: Sequence[float], bins: int) -> dict[str, list[float] | list[int]]:
    """Counts of ``values`` in ``bins`` equal bins over [0, 1] (1.0 falls in the last bin)."""
    counts = [0] * bins
    for v in values:
        counts[min(bins - 1, max(0, int(v * bins)))] += 1
    return {"edges": [i / bins for i in range(bins + 1)], "counts": counts}

