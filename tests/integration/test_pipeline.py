"""The pipeline stages end to end on the smoke config (tiny random model, real BFCL records), the
training stage as a 2-rank process group, the Prefect flow and its cross-run reuse, and the
multi-node config's launch command."""

from __future__ import annotations

import json
import shlex
import subprocess
from pathlib import Path

import pandas as pd
import pytest
from safetensors.torch import load_file

from pivotrl.config import load_config
from pivotrl.pipeline import stages
from pivotrl.pipeline.demos import build_demonstrations
from pivotrl.pipeline.probe import candidate_kind_column

from smoke_runs import copy_smoke_run, smoke_config
from pivotrl.storage import ArtifactStore
from pivotrl.testing import comparable_report, save_tiny_checkpoint

REPO = Path(__file__).resolve().parents[2]
# smoke_run, tiny_model: the session's shared smoke run and model (conftest.py).


@pytest.mark.integration
def test_smoke_pipeline_end_to_end(smoke_run):
    cfg, store, demos, ref, probe, train, ev = smoke_run
    c = demos["counts"]
    # 6 simple_python + 6 multiple + 2 multi_turn_base records; one candidate per assistant turn.
    assert c["trajectories"] == 14
    assert c["trajectories_per_category"] == {"simple_python": 6, "multiple": 6, "multi_turn_base": 2}
    assert sum(c["candidates_per_split"].values()) == c["assistant_turns"]
    # The warm start trained on the warm-start split only and changed the weights.
    assert ref.sft["examples"] == c["trajectories_per_split"]["warm_start"]
    assert ref.ref_hash != ref.base_hash
    assert ref.sft["metrics"]["final_loss"] < ref.sft["metrics"]["first_loss"]
    # Probing: one row per pivot-split candidate, m rewards each; the filter's counts add up.
    probes = store.read_parquet(f"{probe.probes_key}/probes.parquet")
    # Pivot candidates: the pivot split's call states and (smoke: quality.include_stop_decisions)
    # stop decisions; rule-less text turns never.
    cand = store.read_parquet(f"{demos['key']}/candidates.parquet")
    kinds = candidate_kind_column(cand)
    assert cfg.quality.include_stop_decisions
    assert len(probes) == int(((cand["split"] == "pivot") & kinds.isin(["call", "stop"])).sum()) > 0
    assert set(kinds) <= {"call", "stop", "text_no_rule"} and c["candidates_per_kind"]["stop"] > 0
    ok = probes[probes["status"] == "ok"]
    assert all(len(json.loads(r)) == cfg.probing.num_probes for r in ok["rewards"])
    t = probe.stats["total"]
    assert t["candidates"] == len(probes)
    assert t["all_fail"] + t["all_pass"] + t["above_threshold"] + t["kept"] + t["skipped_too_long"] \
        + t["skipped_verifier_error"] == t["candidates"]
    pivots = store.read_parquet(f"{probe.pivots_key}/pivots.parquet")
    assert len(pivots) == t["kept"] > 0
    # Kept states are exactly those with mixed outcomes (λ_diff = 1.0 in the smoke config).
    mixed = {sid for sid, v in zip(ok["state_id"], ok["var"]) if v > 0}
    assert set(pivots["state_id"]) == mixed
    # Training: one metrics row per rollout batch; fp32 refresh is exact to 1e-4 per token.
    m = store.read_parquet(f"{train.train_key}/metrics.parquet")
    assert list(m["step"]) == list(range(1, len(m) + 1))
    assert len(m) == train.summary["steps"] > 0
    assert (m["refresh_max_abs_delta"] <= 1e-4).all()
    assert (m["groups"] + m["dropped_groups"] == m["pivots"]).all()
    # The learning curve (training.eval_every): held-out accuracy before the first step and after the last.
    assert m["heldout_before_n"].iloc[0] > 0 and m["heldout_n"].iloc[-1] > 0 and (m["rollout_tokens"] > 0).all()
    # ... with the held-out stop decisions of multi_turn_base beside it, the same states at every point.
    assert m["heldout_before_stop_n"].iloc[0] == m["heldout_stop_n"].iloc[-1] > 0
    # The report states local and full-task numbers for all three policies.
    report = ev.report
    md = store.read_text(f"{ev.eval_key}/report.md")
    for name in ("base", "reference (SFT warm start)", "pivotrl"):
        assert name in md
    assert "full-task success" in md and "local accuracy (held-out states)" in md
    # Intervals, paired tests, the judge and the audit are in the report.
    assert [p["step"] for p in report["learning_curve"]["heldout"]] == [0, len(m)]
    assert "95% CI" in md and "exact McNemar" in md and "## Judge and metric name" in md and "## Data audit" in md
    assert report["meta"]["full_task_metric"] == "full-task success (BFCL's checker)"
    assert report["statistics"]["full_task"]["pairs"]
    rows = {p["policy"]: p for p in report["policies"]}
    assert set(rows) == {"base", "reference (SFT warm start)", "pivotrl"}
    for p in rows.values():
        assert 0.0 <= p["local_pivot_accuracy"] <= 1.0 and 0.0 <= p["full_task_success"] <= 1.0
        assert p["tasks"] == len(report["meta"]["heldout_tasks"]) > 0


