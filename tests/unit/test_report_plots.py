"""The report's plots and training summary: rates with their 95 % intervals, the reward's rolling
mean and trend (not two single steps), pivot statistics as tables, plots embedded as PNG data URIs."""

from __future__ import annotations

import base64
import json
import re

import pandas as pd
import pytest

from pivotrl.evaluation import plots as P
from pivotrl.evaluation.report import BARS_PLOT, MU_PLOT, REWARD_PLOT, build_report
from pivotrl.evaluation.report_markdown import pivot_stats_markdown
from pivotrl.evaluation.stats import wilson_interval

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"
# The curve of a real smoke run (rewards k/32: 4 pivots × 8 samples per step).
CURVE = [0.1875, 0.15625, 0.0, 0.1875, 0.1875, 0.09375, 0.09375, 0.40625]
STEPS = [float(s) for s in range(1, 9)]


def _row(policy, acc, samples, succ, tasks, pivots=None):
    return {"policy": policy, "local_pivot_accuracy": acc / samples, "local_accepted": acc, "local_samples": samples,
            "full_task_success": succ / tasks, "tasks_succeeded": succ, "tasks": tasks,
            "local_pivot_set_accuracy": None if pivots is None else pivots[0] / pivots[1],
            "local_pivot_set_accepted": None if pivots is None else pivots[0],
            "local_pivot_set_samples": None if pivots is None else pivots[1]}


def _figure():
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    fig = Figure()
    FigureCanvasAgg(fig)
    return fig


def test_reward_trend_is_first_vs_last_quarter_with_intervals():
    t = P.reward_trend(STEPS, CURVE)
    assert t["quarter_steps"] == 2 and t["steps"] == 8
    assert (t["first"]["first_step"], t["first"]["last_step"], t["last"]["first_step"]) == (1.0, 2.0, 7.0)
    assert t["first"]["mean"] == pytest.approx(0.171875) and t["last"]["mean"] == pytest.approx(0.25)
    # bootstrap over two steps: the 2.5/97.5 % points are the two steps themselves
    assert (t["first"]["low"], t["first"]["high"]) == (0.15625, 0.1875)
    assert t["difference"] == pytest.approx(0.078125)
    assert (t["low"], t["high"]) == (pytest.approx(-0.09375), pytest.approx(0.25))
    assert P.reward_trend(STEPS[:3], CURVE[:3]) is None  # a quarter of 3 steps is empty
    # 12 steps: quarters of 3
    t12 = P.reward_trend([float(s) for s in range(12)], [0.0] * 3 + [0.5] * 6 + [1.0, 0.75, 1.0])
    assert t12["quarter_steps"] == 3 and t12["first"]["mean"] == 0.0 and t12["last"]["mean"] == pytest.approx(11 / 12)
    # every first-quarter step at 0: Wilson over the 3 steps, not a zero-width interval
    assert (t12["first"]["low"], t12["first"]["high"]) == pytest.approx(wilson_interval(0, 3))


def test_rolling_mean_windows_and_intervals():
    assert P.rolling_window(8) == 2 and P.rolling_window(100) == 20 and P.rolling_window(40) == 10
    assert P.rolling_window(1) == 0 and P.rolling_mean([1.0], [0.5]) == []
    roll = P.rolling_mean(STEPS, CURVE)
    assert [r["step"] for r in roll] == STEPS[1:]
    assert roll[0]["mean"] == pytest.approx((0.1875 + 0.15625) / 2)
    assert (roll[0]["low"], roll[0]["high"]) == (0.15625, 0.1875)
    assert roll[-1]["mean"] == pytest.approx(0.25) and (roll[-1]["low"], roll[-1]["high"]) == (0.09375, 0.40625)
    # a window with equal steps strictly inside (0, 1) has no spread: the interval collapses, as it should
    assert P.rolling_mean([1.0, 2.0], [0.1875, 0.1875], 2)[0]["low"] == 0.1875


