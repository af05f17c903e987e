"""Paired comparisons pooled over runs (pivotrl.evaluation.pooled, ``pivotrl pool``): the pooled test
is the one the report would give on all runs' items at once, and each run keeps its own line."""

from __future__ import annotations

import json
import random

import pandas as pd
import pytest
from typer.testing import CliRunner

from pivotrl.core.errors import DataError
from pivotrl.evaluation.comparison import compare_policies
from pivotrl.evaluation.pooled import pool_reports, pooled_markdown
from pivotrl.flows.cli import app

POLICIES = ["pivotrl", "reference", "sft"]


def _local(run: int, n: int, rates: dict[str, float]) -> pd.DataFrame:
    """Per-item outcomes of a run: greedy held-out states and 4-sample states, state ids unique to the run."""
    rng = random.Random(run)
    rows = []
    for i in range(n):
        for p, rate in rates.items():
            rows.append({"kind": "heldout_greedy", "policy": p, "state_id": f"r{run}-s{i}", "seed": 0, "status": "ok",
                         "n_samples": 1, "n_accepted": int(rng.random() < rate)})
            rows.append({"kind": "heldout_sampled", "policy": p, "state_id": f"r{run}-s{i}", "seed": 0, "status": "ok",
                         "n_samples": 4, "n_accepted": sum(rng.random() < rate for _ in range(4))})
    return pd.DataFrame(rows)


def test_the_pooled_test_is_the_test_on_every_runs_items_and_each_run_keeps_its_own() -> None:
    runs = [_local(0, 120, {"pivotrl": 0.45, "reference": 0.25, "sft": 0.5}),
            _local(1, 80, {"pivotrl": 0.30, "reference": 0.28, "sft": 0.2})]
    reports = [{"statistics": compare_policies(None, df, POLICIES)} for df in runs]
    pooled = pool_reports(reports, ["seed 0", "seed 1"])
    together = compare_policies(None, pd.concat(runs), POLICIES)["local"]["heldout_greedy"]["pairs"]
    rows = pooled["measures"]["heldout_greedy"]
    assert [(r["a"], r["b"]) for r in rows] == [(q["a"], q["b"]) for q in together]
    for row, whole in zip(rows, together):
        assert row["n"] == whole["n"] == 200
        for key in ("difference", "low", "high", "p_value", "only_a", "only_b"):
            assert row[key] == pytest.approx(whole[key], rel=1e-12), key
        for run, per in zip(reports, row["per_run"]):
            own = next(q for q in run["statistics"]["local"]["heldout_greedy"]["pairs"]
                       if (q["a"], q["b"]) == (row["a"], row["b"]))
            assert (per["n"], per["difference"], per["p_value"]) == (own["n"], pytest.approx(own["difference"]),
                                                                     pytest.approx(own["p_value"]))
    # the sampled measure has no per-item counts in the report: named, not pooled
    assert "heldout_sampled" not in pooled["measures"] and "sign-flip" in pooled["not_pooled"]["heldout_sampled"]
    md = "\n".join(pooled_markdown(pooled))
    assert "| pivotrl − reference |" in md and "seed 1: Δ (p)" in md and "heldout_sampled: not pooled" in md


def test_items_one_policy_could_not_be_scored_on_leave_the_table_whole() -> None:
    """A verifier error for one policy on an item drops that item from its pairs but not from the
    other policy's rate: the pair's own ``both`` keeps the 2×2 table right; a report without it
    (written before it was stored) is not pooled rather than pooled wrong."""
    runs = [_local(5, 50, {"pivotrl": 0.6, "reference": 0.3}), _local(6, 50, {"pivotrl": 0.6, "reference": 0.3})]
    for df in runs:
        hit = (df["policy"] == "reference") & (df["state_id"].isin(df["state_id"].unique()[:5]))
        df.loc[hit, "status"] = "verifier_error"
    reports = [{"statistics": compare_policies(None, df, ["pivotrl", "reference"])} for df in runs]
    row = pool_reports(reports, ["a", "b"])["measures"]["heldout_greedy"][0]
    whole = compare_policies(None, pd.concat(runs), ["pivotrl", "reference"])["local"]["heldout_greedy"]["pairs"][0]
    assert row["n"] == whole["n"] == 90
    assert (row["low"], row["high"], row["p_value"]) == (pytest.approx(whole["low"]), pytest.approx(whole["high"]),
                                                         pytest.approx(whole["p_value"]))
    for rep in reports:
        for pair in rep["statistics"]["local"]["heldout_greedy"]["pairs"]:
            del pair["both"]
    with pytest.raises(DataError, match="nothing to pool .*heldout_greedy: a report lacks the whole 2×2 table"):
        pool_reports(reports, ["a", "b"])


def test_a_pair_stored_the_other_way_round_is_turned_before_pooling() -> None:
    df = _local(2, 60, {"pivotrl": 0.6, "reference": 0.2})
    first = {"statistics": compare_policies(None, df, ["pivotrl", "reference"])}
    second = {"statistics": compare_policies(None, _local(3, 60, {"pivotrl": 0.6, "reference": 0.2}),
                                             ["reference", "pivotrl"])}
    row = pool_reports([first, second], ["a", "b"])["measures"]["heldout_greedy"][0]
    assert (row["a"], row["b"]) == ("pivotrl", "reference") and row["difference"] > 0.2
    assert all(per["difference"] > 0.1 for per in row["per_run"])


def test_bad_input_is_named_and_the_command_ends_in_one_line(tmp_path) -> None:
    good = {"statistics": compare_policies(None, _local(4, 30, {"pivotrl": 0.5, "reference": 0.3}),
                                           ["pivotrl", "reference"])}
    other = {"statistics": compare_policies(None, _local(7, 30, {"pivotrl": 0.5, "reference": 0.3}),
                                            ["pivotrl", "reference"])}
    with pytest.raises(DataError, match="two or more reports"):
        pool_reports([good], ["only"])
    for bad in ({"statistics": {}}, [1, 2], None, {"statistics": 1}):
        with pytest.raises(DataError, match="second: the report has no statistics.local"):
            pool_reports([good, bad], ["first", "second"])
    with pytest.raises(DataError, match="second: the same results as first"):
        pool_reports([good, json.loads(json.dumps(good))], ["first", "second"])
    with pytest.raises(DataError, match="nothing to pool"):
        pool_reports([good, {"statistics": {"local": {"x": 1}}}], ["first", "second"])
    a, b = tmp_path / "a.json", tmp_path / "b.json"
    a.write_text(json.dumps(good))
    b.write_text(json.dumps(other))
    runner = CliRunner()
    out = runner.invoke(app, ["pool", str(a), str(b), "--name", "s0", "--name", "s1"])
    assert out.exit_code == 0 and "pooled over 2 runs (s0, s1)" in out.output
    missing = runner.invoke(app, ["pool", str(a), str(tmp_path / "none.json")])
    assert missing.exit_code == 2 and "none.json" in missing.output and "Traceback" not in missing.output
    (tmp_path / "list.json").write_text("[1, 2]")
    odd = runner.invoke(app, ["pool", str(a), str(tmp_path / "list.json")])
    assert odd.exit_code == 2 and "run 2: the report has no statistics.local" in odd.output