@pytest.mark.integration
def test_smoke_run_scores_stop_decisions_in_probing_and_evaluation(smoke_run):
    """Stop decisions (the turn whose right action is to answer in text) are scored end to end:
    probed on the pivot split, and measured on the held-out split by the evaluation
    (``stop_decisions_greedy``) for every policy, not only counted as too long."""
    cfg, store, demos, _, probe, _, ev = smoke_run
    cand = store.read_parquet(f"{demos['key']}/candidates.parquet")
    stop = cand[candidate_kind_column(cand) == "stop"]
    # Probing: every stop decision of the pivot split fits and is scored.
    probes = store.read_parquet(f"{probe.probes_key}/probes.parquet")
    probed = probes[probes["state_id"].isin(set(stop["state_id"]))]
    assert len(probed) == int((stop["split"] == "pivot").sum()) == 4 and (probed["status"] == "ok").all()
    # Evaluation: the held-out split's 4 stop decisions, the 2 shortest within model.max_context.
    assert ev.report["meta"]["stop_decision_states"] == int((stop["split"] == "heldout").sum()) == 4
    local = store.read_parquet(f"{ev.eval_key}/local.parquet")
    rows = local[local["kind"] == "stop_decisions_greedy"]
    assert set(rows["policy"]) == {"base", "reference", "pivotrl"} and len(ev.report["results"]) == 3
    for name, g in rows.groupby("policy"):
        assert sorted(g["status"]) == ["ok", "ok", "too_long", "too_long"] and (g["n_samples"] > 0).sum() == 2, name
    for name, res in ev.report["results"].items():
        assert (res["local_stop"]["n_states"], res["local_stop"]["n_too_long"]) == (2, 2), name


@pytest.mark.integration
def test_second_run_reuses_every_artifact(smoke_run):
    cfg, store, demos, ref, probe, train, ev = smoke_run
    before = {k: store.read_manifest(k).created_at for k in (
        f"{demos['key']}/candidates.parquet", f"{probe.probes_key}/probes.parquet",
        f"{probe.pivots_key}/pivots.parquet", f"{train.train_key}/metrics.parquet",
        f"{ev.eval_key}/report.json")}
    demos2 = build_demonstrations(cfg, store)
    ref2 = stages.stage_reference(cfg, store, demos2)
    probe2 = stages.stage_probe(cfg, store, demos2, ref2)
    train2 = stages.stage_train(cfg, store, probe2, ref2)
    ev2 = stages.stage_evaluate(cfg, store, demos2, ref2, probe2, train2)
    assert (demos2["key"], ref2.ref_hash, probe2.pivots_key, train2.train_key, ev2.eval_key) == \
        (demos["key"], ref.ref_hash, probe.pivots_key, train.train_key, ev.eval_key)
    after = {k: store.read_manifest(k).created_at for k in before}
    assert after == before  # nothing was rewritten
    # The keys the Prefect tasks look up and lease (pivotrl.pipeline.keys) are the keys these stages wrote under.
    from pivotrl.pipeline.keys import stage_key

    assert [stage_key("demonstrations", cfg, store), stage_key("probe", cfg, store, {"demos": demos, "reference": ref}),
            stage_key("train", cfg, store, {"probe": probe, "reference": ref}),
            stage_key("evaluate", cfg, store, {"demos": demos, "reference": ref, "probe": probe, "train": train})] == \
        [demos["key"], probe.pivots_key, train.train_key, ev.eval_key]


