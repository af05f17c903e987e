"""The report's plots and the numbers they show: rates with their 95 % intervals, the training reward's
rolling mean and trend, and the embedding of the PNGs into markdown (for the Prefect UI).

Intervals come from :mod:`pivotrl.evaluation.stats`: Wilson for a rate k/n
(:func:`~pivotrl.evaluation.stats.wilson_interval`), a percentile bootstrap over training steps for a
mean reward (:func:`~pivotrl.evaluation.stats.bootstrap_mean_interval`) and for the difference of two
quarters of a run (:func:`~pivotrl.evaluation.stats.bootstrap_difference_interval`). The unit of the
reward's intervals is the training step: each step samples its own pivots, so one step's mean reward
is a noisy draw and two single steps say little about a trend.

Figures are drawn on matplotlib's Agg canvas (no display, no global pyplot state).
"""

from __future__ import annotations

import base64
import math
import re
from typing import Any, Callable, Mapping, Sequence

from pivotrl.evaluation.stats import (
    bootstrap_difference_interval, bootstrap_mean_interval, finite_or_none, wilson_interval,
)

__all__ = ["BAR_MEASURES", "bar_rates", "embed_images", "plot_bars", "plot_curve", "plot_mu", "plot_turn_curves",
           "png_bytes", "reward_trend", "rolling_mean", "rolling_window"]

#: (row key of the rate, of its numerator, of its denominator, legend label) per bar of the policy plot.
BAR_MEASURES: tuple[tuple[str, str, str, str], ...] = (
    ("local_pivot_accuracy", "local_accepted", "local_samples", "local accuracy, held-out states"),
    ("full_task_success", "tasks_succeeded", "tasks", "full-task success, held-out tasks"),
    ("local_pivot_set_accuracy", "local_pivot_set_accepted", "local_pivot_set_samples",
     "local accuracy, training pivots"),
)


def _ci(values: Sequence[float], seed: int = 0) -> tuple[float, float, float]:
    """Mean of ``values`` with its bootstrap interval over them; NaN bounds for fewer than two."""
    est, lo, hi = bootstrap_mean_interval(values, seed=seed,
                                          proportion=all(0.0 <= v <= 1.0 for v in values))
    if len(values) < 2:
        lo = hi = float("nan")
    return est, lo, hi


