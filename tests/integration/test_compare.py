"""``pivotrl compare`` on the smoke config (tiny random model, real BFCL records): SFT and PivotRL
start from byte-identical π_ref and every method is evaluated on the same held-out items; the
ledgers are present and summed in the report."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import os
import subprocess
import sys

import pytest

from pivotrl.runtime.ledger import COUNTERS, CostLedger
from pivotrl.runtime.models import checkpoint_hash
from pivotrl.pipeline import stages
from pivotrl.pipeline.compare import pivotrl_ledger, stage_e2e_baseline, stage_sft_baseline
from pivotrl.pipeline.compare_eval import METHODS, stage_compare_evaluate
from pivotrl.pipeline.demos import read_trajectories

from smoke_runs import copy_smoke_run

REPO = Path(__file__).resolve().parents[2]
pytestmark = [pytest.mark.data, pytest.mark.integration]


@pytest.fixture(scope="module")
def compared(tmp_path_factory, smoke_run):
    # The session's smoke run (conftest.py), copied: the comparison stages write into its root.
    cfg, store, demos, ref, probe, train, _ = copy_smoke_run(smoke_run, tmp_path_factory.mktemp("compare") / "root")
    # The comparison stages take the results as the stage processes pass them (their dicts).
    r, p, t = ref.to_dict(), probe.to_dict(), train.to_dict()
    sft = stage_sft_baseline(cfg, store, demos, r, p, t)
    e2e = stage_e2e_baseline(cfg, store, demos, r, p, t)
    ev = stage_compare_evaluate(cfg, store, demos, r, p, t, sft, e2e)
    return cfg, store, demos, ref, probe, train, sft, e2e, ev


def test_sft_and_pivotrl_start_from_the_same_reference_and_see_the_same_items(compared):
    cfg, store, demos, ref, probe, train, sft, e2e, ev = compared
    ref_dir = stages.reference_dir(cfg, store, ref)
    # PivotRL trains from ref_dir (its train key is built from ref_hash); the baselines hashed what they loaded.
    assert checkpoint_hash(ref_dir) == ref.ref_hash == sft["summary"]["start_hash"] == e2e["summary"]["start_hash"]
    assert sft["summary"]["reference_hash"] == ref.ref_hash
    rep = ev["report"]
    items = rep["items"]
    assert set(items) == set(METHODS)
    tasks = {tuple(v["tasks"]) for v in items.values()}
    states = {tuple(v["states"]) for v in items.values()}
    assert len(tasks) == 1 and len(states) == 1
    assert list(next(iter(tasks))) == sorted(rep["meta"]["heldout_tasks"]) and rep["meta"]["heldout_tasks"]
    assert next(iter(states))  # held-out and out-of-domain states were evaluated
    heldout_ids = {t.id for t in read_trajectories(store, demos["key"], split="heldout")}
    assert set(next(iter(tasks))) <= heldout_ids


def test_budgets_are_matched_and_stated(compared):
    cfg, store, demos, ref, probe, train, sft, e2e, ev = compared
    pivot_led = pivotrl_ledger(cfg, store, probe.to_dict(), train.to_dict(), ref.to_dict())
    # SFT: the same optimiser steps as PivotRL (smoke: 2 batches × 2 updates).
    assert sft["summary"]["budget"] == "optimizer_steps"
    assert sft["summary"]["steps"] == sft["summary"]["target_steps"] == pivot_led.optimizer_steps == 4
    assert CostLedger.from_dict(sft["ledger"]).optimizer_steps == 4
    # E2E RL: PivotRL's generated tokens (probing included) as its budget.
    assert e2e["summary"]["budget"] == "generated_tokens"
    assert e2e["summary"]["budget_tokens"] == pivot_led.generated_tokens > 0
    # The smoke pivot split holds a multi-turn task with an environment and the budget is > 0, so E2E RL
    # trains (at least one step, at most compare.e2e_max_steps) and its ledger counts what it did.
    e2e_led = CostLedger.from_dict(e2e["ledger"])
    assert e2e["summary"]["tasks"] >= 1 and 1 <= e2e["summary"]["steps"] <= cfg.compare.e2e_max_steps
    rows = store.read_parquet(f"{e2e['key']}/metrics.parquet")
    assert len(rows) == e2e["summary"]["steps"] and e2e_led.generated_tokens >= 1
    assert e2e_led.optimizer_steps == int(rows["train_updates"].sum())
    # a step whose episodes all had one reward has Â = 0 everywhere: while the policy is still π_ref it
    # takes no update (the KL term's gradient is zero there); a step with signal takes every update
    signal = rows["train_zero_variance_frac"] < 1
    expected = [cfg.training.updates_per_batch if signal[: i + 1].any() else 0 for i in range(len(rows))]
    assert rows["train_updates"].astype(int).tolist() == expected


def test_report_puts_the_methods_side_by_side_with_their_ledgers(compared):
    cfg, store, demos, ref, probe, train, sft, e2e, ev = compared
    rep = ev["report"]
    assert set(rep["statistics"]["full_task"]["per_policy"]) == set(METHODS)
    assert "out_of_domain_greedy" in rep["statistics"]["local"]
    # the held-out stop decisions, every method on the same ones
    stops = rep["statistics"]["local"]["stop_decisions_greedy"]["per_policy"]
    assert set(stops) == set(METHODS) and len({r["n"] for r in stops.values()}) == 1 and stops["reference"]["n"] > 0
    assert set(rep["ledgers"]) == set(METHODS) and len(rep["claims"]) == 3
    total = CostLedger.from_dict(rep["ledger_sum"])
    parts = [CostLedger.from_dict(d) for d in rep["ledger_totals"].values()]
    for c in COUNTERS:
        assert getattr(total, c) == sum(getattr(p, c) for p in parts)
    for m in METHODS:
        saved = store.read_json(f"{ev['key']}/ledgers/{m}.json")
        assert saved["total"] == rep["ledger_totals"][m] and store.read_manifest(f"{ev['key']}/ledgers/{m}.json").kind == "cost_ledger"
    md = store.read_text(ev["report_md"].split(store.root_url + "/", 1)[1])
    assert "Cost ledger" in md and "claims at this scale" in md and "| pivotrl |" in md
    # Cached: a second call reuses every artifact.
    assert stage_sft_baseline(cfg, store, demos, ref.to_dict(), probe.to_dict(), train.to_dict())["key"] == sft["key"]
    assert stage_compare_evaluate(cfg, store, demos, ref.to_dict(), probe.to_dict(), train.to_dict(), sft,
                                  e2e)["key"] == ev["key"]


def test_both_held_out_curves_count_rollout_turns_and_claim_three_reads_them(compared):
    """PivotRL's curve (from its metrics) and E2E RL's (measured in its loop on the same held-out
    states) each carry the rollout turns sampled to every point, monotone, from the probe's samples
    (PivotRL) or 0 (E2E RL) to their ledgers' model calls; the report reads claim 3 off them and
    plots both."""
    from pivotrl.pipeline.curve import probe_turns

    cfg, store, demos, ref, probe, train, sft, e2e, ev = compared
    rep = ev["report"]
    turns = rep["turns_to_target"]
    pivot_led = pivotrl_ledger(cfg, store, probe.to_dict(), train.to_dict(), ref.to_dict())
    ends = {"pivotrl": (probe_turns(store, probe.probes_key), pivot_led.model_calls),
            "e2e": (0, CostLedger.from_dict(e2e["ledger"]).model_calls)}
    for m, (first, last) in ends.items():
        curve = turns["curves"][m]
        xs = [q["rollout_turns"] for q in curve]
        # before the first step and after the last (smoke: eval_every 4 > the steps run)
        assert len(curve) >= 2 and curve[0]["step"] == 0 and xs == sorted(xs), (m, curve)
        assert (xs[0], xs[-1]) == (first, last) and 0 < last, (m, xs)
        assert {q["n"] for q in curve} == {turns["n_states"][0]} and turns["n_states"][0] > 0
    # the same held-out states, the same greedy measure: π_ref scores the same on both engines
    assert turns["e2e_start"] == turns["reference_accuracy"]
    assert turns["status"] in {"both_gained", "pivotrl_only", "e2e_only", "none_gained"}
    assert set(turns["final"]) == {"pivotrl", "e2e"} and (turns["target"] is None) == (turns["status"] == "none_gained")
    assert rep["claims"][2].endswith(turns["sentence"] + ".") and "held-out states per point" in turns["sentence"]
    assert rep["plots"]["turn_curves"] == "turn_curves.png"
    assert store.read_bytes(f"{ev['key']}/turn_curves.png")[:4] == b"\x89PNG"
    md = store.read_text(f"{ev['key']}/report.md")
    assert "## Held-out accuracy against rollout turns" in md and "](turn_curves.png)" in md
    em = store.read_parquet(f"{e2e['key']}/metrics.parquet")
    assert em["rollout_turns"].tolist()[-1] == ends["e2e"][1]
    # The held-out stop decisions beside both curves: the same states, π_ref's score at step 0 on both engines.
    pm = store.read_parquet(f"{train.train_key}/metrics.parquet")
    assert em["heldout_before_stop_n"].iloc[0] == pm["heldout_before_stop_n"].iloc[0] > 0
    assert em["heldout_before_stop_accepted"].iloc[0] == pm["heldout_before_stop_accepted"].iloc[0]


def test_sft_at_matched_wall_time_and_e2e_at_matched_rollout_turns(compared):
    """``compare.sft_budget: wall_time`` gives two SFT policies from one run (PivotRL's step count and
    its wall time), both evaluated; ``compare.e2e_budget: rollout_turns`` takes PivotRL's model calls
    as E2E RL's budget, which the report states as the equal turn budget of its curves."""
    cfg, store, demos, ref, probe, train, *_ = compared
    cfg = cfg.model_copy(update={"compare": cfg.compare.model_copy(update={
        "sft_budget": "wall_time", "sft_max_steps": 6, "e2e_budget": "rollout_turns"})})
    r, p, t = ref.to_dict(), probe.to_dict(), train.to_dict()
    pivot_led = pivotrl_ledger(cfg, store, p, t, r)
    sft = stage_sft_baseline(cfg, store, demos, r, p, t)
    s = sft["summary"]
    assert s["budget"] == "wall_time" and s["budget_wall_s"] == round(pivot_led.total_wall_s, 1)
    assert s["steps"] == s["target_steps"] == 4 and s["target_steps"] <= s["wall_steps"] <= 6
    steps_led, wall_led = CostLedger.from_dict(sft["ledger"]), CostLedger.from_dict(sft["ledger_wall"])
    assert s["wall_reached"] == (wall_led.total_wall_s >= s["budget_wall_s"])  # else stopped by sft_max_steps
    assert (steps_led.optimizer_steps, wall_led.optimizer_steps) == (4, s["wall_steps"])
    assert 0 < steps_led.trainer_tokens <= wall_led.trainer_tokens
    assert store.exists(f"{sft['key']}/ledger_wall.json") and store.exists(f"{sft['policy_wall_key']}/config.json")
    e2e = stage_e2e_baseline(cfg, store, demos, r, p, t)
    assert e2e["summary"]["budget"] == "rollout_turns" and e2e["summary"]["budget_model_calls"] == pivot_led.model_calls
    # capped by compare.e2e_max_steps (2) before PivotRL's turns: said so
    assert e2e["summary"]["budget_reached"] == (e2e["summary"]["model_calls"] >= pivot_led.model_calls)
    ev = stage_compare_evaluate(cfg, store, demos, r, p, t, sft, e2e)
    rep = ev["report"]
    assert set(rep["items"]) == set(METHODS) | {"sft_wall"} and "sft_wall" in rep["ledgers"]
    assert "sft_wall" in rep["statistics"]["local"]["heldout_greedy"]["per_policy"]
    assert "at matched optimiser steps" in rep["claims"][0] and "; at matched wall time (SFT " in rep["claims"][0]
    assert rep["turns_to_target"]["budget_turns"] == pivot_led.model_calls
    assert f"equal turn budget {pivot_led.model_calls:,}" in rep["turns_to_target"]["sentence"]
    md = store.read_text(f"{ev['key']}/report.md")
    assert "same rollout turns as PivotRL's probing and training" in md and "wall time for `sft_wall`" in md


