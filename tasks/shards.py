"""Prefect tasks of sharded probing (``scale_out``): plan → one mapped task run per shard → merge;
and the pieces sharded evaluation (:mod:`pivotrl.tasks.eval_shards`) shares with it:
:func:`run_shard`, the task runner, the resources and :func:`wait_for_shards`.

Each shard is its own task run, addressed by its content key (see
:mod:`pivotrl.pipeline.probe_stage`), with ``scale_out.shard_retries`` retries of a crash. A shard
whose table exists in the store is reused by its task (the shard's own check,
``cached_probe_shard``; no process, no engine), so a rerun of the flow — or a concurrent run, or
one on another machine sharing the storage root — runs only the missing or failed shards; a shard
whose tool executions kept failing ends Failed with a message naming the states it could not decide.

Where shards run is ``scale_out.task_runner``: in-process (Prefect's thread pool, at most
``scale_out.max_parallel_shards`` at once, each shard's engine in a child process that ends with
it) or Ray (prefect-ray's ``RayTaskRunner``; every shard task asks Ray for
``ray_cpus_per_shard``/``ray_gpus_per_shard``, so one engine runs per worker slot, and the engine
stays warm in the worker process for its next shard).
"""

from __future__ import annotations

import contextlib
import os
from dataclasses import dataclass
from typing import Any, Callable, Iterator, Mapping

from prefect import Task, get_run_logger, task
from pivotrl.core.errors import PivotRLError
from pivotrl.tasks import publish
from pivotrl.tasks.stages import NO_CACHE, config_of, retry_crashes, run_once, store_of


class ShardsFailed(PivotRLError, RuntimeError):
    """Some shard task runs ended Failed; the message names each one and why. ``lost``: the
    indices of the shards that ended Crashed (on Ray: their worker process, node or the driver's
    raylet was lost, so the task's own retries never ran); ``failed``: the others."""

    def __init__(self, message: str, *, lost: list[int] | None = None, failed: list[int] | None = None) -> None:
        super().__init__(message)
        self.lost = list(lost or [])
        self.failed = list(failed or [])


def run_shard(stage: str, config: dict[str, Any], inputs: dict[str, Any], shard: dict[str, Any],
              in_worker: Callable[[Any, Any], dict[str, Any]]) -> dict[str, Any]:
    """Run one shard task's work: on Ray, ``in_worker(cfg, store)`` in this worker process (its
    engine stays warm for the worker's next shard; the result names the worker's pid and node);
    in-process, the entry stage ``stage`` in a child process (its engine ends with it)."""
    from prefect.runtime import task_run

    from pivotrl.pipeline.common import make_store, set_threads
    from pivotrl.pipeline.entry import run_stage_process

    cfg = config_of(config)
    attempt = max(0, int(task_run.run_count or 1) - 1)
    if cfg.scale_out.task_runner == "ray":
        import os

        import ray

        if shard.get("index") in cfg.faults.ray_node_loss_shards:
            _lose_this_node(make_store(cfg), shard)
        set_threads(cfg.rollout.num_threads)
        out = in_worker(cfg, make_store(cfg, attempt=attempt))
        return {**out, "worker": {"pid": os.getpid(), "node": ray.get_runtime_context().get_node_id()}}
    return run_stage_process(stage, config, {**inputs, "shard": shard}, threads=cfg.rollout.num_threads,
                             attempt=attempt)


def _lose_this_node(store: Any, shard: dict[str, Any]) -> None:
    """The ``faults.ray_node_loss_shards`` drill, on a shard's first attempt (a marker object in the
    store says it happened): SIGKILL this worker's raylet (the process that started it), so the node
    is lost with the shard on it, then end this worker."""
    import os
    import signal

    marker = f"{shard['key']}/node-loss-drill.json"
    if store.exists(marker):
        return
    store.write_json(marker, {"raylet": os.getppid()})
    os.kill(os.getppid(), signal.SIGKILL)
    os._exit(1)


@task(name="probe-plan", cache_policy=NO_CACHE, persist_result=False)
def probe_plan(config: dict[str, Any], inputs: dict[str, Any]) -> dict[str, Any]:
    """The shards of this run's probing (see ``plan_probe_shards``)."""
    from pivotrl.pipeline.probe_stage import plan_probe_shards

    return plan_probe_shards(config_of(config), store_of(config), inputs["demos"], inputs["reference"])


@task(name="probe-shard", retries=2, retry_delay_seconds=1, retry_condition_fn=retry_crashes, cache_policy=NO_CACHE,
      persist_result=False)