@pytest.mark.integration
def test_lambda_change_refilters_without_reprobing(smoke_run, tmp_path):
    # A new pivot set is written: into a copy of the shared run's root.
    cfg, store, demos, ref, probe, _, _ = copy_smoke_run(smoke_run, tmp_path / "root")
    cfg2 = cfg.model_copy(update={"probing": cfg.probing.model_copy(update={"lambda_diff": 0.3})})
    probe2 = stages.stage_probe(cfg2, store, demos, ref)
    assert probe2.probes_key == probe.probes_key  # same probe table
    assert probe2.pivots_key != probe.pivots_key
    probes = store.read_parquet(f"{probe.probes_key}/probes.parquet")
    ok = probes[probes["status"] == "ok"]
    expected = {s for s, mu, v in zip(ok["state_id"], ok["mu"], ok["var"]) if v > 0 and mu < 0.3}
    assert set(store.read_parquet(f"{probe2.pivots_key}/pivots.parquet")["state_id"]) == expected


@pytest.mark.integration
def test_anchor_states_come_from_the_probe_table_and_train_beside_the_pivots(smoke_run, tmp_path):
    """training.anchors_per_batch on the smoke run: the anchors are the probe table's all-pass states
    (every probe accepted; two of its rows get such rewards here, as a reference that solves them
    would leave them), read back as whole turn states, trained one per step beside the pivots and
    counted apart; the probe table joins the train key. In the copied store, the held-out curve's
    states are found as well."""
    from pivotrl.pipeline.curve import curve_states, pivot_candidates_key
    from pivotrl.pipeline.probe import apply_pivot_filter
    from pivotrl.pipeline.train import anchor_states, train_key

    cfg, store, demos, ref, probe, train, _ = copy_smoke_run(smoke_run, tmp_path / "root")
    table = store.read_parquet(f"{probe.probes_key}/probes.parquet")
    assert set(table["decision"]) <= {""}  # the table keeps no decision: the pivot rule gives it
    pivot_ids = set(store.read_parquet(f"{probe.pivots_key}/pivots.parquet")["state_id"])
    solved = sorted(s for s, st in zip(table["state_id"], table["status"]) if st == "ok" and s not in pivot_ids)[:2]
    assert len(solved) == 2
    m = len(json.loads(table["rewards"].iloc[0]))
    pick = table["state_id"].isin(solved)
    table.loc[pick, "rewards"] = json.dumps([1.0] * m)
    table.loc[pick, "mu"], table.loc[pick, "var"] = 1.0, 0.0
    store.write_artifact(f"{probe.probes_key}/probes.parquet", table, kind="probe_table")
    decided = apply_pivot_filter(table, cfg.probing.lambda_diff)
    expected = sorted(decided.loc[decided["decision"] == "all_pass", "state_id"])
    anchors = anchor_states(cfg, store, probe)
    assert set(solved) <= set(expected) and [a.state_id for a in anchors] == expected
    # The store is a copy: its manifests name the first root's URLs, and the candidates' content key is found.
    assert not store.read_manifest(f"{probe.pivots_key}/pivots.parquet").inputs["candidates"]["uri"].startswith(
        store.url("x")[:-1])
    assert pivot_candidates_key(store, probe) == f"{demos['key']}/candidates.parquet"
    held = curve_states(cfg, store, probe)
    assert held and [s.state_id for s in held] == [s.state_id for s in curve_states(cfg, store, probe, demos["key"])]
    cand = store.read_parquet(f"{demos['key']}/candidates.parquet").set_index("state_id")
    assert all(len(a.messages) == int(cand.loc[a.state_id, "history_len"]) for a in anchors)  # whole histories
    cfg2 = cfg.model_copy(update={"training": cfg.training.model_copy(update={"anchors_per_batch": 1,
                                                                               "max_steps": 2})})
    assert train_key(cfg2, store, probe, ref) != train_key(cfg, store, probe, ref)
    res = stages.stage_train(cfg2, store, probe, ref)
    m = store.read_parquet(f"{res.train_key}/metrics.parquet")
    assert list(m["anchors"]) == [1, 1] and list(m["groups"] + m["dropped_groups"]) == list(m["pivots"] + 1)
    assert m["anchor_reward_mean"].notna().all() and res.summary["anchors"] == len(anchors)
    assert res.summary["pivots"] == len(pivot_ids)


def _copy_root(src: Path, dst: Path) -> Path:
    """A copy of a run root without its evaluation (same content keys, nothing evaluated yet)."""
    import shutil

    shutil.copytree(src, dst, ignore=lambda d, names: [n for n in names if Path(d) == Path(src)
                                                       and n in ("eval", "logs")])
    return dst


