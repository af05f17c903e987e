"""Prefect tasks of the nightly pipeline: one per stage, each a thin wrapper.

Every task takes the run config (as JSON) and the small results of earlier tasks (URIs, hashes,
counts — never tensors or tables; typed in ``pivotrl.pipeline.results``, passed between tasks as
their JSON dicts: ``to_dict`` / ``of``), runs one ``pivotrl.pipeline`` stage through
:func:`run_once` and publishes its facts, Prefect artifacts and asset events
(:mod:`pivotrl.tasks.publish`). Heavy stages run in a child process (engine and trainer memory
live and die with the stage).

Reuse has one layer: the content-addressed store. :func:`run_once` computes the stage's key
(:func:`pivotrl.pipeline.keys.stage_key`: what the stage's artifact depends on and nothing else,
computed here without loading a model) and asks the stage's own reuse check
(:func:`pivotrl.pipeline.keys.cached_result`: do its artifacts exist under that key?); a stage
already computed — by an earlier run, a concurrent one, or a run on another machine sharing the
storage root — returns its result with no stage process started. Otherwise the stage runs under
the lease on its key (:mod:`pivotrl.storage.lease`), the lock that keeps two runs from computing
one stage at once; a run that waited on the lease looks again and reuses what the holder wrote.
Prefect's task cache is off (``NO_CACHE``, no persisted results): it would be a second index of
the same facts, kept on the Prefect server's side and locked only on one machine.

Retries: a task retries a crashed or failed stage process (:func:`retry_crashes`), never a
config, data or model error, and never a storage error — the store retried that already under its
own policy (:mod:`pivotrl.storage.store`).

Assets: each artifact is an asset keyed by its URI (content-addressed, so an artifact reused on a
later night is the same asset), with its manifest's inputs as upstream assets: sources →
trajectories → candidates → probes → pivots → policy → report (with π_ref feeding probes and
training). The events come from the stage task itself; a reused stage emits none.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Mapping

from prefect import Task, get_run_logger, task
from prefect.cache_policies import NO_CACHE

from pivotrl.pipeline.registry import NIGHTLY_STAGES
from pivotrl.pipeline.results import EvalResult, ProbeResult, ReferenceResult, TrainResult
from pivotrl.tasks import publish

#: The pipeline stage whose key a task uses (a sharded stage's merge is that stage).
_KEYED_AS = {"probe-merge": "probe", "eval-merge": "evaluate"}


def lease_key(stage: str, config: Mapping[str, Any], inputs: Any) -> str:
    """The content key of the stage a task runs (:func:`pivotrl.pipeline.keys.stage_key`), e.g.
    ``train/3f2a…`` for the artifacts under ``train/3f2a…``: the key its artifacts are looked up
    under and its lease is taken on. It covers what the stage's artifact depends on and nothing
    else — its config sections, the earlier stages' keys, the files it reads, its code — so a
    change to ``training`` alone leaves the demonstrations, reference and probe stages reused.
    Computed in the flow process without loading a model (at most a manifest is read).
    Raises ConfigError for a task of no stage or a missing input."""
    from pivotrl.pipeline.keys import stage_key

    return stage_key(_KEYED_AS.get(stage, stage), config_of(config), store_of(config), inputs)


def retry_crashes(_task: Any, _task_run: Any, state: Any) -> bool:
    """Retry a crashed or failed stage process (or shard); never a config/data/model error or a
    broken training invariant, which would fail the same way again, and never a storage error,
    which the store retried already (:func:`pivotrl.pipeline.entry.retried_by_task`)."""
    from pivotrl.pipeline.entry import retried_by_task

    try:
        exc = state.result(raise_on_failure=False)
    except Exception as e:  # the result itself could not be read
        exc = e
    return not isinstance(exc, BaseException) or retried_by_task(exc)


def stage_task(stage: str, retries: int):
    """The task decorator of a stage: ``retries`` retries of a crash (:func:`retry_crashes`), no
    Prefect cache and no persisted result (reuse is the store's: :func:`run_once`)."""
    return task(
        name=stage, retries=retries, retry_delay_seconds=[5, 30, 120][:retries] or 0,
        retry_condition_fn=retry_crashes, cache_policy=NO_CACHE, persist_result=False,
    )


def config_of(config: Mapping[str, Any]):
    from pivotrl.config import parse_config

    return parse_config(config, source="the flow's config")  # validated once per process


def store_of(config: Mapping[str, Any]):
    from pivotrl.pipeline.common import make_store

    return make_store(config_of(config))


@dataclass(frozen=True)
class PipelineTasks:
    """The stage tasks of one run (see :func:`pipeline_tasks`)."""

    demonstrations: Task
    reference: Task
    probe: Task
    train: Task
    evaluate: Task


def pipeline_tasks(config: Mapping[str, Any]) -> PipelineTasks:
    """The five stage tasks of the run of ``config`` (each reuses its stage from the run's store)."""
    config_of(config)  # a bad config fails here, before any task runs
    return PipelineTasks(**{name: globals()[name] for name in NIGHTLY_STAGES})


# ------------------------------------------------------------------------------------- lease
def run_once(stage: str, config: Mapping[str, Any], inputs: Any, compute: Any) -> tuple[dict[str, Any], bool]:
    """``(result, computed)``: the stage's result from the store if its artifacts exist under its
    key (:func:`pivotrl.pipeline.keys.cached_result`; no stage process starts), else ``compute()``
    under the lease on that key. A run that waited on the lease (another run was computing the
    stage) looks again and reuses what the holder wrote: two runs on one storage root never
    compute, or write, the same stage at once (see :mod:`pivotrl.storage.lease`)."""
    from prefect.runtime import flow_run

    from pivotrl.pipeline.keys import cached_result
    from pivotrl.storage.lease import stage_lease

    cfg, store, key = config_of(config), store_of(config), lease_key(stage, config, inputs)
    name = _KEYED_AS.get(stage, stage)
    logger = get_run_logger()

    def reused() -> dict[str, Any] | None:
        hit = cached_result(name, cfg, store, inputs)
        if hit is not None:
            logger.info("stage %s: reused %s (its artifacts exist; no stage process started)", stage, key)
        return hit

    if (hit := reused()) is not None:
        return hit, False

    def waiting(holder: dict[str, Any]) -> None:
        logger.info("stage %s is being computed by another run (flow run %s, pid %s on %s): waiting for it",
                    stage, holder.get("flow_run_id"), holder.get("pid"), holder.get("host"))

    with stage_lease(store, key, describe={"stage": stage, "flow_run_id": str(flow_run.id)}, on_wait=waiting):
        if (hit := reused()) is not None:  # written by the run whose lease this one waited on
            return hit, False
        logger.info("stage %s: computing %s", stage, key)
        out = compute()
        logger.info("stage %s: computed", stage)
        return out, True


# -------------------------------------------------------------------------------------- tasks
@stage_task("demonstrations", retries=2)
def demonstrations(config: dict[str, Any], inputs: dict[str, Any] | None = None) -> dict[str, Any]:
    """Load + validate demonstrations, split by trajectory, extract turn-state candidates."""
    from pivotrl.pipeline.demos import build_demonstrations
    from pivotrl.pipeline.entry import announce

    def compute() -> dict[str, Any]:
        with announce("demonstrations"):
            return build_demonstrations(config_of(config), store_of(config))

    out, computed = run_once("demonstrations", config, inputs, compute)
    publish.demonstrations(out)
    if computed:
        publish.emit_assets(store_of(config), [out["trajectories"], out["candidates"]] + ([out["flagged"]] if out.get("flagged") else []))
    return out


def _stage_process(stage: str, config: dict[str, Any], inputs: dict[str, Any]) -> dict[str, Any]:
    from pivotrl.pipeline.entry import run_stage_process

    from prefect.runtime import flow_run, task_run

    from pivotrl.storage.manifest import RUN_ID_ENV

    # A retried stage gets a fresh fault-injection stream (drills), else it would replay its failure.
    attempt = max(0, int(task_run.run_count or 1) - 1)
    # The stage's manifests record this flow run and task run (the stage process never imports Prefect).
    ids = {RUN_ID_ENV["flow_run_id"]: str(flow_run.id or ""), RUN_ID_ENV["task_run_id"]: str(task_run.id or "")}
    return run_stage_process(stage, config, inputs, threads=config_of(config).rollout.num_threads, attempt=attempt,
                             env=ids)


def run_stage_task(stage: str, config: dict[str, Any], inputs: dict[str, Any]) -> tuple[dict[str, Any], bool]:
    return run_once(stage, config, inputs, lambda: _stage_process(stage, config, inputs))


@stage_task("reference", retries=1)
def reference(config: dict[str, Any], inputs: dict[str, Any]) -> dict[str, Any]:
    """Resolve the base model; supervised warm start on the warm-start split → π_ref."""
    out, computed = run_stage_task("reference", config, inputs)
    ref = ReferenceResult.of(out)
    publish.reference(out)
    if computed and ref.ref_key:
        publish.emit_assets(store_of(config), [store_of(config).url(f"{ref.ref_key}.sft.json")])
    return out


@stage_task("probe", retries=2)
def probe(config: dict[str, Any], inputs: dict[str, Any]) -> dict[str, Any]:
    """Probe π_ref (m samples per candidate, verifier-scored) and select the pivot set."""
    out, computed = run_stage_task("probe", config, inputs)
    res = ProbeResult.of(out)
    publish.probe(out)
    if computed:
        publish.emit_assets(store_of(config), [res.probes, res.pivots])
    return out


@stage_task("train", retries=2)
def train(config: dict[str, Any], inputs: dict[str, Any]) -> dict[str, Any]:
    """PivotRL epochs on the pivot set; resumes from the latest checkpoint on retry."""
    out, computed = run_stage_task("train", config, inputs)
    res, store = TrainResult.of(out), store_of(config)
    publish.train(out, store.read_parquet(f"{res.train_key}/metrics.parquet"))
    if computed:
        publish.emit_assets(store, [res.metrics, store.url(f"{res.train_key}/summary.json")])
    return out


@stage_task("evaluate", retries=1)
def evaluate(config: dict[str, Any], inputs: dict[str, Any]) -> dict[str, Any]:
    """Full multi-turn task + local evaluation of base, π_ref and PivotRL; report."""
    out, computed = run_stage_task("evaluate", config, inputs)
    res, store = EvalResult.of(out), store_of(config)
    from pivotrl.evaluation.report import published_markdown  # matplotlib: only when a report is published

    publish.evaluate(out, published_markdown(store, res.eval_key))
    if computed:
        publish.emit_assets(store, [res.report_json])
    return out


__all__ = [
    "demonstrations", "reference", "probe", "train", "evaluate", "lease_key", "pipeline_tasks", "PipelineTasks",
    "retry_crashes", "run_once",
]
