"""The evaluation report: both numbers for every policy, plots on disk, atomic, valid JSON."""

from __future__ import annotations

import json

import pandas as pd
import pytest

from pivotrl.core.errors import ConfigError
from pivotrl.evaluation.report import BARS_PLOT, MU_PLOT, POLICIES, REWARD_PLOT, build_report

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def _local(accepted: int, samples: int) -> dict:
    return {"accuracy": accepted / samples, "n_accepted": accepted, "n_samples": samples, "n_states": samples}


def _full(success: int, tasks: int, passed: int, turns: int) -> dict:
    return {
        "success_rate": success / tasks,
        "n_success": success,
        "n_tasks": tasks,
        "turn_pass_rate": passed / turns,
        "turns_passed": passed,
        "turns_total": turns,
        "format_error_rate": 0.25,
        "failure_reasons": {"state_mismatch": tasks - success},
    }


RESULTS = {
    "base": {"local": _local(1, 40), "full_task": _full(0, 20, 3, 80)},
    "reference (SFT warm start)": {"local": _local(12, 40), "full_task": _full(2, 20, 21, 80)},
    "pivotrl": {"local": _local(19, 40), "full_task": _full(3, 20, 26, 80)},
}


def _table_rows(md: str, table: int = 0) -> dict[str, list[str]]:
    """The policy rows of the ``table``-th results table (0: local accuracy, full-task success; 1: turns
    passed, format error rate[, states skipped]; 2 when evaluated: the training pivots, states skipped)."""
    tables: list[dict[str, list[str]]] = []
    for line in md.splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if line.startswith("| ") and cells[0] in POLICIES:
            if not tables or cells[0] in tables[-1]:
                tables.append({})
            tables[-1][cells[0]] = [c.split(", 95% CI")[0] for c in cells[1:]]
    rows = tables[table]
    return rows


def test_report_table_plots_and_json(tmp_path):
    metrics = pd.DataFrame({"step": [0, 1, 2, 3], "reward_mean": [0.25, 0.375, 0.5, 0.625]})
    probes = pd.DataFrame({"state_id": [f"t#{i}" for i in range(6)], "mu": [0.0, 0.125, 0.25, 0.25, 1.0, float("nan")]})
    stats = {"candidates": 6, "kept": 3, "all_fail": 1, "all_pass": 1, "lambda_diff": 0.5, "num_probes": 8}
    json_path, md_path = build_report(
        RESULTS, metrics_df=metrics, probe_df=probes, pivot_stats=stats,
        meta={"model": "tiny", "config_hash": "abc"}, out_dir=tmp_path / "rep",
    )
    md = md_path.read_text()
    rows = _table_rows(md)
    assert list(rows) == list(POLICIES)
    # local pivot accuracy | full-task success, then turns passed | format error rate
    # (3/80 = 0.0375 is stored as 0.03749..., 21/80 = 0.2625 as 0.26250...01)
    turns = _table_rows(md, 1)
    assert rows["base"] + turns["base"][:1] == ["0.025 (1/40)", "0.000 (0/20)", "0.037 (3/80)"]
    assert rows["reference (SFT warm start)"] + turns["reference (SFT warm start)"][:1] == [
        "0.300 (12/40)", "0.100 (2/20)", "0.263 (21/80)"]
    assert rows["pivotrl"] + turns["pivotrl"][:1] == ["0.475 (19/40)", "0.150 (3/20)", "0.325 (26/80)"]
    assert "## Known limits" in md and "Finite probing" in md and "Local correctness is not task success" in md
    # Every rate carries its n and a 95% interval (Wilson: 12/40 → centre 0.3175 ± 0.1368 by hand).
    assert "| reference (SFT warm start) | 0.300 (12/40), 95% CI 0.181–0.454 |" in md
    for png in (REWARD_PLOT, MU_PLOT, BARS_PLOT):
        data = (tmp_path / "rep" / png).read_bytes()
        assert data.startswith(PNG_MAGIC) and len(data) > 1000
        assert f"]({png})" in md
    report = json.loads(json_path.read_text())  # strict JSON: NaN became null
    pol = {r["policy"]: r for r in report["policies"]}
    assert pol["pivotrl"]["local_pivot_accuracy"] == pytest.approx(19 / 40)
    assert pol["pivotrl"]["full_task_success"] == pytest.approx(3 / 20)
    assert report["training"]["curve"] == [[0.0, 0.25], [1.0, 0.375], [2.0, 0.5], [3.0, 0.625]]
    assert report["probes"]["n_candidates"] == 5  # the NaN μ̂ is left out
    assert report["probes"]["mu_histogram"]["counts"] == [1, 1, 2, 0, 0, 0, 0, 0, 0, 1]
    assert report["pivot_stats"]["kept"] == 3
    # nothing but the report files is left behind (temporary files were renamed)
    assert sorted(p.name for p in (tmp_path / "rep").iterdir()) == sorted(
        ["report.json", "report.md", REWARD_PLOT, MU_PLOT, BARS_PLOT]
    )