def same_report(out: dict, ev, roots: list[Path]) -> None:
    """``out`` (a merged EvalResult dict) holds the unsharded report ``ev``: the same report.json and
    report.md but for the config hash (the config names the shard size) and the roots' paths."""
    report, md = comparable_report(out, roots)
    assert (report, md) == comparable_report(ev.to_dict(), roots)
    assert out["report"]["meta"]["config_hash"] != ev.report["meta"]["config_hash"]
    report0 = ev.report
    # The numbers, one by one: per policy full-task success, turns passed, local accuracy and n.
    rows = {p["policy"]: p for p in report["policies"]}
    for p in report0["policies"]:
        for k in ("full_task_success", "turn_pass_rate", "local_pivot_accuracy", "local_pivot_set_accuracy",
                  "tasks", "turns_total", "local_samples", "local_states"):
            assert rows[p["policy"]][k] == p[k], (p["policy"], k)
    assert sum(p["tasks"] for p in rows.values()) == 3 * len(report["meta"]["heldout_tasks"]) > 0


@pytest.mark.integration
def test_sharded_evaluation_gives_the_unsharded_report_and_reruns_only_a_missing_shard(smoke_run, tmp_path):
    """``scale_out.eval_shard_size=1``: a shard per held-out task (every policy on one engine) and
    one for the state-level measures, merged into the unsharded stage's report; after one shard's
    output and the report are deleted, a rerun evaluates exactly that shard."""
    from pivotrl.pipeline.evaluate_stage import eval_shard, merge_eval_shards, plan_eval_shards

    cfg0, _, demos, ref, probe, train, ev = smoke_run
    root = _copy_root(Path(cfg0.run.storage_root), tmp_path / "root")
    cfg = smoke_config(root, Path(cfg0.model.source), "scale_out.eval_shard_size=1")
    store = ArtifactStore(cfg.run.storage_root)
    args = (demos, ref.to_dict(), probe.to_dict(), train.to_dict())
    plan = plan_eval_shards(cfg, store, *args)
    tasks = ev.report["meta"]["heldout_tasks"]
    assert plan["eval_key"] == ev.eval_key and not plan["done"]
    assert [(s["part"], s["tasks"]) for s in plan["shards"]] == [("tasks", [t]) for t in tasks] + [("states", [])]
    assert [eval_shard(cfg, store, *args, s)["evaluated"] for s in plan["shards"]] == [True] * len(plan["shards"])
    for s in plan["shards"]:  # each shard's output names its shard, part and tasks in its manifest
        m = store.read_manifest(s["output"])
        assert (m.kind, m.extra["shard"], m.extra["part"], m.extra["tasks"]) == (
            f"eval_shard_{s['part']}", s["index"], s["part"], s["tasks"])
    same_report(merge_eval_shards(cfg, store, *args, plan), ev, [root, Path(cfg0.run.storage_root)])

    gone = plan["shards"][0]
    store.delete(gone["output"])
    store.delete(ev.eval_key)
    rerun = [eval_shard(cfg, store, *args, s) for s in plan["shards"]]
    assert [r["index"] for r in rerun if r["evaluated"]] == [gone["index"]]
    same_report(merge_eval_shards(cfg, store, *args, plan), ev, [root, Path(cfg0.run.storage_root)])


