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


def _run_sharded(subflow: Any, config: dict[str, Any], inputs: dict[str, Any]) -> dict[str, Any]:
    """Run a sharded subflow on the configured task runner. On Ray, shards whose worker, node or
    the driver's own raylet was lost (ShardsFailed.lost, task runs ended Crashed) are rerun in up
    to ``scale_out.shard_retries`` more rounds, each a new subflow run on a new task runner: the
    finished shards are reused from the store, so only the lost ones run; where the flow owns the Ray
    instance (``ray_address`` null) it is shut down first, so the round starts a fresh local
    cluster. A round with a shard that failed for another reason, or the last round, raises
    ShardsFailed naming the shards."""
    from prefect.exceptions import MissingResult

    from pivotrl.tasks.shards import ShardsFailed, task_runner

    so = config.get("scale_out") or {}
    rounds = int(so.get("shard_retries", 2)) + 1 if so.get("task_runner") == "ray" else 1
    for attempt in range(rounds):
        state = subflow.with_options(task_runner=task_runner(config))(config, inputs, return_state=True)
        try:
            exc = state.result(raise_on_failure=False)
        except MissingResult:
            exc = None
        if not isinstance(exc, BaseException):
            return state.result()
        if not (isinstance(exc, ShardsFailed) and exc.lost and not exc.failed) or attempt == rounds - 1:
            if isinstance(exc, ShardsFailed) and exc.lost and not exc.failed:
                raise ShardsFailed(f"shards {exc.lost} lost their Ray worker or node in each of {rounds} rounds "
                                   f"(scale_out.shard_retries={rounds - 1}):\n{exc}", lost=exc.lost) from None
            raise exc
        get_run_logger().warning("shards %s lost their Ray worker or node; rerunning them (round %d of %d)%s",
                                 exc.lost, attempt + 2, rounds,
                                 "; restarting the local Ray cluster" if so.get("ray_address") is None else "")
        if so.get("ray_address") is None:
            import ray

            if ray.is_initialized():
                ray.shutdown()
    raise AssertionError("unreachable")


def _unsharded(config: dict[str, Any], size_key: str) -> bool:
    so = config.get("scale_out") or {}
    return so.get(size_key) is None and so.get("task_runner", "inprocess") == "inprocess"


def probe_stage(tasks: Any, config: dict[str, Any], inputs: dict[str, Any]) -> dict[str, Any]:
    """The probe stage of a flow: the single ``probe`` task, or, with ``scale_out.probe_shard_size``
    set or a Ray task runner, :func:`sharded_probe` on the configured task runner (lost shards
    rerun: :func:`_run_sharded`)."""
    if _unsharded(config, "probe_shard_size"):
        return tasks.probe(config, inputs)
    return _run_sharded(sharded_probe, config, inputs)


def evaluate_stage(tasks: Any, config: dict[str, Any], inputs: dict[str, Any]) -> dict[str, Any]:
    """The evaluate stage of a flow: the single ``evaluate`` task, or, with
    ``scale_out.eval_shard_size`` set or a Ray task runner (the engines run on the workers, not on
    the flow's machine), :func:`sharded_evaluate` on the configured task runner (lost shards
    rerun: :func:`_run_sharded`)."""
    if _unsharded(config, "eval_shard_size"):
        return tasks.evaluate(config, inputs)
    return _run_sharded(sharded_evaluate, config, inputs)
