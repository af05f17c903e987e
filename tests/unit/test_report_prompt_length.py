"""The report states the mean prompt length of the probed states (from the probe table)."""

from __future__ import annotations

import json

import pandas as pd

from pivotrl.evaluation.report import build_report


def test_report_states_the_mean_prompt_length(tmp_path):
    probes = pd.DataFrame({"state_id": ["a", "b", "c", "d"], "mu": [0.0, 0.25, 0.5, 1.0],
                           "prompt_tokens": [100, 200, -1, 330]})  # -1: a state never rendered
    json_path, md_path = build_report({}, metrics_df=None, probe_df=probes, pivot_stats=None, meta={},
                                      out_dir=tmp_path)
    probes_json = json.loads(json_path.read_text())["probes"]
    assert probes_json["prompt_tokens_mean"] == 210.0
    assert (probes_json["prompt_tokens_max"], probes_json["prompt_tokens_n"]) == (330, 3)
    assert "mean prompt length 210 tokens (max 330, over 3 states)" in md_path.read_text()
    # A probe table without the column: nothing claimed.
    json_path, md_path = build_report({}, metrics_df=None, probe_df=probes.drop(columns="prompt_tokens"),
                                      pivot_stats=None, meta={}, out_dir=tmp_path / "b")
    assert "prompt_tokens_mean" not in json.loads(json_path.read_text())["probes"]
    assert "mean prompt length" not in md_path.read_text()