def test_bar_plot_draws_wilson_intervals_and_says_what_is_plotted():
    rows = [_row("base", 1, 40, 0, 20), _row("pivotrl", 19, 40, 3, 20, pivots=(5, 8))]
    fig = _figure()
    P.plot_bars(fig, rows)
    ax = fig.axes[0]
    assert ax.get_title() == "Held-out local accuracy and full-task success per policy (95% Wilson intervals)"
    labels = [t.get_text() for t in ax.get_legend().get_texts()]
    assert labels == ["local accuracy, held-out states", "full-task success, held-out tasks",
                      "local accuracy, training pivots"]
    from matplotlib.container import ErrorbarContainer

    spans = []
    for c in ax.containers:
        if isinstance(c, ErrorbarContainer):
            spans.append([(float(seg[0][1]), float(seg[1][1])) for seg in c.lines[2][0].get_segments()])
    local, full, pivots = spans
    assert local[1] == pytest.approx(wilson_interval(19, 40)) and local[0] == pytest.approx(wilson_interval(1, 40))
    assert full[0] == pytest.approx(wilson_interval(0, 20), abs=1e-12) and full[1] == pytest.approx(wilson_interval(3, 20))
    assert pivots[1] == pytest.approx(wilson_interval(5, 8))
    assert pivots[0] == (0.0, 0.0)  # base: not evaluated on the pivots, no bar and no interval


def test_reward_curve_shows_the_rolling_band():
    fig = _figure()
    roll = P.rolling_mean(STEPS, CURVE)
    P.plot_curve(fig, STEPS, CURVE, "reward_mean", roll, 2)
    ax = fig.axes[0]
    assert "rolling mean with 95% interval" in ax.get_title()
    band = ax.collections[0].get_paths()[0].vertices
    assert band[:, 1].min() == pytest.approx(0.0) and band[:, 1].max() == pytest.approx(0.40625)
    assert list(ax.lines[1].get_ydata()) == pytest.approx([r["mean"] for r in roll])


def test_report_training_summary_is_a_trend_not_two_steps(tmp_path):
    metrics = pd.DataFrame({"step": range(1, 9), "reward_mean": CURVE})
    results = {"pivotrl": {"local": {"accuracy": 0.5, "n_accepted": 2, "n_samples": 4}, "full_task": None}}
    json_path, md_path = build_report(results, metrics_df=metrics, probe_df=None, pivot_stats=None, meta={},
                                      out_dir=tmp_path)
    md = md_path.read_text()
    assert "at the first step" not in md and "at the last" not in md
    assert ("first quarter (steps 1–2) 0.172 (95% CI 0.156–0.188), last quarter (steps 7–8) 0.250 "
            "(95% CI 0.094–0.406); last − first +0.078 (95% CI -0.094–0.250)") in md
    training = json.loads(json_path.read_text())["training"]
    assert "first_reward" not in training and training["trend"]["difference"] == pytest.approx(0.078125)
    assert training["rolling_window"] == 2 and len(training["rolling_mean"]) == 7
    short = build_report(results, metrics_df=metrics.head(3), probe_df=None, pivot_stats=None, meta={},
                         out_dir=tmp_path / "short")[1].read_text()
    assert "3 logged steps of `reward_mean` (0.188, 0.156, 0.000): too few for a trend" in short


PIVOT_STATS = {
    "lambda_diff": 0.5,
    "total": {"candidates": 8, "all_fail": 1, "all_pass": 1, "above_threshold": 2, "kept": 4,
              "skipped_too_long": 0, "skipped_verifier_error": 0},
    "per_category": {"multi_turn_base": {"candidates": 8, "all_fail": 1, "all_pass": 1, "above_threshold": 2,
                                         "kept": 4, "skipped_too_long": 0, "skipped_verifier_error": 0}},
    "per_turn_index": {0: {"candidates": 5, "all_fail": 1, "all_pass": 0, "above_threshold": 1, "kept": 3,
                           "skipped_too_long": 0, "skipped_verifier_error": 0},
                       2: {"candidates": 3, "all_fail": 0, "all_pass": 1, "above_threshold": 1, "kept": 1,
                           "skipped_too_long": 0, "skipped_verifier_error": 0}},
    "mu_histogram": {"bin_centers": [0.0, 0.5, 1.0], "counts": [1, 6, 1]},
    "mu_mean": 0.421875,
    "verifier_retries": 2,
}


