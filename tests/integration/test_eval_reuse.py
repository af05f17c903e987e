"""The evaluation reuses each policy's results under their own content key.

A run that changes only a training setting trains a new policy, but the base model and π_ref are
the same weights on the same held-out items: their results are read back from the store
(``eval/shards/by-policy/<key>``), and only the new policy is evaluated. The report must be the one
a cold evaluation of that run writes, item for item.
"""

from __future__ import annotations

import shutil
from pathlib import Path

import pandas as pd
import pytest

from pivotrl.pipeline import stages
from pivotrl.pipeline.evaluate import PARTS_PREFIX
from pivotrl.pipeline.evaluate_stage import plan_eval_shards
from pivotrl.storage import ArtifactStore
from pivotrl.testing import comparable_report

from smoke_runs import copy_smoke_run

pytestmark = pytest.mark.integration


def _policy_parts(store: ArtifactStore, plan: dict) -> dict[str, dict[str, dict]]:
    """Shard part ("tasks" | "states") → policy → what the shard recorded of it (part key,
    computed now, prompts the engine served for it)."""
    return {s["part"]: store.read_manifest(s["output"]).extra["policy_parts"] for s in plan["shards"]}


def test_training_change_reuses_base_and_reference_and_gives_the_cold_report(smoke_run, tmp_path):
    run = copy_smoke_run(smoke_run, tmp_path / "warm")
    cfg, store = run.cfg, run.store
    first = _policy_parts(store, plan_eval_shards(cfg, store, run.demos, run.ref, run.probe, run.train))
    # The first run evaluated every policy, each with generation.
    assert {p: {n: d["computed"] for n, d in parts.items()} for p, parts in first.items()} == \
        {part: {"base": True, "reference": True, "pivotrl": True} for part in ("tasks", "states")}
    assert all(d["requests"] > 0 for parts in first.values() for d in parts.values())

    # Only a training setting changes: a new policy, the same base model and π_ref.
    cfg2 = cfg.model_copy(update={"training": cfg.training.model_copy(update={"max_steps": 1})})
    train2 = stages.stage_train(cfg2, store, run.probe, run.ref)
    assert train2.train_key != run.train.train_key and train2.policy_key
    # A cold evaluation of that run, in a copy of the root without any evaluation artifact.
    cold_root = tmp_path / "cold"
    shutil.copytree(Path(cfg.run.storage_root), cold_root, ignore=lambda d, names: [
        n for n in names if Path(d) == Path(cfg.run.storage_root) and n == "eval"])
    cfg_cold = cfg2.model_copy(update={"run": cfg2.run.model_copy(update={"storage_root": str(cold_root)})})
    store_cold = ArtifactStore(str(cold_root))
    cold = stages.stage_evaluate(cfg_cold, store_cold, run.demos, run.ref, run.probe, train2)

    root = Path(cfg.run.storage_root)
    written = {d["part"]: (root / d["part"] / ("full_task.parquet" if p == "tasks" else "states.json")).stat().st_mtime_ns
               for p, parts in first.items() for d in parts.values()}
    warm = stages.stage_evaluate(cfg2, store, run.demos, run.ref, run.probe, train2)
    assert warm.eval_key == cold.eval_key != run.ev.eval_key

    plan = plan_eval_shards(cfg2, store, run.demos, run.ref, run.probe, train2)
    second = _policy_parts(store, plan)
    # Base and π_ref: no generation at all, their parts read back under the first run's keys.
    for part in ("tasks", "states"):
        for name in ("base", "reference"):
            assert second[part][name] == {**first[part][name], "computed": False, "requests": 0}, (part, name)
        # The new policy is evaluated, under a new key.
        assert second[part]["pivotrl"]["computed"] and second[part]["pivotrl"]["requests"] > 0
        assert second[part]["pivotrl"]["part"] != first[part]["pivotrl"]["part"]
        assert second[part]["pivotrl"]["part"].startswith(PARTS_PREFIX + "/")
    for key, when in written.items():  # nothing of the first run was rewritten
        name = "full_task.parquet" if store.exists(f"{key}/full_task.parquet") else "states.json"
        assert (root / key / name).stat().st_mtime_ns == when
    cold_parts = _policy_parts(store_cold, plan_eval_shards(cfg_cold, store_cold, run.demos, run.ref, run.probe,
                                                            train2))
    assert all(d["computed"] for parts in cold_parts.values() for d in parts.values())
    assert {p: {n: d["part"] for n, d in parts.items()} for p, parts in cold_parts.items()} == \
        {p: {n: d["part"] for n, d in parts.items()} for p, parts in second.items()}

    # The same per-item tables and report as the cold evaluation.
    for name in ("full_task.parquet", "local.parquet"):
        a = store.read_parquet(f"{warm.eval_key}/{name}")
        b = store_cold.read_parquet(f"{cold.eval_key}/{name}")
        assert len(a) > 0 and set(a["policy"]) == {"base", "reference", "pivotrl"}
        pd.testing.assert_frame_equal(a.reset_index(drop=True), b.reset_index(drop=True))
    roots = [Path(cfg.run.storage_root), cold_root]
    assert comparable_report(warm.to_dict(), roots) == comparable_report(cold.to_dict(), roots)
    # The numbers differ between the policies' results where they should: the parts are not one copy.
    local = store.read_parquet(f"{warm.eval_key}/local.parquet")
    by_policy = local.groupby("policy")["tokens_generated"].sum()
    assert by_policy["base"] != by_policy["reference"]


def test_without_warm_start_the_reference_is_the_base_model_evaluated_once(tiny_model, tmp_path):
    """Without a warm start π_ref is the base model's checkpoint: one content key, so the stage
    evaluates it once and reports it under both names, row for row."""
    from smoke_runs import run_smoke_stages, smoke_config

    run = run_smoke_stages(smoke_config(tmp_path / "root", tiny_model, "warm_start.enabled=false"))
    assert run.ref.ref_hash == run.ref.base_hash
    parts = _policy_parts(run.store, plan_eval_shards(run.cfg, run.store, run.demos, run.ref, run.probe, run.train))
    for part, policies in parts.items():
        assert policies["base"]["computed"] and policies["base"]["requests"] > 0, part
        assert policies["reference"] == {**policies["base"], "computed": False, "requests": 0}, part
        assert policies["pivotrl"]["part"] != policies["base"]["part"], part
    for name in ("full_task.parquet", "local.parquet"):
        df = run.store.read_parquet(f"{run.ev.eval_key}/{name}")
        base, reference = (df[df["policy"] == p].drop(columns="policy").reset_index(drop=True)
                           for p in ("base", "reference"))
        assert len(base) > 0
        pd.testing.assert_frame_equal(base, reference)
    rows = {p["policy"].split(" ")[0]: p for p in run.ev.report["policies"]}  # "reference (...)"
    assert rows["base"]["local_samples"] > 0
    assert {k: v for k, v in rows["base"].items() if k != "policy" and "gen_" not in k} == \
        {k: v for k, v in rows["reference"].items() if k != "policy" and "gen_" not in k}