def rolling_window(n_steps: int) -> int:
    """Steps per rolling-mean window: a quarter of the run, at least 2 and at most 20 (0 below 2 steps)."""
    return 0 if n_steps < 2 else max(2, min(20, n_steps // 4))


def rolling_mean(steps: Sequence[float], values: Sequence[float], window: int | None = None,
                 seed: int = 0) -> list[dict[str, float]]:
    """Trailing rolling mean of ``values`` over ``window`` steps (default :func:`rolling_window`), one
    entry per full window: ``{"step": last step of the window, "mean", "low", "high"}`` with the 95 %
    bootstrap interval over the window's steps. Empty when there are fewer steps than the window."""
    w = rolling_window(len(values)) if window is None else int(window)
    if w < 1:
        return []
    out = []
    for i in range(w - 1, len(values)):
        mean, lo, hi = _ci(list(values[i - w + 1:i + 1]), seed)
        out.append({"step": float(steps[i]), "mean": mean, "low": lo, "high": hi})
    return out


def reward_trend(steps: Sequence[float], values: Sequence[float], seed: int = 0) -> dict[str, Any] | None:
    """The reward's trend: mean of the first and of the last quarter of the steps (each with its 95 %
    bootstrap interval over its steps) and last − first with the bootstrap interval of a difference
    of independent samples. None below 4 steps (a quarter would be empty).

    Returns ``{"quarter_steps": q, "first": {...}, "last": {...}, "difference", "low", "high",
    "interval"}``; ``first``/``last`` hold ``first_step``, ``last_step``, ``mean``, ``low``, ``high``.
    NaN bounds where an interval cannot be given (a quarter of one step, or every step equal).
    """
    n = len(values)
    q = n // 4
    if q < 1:
        return None

    def part(lo: int, hi: int) -> dict[str, float]:
        mean, low, high = _ci(list(values[lo:hi]), seed)
        return {"first_step": float(steps[lo]), "last_step": float(steps[hi - 1]), "mean": mean, "low": low, "high": high}

    first, last = part(0, q), part(n - q, n)
    diff, lo, hi = bootstrap_difference_interval(values[n - q:], values[:q], seed=seed)
    return {"quarter_steps": q, "steps": n, "first": first, "last": last, "difference": diff, "low": lo, "high": hi,
            "interval": "bootstrap over steps 95%"}


def bar_rates(row: Mapping[str, Any]) -> list[tuple[str, float | None, tuple[float, float] | None]]:
    """One policy row's plotted rates: ``(label, rate or None, Wilson 95 % interval or None)`` per
    :data:`BAR_MEASURES` entry (the interval when the counts are known)."""
    out = []
    for key, num, den, label in BAR_MEASURES:
        rate, k, n = row.get(key), row.get(num), row.get(den)
        interval = wilson_interval(int(k), int(n)) if rate is not None and k is not None and n else None
        out.append((label, rate, interval))
    return out


# ------------------------------------------------------------------------------------------ drawing


def plot_curve(fig: Any, steps: Sequence[float], values: Sequence[float], column: str,
               rolling: Sequence[Mapping[str, float]], window: int) -> None:
    """Per-step mean reward (points) and its rolling mean with the 95 % band."""
    ax = fig.add_subplot(1, 1, 1)
    ax.plot(steps, values, linestyle="none", marker="o", markersize=4, color="0.55", label="one step (its own pivots)")
    if rolling:
        xs = [r["step"] for r in rolling]
        ax.plot(xs, [r["mean"] for r in rolling], color="C0", label=f"rolling mean over {window} steps")
        lows = [r["low"] if math.isfinite(r["low"]) else r["mean"] for r in rolling]
        highs = [r["high"] if math.isfinite(r["high"]) else r["mean"] for r in rolling]
        ax.fill_between(xs, lows, highs, color="C0", alpha=0.2, label="95% interval (bootstrap over steps)")
    ax.set_xlabel("training step")
    ax.set_ylabel(f"{column} (mean per step)")
    ax.set_title(f"Training reward ({column}) per step, rolling mean with 95% interval", fontsize=10)
    ax.grid(True, alpha=0.3)
    ax.legend(fontsize=7)


def plot_mu(fig: Any, mus: Sequence[float], lambda_diff: Any) -> None:
    """Histogram of the reference's success rate μ̂ per probed candidate, with λ_diff marked."""
    ax = fig.add_subplot(1, 1, 1)
    ax.hist(list(mus), bins=[i / 10 for i in range(11)], edgecolor="black")
    lam = finite_or_none(lambda_diff)
    if lam is not None:
        ax.axvline(lam, color="red", linestyle="--", label=f"lambda_diff = {lam:g} (kept: 0 < μ̂ ≤ λ)")
        ax.legend(fontsize=8)
    ax.set_xlabel("μ̂: share of the reference's probes the verifier accepted")
    ax.set_ylabel("candidate states")
    from matplotlib.ticker import MaxNLocator

    ax.yaxis.set_major_locator(MaxNLocator(integer=True))  # counts: no 0.25-state ticks
    ax.set_title(f"Reference success rate μ̂ per probed candidate state (n = {len(mus)})", fontsize=10)


def plot_bars(fig: Any, rows: Sequence[Mapping[str, Any]]) -> None:
    """Per policy: held-out local accuracy, full-task success (and local accuracy on the training
    pivots where measured), each with its 95 % Wilson interval as an error bar."""
    ax = fig.add_subplot(1, 1, 1)
    rates = [bar_rates(r) for r in rows]
    shown = [j for j in range(len(BAR_MEASURES)) if j < 2 or any(rs[j][1] is not None for rs in rates)]
    width = 0.8 / len(shown)
    for slot, j in enumerate(shown):
        xs = [i + (slot - (len(shown) - 1) / 2) * width for i in range(len(rows))]
        vals = [rs[j][1] for rs in rates]
        ivs = [rs[j][2] for rs in rates]
        # max(0, …): Wilson's bound at k = 0 or k = n is the rate up to rounding (1e-17 off)
        err = [[0.0 if v is None or iv is None else max(0.0, v - iv[0]) for v, iv in zip(vals, ivs)],
               [0.0 if v is None or iv is None else max(0.0, iv[1] - v) for v, iv in zip(vals, ivs)]]
        bars = ax.bar(xs, [v or 0.0 for v in vals], width, yerr=err, capsize=3, label=BAR_MEASURES[j][3])
        ax.bar_label(bars, labels=["n/a" if v is None else f"{v:.2f}" for v in vals], fontsize=7, padding=2)
    ax.set_xticks(range(len(rows)))
    ax.set_xticklabels([r["policy"] for r in rows], fontsize=8)
    ax.set_ylim(0, 1.05)
    ax.set_ylabel("rate")
    ax.set_title("Held-out local accuracy and full-task success per policy (95% Wilson intervals)", fontsize=10)
    ax.legend(fontsize=7)


def plot_turn_curves(fig: Any, curves: Mapping[str, Sequence[Mapping[str, Any]]], *, target: float | None = None,
                     budget: float | None = None) -> None:
    """Held-out accuracy against rollout turns sampled, one line per method (``curves``: label →
    points with ``rollout_turns``, ``accuracy``, ``low``/``high`` (95 % Wilson, drawn as error bars)
    and ``n``); each label says its n states per point. ``target``: a dashed horizontal line (π_ref +
    the smaller gain); ``budget``: a dotted vertical line (the equal turn budget)."""
    ax = fig.add_subplot(1, 1, 1)
    for label, pts in curves.items():
        pts = [q for q in pts if q.get("rollout_turns") is not None]
        if not pts:
            continue
        xs = [q["rollout_turns"] for q in pts]
        ys = [q["accuracy"] for q in pts]
        err = [[max(0.0, y - q["low"]) for y, q in zip(ys, pts)], [max(0.0, q["high"] - y) for y, q in zip(ys, pts)]]
        ns = sorted({int(q["n"]) for q in pts})
        n = f"n = {ns[0]}" if len(ns) == 1 else f"n = {ns[0]}–{ns[-1]}"
        ax.errorbar(xs, ys, yerr=err, marker="o", markersize=4, capsize=3, label=f"{label} ({n} states per point)")
    if target is not None:
        ax.axhline(target, color="0.3", linestyle="--", linewidth=1, label=f"target {target:.3f} (π_ref + smaller gain)")
    if budget is not None:
        ax.axvline(budget, color="0.5", linestyle=":", linewidth=1, label=f"equal turn budget ({budget:,.0f})")
    ax.set_ylim(0, 1)
    ax.set_xlabel("rollout turns sampled (model calls; PivotRL's include probing)")
    ax.set_ylabel("held-out accuracy (greedy)")
    ax.set_title("Held-out accuracy against rollout turns (95% Wilson intervals)", fontsize=10)
    ax.grid(True, alpha=0.3)
    ax.legend(fontsize=7)


def png_bytes(draw: Callable[[Any], None], size: tuple[float, float] = (7, 4), dpi: int = 100) -> bytes:
    """The PNG of a figure drawn by ``draw(fig)`` on the Agg canvas."""
    import io

    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    fig = Figure(figsize=size, dpi=dpi)
    FigureCanvasAgg(fig)
    draw(fig)
    fig.tight_layout()
    buf = io.BytesIO()
    fig.savefig(buf, format="png")
    return buf.getvalue()


# ----------------------------------------------------------------------------------------- markdown

_IMAGE = re.compile(r"!\[([^\]]*)\]\(([^)\s]+\.png)\)")


def embed_images(markdown: str, read: Callable[[str], bytes | None]) -> str:
    """``markdown`` with each relative PNG image link ``![alt](name.png)`` replaced by a
    ``data:image/png;base64,…`` URI of ``read(name)`` (e.g. the file beside report.md), so the
    image shows where the relative path does not resolve (the Prefect UI's markdown artifact). A
    link whose ``read`` returns None, or that is absolute (``http:``, ``data:``, ``/``), stays as it is.
    """
    def sub(m: re.Match[str]) -> str:
        alt, target = m.group(1), m.group(2)
        if ":" in target or target.startswith("/"):
            return m.group(0)
        data = read(target)
        if data is None:
            return m.group(0)
        return f"![{alt}](data:image/png;base64,{base64.b64encode(data).decode('ascii')})"

    return _IMAGE.sub(sub, markdown)
