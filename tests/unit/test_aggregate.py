"""The evaluation's arithmetic over seeds and categories (pivotrl.evaluation.aggregate)."""

from __future__ import annotations

import math

import pandas as pd
import pytest

from pivotrl.evaluation.aggregate import accuracy_by_category, mean_summary, summarize_runs, task_summary
from pivotrl.rollout import SamplingConfig


def test_mean_summary_averages_numbers_and_keeps_the_rest_from_the_first_seed():
    runs = [{"accuracy": 0.5, "n": 4, "reasons": {"a": 1}, "note": None},
            {"accuracy": 0.25, "n": 4, "reasons": {"b": 2}, "note": 3}]
    assert mean_summary(runs) == {"accuracy": 0.375, "n": 4.0, "reasons": {"a": 1}, "note": None}


def test_summarize_runs_one_seed_is_the_run_itself_several_are_averaged():
    one = {"accuracy": 0.5}
    res = {"full_task_runs": [one], "local_heldout_runs": [one], "local_sampled_runs": [one],
           "local_stop_runs": [None], "out_of_domain_runs": [None]}
    summarize_runs(res, has_stop=False, has_ood=False, pivots=False)
    assert res["full_task"] is one and res["local"] is one and res["local_sampled"] is one
    assert res["local_stop"] is None and res["out_of_domain"] is None and "local_pivots" not in res
    two = {k: [{"accuracy": 0.5}, {"accuracy": 1.0}] for k in
           ("full_task_runs", "local_heldout_runs", "local_sampled_runs", "local_stop_runs", "out_of_domain_runs",
            "local_pivot_runs")}
    summarize_runs(two, has_stop=True, has_ood=True, pivots=True)
    assert [two[k]["accuracy"] for k in ("full_task", "local", "local_sampled", "local_stop", "out_of_domain",
                                         "local_pivots")] == [0.75] * 6
    assert list(two)[6:] == ["full_task", "local", "local_sampled", "local_stop", "out_of_domain", "local_pivots"]


def test_accuracy_by_category_splits_calls_from_text_turns_over_decided_states():
    frame = pd.DataFrame({"state_id": ["s1", "s2", "s3", "s4"], "category": ["simple", "simple", "multi", "multi"],
                          "status": ["ok", "ok", "ok", "verifier_error"], "n_accepted": [2, 1, 0, 0],
                          "n_samples": [4, 4, 2, 0]})
    text = {"s1": False, "s2": True, "s3": False, "s4": False}
    assert accuracy_by_category(frame, text) == {"simple/call": 0.5, "simple/text": 0.25, "multi/call": 0.0}
    assert accuracy_by_category(frame.iloc[:0], text) == {}


def test_task_summary_counts_and_rates():
    df = pd.DataFrame({"success": [True, False], "model_calls": [3, 1], "n_turns": [2, 2], "turns_passed": [2, 0],
                       "tool_calls": [2, 0], "format_errors": [0, 1], "tokens_generated": [30, 8],
                       "reason": ["", "empty_turn"]})
    s = task_summary(df, sampling=SamplingConfig(temperature=0.0, max_tokens=16), seed=7)
    assert (s["n_tasks"], s["n_success"], s["success_rate"], s["turn_pass_rate"]) == (2, 1, 0.5, 0.5)
    assert s["format_error_rate"] == pytest.approx(0.25) and s["failure_reasons"] == {"empty_turn": 1}
    assert (s["temperature"], s["max_tokens"], s["seed"]) == (0.0, 16, 7)
    empty = task_summary(df.iloc[:0], sampling=SamplingConfig())
    assert empty["n_tasks"] == 0 and math.isnan(empty["success_rate"])
