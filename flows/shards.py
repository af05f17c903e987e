"""Sharded probing as a subflow with its own task runner (``scale_out.task_runner``): plan the
shards, map one task run over each, merge. The nightly and probe flows call :func:`probe_stage`.
"""

from __future__ import annotations

from typing import Any

from prefect import flow, unmapped


@flow(name="pivotrl-probe-shards", log_prints=True)
def sharded_probe(config: dict[str, Any], inputs: dict[str, Any]) -> dict[str, Any]:
    """Probing in shards → the same result dict as the single ``probe`` task."""
    from pivotrl.tasks.shards import shard_resources, shard_tasks, wait_for_shards

    t = shard_tasks(config)
    plan = t.plan(config, inputs)
    with shard_resources(config):
        futures = t.shard.map(unmapped(config), unmapped(inputs), plan["shards"])
    results = wait_for_shards(list(futures), plan)
    return t.merge(config, {**inputs, "plan": plan, "shards": results})


def probe_stage(tasks: Any, config: dict[str, Any], inputs: dict[str, Any]) -> dict[str, Any]:
    """The probe stage of a flow: the single ``probe`` task, or, with ``scale_out.probe_shard_size``
    set or a Ray task runner, :func:`sharded_probe` on the configured task runner."""
    from pivotrl.tasks.shards import task_runner

    so = config.get("scale_out") or {}
    if so.get("probe_shard_size") is None and so.get("task_runner", "inprocess") == "inprocess":
        return tasks.probe(config, inputs)
    return sharded_probe.with_options(task_runner=task_runner(config))(config, inputs)
