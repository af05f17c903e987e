"""The evaluation report: ``report.json`` (every number), ``report.md`` (tables, limits) and plots.

The report states, for every policy, local pivot accuracy and full-task success side by side and
never one without the other (PivotRL's known limits: local correctness is not task success).
Plots (:mod:`pivotrl.evaluation.plots`) show every rate with its 95 % interval; the training reward is
summarised by its trend (first vs last quarter of the steps, with an interval), never by two single
steps. Every file is written to a temporary name in ``out_dir`` first and then renamed, so a present
file is complete.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any, Callable, Mapping, Sequence

import pandas as pd

from pivotrl.core.errors import ConfigError, StorageError
from pivotrl.evaluation import plots as P
from pivotrl.evaluation.comparison import floor_note, verdict
from pivotrl.evaluation.report_data import (
    POLICIES, POLICY_ALIASES, histogram, jsonable, mu_values, policy_row, prompt_lengths, reward_series,
)
from pivotrl.evaluation.report_markdown import report_markdown
from pivotrl.evaluation.report_speed import generation_speed, training_speed, warm_start_speed
from pivotrl.storage.files import atomic_file

__all__ = ["KNOWN_LIMITS", "POLICIES", "POLICY_ALIASES", "build_report", "published_markdown"]

KNOWN_LIMITS: tuple[str, ...] = (
    "Local correctness is not task success: an action the verifier accepts at a demonstration "
    "state (especially under a tool-name-only verifier) can still lead the full task astray. "
    "Full-task success, measured from scratch on held-out tasks, is the deciding number.",
    "Finite probing misses states: a state whose m probes all failed may still have a non-zero "
    "success probability; the pivot set is an estimate.",
    "After updates a pivot may stop satisfying the filter (its success rate moves); the pivot set "
    "is fixed before training and re-probed after it (the pivot-drift table); between epochs only with "
    "training.refilter_between_epochs (the training metrics then count the pivots each re-filter kept).",
    "Training sees demonstration histories only; the full-task run checks whether the policy copes "
    "with its own, possibly wrong, histories.",
)

REWARD_PLOT = "reward_curve.png"
MU_PLOT = "mu_histogram.png"
BARS_PLOT = "local_vs_full_task.png"


def build_report(
    results: Mapping[str, Mapping[str, Mapping[str, Any] | None]],
    *,
    metrics_df: pd.DataFrame | None,
    probe_df: pd.DataFrame | None,
    pivot_stats: Mapping[str, Any] | None,
    meta: Mapping[str, Any],
    out_dir: str | os.PathLike[str],
    reward_column: str | None = None,
    mu_column: str | None = None,
    statistics: Mapping[str, Any] | None = None,
    sections: Sequence[str] = (),
) -> tuple[Path, Path]:
    """Write ``report.json``, ``report.md`` and PNG plots into ``out_dir``.

    Args:
        results: policy name → ``{"local": summary | None, "full_task": summary | None}`` (plus an
            optional ``"local_pivots"``: local accuracy on the training pivot set) with the
            summaries of :func:`pivotrl.evaluation.evaluate_local` (``accuracy``, ``n_samples``,
            ``n_accepted``, ``n_states``...) and :func:`pivotrl.evaluation.evaluate_full_tasks`
            (``success_rate``, ``n_success``, ``n_tasks``, ``turn_pass_rate``...). The table lists
            :data:`POLICIES` first (a missing one is shown as not evaluated; "reference" is read as
            "reference (SFT warm start)"), then any others.
        metrics_df: training metrics, one row per step: a ``step`` column and a reward column
            (``reward_column`` or the first of
            :data:`~pivotrl.evaluation.report_data.REWARD_COLUMNS` present); None → no curve.
        probe_df: one row per probed candidate with its μ̂ (``mu_column`` or the first of
            :data:`~pivotrl.evaluation.report_data.MU_COLUMNS` present); None → no histogram.
        pivot_stats: pivot filtering statistics (e.g. candidates, kept, decision counts,
            lambda_diff, num_probes); shown as a table. A ``lambda_diff`` entry is drawn on the
            histogram.
        meta: run description (model, config hash, data, dates...); shown as a table.
        statistics: intervals and paired comparisons
            (:func:`pivotrl.evaluation.comparison.compare_policies`); in report.json and as tables.
        sections: further markdown lines (e.g. the judge, data audit and pivot-drift sections),
            placed after the results.
        out_dir: output directory (created if missing).

    Returns:
        ``(report.json path, report.md path)``.

    Raises:
        ConfigError: ``results`` is not a mapping of mappings, or a named column is missing.
        StorageError: a file cannot be written.
    """
    if not isinstance(results, Mapping) or not all(isinstance(v, Mapping) for v in results.values()):
        raise ConfigError("build_report: results must map policy name -> {'local': ..., 'full_task': ...}")
    out = Path(out_dir)
    try:
        out.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise StorageError(f"report directory {out}: cannot create ({e})") from e

    results = {POLICY_ALIASES.get(name, name): res for name, res in results.items()}
    names = [p for p in POLICIES] + [p for p in results if p not in POLICIES]
    rows = [policy_row(name, results.get(name)) for name in names]

    plots: dict[str, str] = {}
    curve = reward_series(metrics_df, reward_column)
    window = P.rolling_window(len(curve[0])) if curve is not None else 0
    rolling = P.rolling_mean(curve[0], curve[1], window) if curve is not None else []
    if curve is not None:
        _write_png(out / REWARD_PLOT, lambda fig: P.plot_curve(fig, curve[0], curve[1], curve[2], rolling, window))
        plots["reward_curve"] = REWARD_PLOT
    mus = mu_values(probe_df, mu_column)
    lam = (pivot_stats or {}).get("lambda_diff")
    if mus is not None:
        _write_png(out / MU_PLOT, lambda fig: P.plot_mu(fig, mus, lam))
        plots["mu_histogram"] = MU_PLOT
    _write_png(out / BARS_PLOT, lambda fig: P.plot_bars(fig, rows))
    plots["local_vs_full_task"] = BARS_PLOT
    from pivotrl.evaluation.learning_curve import write_learning_curve  # held-out curve, rolling reward

    totals = (pivot_stats or {}).get("total") or pivot_stats or {}  # the probe stage's stats, or a flat mapping
    learning, learning_lines, learning_plot = write_learning_curve(metrics_df, out, pivots=totals.get("kept"),
                                                                   candidates=totals.get("candidates"))
    if learning_plot:
        plots["learning_curve"] = learning_plot

    report = {
        "meta": dict(meta),
        "policies": rows,
        "results": {name: dict(results[name]) for name in results},
        "pivot_stats": None if pivot_stats is None else dict(pivot_stats),
        "training": None if curve is None else {
            "reward_column": curve[2],
            "steps": len(curve[0]),
            "trend": P.reward_trend(curve[0], curve[1]),
            "rolling_window": window,
            "rolling_mean": rolling,
            "curve": [[s, r] for s, r in zip(curve[0], curve[1])],
            "speed": training_speed(metrics_df),
        },
        "warm_start_speed": warm_start_speed(meta),
        "generation_speed": generation_speed(metrics_df, rows),
        "probes": None if mus is None else {
            "n_candidates": len(mus),
            "mu_mean": sum(mus) / len(mus) if mus else None,
            "mu_histogram": histogram(mus, bins=10),
            **prompt_lengths(probe_df),
        },
        "plots": plots,
        "learning_curve": learning,
        "statistics": None if statistics is None else dict(statistics),
        "verdict": verdict(statistics),  # PivotRL against π_ref, per measure (the markdown's opening)
        "known_limits": list(KNOWN_LIMITS) + floor_note(rows),
    }
    json_path = out / "report.json"
    md_path = out / "report.md"
    _write_text(json_path, json.dumps(jsonable(report), indent=2, sort_keys=True, allow_nan=False) + "\n")
    _write_text(md_path, report_markdown(report, rows, plots, sections, learning_lines))
    return json_path, md_path


# ------------------------------------------------------------------------------------ atomic files


def _atomic(path: Path, write: Callable[[str], None]) -> None:
    try:
        with atomic_file(path) as tmp:
            write(str(tmp))
    except OSError as e:
        raise StorageError(f"cannot write {path}: {e}") from e


def _write_text(path: Path, text: str) -> None:
    _atomic(path, lambda tmp: Path(tmp).write_text(text, encoding="utf-8"))


def _write_png(path: Path, draw: Callable[[Any], None]) -> None:
    data = P.png_bytes(draw)
    _atomic(path, lambda tmp: Path(tmp).write_bytes(data))


def published_markdown(store: Any, eval_key: str) -> str:
    """The text of ``<eval_key>/report.md`` as published to the Prefect UI: each plot beside it
    (``![…](name.png)``) embedded as a PNG data URI (:func:`pivotrl.evaluation.plots.embed_images`),
    since the UI cannot resolve a path relative to the report. ``store``: an
    :class:`~pivotrl.storage.store.ArtifactStore` (``read_text``, ``read_bytes``, ``exists``).
    A plot that is not in the store stays a link. Raises StorageError if report.md cannot be read."""
    def read(name: str) -> bytes | None:
        key = f"{eval_key}/{name}"
        return store.read_bytes(key) if store.exists(key) else None

    return P.embed_images(store.read_text(f"{eval_key}/report.md"), read)
