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
import math
import os
from pathlib import Path
from typing import Any, Callable, Mapping, Sequence

import pandas as pd

from pivotrl.core.errors import ConfigError, StorageError
from pivotrl.evaluation import plots as P
from pivotrl.evaluation.comparison import (
    comparison_markdown, floor_note, format_meta_value, format_rate, stats_name, turn_interval, verdict, verdict_lines,
)
from pivotrl.storage.files import atomic_file

__all__ = ["KNOWN_LIMITS", "POLICIES", "POLICY_ALIASES", "build_report", "pivot_stats_markdown", "published_markdown"]

# The three policies every report compares, in table order.
POLICIES: tuple[str, ...] = ("base", "reference (SFT warm start)", "pivotrl")

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

# Other spellings accepted as keys of ``results``.
POLICY_ALIASES: dict[str, str] = {"reference": "reference (SFT warm start)", "sft": "reference (SFT warm start)"}



REWARD_COLUMNS: tuple[str, ...] = ("reward_mean", "rewards/mean", "train/reward_mean", "reward", "rewards")
MU_COLUMNS: tuple[str, ...] = ("mu", "mu_hat", "mean_reward", "reward_mean")

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
            (``reward_column`` or the first of :data:`REWARD_COLUMNS` present); None → no curve.
        probe_df: one row per probed candidate with its μ̂ (``mu_column`` or the first of
            :data:`MU_COLUMNS` present); None → no histogram.
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
    rows = [_policy_row(name, results.get(name)) for name in names]

    plots: dict[str, str] = {}
    curve = _reward_series(metrics_df, reward_column)
    window = P.rolling_window(len(curve[0])) if curve is not None else 0
    rolling = P.rolling_mean(curve[0], curve[1], window) if curve is not None else []
    if curve is not None:
        _write_png(out / REWARD_PLOT, lambda fig: P.plot_curve(fig, curve[0], curve[1], curve[2], rolling, window))
        plots["reward_curve"] = REWARD_PLOT
    mus = _mu_values(probe_df, mu_column)
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
            "speed": _training_speed(metrics_df),
        },
        "warm_start_speed": _warm_start_speed(meta),
        "probes": None if mus is None else {
            "n_candidates": len(mus),
            "mu_mean": sum(mus) / len(mus) if mus else None,
            "mu_histogram": _histogram(mus, bins=10),
            **_prompt_lengths(probe_df),
        },
        "plots": plots,
        "learning_curve": learning,
        "statistics": None if statistics is None else dict(statistics),
        "verdict": verdict(statistics),  # PivotRL against π_ref, per measure (the markdown's opening)
        "known_limits": list(KNOWN_LIMITS) + floor_note(rows),
    }
    json_path = out / "report.json"
    md_path = out / "report.md"
    _write_text(json_path, json.dumps(_jsonable(report), indent=2, sort_keys=True, allow_nan=False) + "\n")
    _write_text(md_path, _markdown(report, rows, plots, sections, learning_lines))
    return json_path, md_path


# ------------------------------------------------------------------------------------------ numbers


def _policy_row(name: str, res: Mapping[str, Any] | None) -> dict[str, Any]:
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
    }


def _num(x: Any) -> float | None:
    if x is None:
        return None
    try:
        v = float(x)
    except (TypeError, ValueError):
        return None
    return v if math.isfinite(v) else None