def test_pivot_statistics_are_tables_not_dicts():
    lines = pivot_stats_markdown(PIVOT_STATS)
    text = "\n".join(lines)
    assert "{" not in text and "}" not in text
    assert "| group | candidates | kept | all fail | all pass | above λ_diff | too long | verifier error |" in lines
    assert "| all | 8 | 4 | 1 | 1 | 2 | 0 | 0 |" in lines
    assert "| multi_turn_base | 8 | 4 | 1 | 1 | 2 | 0 | 0 |" in lines
    assert "| turn 2 | 3 | 1 | 0 | 1 | 1 | 0 | 0 |" in lines
    assert "| mu_mean | 0.4219 |" in lines and "| verifier_retries | 2 |" in lines
    assert ["| 0 | 1 |", "| 0.5 | 6 |", "| 1 | 1 |"] == [x for x in lines if re.fullmatch(r"\| [0-9.]+ \| \d \|", x)]
    # a flat mapping (older pivot_stats) stays one statistic | value table
    assert pivot_stats_markdown({"kept": 3, "lambda_diff": 0.5}) == ["| statistic | value |", "|---|---|",
                                                                     "| kept | 3 |", "| lambda_diff | 0.5 |"]


def _image_links(md: str) -> list[tuple[str, str]]:
    return re.findall(r"!\[([^\]]*)\]\(([^)]+)\)", md)


def test_every_table_of_the_report_is_narrow(tmp_path):
    """The Prefect UI neither wraps a table cell nor shows a table's scroll bar: a wider table is cut
    off (about 110 characters of a table line fill its 830-pixel column; tests/integration/
    test_report_ui.py measures it in a browser). The paired comparisons are a list, not a table."""
    from pivotrl.evaluation.comparison import compare_policies

    results = {"base": {"local": {"accuracy": 0.5, "n_accepted": 2, "n_samples": 4},
                        "full_task": {"success_rate": 0.25, "n_success": 1, "n_tasks": 4, "turn_pass_rate": 0.25,
                                      "turns_passed": 2, "turns_total": 8}},
           "reference": {"local": {"accuracy": 0.75, "n_accepted": 3, "n_samples": 4}, "full_task": None},
           "pivotrl": {"local": {"accuracy": 0.5, "n_accepted": 2, "n_samples": 4},
                       "local_pivots": {"accuracy": 0.25, "n_accepted": 1, "n_samples": 4}, "full_task": None}}
    per_task = pd.DataFrame([{"policy": p, "seed": 0, "task_id": f"t{i}", "success": i < k, "turns_passed": i % 2,
                              "n_turns": 2} for p, k in (("pivotrl", 2), ("reference", 1)) for i in range(6)])
    stats = compare_policies(per_task, None, ["pivotrl", "reference"])
    meta = {"run": "x", "config_hash": "5b22" * 16, "note": "",
            "full_task_metric_differs_from_bfcl": ["step limit: 2 per turn, BFCL's is 20", "subset: 1 held-out task "
                                                   "of the 200", "prompt: pivotrl's renderer and action format"]}
    md = build_report(results, metrics_df=None, probe_df=None, pivot_stats=PIVOT_STATS, meta=meta,
                      out_dir=tmp_path, statistics=stats)[1].read_text()
    # the run's description is a list (its values are long), an empty value left out
    assert f"- config_hash: {'5b22' * 16}" in md.splitlines() and "- note:" not in md
    assert "- full_task_metric_differs_from_bfcl: [\"step limit: 2 per turn" in md
    table_lines = [line for line in md.splitlines() if line.startswith("|")]
    assert len(table_lines) > 20 and max(len(line) for line in table_lines) <= 110
    assert "- pivotrl vs reference (task success): A − B +0.167 (95% CI " in md