@pytest.mark.integration
@pytest.mark.parametrize("placement", ["rank0", "ranks"])
def test_training_stage_two_ranks_matches_one_rank(smoke_run, tmp_path, placement):
    """The training stage as a 2-rank torchrun process group on the same pivots gives the same
    policy as the 1-rank run: with rank 0's engine (it samples and broadcasts the batch), and with
    an engine and a verifier on each rank (``rollout.engine_placement: ranks``: each rank samples
    its half of the batch, both engines are refreshed and verified every step); gradients are
    averaged. The ``ranks`` case runs as ``pivotrl run`` does: the stage process of a config with
    ``training.launcher: torchrun`` and ``nproc_per_node: 2`` starts the two ranks itself."""
    from pivotrl.pipeline.entry import run_stage_process
    from pivotrl.training.launch import LaunchConfig, launch

    cfg, store, demos, ref, probe, train, _ = smoke_run
    root2 = tmp_path / "root2"
    # Same artifacts up to the pivot set, in a fresh root, so the 2-rank run trains from scratch.
    subprocess.run(["cp", "-r", str(Path(cfg.run.storage_root)), str(root2)], check=True)
    import shutil

    shutil.rmtree(root2 / "train")
    port = 29500 + (hash(str(tmp_path)) % 1000)
    tr = LaunchConfig(launcher="torchrun", nnodes=1, nproc_per_node=2, master_port=port, omp_num_threads=1)
    cfg2 = cfg.model_copy(update={"run": cfg.run.model_copy(update={"storage_root": str(root2)}),
                                  "rollout": cfg.rollout.model_copy(update={"engine_placement": placement})})
    inputs = {"probe": probe.to_dict(), "reference": ref.to_dict()}
    if placement == "rank0":  # the launcher entry, as infra/multinode/launch_train.py runs it
        out = tmp_path / "result.json"
        spec = {"config": cfg2.model_dump(mode="json"), "inputs": inputs, "output": str(out)}
        launch(tr, entry="rl_stage", spec=spec, workdir=tmp_path, timeout_s=600)
        res = json.loads(out.read_text())
    else:
        config = cfg2.model_dump(mode="json")
        config["training"].update(launcher="torchrun", nproc_per_node=2, world_size=2, master_port=port)
        res = run_stage_process("train", config, inputs, threads=2)
        text = "\n".join(p.read_text() for p in (root2 / "logs").glob("*-train-*.log"))
        assert "train: starting 2 ranks with torchrun" in text, text[-3000:]
        assert "rollout engine 0 of 2 on rank 0" in text and "rollout engine 1 of 2 on rank 1" in text
    assert (res["train_key"] == train.train_key) == (placement == "rank0")  # the placement is in the key
    m1 = store.read_parquet(f"{train.train_key}/metrics.parquet")
    m2 = pd.read_parquet(root2 / res["train_key"] / "metrics.parquet")
    assert list(m2["reward_mean"]) == list(m1["reward_mean"])  # identical rollouts (seeds by batch position)
    if placement == "ranks":  # 2 pivots per batch: one on each rank's engine, both engines checked
        assert list(m2["engines"]) == [2, 2] and list(m2["refresh_verified_engines"]) == [2, 2]
        # Each engine samples its block of the batch (one pivot each; a last batch of one pivot, when
        # the pivot set is odd, leaves one engine idle).
        e0, e1 = list(m2["rollout_states_e0"]), list(m2["rollout_states_e1"])
        assert (e0[0], e1[0]) == (1, 1) and [a + b for a, b in zip(e0, e1)] == list(m2["pivots"])
        assert max(e0 + e1) == 1
        assert (m2["refresh_max_abs_delta_e1"] <= 1e-4).all()
    else:
        assert "engines" not in m2
    w1 = load_file(str(Path(cfg.run.storage_root) / train.policy_key / "model.safetensors"))
    w2 = load_file(str(root2 / res["policy_key"] / "model.safetensors"))
    assert w1.keys() == w2.keys()
    for k in w1:
        assert (w1[k] - w2[k]).abs().max().item() < 1e-5, k


def test_multinode_gpu_config_validates_and_renders_its_launch_command():
    """The GPU cluster config: two nodes of eight ranks, started by the train stage on the Ray
    cluster (one torchrun per node); the manual path renders the same per-node command."""
    from pivotrl.training.launch import LaunchConfig, render_launch_command

    cfg = load_config(str(REPO / "configs" / "multinode-gpu.yaml"))
    tr = cfg.training
    assert (tr.nnodes, tr.nproc_per_node, tr.world_size) == (2, 8, 16)
    assert (tr.launcher, tr.node_launch, tr.ray_gpus_per_node, cfg.scale_out.ray_address) == ("torchrun", "ray", 8.0, "auto")
    tcmd = render_launch_command(LaunchConfig.of(tr, node_rank=1), entry="rl_stage", spec_path="spec.json", python="python")
    assert tcmd[:3] == ["python", "-m", "torch.distributed.run"]
    assert "--nnodes=2" in tcmd and "--nproc-per-node=8" in tcmd and "--node-rank=1" in tcmd
    assert tcmd[-4:] == ["-m", "pivotrl.pipeline.rl_stage", "--spec", "spec.json"]
    dcmd = render_launch_command(LaunchConfig.of(tr, launcher="deepspeed", hostfile="configs/hostfile", no_ssh=True),
                                 entry="rl_stage", spec_path="spec.json", python="python")
    assert shlex.join(dcmd).startswith("python -m deepspeed.launcher.runner --hostfile=configs/hostfile --num_nodes=2 "
                                       "--no_ssh --node_rank=0")


def test_pivot_schedule_is_deterministic_and_covers_each_epoch():
    s1 = stages.pivot_schedule(10, 4, 2, seed=3, max_steps=None)
    assert s1 == stages.pivot_schedule(10, 4, 2, seed=3, max_steps=None)
    assert [len(b) for b in s1] == [4, 4, 2, 4, 4, 2]
    assert sorted(sum(s1[:3], [])) == list(range(10)) and sorted(sum(s1[3:], [])) == list(range(10))
    assert s1[:3] != s1[3:]  # a fresh permutation per epoch
    assert stages.pivot_schedule(10, 4, 2, seed=3, max_steps=4) == s1[:4]
