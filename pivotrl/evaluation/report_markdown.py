"""The evaluation report rendered as markdown (``report.md``), from the numbers of ``report.json``.

:func:`report_markdown` lays out the verdict, the run, the per-policy results (narrow tables of
three columns, each rate with its count and 95 % interval), the paired comparisons, any further
sections, the pivot statistics (:func:`pivot_stats_markdown`), the training reward's trend, the
speed table and the known limits. Pure text: no file is read or written here.
"""

from __future__ import annotations

from typing import Any, Callable, Mapping, Sequence

from pivotrl.evaluation.comparison import (
    comparison_markdown, format_meta_value, format_rate, stats_name, turn_interval, verdict_lines,
)
from pivotrl.evaluation.report_data import POLICY_ALIASES, jsonable
from pivotrl.evaluation.report_speed import speed_lines

__all__ = ["pivot_stats_markdown", "report_markdown"]

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
    other = [r for r in rows if r.get("local_accepted_not_demonstrated") is not None]
    if other:
        lines += ["Accepted held-out actions that are not the demonstrated calls (the verifier found them "
                  "equivalent by execution; imitation of the demonstration never teaches them): " + ", ".join(
                      f"{r['policy']} {r['local_accepted_not_demonstrated']} of {r['local_accepted']}" for r in other)
                  + ".", ""]
    return lines


_COUNT_NAMES = {"candidates": "candidates", "kept": "kept", "all_fail": "all fail", "all_pass": "all pass",
                "above_threshold": "above λ_diff", "skipped_too_long": "too long",
                "skipped_verifier_error": "verifier error", "accepted_samples": "accepted probes",
                "accepted_not_demonstrated": "accepted, not the demonstrated calls"}


def _value(v: Any) -> str:
    v = jsonable(v)
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


def report_markdown(report: Mapping[str, Any], rows: list[dict[str, Any]], plots: Mapping[str, str],
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
    lines += speed_lines(training["speed"] if training else {}, report.get("warm_start_speed") or {},
                         report.get("generation_speed") or {})
    lines += ["", "## Known limits", ""]
    lines += [f"- {limit}" for limit in report["known_limits"]]
    lines.append("")
    return "\n".join(lines)

