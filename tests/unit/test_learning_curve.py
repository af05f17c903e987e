"""The learning curve: held-out accuracy measured inside the RL loop every N steps (on the engine
serving the current policy), its numbers with 95 % intervals, the rolling reward, the pivots that
left the filter, and the report's plot."""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace

import pandas as pd
import pytest

from pivotrl.evaluation.learning_curve import CURVE_PLOT, learning_curve, write_learning_curve
from pivotrl.evaluation.report import build_report
from pivotrl.evaluation.stats import wilson_interval
from pivotrl.rollout import SamplingConfig, make_engine
from pivotrl.testing import save_tiny_checkpoint
from pivotrl.config import load_config
from pivotrl.training.loop import LoopHooks, pivot_schedule, run_rl_loop
from pivotrl.verifiers import VerifierResult

PROMPTS = [[5, 17, 42, 9, 11], [7, 8, 9], [100, 3, 64, 2], [12, 13, 14, 15, 16, 17]]
HELDOUT = [[30, 31, 32], [40, 41, 42, 43]]


class EvenVerifier:
    def score(self, state, actions):
        return [VerifierResult.accept() if len(a) % 2 == 0 else VerifierResult.reject("odd") for a in actions]


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    return save_tiny_checkpoint(tmp_path_factory.mktemp("tiny") / "model")


def test_the_loop_measures_heldout_accuracy_before_every_n_steps_and_after_the_last(ckpt: Path, tmp_path: Path):
    from pivotrl.training.pivotrl import PivotRLTrainer

    engine = make_engine("transformers", str(ckpt), dtype="fp32", max_model_len=256)
    trainer = PivotRLTrainer.build(ckpt, group_size=4, dtype="float32", lr=1e-2, beta=0.0, seed=0)
    pivots = [SimpleNamespace(state_id=f"p{i}") for i in range(4)]
    schedule = pivot_schedule(4, 1, 1, seed=0, max_steps=3)
    calls: list[tuple[int, float]] = []

    def evaluate(step):
        # The engine serves the policy after `step` steps: its log-probs of a fixed action equal the trainer's.
        gap = max(abs(a - b) for a, b in zip(engine.score([HELDOUT[0]], [[1, 2, 3]])[0],
                                              trainer.old_policy_logprobs(HELDOUT[0], [1, 2, 3])))
        calls.append((step, gap))
        gens = engine.generate(HELDOUT, SamplingConfig(n=1, temperature=0.0, max_tokens=6))
        k = sum(len(g[0].token_ids) % 2 == 0 for g in gens)
        return {"heldout_n": 2.0, "heldout_accepted": float(k), "heldout_accuracy": k / 2}

    settings = load_config(None, ["model.dtype=fp32", "run.seed=0", "rollout.max_tokens=6", "rollout.weight_sync=disk",
                                  "training.group_size=4", "training.checkpoint_every=10", "training.pivots_per_batch=1",
                                  "training.updates_per_batch=1", "training.eval_every=2"])
    try:
        rows = run_rl_loop(trainer, engine, EvenVerifier(), pivots, PROMPTS, schedule, settings, tmp_path / "w",
                           hooks=LoopHooks(evaluate=evaluate), progress=False)
    finally:
        engine.close()
    assert [c[0] for c in calls] == [0, 2, 3]  # before the first step, every 2 steps, after the last
    assert all(gap < 1e-4 for _, gap in calls), calls
    assert "heldout_before_accuracy" in rows[0] and "heldout_accuracy" not in rows[0]
    assert [("heldout_accuracy" in r) for r in rows] == [False, True, True]
    assert all(r["rollout_tokens"] >= 4 for r in rows)  # K = 4 actions of >= 1 token each
    # The engine's sampled log-probs against the trainer's π_old, per step (fp32: the same numbers).
    assert all(0.0 <= r["sampler_mismatch_mean_abs"] < 1e-4 for r in rows), [r.get("sampler_mismatch_mean_abs") for r in rows]
    curve = learning_curve(pd.DataFrame(rows))
    assert [p["step"] for p in curve["heldout"]] == [0, 2, 3]
    assert curve["heldout"][2]["rollout_tokens"] == sum(r["rollout_tokens"] for r in rows)