def _jsonable(obj: Any) -> Any:
    """NaN/inf → None, numpy scalars → Python, tuples → lists, keys → str."""
    if isinstance(obj, Mapping):
        return {str(k): _jsonable(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [_jsonable(v) for v in obj]
    if isinstance(obj, bool) or obj is None or isinstance(obj, str):
        return obj
    if isinstance(obj, int):
        return obj
    if isinstance(obj, float):
        return obj if math.isfinite(obj) else None
    if hasattr(obj, "item"):  # numpy / torch scalar
        return _jsonable(obj.item())
    if isinstance(obj, os.PathLike):
        return os.fspath(obj)
    return str(obj)


def _reward_series(df: pd.DataFrame | None, column: str | None) -> tuple[list[float], list[float], str] | None:
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


def _mu_values(df: pd.DataFrame | None, column: str | None) -> list[float] | None:
    if df is None:
        return None
    if column is None:
        column = next((c for c in MU_COLUMNS if c in df.columns), None)
        if column is None:
            return None
    elif column not in df.columns:
        raise ConfigError(f"build_report: probe_df has no column {column!r}; columns: {list(df.columns)}")
    return [float(v) for v in df[column] if _num(v) is not None]


def _prompt_lengths(df: pd.DataFrame | None) -> dict[str, Any]:
    """Mean / max prompt length in tokens of the probed states (the probe table's ``prompt_tokens``;
    -1 marks a state never rendered), or {} when the table has no such column."""
    if df is None or "prompt_tokens" not in df.columns:
        return {}
    tokens = [int(x) for x in pd.to_numeric(df["prompt_tokens"], errors="coerce").dropna() if x >= 0]
    if not tokens:
        return {}
    return {"prompt_tokens_mean": sum(tokens) / len(tokens), "prompt_tokens_max": max(tokens),
            "prompt_tokens_n": len(tokens)}


def _histogram(values: Sequence[float], bins: int) -> dict[str, list[float] | list[int]]:
    """Counts of ``values`` in ``bins`` equal bins over [0, 1] (1.0 falls in the last bin)."""
    counts = [0] * bins
    for v in values:
        counts[min(bins - 1, max(0, int(v * bins)))] += 1
    return {"edges": [i / bins for i in range(bins + 1)], "counts": counts}


# ---------------------------------------------------------------------------------------- markdown


_fmt_rate = format_rate


def _md_cell(x: Any) -> str:
    return str(x).replace("|", "\\|").replace("\n", " ")



def _results_tables(rows: list[dict[str, Any]], statistics: Mapping[str, Any] | None) -> list[str]:
    """The per-policy results as narrow tables of three columns (the Prefect UI neither wraps a cell nor
    shows a table's scroll bar, so a wider table is cut off): local accuracy beside full-task success,
    then turns passed and format errors, then the pivot set and the skipped states."""
    def turns(r: dict[str, Any]) -> str:  # bootstrap over tasks
        return _fmt_rate(r["turn_pass_rate"], r["turns_passed"], r["turns_total"],
                         turn_interval(dict(statistics or {}), stats_name(r["policy"], POLICY_ALIASES)),
                         over=f"{r['tasks']} task{'s' if r['tasks'] != 1 else ''}")

    def errors(r: dict[str, Any]) -> str:
        return "n/a" if r["format_error_rate"] is None else _fmt_rate(r["format_error_rate"], r["format_errors"],
                                                                       r["model_calls"])

    tables: list[tuple[tuple[str, str], Callable[[dict[str, Any]], str], Callable[[dict[str, Any]], str]]] = [
        (("local accuracy (held-out states)", "full-task success"),
         lambda r: _fmt_rate(r["local_pivot_accuracy"], r["local_accepted"], r["local_samples"]),
         lambda r: _fmt_rate(r["full_task_success"], r["tasks_succeeded"], r["tasks"])),
        (("turns passed", "format error rate"), turns, errors)]
    if any(r["local_pivot_set_accuracy"] is not None for r in rows):
        tables.append((("local accuracy on the training pivots", "held-out states skipped (too long)"),
                       lambda r: _fmt_rate(r["local_pivot_set_accuracy"], r["local_pivot_set_accepted"],
                                           r["local_pivot_set_samples"]),
                       lambda r: "n/a" if r.get("local_too_long") is None else str(r["local_too_long"])))
    else:
        tables[-1] = (("turns passed", "format error rate", "held-out states skipped (too long)"), turns, errors)
    lines: list[str] = []
    for header, first, second in tables:
        lines += [f"| policy | {' | '.join(header)} |", "|---" * (len(header) + 1) + "|"]
        for r in rows:
            cells = [_md_cell(r["policy"]), first(r), second(r)]
            if len(header) == 3:
                cells.append("n/a" if r.get("local_too_long") is None else str(r["local_too_long"]))
            lines.append("| " + " | ".join(cells) + " |")
        lines.append("")
    return lines


_COUNT_NAMES = {"candidates": "candidates", "kept": "kept", "all_fail": "all fail", "all_pass": "all pass",
                "above_threshold": "above λ_diff", "skipped_too_long": "too long",
                "skipped_verifier_error": "verifier error"}


def _value(v: Any) -> str:
    v = _jsonable(v)
    if isinstance(v, float):
        return f"{v:.4g}"
    return "n/a" if v is None else _md_cell(v)


def pivot_stats_markdown(stats: Mapping[str, Any]) -> list[str]:
    """Pivot statistics as markdown tables (never a raw dict in a cell): scalars as ``statistic |
    value``; the filter's decision counts (``total``, ``per_category``, ``per_turn_index``: mappings
    of count name → int) as one table with a row per group; the μ̂ histogram (``bin_centers``,
    ``counts``) as ``μ̂ | states``; any other mapping as its own ``key | value`` table."""
    scalars = {k: v for k, v in stats.items() if not isinstance(v, Mapping)}
    nested = {k: v for k, v in stats.items() if isinstance(v, Mapping)}
    lines: list[str] = []
    if scalars:
        lines += ["| statistic | value |", "|---|---|"]
        lines += [f"| {_md_cell(k)} | {_value(v)} |" for k, v in scalars.items()]
        lines.append("")
    groups: list[tuple[str, Mapping[str, Any]]] = []
    if isinstance(nested.get("total"), Mapping):
        groups.append(("all", nested.pop("total")))
    for key, label in (("per_category", "{}"), ("per_turn_index", "turn {}")):
        block = nested.get(key)
        if isinstance(block, Mapping) and all(isinstance(c, Mapping) for c in block.values()):
            nested.pop(key)
            groups += [(label.format(g), c) for g, c in block.items()]
    if groups:
        cols = [c for c in _COUNT_NAMES if any(c in g for _, g in groups)]
        cols += sorted({c for _, g in groups for c in g} - set(cols))
        lines += ["Filter decisions per group of candidate states:", "",
                  "| group | " + " | ".join(_COUNT_NAMES.get(c, c) for c in cols) + " |", "|---" * (len(cols) + 1) + "|"]
        lines += [f"| {_md_cell(name)} | " + " | ".join(_value(g.get(c, 0)) for c in cols) + " |" for name, g in groups]
        lines.append("")
    hist = nested.pop("mu_histogram", None)
    if isinstance(hist, Mapping) and "counts" in hist:
        centers = hist.get("bin_centers") or [(a + b) / 2 for a, b in zip(hist.get("edges", []), hist.get("edges", [])[1:])]
        lines += ["| μ̂ (bin centre) | states |", "|---|---|"]
        lines += [f"| {_value(c)} | {_value(n)} |" for c, n in zip(centers, hist["counts"])]
        lines.append("")
    for key, block in nested.items():
        lines += [f"{_md_cell(key)}:", "", "| key | value |", "|---|---|"]
        lines += [f"| {_md_cell(k)} | {_md_cell(format_meta_value(v))} |" for k, v in block.items()]
        lines.append("")
    return lines[:-1] if lines and lines[-1] == "" else lines


def _trend_lines(training: Mapping[str, Any]) -> list[str]:
    """The training summary: the reward's trend over the run (first vs last quarter of the steps with
    95 % intervals), not the first and last single steps."""
    col, n, t = training["reward_column"], training["steps"], training.get("trend")
    if t is None:
        values = ", ".join(f"{v:.3f}" for _, v in training["curve"])
        return [f"{n} logged step{'s' if n != 1 else ''} of `{col}` ({values}): too few for a trend (the first "
                "and the last quarter of the run need 4 steps at least)."]

    def ci(lo: Any, hi: Any) -> str:
        return "no interval" if lo is None or hi is None or lo != lo or hi != hi else f"95% CI {lo:.3f}–{hi:.3f}"

    def span(p: Mapping[str, Any]) -> str:
        a, b = int(p["first_step"]), int(p["last_step"])
        return f"step {a}" if a == b else f"steps {a}–{b}"

    f, la, q = t["first"], t["last"], t["quarter_steps"]
    d = t["difference"]
    return [f"{n} logged steps; each step samples its own pivots, so a single step's `{col}` is a noisy draw. "
            f"Trend (mean over a quarter of the run, {q} step{'s' if q != 1 else ''} each; intervals by bootstrap "
            f"over steps): first quarter ({span(f)}) {f['mean']:.3f} ({ci(f['low'], f['high'])}), last quarter "
            f"({span(la)}) {la['mean']:.3f} ({ci(la['low'], la['high'])}); last − first "
            f"{'+' if d >= 0 else '−'}{abs(d):.3f} ({ci(t['low'], t['high'])})."
            + (f" A bootstrap over {q} step{'s' if q != 1 else ''} per quarter understates the uncertainty: take "
               "the trend as a rough indication." if q < 5 else "")]


def _markdown(report: Mapping[str, Any], rows: list[dict[str, Any]], plots: Mapping[str, str],
              sections: Sequence[str] = (), learning_lines: Sequence[str] = ()) -> str:
    lines = ["# PivotRL evaluation report", "", *verdict_lines(report.get("statistics"), names=POLICY_ALIASES)]
    meta = report["meta"]
    if meta:  # a list, not a table: its values (hashes, lists of notes) are long, and a list item wraps
        lines += ["## Run", ""]
        lines += [f"- {_md_cell(k)}: {_md_cell(format_meta_value(v))}" for k, v in meta.items()
                  if format_meta_value(v) != ""]
        lines.append("")
    lines += [
        "## Results per policy",
        "",
        "Local accuracy (held-out states): fraction of actions the verifier accepts at demonstration states of "
        "held-out trajectories (the demonstration history is given; states longer than the context are skipped "
        "and counted). Local accuracy on the training pivots: the same on the pivot set trained on. Full-task "
        "success: fraction of held-out tasks solved from scratch (BFCL multi-turn rules: state and "
        "execution-result checks after every user turn). Format error rate: model calls of those full-task "
        "runs whose output the action parser rejected (a malformed tool call), over all their model calls.",
        "",
    ]
    lines += _results_tables(rows, report.get("statistics"))
    if "local_vs_full_task" in plots:
        lines += [f"![held-out local accuracy and full-task success per policy, 95% intervals]"
                  f"({plots['local_vs_full_task']})", ""]
    if report.get("statistics"):
        lines += comparison_markdown(dict(report["statistics"]))
    lines += list(sections)
    stats = report["pivot_stats"]
    lines += ["## Pivot statistics", ""]
    if stats:
        lines += pivot_stats_markdown(stats)
    else:
        lines.append("No pivot statistics were given.")
    lines.append("")
    probes = report["probes"]
    if probes is not None:
        lines += [f"Probed candidates: {probes['n_candidates']}, mean μ̂ "
                  + ("n/a" if probes["mu_mean"] is None else f"{probes['mu_mean']:.3f}")
                  + ("" if probes.get("prompt_tokens_mean") is None else
                     f", mean prompt length {probes['prompt_tokens_mean']:.0f} tokens "
                     f"(max {probes['prompt_tokens_max']}, over {probes['prompt_tokens_n']} states)") + ".", ""]
    if "mu_histogram" in plots:
        lines += [f"![reference success rate per probed candidate]({plots['mu_histogram']})", ""]
    lines += ["## Training", ""]
    training = report["training"]
    if training is None:
        lines.append("No training metrics were given.")
    else:
        lines += _trend_lines(training)
        if "reward_curve" in plots:
            lines += ["", f"![training reward per step with its rolling mean and 95% interval]({plots['reward_curve']})"]
    if learning_lines:
        lines += ["", *learning_lines]
    lines += _speed_lines(training["speed"] if training else {}, report.get("warm_start_speed") or {})
    lines += ["", "## Known limits", ""]
    lines += [f"- {limit}" for limit in report["known_limits"]]
    lines.append("")
    return "\n".join(lines)


# ------------------------------------------------------------------------------------------- speed
def _training_speed(metrics_df: pd.DataFrame | None) -> dict[str, float]:
    """The trainer's speed over all steps (:func:`pivotrl.runtime.mfu.summarize`); {} without the columns."""
    from pivotrl.runtime.mfu import summarize

    if metrics_df is None or "model_tflop" not in metrics_df.columns:
        return {}
    return summarize(metrics_df.to_dict("records"))


def _warm_start_speed(meta: Mapping[str, Any]) -> dict[str, float]:
    """The warm start's speed from ``meta["sft"]["metrics"]`` (time_s, tokens_per_s, model_tflop, mfu)."""
    m = ((meta.get("sft") or {}).get("metrics") or {}) if isinstance(meta.get("sft"), Mapping) else {}
    return {k: float(m[k]) for k in ("time_s", "tokens_per_s", "model_tflop", "peak_gflops", "mfu")
            if isinstance(m.get(k), (int, float))}


def _speed_lines(train: Mapping[str, float], warm: Mapping[str, float]) -> list[str]:
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
