"""Prefect tasks of sharded evaluation (``scale_out.eval_shard_size``): plan → one mapped task run
per shard → merge into the report.

The shards are those of :mod:`pivotrl.pipeline.evaluate_stage` (held-out tasks by id, every policy on
one engine per shard, plus one shard for the state-level measures). They reuse the probe shards'
machinery (:mod:`pivotrl.tasks.shards`): the content-addressed cache key (a rerun runs only the
shards whose output is missing or that failed), ``scale_out.shard_retries`` retries, and the task
runner (in-process, each shard in a child process; or Ray, the engine kept warm in the worker).
"""

from __future__ import annotations

from datetime import timedelta
from typing import Any, Mapping

from prefect import task

from pivotrl.pipeline.results import EvalResult
from pivotrl.tasks import publish
from pivotrl.tasks.shards import ShardTasks, shard_cache_key, run_shard
from pivotrl.tasks.stages import config_of, run_once, retry_unless_permanent, store_of, result_storage

_INPUTS = ("demos", "reference", "probe", "train")


@task(name="eval-plan", persist_result=False)
def eval_plan(config: dict[str, Any], inputs: dict[str, Any]) -> dict[str, Any]:
    """The shards of this run's evaluation (see ``plan_eval_shards``)."""
    from pivotrl.pipeline.evaluate_stage import plan_eval_shards

    return plan_eval_shards(config_of(config), store_of(config), *(inputs[k] for k in _INPUTS))


@task(name="eval-shard", retries=2, retry_delay_seconds=1, retry_condition_fn=retry_unless_permanent,
      cache_key_fn=shard_cache_key, cache_expiration=timedelta(days=30), persist_result=True,
      result_serializer="json")
def eval_shard(config: dict[str, Any], inputs: dict[str, Any], shard: dict[str, Any]) -> dict[str, Any]:
    """Evaluate one shard for every policy: in this process with a warm engine on Ray, else in a
    child process."""
    from pivotrl.pipeline.evaluate_stage import eval_shard as run_eval_shard

    return run_shard("eval_shard", config, inputs, shard, lambda cfg, store: run_eval_shard(
        cfg, store, *(inputs[k] for k in _INPUTS), shard, warm_engine=True))


@task(name="eval-merge", retries=2, retry_delay_seconds=5, retry_condition_fn=retry_unless_permanent,
      persist_result=True, result_serializer="json")
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
    """The tasks bound to the run's result storage, the shard task with ``scale_out.shard_retries``."""
    storage = result_storage(config)
    return ShardTasks(plan=eval_plan,
                      shard=eval_shard.with_options(result_storage=storage,
                                                    retries=config_of(config).scale_out.shard_retries),
                      merge=eval_merge.with_options(result_storage=storage))


__all__ = ["eval_merge", "eval_plan", "eval_shard", "eval_shard_tasks"]