def test_compare_flow_runs_and_a_second_run_is_all_cached(tmp_path, tiny_model, smoke_run):
    """The Prefect flow through the CLI, as a user runs it after a nightly run (a copy of the
    session's smoke run: the shared stages are found published and reused, the comparison's are
    computed); the second run re-runs no stage."""
    import shutil

    model = tiny_model
    shutil.copytree(Path(smoke_run.cfg.run.storage_root), tmp_path / "root")
    cmd = [sys.executable, "-m", "pivotrl.flows.cli", "compare", "--config", str(REPO / "configs" / "smoke.yaml"),
           "--set", f"run.storage_root={tmp_path / 'root'}", "--set", f"model.source={model}"]
    env = {**os.environ, "PREFECT_HOME": str(tmp_path / "prefect"), "OMP_NUM_THREADS": "1"}
    first = subprocess.run(cmd, capture_output=True, text=True, env=env, cwd=REPO, timeout=600)
    assert first.returncode == 0, first.stdout[-3000:] + first.stderr[-3000:]
    assert "comparison finished" in first.stdout and "1. PivotRL beats SFT in-domain" in first.stdout
    second = subprocess.run(cmd, capture_output=True, text=True, env=env, cwd=REPO, timeout=600)
    assert second.returncode == 0, second.stderr[-3000:]
    log = second.stdout + second.stderr
    # every stage reused from the store by its task: 4 shared stages + 3 comparison stages, no stage process
    assert log.count("no stage process started") == 7, log[-3000:]
    assert "[pivotrl] stage" not in second.stdout, second.stdout[-3000:]
    report = first.stdout.split("report: ")[-1].split()[0]
    assert report == second.stdout.split("report: ")[-1].split()[0]