def test_curve_numbers_intervals_rolling_reward_and_pivots_that_left(tmp_path: Path):
    df = pd.DataFrame({
        "step": [1, 2, 3, 4], "reward_mean": [0.25, 0.5, 0.75, 0.5], "actions": [8, 8, 16, 8], "groups": [2, 2, 4, 2],
        "rollout_tokens": [10, 20, 30, 40],
        "heldout_before_n": [10, None, None, None], "heldout_before_accepted": [2, None, None, None],
        "heldout_n": [None, 10, None, 10], "heldout_accepted": [None, 4, None, 7],
        "refilter_active": [None, None, json.dumps([0, 2]), None],
        "heldout_before_stop_n": [4, None, None, None], "heldout_before_stop_accepted": [4, None, None, None],
        "heldout_stop_n": [None, 4, None, 4], "heldout_stop_accepted": [None, 1, None, 0],
    })
    curve = learning_curve(df, pivots=5, window=2)
    held = curve["heldout"]
    assert [(p["step"], p["rollout_tokens"], p["accepted"], p["n"]) for p in held] == [
        (0, 0.0, 2, 10), (2, 30.0, 4, 10), (4, 100.0, 7, 10)]
    assert (held[1]["low"], held[1]["high"]) == wilson_interval(4, 10)
    # The stop decisions, a second series at the same points.
    assert [(p["step"], p["rollout_tokens"], p["accepted"], p["n"]) for p in curve["stop"]] == [
        (0, 0.0, 4, 4), (2, 30.0, 1, 4), (4, 100.0, 0, 4)]
    assert (curve["stop"][2]["low"], curve["stop"][2]["high"]) == wilson_interval(0, 4)
    # Rolling mean at step 3 over steps 2–3, weighted by actions: (0.5·8 + 0.75·16) / 24.
    r3 = curve["reward"][2]
    assert r3["rolling_mean"] == pytest.approx((0.5 * 8 + 0.75 * 16) / 24)
    # Its interval: Wilson at the window's 6 groups (the units), 2/3 of them → 4 of 6.
    assert (r3["low"], r3["high"]) == wilson_interval(4, 6)
    flat = learning_curve(pd.DataFrame({"step": [1, 2], "reward_mean": [0.5, 0.5], "groups": [4, 4]}))["reward"][1]
    assert flat["low"] < 0.5 < flat["high"]  # equal steps: no zero-width interval
    assert curve["reward"][0]["rolling_mean"] == 0.25
    assert (curve["pivots_active"], curve["pivots_left_filter"]) == (2, 3)
    _, lines, plot = write_learning_curve(df, tmp_path, pivots=5, candidates=40, window=2)
    assert lines[0] == "Pivots that came out of the filter and were trained on: 5 of 40 probed candidates."
    assert plot == CURVE_PLOT and (tmp_path / CURVE_PLOT).read_bytes()[:4] == b"\x89PNG"
    assert any("step 2: 4/10" in line for line in lines)
    assert any(line.startswith("Held-out stop decisions") and "step 0: 4/4" in line and "step 4: 0/4" in line
               for line in lines)
    assert any("left the filter during training: 3 of 5" in line for line in lines)


def test_the_report_carries_the_curve(tmp_path: Path):
    df = pd.DataFrame({"step": [1, 2], "reward_mean": [0.2, 0.4], "heldout_before_n": [20, None],
                       "heldout_before_accepted": [3, None], "heldout_n": [None, 20], "heldout_accepted": [None, 6]})
    stats = {"total": {"candidates": 17, "kept": 4}, "lambda_diff": 0.5}  # as the probe stage writes them
    json_path, md_path = build_report({}, metrics_df=df, probe_df=None, pivot_stats=stats, meta={}, out_dir=tmp_path)
    report = json.loads(json_path.read_text())
    assert [p["accepted"] for p in report["learning_curve"]["heldout"]] == [3, 6]
    assert report["plots"]["learning_curve"] == CURVE_PLOT
    md = md_path.read_text()
    assert "step 0: 3/20" in md and f"]({CURVE_PLOT})" in md and "trained on: 4 of 17 probed candidates" in md
    assert report["learning_curve"]["stop"] == [] and "stop decisions" not in md  # none measured: no line
    # No held-out columns (eval_every = 0): said, and no curve plot.
    json_path, md_path = build_report({}, metrics_df=df[["step", "reward_mean"]], probe_df=None, pivot_stats=None,
                                      meta={}, out_dir=tmp_path / "b")
    assert "learning_curve" not in json.loads(json_path.read_text())["plots"]
    assert "not measured during training" in md_path.read_text()


def test_each_point_carries_the_rollout_turns_sampled_to_it_probing_included():
    from pivotrl.evaluation.learning_curve import pivotrl_step_turns, with_rollout_turns

    # K = 4: step 1 trained 2 groups (8 actions) and dropped 1 (4 more sampled); step 2 was preceded by a
    # re-filter that re-probed 3 pivots with m = 6 samples each; step 3 had no decided group (no "actions").
    rows = [{"step": 2, "actions": 8.0, "dropped_groups": 0, "refilter_kept": 2, "refilter_all_pass": 1,
             "heldout_n": 10.0, "heldout_accepted": 6.0},
            {"step": 1, "actions": 8.0, "dropped_groups": 1, "heldout_before_n": 10.0, "heldout_before_accepted": 3.0},
            {"step": 3, "actions": float("nan"), "dropped_groups": 2, "heldout_n": 10.0, "heldout_accepted": 7.0}]
    assert [pivotrl_step_turns(r, 4, 6) for r in rows] == [8 + 3 * 6, 8 + 4, 8]
    out = with_rollout_turns(rows, 120, group_size=4, num_probes=6)  # 120: the probe's samples
    assert [r["step"] for r in out] == [1, 2, 3]
    assert [r["model_calls"] for r in out] == [12.0, 26.0, 8.0]
    assert [r["rollout_turns"] for r in out] == [132.0, 158.0, 166.0]
    assert out[0]["heldout_before_rollout_turns"] == 120.0 and "heldout_before_rollout_turns" not in out[1]
    held = learning_curve(pd.DataFrame(out))["heldout"]
    assert [(p["step"], p["rollout_turns"]) for p in held] == [(0, 120), (2, 158), (3, 166)]
    # metrics written before the turn counts: the points say nothing of turns
    assert {p["rollout_turns"] for p in learning_curve(pd.DataFrame(rows))["heldout"]} == {None}