def test_embed_images_inlines_every_plot_as_a_loadable_png(tmp_path):
    metrics = pd.DataFrame({"step": range(1, 9), "reward_mean": CURVE})
    probes = pd.DataFrame({"mu": [0.0, 0.5, 0.5, 1.0]})
    results = {"pivotrl": {"local": {"accuracy": 0.5, "n_accepted": 2, "n_samples": 4}, "full_task": None}}
    _, md_path = build_report(results, metrics_df=metrics, probe_df=probes, pivot_stats=PIVOT_STATS, meta={},
                              out_dir=tmp_path)
    md = md_path.read_text()
    assert [t for _, t in _image_links(md)] == [BARS_PLOT, MU_PLOT, REWARD_PLOT]
    embedded = P.embed_images(md, lambda name: (tmp_path / name).read_bytes() if (tmp_path / name).exists() else None)
    links = _image_links(embedded)
    assert len(links) == 3
    for (_, target), name in zip(links, (BARS_PLOT, MU_PLOT, REWARD_PLOT)):
        assert target.startswith("data:image/png;base64,")
        data = base64.b64decode(target.split(",", 1)[1], validate=True)
        assert data == (tmp_path / name).read_bytes() and data.startswith(PNG_MAGIC)
        width, height = int.from_bytes(data[16:20], "big"), int.from_bytes(data[20:24], "big")
        assert (width, height) == (700, 400)  # the IHDR chunk: 7 × 4 inches at 100 dpi
    # the rest of the text is unchanged; a missing or absolute image stays a link
    assert re.sub(r"\(data:[^)]+\)", "()", embedded) == re.sub(r"\([^)]+\.png\)", "()", md)
    assert P.embed_images("![a](gone.png) ![b](https://x/y.png)", lambda n: None) == "![a](gone.png) ![b](https://x/y.png)"


def test_published_markdown_embeds_every_plot_from_the_store(tmp_path):
    """What the evaluate stage publishes to the Prefect UI (tasks/stages.py): report.md read from the
    artifact store with every plot inlined as a PNG that decodes, so it shows in the artifact."""
    from pivotrl.evaluation.report import published_markdown
    from pivotrl.storage.store import ArtifactStore

    metrics = pd.DataFrame({"step": range(1, 9), "reward_mean": CURVE})
    probes = pd.DataFrame({"mu": [0.0, 0.5, 0.5, 1.0]})
    results = {"pivotrl": {"local": {"accuracy": 0.5, "n_accepted": 2, "n_samples": 4},
                           "full_task": {"success_rate": 0.25, "n_success": 1, "n_tasks": 4}}}
    _, md_path = build_report(results, metrics_df=metrics, probe_df=probes, pivot_stats=PIVOT_STATS, meta={},
                              out_dir=tmp_path / "rep")
    store = ArtifactStore(str(tmp_path / "store"))
    for f in (tmp_path / "rep").iterdir():
        store.write_bytes(f"eval/abc/{f.name}", f.read_bytes())
    published = published_markdown(store, "eval/abc")
    targets = [t for _, t in _image_links(published)]
    assert len(targets) == 3
    for target, name in zip(targets, (BARS_PLOT, MU_PLOT, REWARD_PLOT)):
        data = base64.b64decode(target.removeprefix("data:image/png;base64,"), validate=True)
        assert data.startswith(PNG_MAGIC) and data == (tmp_path / "rep" / name).read_bytes()
        assert (int.from_bytes(data[16:20], "big"), int.from_bytes(data[20:24], "big")) == (700, 400)
    # a plot missing from the store stays a link (the report is still published)
    store.delete(f"eval/abc/{MU_PLOT}")
    assert f"]({MU_PLOT})" in published_markdown(store, "eval/abc")