def test_the_comparison_report_traces_every_policy_back_to_the_reference(compared):
    """``pivotrl lineage`` of the comparison report: the SFT and E2E policies are described by their
    summaries (not bare sources), and each leads to π_ref and the PivotRL run; the PivotRL policy
    is named too."""
    from pivotrl.provenance.lineage import lineage_tree

    cfg, store, demos, ref, probe, train, sft, e2e, ev = compared
    tree = lineage_tree(store, ev["report_json"][len(store.root_url) + 1:])
    assert set(tree["inputs"]) == {"sft", "e2e", "pivotrl", "trajectories"}
    for name, kind in (("sft", "sft_baseline"), ("e2e", "e2e_baseline")):
        node = tree["inputs"][name]
        assert node["kind"] == kind and not node.get("source") and len(node["sha256"]) == 64, node
        assert node["inputs"]["pivotrl_run"]["kind"] == "policy_checkpoint"
        assert node["inputs"]["reference"]["uri"] == (store.url(ref.ref_key) if ref.ref_key else ref.base_dir)
    # (this root is a copy of the session's smoke run, whose manifests name the original root: the
    # PivotRL policy is named here, and described by its summary in an uncopied run)
    assert tree["inputs"]["pivotrl"]["uri"] == store.url(train.policy_key)


