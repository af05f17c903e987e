"""Arithmetic of the evaluate stage over seeds and categories (pure: pandas only).

:func:`mean_summary` averages the numeric fields of per-seed summaries, :func:`summarize_runs` fills
a policy's combined sections from its per-seed runs, :func:`accuracy_by_category` gives local
accuracy per (category, call | text) group, :func:`task_summary` summarises a full-task table.
"""

from __future__ import annotations

from collections import Counter
from typing import Any, Mapping, Sequence

import pandas as pd

__all__ = ["accuracy_by_category", "mean_summary", "summarize_runs", "task_summary"]

#: combined section → the per-seed runs it comes from
RUN_SECTIONS = {"full_task": "full_task_runs", "local": "local_heldout_runs", "local_sampled": "local_sampled_runs",
                "local_stop": "local_stop_runs", "out_of_domain": "out_of_domain_runs",
                "local_pivots": "local_pivot_runs"}


def mean_summary(runs: Sequence[Mapping[str, Any]]) -> dict[str, Any]:
    """The per-key mean of ``runs`` (one summary dict per seed): a key numeric in every run is
    averaged; any other key keeps the first run's value. Raises IndexError for no runs."""
    out: dict[str, Any] = {}
    for k in runs[0]:
        vals = [r[k] for r in runs if isinstance(r.get(k), (int, float))]
        out[k] = sum(vals) / len(vals) if len(vals) == len(runs) else runs[0][k]
    return out


def summarize_runs(res: dict[str, Any], *, has_stop: bool, has_ood: bool, pivots: bool) -> None:
    """Fill ``res`` (one policy's results) with each combined section from its per-seed runs: the
    run itself for one seed, else :func:`mean_summary`. ``local_stop`` / ``out_of_domain`` are None
    without such states; ``local_pivots`` is filled only when the pivot set was evaluated."""
    for section, runs_key in RUN_SECTIONS.items():
        if section == "local_pivots" and not pivots:
            continue
        if (section == "local_stop" and not has_stop) or (section == "out_of_domain" and not has_ood):
            res[section] = None
            continue
        runs = res[runs_key]
        res[section] = runs[0] if len(runs) == 1 else mean_summary(runs)


def accuracy_by_category(frame: pd.DataFrame, text_turn: Mapping[str, bool]) -> dict[str, float]:
    """Accepted samples / samples per ``<category>/<call|text>`` over the "ok" rows of a local
    evaluation table (``pivotrl.evaluation.local``); ``text_turn``: state_id → the demonstration
    answers in text (no tool call)."""
    ok = frame[frame["status"] == "ok"]
    groups = ok.assign(group=[f"{c}/{'text' if text_turn[sid] else 'call'}"
                              for c, sid in zip(ok["category"], ok["state_id"])]).groupby("group")
    return {c: float(g["n_accepted"].sum() / max(1, g["n_samples"].sum())) for c, g in groups}


def task_summary(df: pd.DataFrame, **settings: Any) -> dict[str, Any]:
    """The summary of a full-task table (``pivotrl.evaluation.full_task``, one row per task): counts,
    success and turn-pass rates, model/tool calls, format errors, tokens, failure reasons, and
    ``settings`` (``sampling``: its temperature and max_tokens; the rest as given)."""
    n = len(df)
    calls = int(df["model_calls"].sum()) if n else 0
    turns_total = int(df["n_turns"].sum()) if n else 0
    turns_passed = int(df["turns_passed"].sum()) if n else 0
    sampling = settings.pop("sampling")
    return {
        "n_tasks": n,
        "n_success": int(df["success"].sum()) if n else 0,
        "success_rate": float(df["success"].mean()) if n else float("nan"),
        "turns_total": turns_total,
        "turns_passed": turns_passed,
        "turn_pass_rate": turns_passed / turns_total if turns_total else float("nan"),
        "mean_turns_passed": float(df["turns_passed"].mean()) if n else float("nan"),
        "model_calls": calls,
        "tool_calls": int(df["tool_calls"].sum()) if n else 0,
        "format_errors": int(df["format_errors"].sum()) if n else 0,
        "format_error_rate": int(df["format_errors"].sum()) / calls if calls else 0.0,
        "tokens_generated": int(df["tokens_generated"].sum()) if n else 0,
        "failure_reasons": {str(k): int(v) for k, v in Counter(r for r in df["reason"] if r).items()},
        "temperature": float(sampling.temperature),
        "max_tokens": int(sampling.max_tokens),
        **settings,
    }
