"""Prefect tasks of sharded evaluation (``scale_out.eval_shard_size``): plan → one mapped task run
per shard → merge into the report.

The shards are those of :mod:`pivotrl.pipeline.evaluate_stage` (held-out tasks by id, every policy on
one engine per shard, plus one shard for the state-level measures). They reuse the probe shards'
machinery (:mod:`pivotrl.tasks.shards`): a shard whose output exists in the store is reused by its
task (a rerun runs only the shards whose output is missing or that failed), ``scale_out.shard_retries``
retries of a crash, and the task runner (in-process, each shard in a child process; or Ray, the engine kept warm in the worker).
"""

from __future__ import annotations

from typing import Any, Mapping

from prefect import get_run_logger, task

from pivotrl.pipeline.results import EvalResult
from pivotrl.tasks import publish
from pivotrl.tasks.shards import ShardTasks, run_shard
from pivotrl.tasks.stages import NO_CACHE, config_of, retry_crashes, run_once, store_of

_INPUTS = ("demos", "reference", "probe", "train")


@task(name="eval-plan", cache_policy=NO_CACHE, persist_result=False)
def eval_plan(config: dict[str, Any], inputs: dict[str, Any]) -> dict[str, Any]:
    """The shards of this run's evaluation (see ``plan_eval_shards``)."""
    from pivotrl.pipeline.evaluate_stage import plan_eval_shards

    return plan_eval_shards(config_of(config), store_of(config), *(inputs[k] for k in _INPUTS))


@task(name="eval-shard", retries=2, retry_delay_seconds=1, retry_condition_fn=retry_crashes, cache_policy=NO_CACHE,
      persist_result=False)
def eval_shard(config: dict[str, Any], inputs: dict[str, Any], shard: dict[str, Any]) -> dict[str, Any]:
    """Evaluate one shard for every policy: its output from the store if it exists, else in this
    process with a warm engine on Ray, else in a child process."""
    from pivotrl.pipeline.evaluate_stage import cached_eval_shard, eval_shard as run_eval_shard

    if (hit := cached_eval_shard(store_of(config), shard)) is not None:
        get_run_logger().info("evaluation shard %s: reused %s (no process started)", shard["index"], shard["key"])
        publish.shard("eval", shard["index"], hit, reused=True)
        return hit
    out = run_shard("eval_shard", config, inputs, shard, lambda cfg, store: run_eval_shard(
        cfg, store, *(inputs[k] for k in _INPUTS), shard, warm_engine=True))
    publish.shard("eval", shard["index"], out, reused=False)
    return out


@task(name="eval-merge", retries=2, retry_delay_seconds=5, retry_condition_fn=retry_crashes, cache_policy=NO_CACHE,
      persist_result=False)
def eval_merge(config: dict[str, Any], inputs: dict[str, Any]) -> dict[str, Any]:
    """Merge the shards' tables into the run's report (the unsharded evaluate stage's files)."""
    from pivotrl.pipeline.evaluate_stage import merge_eval_shards

    out, computed = run_once("eval-merge", config, {k: inputs[k] for k in _INPUTS},
                          lambda: merge_eval_shards(config_of(config), store_of(config), *(inputs[k] for k in _INPUTS),
                                                    inputs["plan"]))
    res, store = EvalResult.of(out), store_of(config)
    from pivotrl.evaluation.report import published_markdown  # matplotlib: only when a report is published

    publish.evaluate(out, published_markdown(store, res.eval_key))
    if computed:
        publish.emit_assets(store, [res.report_json])
    return out


def eval_shard_tasks(config: Mapping[str, Any]) -> ShardTasks:
    """The tasks of sharded evaluation, the shard task with ``scale_out.shard_retries``."""
    return ShardTasks(plan=eval_plan, shard=eval_shard.with_options(retries=config_of(config).scale_out.shard_retries),
                      merge=eval_merge)


__all__ = ["eval_merge", "eval_plan", "eval_shard", "eval_shard_tasks"]