def test_without_a_task_with_an_environment_the_e2e_baseline_is_the_reference(compared, tmp_path, monkeypatch):
    """Single-turn data (no simulated environment): end-to-end RL has nothing to play, so its policy is
    π_ref, published as it is (a checkpoint from the store carries a marker the store must not copy)."""
    from pivotrl.pipeline import compare as compare_mod
    from pivotrl.pipeline.reference import reference_dir

    cfg, store, demos, ref, probe, train, *_ = compared
    cfg = cfg.model_copy(update={"compare": cfg.compare.model_copy(update={"e2e_max_steps": 3})})  # another key
    no_env = [dataclasses.replace(t, env=None) for t in read_trajectories(store, demos["key"], split="pivot")]
    monkeypatch.setattr(compare_mod, "read_trajectories", lambda *a, **k: no_env)
    e2e = stage_e2e_baseline(cfg, store, demos, ref.to_dict(), probe.to_dict(), train.to_dict())
    assert e2e["summary"]["steps"] == 0 and e2e["summary"]["policy"] == "reference"
    published = store.get_dir(e2e["policy_key"], str(tmp_path / "e2e"))
    assert checkpoint_hash(published) == checkpoint_hash(reference_dir(cfg, store, ref))


def test_a_policy_with_the_reference_weights_takes_the_reference_measures(compared, tmp_path, monkeypatch):
    """E2E RL that never updated exports π_ref's tensors: the comparison does not sample it again but
    gives it π_ref's per-item results, says so, and charges it no evaluation; sampling it anyway on
    this deterministic engine gives the same per-item results."""
    import pandas as pd

    from pivotrl.pipeline import compare as compare_mod
    from pivotrl.pipeline import compare_eval

    cfg, store, demos, ref, probe, train, sft, _, _ = compared
    cfg = cfg.model_copy(update={"compare": cfg.compare.model_copy(update={"e2e_max_steps": 3})})
    no_env = [dataclasses.replace(t, env=None) for t in read_trajectories(store, demos["key"], split="pivot")]
    monkeypatch.setattr(compare_mod, "read_trajectories", lambda *a, **k: no_env)
    r, p, t = ref.to_dict(), probe.to_dict(), train.to_dict()
    e2e = stage_e2e_baseline(cfg, store, demos, r, p, t)
    ev = stage_compare_evaluate(cfg, store, demos, r, p, t, sft, e2e)
    rep = ev["report"]
    assert rep["meta"]["same_weights"] == {"e2e": "reference"}
    assert CostLedger.from_dict(rep["evaluation_ledgers"]["e2e"]).model_calls == 0
    assert CostLedger.from_dict(rep["evaluation_ledgers"]["reference"]).model_calls > 0
    assert "`e2e` = `reference`" in store.read_text(f"{ev['key']}/report.md")

    def per_item(key: str, name: str, policy: str) -> pd.DataFrame:
        df = store.read_parquet(f"{key}/{name}")
        return df[df["policy"] == policy].drop(columns=["policy"]).reset_index(drop=True)

    for name in ("full_task.parquet", "local.parquet"):
        reused = per_item(ev["key"], name, "e2e")
        assert len(reused) > 0
        pd.testing.assert_frame_equal(reused, per_item(ev["key"], name, "reference"))
    # The same policy sampled again (the twin rule switched off, another key): the same per-item results.
    monkeypatch.setattr(compare_eval, "same_weights", lambda policies: {})
    monkeypatch.setattr(compare_eval, "compare_eval_key", lambda *a: "compare/eval/sampled-again")
    again = stage_compare_evaluate(cfg, store, demos, r, p, t, sft, e2e)
    assert again["report"]["meta"]["same_weights"] == {}
    assert CostLedger.from_dict(again["report"]["evaluation_ledgers"]["e2e"]).model_calls > 0
    cols = {"full_task.parquet": ["task_id", "seed", "success", "turns_passed", "tokens_generated"],
            "local.parquet": ["state_id", "seed", "kind", "n_accepted", "tokens_generated"]}
    for name, keep in cols.items():
        sampled = per_item(again["key"], name, "e2e")
        reused = per_item(ev["key"], name, "e2e")
        keep = [c for c in keep if c in sampled.columns]
        assert len(keep) == 5 and len(sampled) > 0, (name, list(sampled.columns), len(sampled))
        pd.testing.assert_frame_equal(sampled[keep], reused[keep])