def probe_shard(config: dict[str, Any], inputs: dict[str, Any], shard: dict[str, Any]) -> dict[str, Any]:
    """Probe one shard: its table from the store if it exists, else in this process with a warm
    engine on Ray, else in a child process."""
    from pivotrl.pipeline.entry import StageError
    from pivotrl.pipeline.probe_stage import cached_probe_shard, probe_shard as run_probe_shard, shard_failure

    store = store_of(config)
    if (hit := cached_probe_shard(store, shard)) is not None:
        get_run_logger().info("probe shard %s: reused %s (no process started)", shard["index"], shard["key"])
        publish.shard("probe", shard["index"], hit, reused=True)
        return hit
    if store.exists(f"{shard['key']}/failed.json"):
        store.delete(f"{shard['key']}/failed.json")  # only this attempt's failure is reported
    try:
        out = run_shard("probe_shard", config, inputs, shard, lambda cfg, st: run_probe_shard(
            cfg, st, inputs["demos"], inputs["reference"], shard, warm_engine=True))
        publish.shard("probe", shard["index"], out, reused=False)
        return out
    except StageError:
        failure = shard_failure(store, shard)
        if failure is not None:
            raise failure from None
        raise


@task(name="probe-merge", retries=2, retry_delay_seconds=5, retry_condition_fn=retry_crashes, cache_policy=NO_CACHE,
      persist_result=False)
def probe_merge(config: dict[str, Any], inputs: dict[str, Any]) -> dict[str, Any]:
    """Merge the shard tables into the run's probe table and select the pivot set."""
    from pivotrl.pipeline.probe_stage import merge_probe_shards

    out, computed = run_once("probe-merge", config, {k: inputs[k] for k in ("demos", "reference")},
                          lambda: merge_probe_shards(config_of(config), store_of(config), inputs["demos"],
                                                     inputs["reference"], inputs["plan"]).to_dict())
    publish.probe(out)
    if computed:
        publish.emit_assets(store_of(config), [out["probes"], out["pivots"]])
    return out


@dataclass(frozen=True)
class ShardTasks:
    """The plan, shard and merge tasks of one sharded stage (probing: :func:`shard_tasks`;
    evaluation: ``pivotrl.tasks.eval_shards.eval_shard_tasks``)."""

    plan: Task
    shard: Task
    merge: Task


def shard_tasks(config: Mapping[str, Any]) -> ShardTasks:
    """The tasks of sharded probing, the shard task with ``scale_out.shard_retries``."""
    retries = config_of(config).scale_out.shard_retries
    return ShardTasks(plan=probe_plan, shard=probe_shard.with_options(retries=retries), merge=probe_merge)


def task_runner(config: Mapping[str, Any]) -> Any:
    """The Prefect task runner of ``scale_out.task_runner``: a ``ThreadPoolTaskRunner`` with
    ``max_parallel_shards`` threads, or a ``RayTaskRunner`` joining ``ray_address`` ('auto': the
    cluster this machine belongs to) or starting a local Ray instance when it is null."""
    so = config_of(config).scale_out
    if so.task_runner == "ray":
        from prefect_ray.task_runners import RayTaskRunner

        if so.ray_address is None:  # a local instance of this flow's own: loopback, no token (see ray_local)
            os.environ.setdefault("RAY_AUTH_MODE", "disabled")
            return RayTaskRunner(init_kwargs={"address": "local"})
        if so.ray_address == "auto":
            return RayTaskRunner(init_kwargs={"address": "auto"})
        return RayTaskRunner(address=so.ray_address)
    from prefect.task_runners import ThreadPoolTaskRunner

    return ThreadPoolTaskRunner(max_workers=so.max_parallel_shards)


@contextlib.contextmanager
def shard_resources(config: Mapping[str, Any]) -> Iterator[None]:
    """Around the submission of shard tasks: on Ray, each asks for its CPUs/GPUs (one engine each)."""
    so = config_of(config).scale_out
    if so.task_runner != "ray":
        yield
        return
    from prefect_ray.context import remote_options

    # No retry by Ray itself (it would rerun the task under the same Prefect task run): a shard whose
    # worker or node is lost ends Crashed, and the flow reruns it (pivotrl.flows.shards).
    opts: dict[str, Any] = {"num_cpus": so.ray_cpus_per_shard, "max_retries": 0}
    if so.ray_gpus_per_shard:
        opts["num_gpus"] = so.ray_gpus_per_shard
    with remote_options(**opts):
        yield


def wait_for_shards(futures: list[Any], plan: dict[str, Any], what: str = "probe") -> list[dict[str, Any]]:
    """The results of every shard future, in plan order; raises ShardsFailed naming each failed
    shard (index, key and its failure message, e.g. the states it could not decide). ``what``:
    the kind of shards, for the message ("probe", "evaluation")."""
    results, failed, lost, other = [], [], [], []
    for shard, fut in zip(plan["shards"], futures):
        fut.wait()
        state = fut.state
        if state.is_completed():
            results.append(fut.result())
        else:
            (lost if state.is_crashed() else other).append(shard["index"])
            failed.append(f"shard {shard['index']} ({shard['key']}): {state.name}: {state.message or ''}".strip())
    if failed:
        raise ShardsFailed(f"{len(failed)} of {len(futures)} {what} shards failed; run the flow again to retry "
                           "only them:\n" + "\n".join(failed), lost=lost, failed=other)
    return results


__all__ = ["ShardTasks", "ShardsFailed", "probe_merge", "probe_plan", "probe_shard", "shard_resources",
           "run_shard", "shard_tasks", "task_runner", "wait_for_shards"]
