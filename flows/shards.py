"""Sharded probing and evaluation as subflows with their own task runner (``scale_out.task_runner``):
plan the shards, map one task run over each, merge. The nightly and probe flows call
:func:`probe_stage` and :func:`evaluate_stage`.
"""

from __future__ import annotations

from typing import Any

from prefect import flow, get_run_logger, unmapped


def _sharded(t: Any, config: dict[str, Any], inputs: dict[str, Any], what: str) -> dict[str, Any]:
    from pivotrl.tasks.shards import shard_resources, wait_for_shards

    plan = t.plan(config, inputs)
    if plan.get("done"):  # the stage's result exists (an unsharded run, or an earlier merge): no shard runs
        get_run_logger().info("%s: the merged result exists already; no shard runs", what)
        return t.merge(config, {**inputs, "plan": plan, "shards": []})
    with shard_resources(config):
        futures = t.shard.map(unmapped(config), unmapped(inputs), plan["shards"])
    results = wait_for_shards(list(futures), plan, what)
    return t.merge(config, {**inputs, "plan": plan, "shards": results})


@flow(name="pivotrl-probe-shards", log_prints=True)
def sharded_probe(config: dict[str, Any], inputs: dict[str, Any]) -> dict[str, Any]:
    """Probing in shards → the same result dict as the single ``probe`` task."""
    from pivotrl.tasks.shards import shard_tasks

    return _sharded(shard_tasks(config), config, inputs, "probe")


@flow(name="pivotrl-eval-shards", log_prints=True)
def sharded_evaluate(config: dict[str, Any], inputs: dict[str, Any]) -> dict[str, Any]:
    """Evaluation in shards → the same result dict (and report) as the single ``evaluate`` task."""
    from pivotrl.tasks.eval_shards import eval_shard_tasks

    return _sharded(eval_shard_tasks(config), config, inputs, "evaluation")


def _unsharded(config: dict[str, Any], size_key: str) -> bool:
    so = config.get("scale_out") or {}
    return so.get(size_key) is None and so.get("task_runner", "inprocess") == "inprocess"


def probe_stage(tasks: Any, config: dict[str, Any], inputs: dict[str, Any]) -> dict[str, Any]:
    """The probe stage of a flow: the single ``probe`` task, or, with ``scale_out.probe_shard_size``
    set or a Ray task runner, :func:`sharded_probe` on the configured task runner."""
    from pivotrl.tasks.shards import task_runner

    if _unsharded(config, "probe_shard_size"):
        return tasks.probe(config, inputs)
    return sharded_probe.with_options(task_runner=task_runner(config))(config, inputs)


def evaluate_stage(tasks: Any, config: dict[str, Any], inputs: dict[str, Any]) -> dict[str, Any]:
    """The evaluate stage of a flow: the single ``evaluate`` task, or, with
    ``scale_out.eval_shard_size`` set or a Ray task runner (the engines run on the workers, not on
    the flow's machine), :func:`sharded_evaluate` on the configured task runner."""
    from pivotrl.tasks.shards import task_runner

    if _unsharded(config, "eval_shard_size"):
        return tasks.evaluate(config, inputs)
    return sharded_evaluate.with_options(task_runner=task_runner(config))(config, inputs)