def test_report_missing_policy_and_inputs(tmp_path):
    results = {"pivotrl": {"local": _local(2, 4), "full_task": None}, "extra": {"local": None, "full_task": _full(1, 2, 3, 4)}}
    json_path, md_path = build_report(results, metrics_df=None, probe_df=None, pivot_stats=None, meta={}, out_dir=tmp_path)
    md = md_path.read_text()
    rows = _table_rows(md)
    assert rows["base"][:2] == ["not evaluated", "not evaluated"]
    assert rows["pivotrl"][:2] == ["0.500 (2/4)", "not evaluated"]
    assert "| extra | not evaluated | 0.500 (1/2), 95% CI 0.095–0.905 |" in md
    assert "| extra | 0.750 (3/4), 95% CI 0.301–0.954 | 0.250 | n/a |" in md
    assert "No training metrics were given." in md and "No pivot statistics were given." in md
    assert (tmp_path / BARS_PLOT).exists() and not (tmp_path / REWARD_PLOT).exists()
    report = json.loads(json_path.read_text())
    assert report["training"] is None and report["probes"] is None
    pol = {r["policy"]: r for r in report["policies"]}
    assert pol["base"]["evaluated"] is False and pol["base"]["local_pivot_accuracy"] is None
    assert pol["pivotrl"]["full_task_success"] is None and pol["extra"]["turn_pass_rate"] == 0.75


def test_report_alias_and_pivot_set_column(tmp_path):
    results = {"base": RESULTS["base"], "reference": RESULTS["reference (SFT warm start)"],
               "pivotrl": {**RESULTS["pivotrl"], "local_pivots": _local(5, 8)}}
    _, md_path = build_report(results, metrics_df=None, probe_df=None, pivot_stats=None, meta={}, out_dir=tmp_path)
    md = md_path.read_text()
    rows = _table_rows(md)
    assert list(rows) == list(POLICIES)  # "reference" is the SFT warm-start row, no extra row
    assert rows["reference (SFT warm start)"][:2] == ["0.300 (12/40)", "0.100 (2/20)"]
    third = _table_rows(md, 2)
    assert third["pivotrl"][0] == "0.625 (5/8)" and third["base"][0] == "not evaluated"


def test_report_rejects_bad_input(tmp_path):
    with pytest.raises(ConfigError, match="results must map"):
        build_report({"base": 0.5}, metrics_df=None, probe_df=None, pivot_stats=None, meta={}, out_dir=tmp_path)
    with pytest.raises(ConfigError, match="no column 'loss'"):
        build_report(RESULTS, metrics_df=pd.DataFrame({"step": [0]}), probe_df=None, pivot_stats=None, meta={},
                     out_dir=tmp_path, reward_column="loss")


def test_report_floor_note_and_reference_turn_interval(tmp_path):
    """All policies at 0 task successes: the report says why; the reference row's turns-passed
    interval is the bootstrap-over-tasks one from the statistics, as for every other policy."""
    import pandas as pd

    from pivotrl.evaluation.comparison import compare_policies

    results = {name: {"local": _local(1, 4), "full_task": _full(0, 6, 2, 12)} for name in ("base", "reference", "pivotrl")}
    per_task = pd.DataFrame([{"policy": p, "seed": 0, "task_id": f"t{i}", "success": False,
                              "turns_passed": int(i < 2), "n_turns": 2} for p in ("base", "reference", "pivotrl")
                             for i in range(6)])
    stats = compare_policies(per_task, None, ["base", "reference", "pivotrl"])
    json_path, md_path = build_report(results, metrics_df=None, probe_df=None, pivot_stats=None, meta={},
                                      out_dir=tmp_path, statistics=stats)
    md = md_path.read_text()
    tp = stats["full_task"]["per_policy"]["reference"]["turn_pass"]
    cell = f"0.167 (2/12), 95% CI over 6 tasks {tp['low']:.3f}–{tp['high']:.3f}"  # the interval's units: tasks
    row = [line for line in md.splitlines() if line.startswith("| reference (SFT warm start) |")][1]  # turns table
    assert cell in row
    assert "Full-task success is at its floor: no policy solved any of the 6 held-out tasks" in md
    assert any("at its floor" in x for x in json.loads(json_path.read_text())["known_limits"])
    # one success anywhere and the note is gone
    results["pivotrl"]["full_task"] = _full(1, 6, 3, 12)
    _, md_path = build_report(results, metrics_df=None, probe_df=None, pivot_stats=None, meta={}, out_dir=tmp_path / "b")
    assert "at its floor" not in md_path.read_text()


def test_the_run_table_shows_nested_values_short():
    from pivotrl.evaluation.comparison import format_meta_value

    sft = {"examples": 3, "final_loss": 7.33390315886, "metrics": {"losses": [7.3, 6.1]}, "epochs": 4}
    assert format_meta_value(sft) == "examples=3, final_loss=7.334, epochs=4 (+1 more in report.json)"
    assert format_meta_value(list(range(20))) == "20 values (in report.json)"
    assert format_meta_value([1, 2]) == "[1, 2]" and format_meta_value("smoke") == "smoke"
