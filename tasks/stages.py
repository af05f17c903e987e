"""Prefect tasks of the nightly pipeline: one per stage, each a thin wrapper.

Every task takes the run config (as JSON) and the small results of earlier tasks (URIs, hashes,
counts — never tensors or tables; typed in ``pivotrl.pipeline.results``, passed between tasks and
cached as their JSON dicts: ``to_dict`` / ``of``), runs one ``pivotrl.pipeline`` stage under a lease on
its key (:func:`run_once`: a concurrent run on the same root waits and reuses it), and publishes its
facts, Prefect artifacts and asset events (:mod:`pivotrl.tasks.publish`). A task's cache key is
its stage's own content key (:func:`_base_key`, :mod:`pivotrl.pipeline.keys`; not Prefect's
default policy, which includes the run id and never hits across runs), so a change to one stage's
settings re-runs that stage and the ones after it only. Stages are also idempotent on those
content-addressed artifact keys, so a cache miss on unchanged inputs costs a lookup. Heavy stages
run in a child process (engine and trainer memory live and die with the stage).

Task results (small JSON) are stored under ``<run.storage_root>/.prefect-results``
(:func:`result_storage`), beside the artifacts they point to: deleting a run root deletes its task
cache too, so a cache hit never points at deleted artifacts. :func:`pipeline_tasks` returns the
tasks bound to a config's result storage; flows call those.

Assets: each artifact is an asset keyed by its URI (content-addressed, so an artifact reused on a
later night is the same asset), with its manifest's inputs as upstream assets: sources →
trajectories → candidates → probes → pivots → policy → report (with π_ref feeding probes and
training). The events come from the stage task itself; a cached or reused stage emits none.
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import timedelta
from typing import Any, Mapping

from prefect import Task, get_run_logger, task
from prefect.cache_policies import NO_CACHE

from pivotrl.pipeline.registry import NIGHTLY_STAGES
from pivotrl.pipeline.results import EvalResult, ProbeResult, ReferenceResult, TrainResult
from pivotrl.tasks import publish

#: Folder under the run root that holds Prefect's task results (the task cache).
RESULTS_DIR = ".prefect-results"


#: The pipeline stage whose key a task uses (a sharded stage's merge is that stage).
_KEYED_AS = {"probe-merge": "probe", "eval-merge": "evaluate"}


def _base_key(stage: str, config: Mapping[str, Any], inputs: Any) -> str:
    """The task's cache key: ``pivotrl-<task>-`` + the stage's own content key
    (:func:`pivotrl.pipeline.keys.stage_key`, with ``/`` and ``-`` as ``.``), e.g.
    ``pivotrl-train-train.3f2a…`` for the artifacts under ``train/3f2a…``. It covers what the
    stage's artifact depends on and nothing else — its config sections, the earlier stages' keys,
    the files it reads, its code — so a change to ``training`` alone is a cache hit for the
    demonstrations, reference and probe tasks. Computed in the flow process without loading a
    model (at most a manifest is read).

    The comparison's stages (``pivotrl.tasks.compare``) are keyed the same way (their keys read
    nothing). A task of no stage keeps a key of the whole config (without ``tracking``), its
    inputs, the files the config points at and the package's code version."""
    from pivotrl.pipeline.keys import STAGE_INPUTS, stage_key

    cfg = config_of(config)
    if _KEYED_AS.get(stage, stage) in STAGE_INPUTS:
        key = stage_key(_KEYED_AS.get(stage, stage), cfg, store_of(config), inputs)
        return f"pivotrl-{stage}-" + key.replace("/", ".").replace("-", ".")
    from pivotrl.core.hashing import content_hash
    from pivotrl.provenance.fingerprints import inputs_fingerprint
    from pivotrl.storage import code_version

    config = {k: v for k, v in config.items() if k != "tracking"}  # where a run is recorded changes no result
    return f"pivotrl-{stage}-" + content_hash({"config": dict(config), "inputs": inputs,
                                              "files": inputs_fingerprint(cfg), "code": code_version()})


def _index_key(key: str) -> str:
    return f"{RESULTS_DIR}/outputs/{key}.json"


def _artifact_uris(obj: Any, root: str) -> list[str]:
    """Every string in a stage result that is an artifact URI under the run root."""
    if isinstance(obj, str):
        return [obj] if obj.startswith(root + "/") else []
    if isinstance(obj, Mapping):
        return [u for v in obj.values() for u in _artifact_uris(v, root)]
    if isinstance(obj, (list, tuple)):
        return [u for v in obj for u in _artifact_uris(v, root)]
    return []


def _cache_key(stage: str):
    def key(_ctx: Any, params: dict[str, Any]) -> str:
        config, inputs = params["config"], params.get("inputs")
        base = _base_key(stage, config, inputs)
        # A cached result is only trusted while every artifact it points at still exists (a
        # lifecycle rule or a manual clean-up may delete some); otherwise the key misses.
        try:
            store = store_of(config)
            listed = store.read_json(_index_key(base))["artifacts"] if store.exists(_index_key(base)) else []
            root = store.root_url + "/"
            if any(not store.exists(u[len(root):]) for u in listed):
                import uuid

                return f"{base}-rerun-{uuid.uuid4().hex}"
        except Exception:  # the check is an optimisation; the stage itself is idempotent
            pass
        return base
    return key


def retry_unless_permanent(_task: Any, _task_run: Any, state: Any) -> bool:
    """Retry transient failures (storage, sandbox, crashes); never config/data/model errors or a
    broken training invariant, which would fail the same way again."""
    from pivotrl.pipeline.entry import is_permanent

    try:
        exc = state.result(raise_on_failure=False)
    except Exception as e:  # the result itself could not be read
        exc = e
    return not (isinstance(exc, BaseException) and is_permanent(exc))


def stage_task(stage: str, retries: int):
    return task(
        name=stage, retries=retries, retry_delay_seconds=[5, 30, 120][:retries] or 0,
        retry_condition_fn=retry_unless_permanent,
        cache_key_fn=_cache_key(stage), cache_expiration=timedelta(days=30), persist_result=True,
        result_serializer="json",
    )


def config_of(config: Mapping[str, Any]):
    from pivotrl.config import parse_config

    return parse_config(config, source="the flow's config")  # validated once per process


def store_of(config: Mapping[str, Any]):
    from pivotrl.pipeline.common import make_store

    return make_store(config_of(config))


# ------------------------------------------------------------------------------ result storage
def result_storage(config: Mapping[str, Any]):
    """The Prefect result storage of a run: ``<run.storage_root>/.prefect-results``.

    A local root gives its absolute path (a ``Path``, which Prefect turns into a local file system
    block; resolved against the working directory). Any other fsspec URL (``s3://bucket/prefix``)
    gives a ``RemoteFileSystem`` block with ``run.storage_options`` as its settings, saved on the
    Prefect server as ``remote-file-system/pivotrl-results-<12 hex of its path>`` (Prefect only takes
    saved blocks); credentials are never in it — they stay in the environment of whoever runs the
    flow. Must be called where the Prefect API is reachable (inside a flow) for remote roots.
    Raises ConfigError for an invalid config.
    """
    import hashlib
    import os
    from pathlib import Path

    import fsspec

    cfg = config_of(config)
    root = os.path.expanduser(cfg.run.storage_root)
    fs, path = fsspec.core.url_to_fs(root, **(cfg.run.storage_options or {}))
    protocols = fs.protocol if isinstance(fs.protocol, (tuple, list)) else (fs.protocol,)
    if "file" in protocols or "local" in protocols:
        return Path(os.path.abspath(path)) / RESULTS_DIR
    from prefect.filesystems import RemoteFileSystem

    basepath = f"{root.rstrip('/')}/{RESULTS_DIR}"
    block = RemoteFileSystem(basepath=basepath, settings=dict(cfg.run.storage_options or {}))
    block.save(f"pivotrl-results-{hashlib.sha256(basepath.encode()).hexdigest()[:12]}", overwrite=True)
    return block


@dataclass(frozen=True)
class PipelineTasks:
    """The stage tasks of one run, bound to its result storage (see :func:`pipeline_tasks`)."""

    demonstrations: Task
    reference: Task
    probe: Task
    train: Task
    evaluate: Task


def pipeline_tasks(config: Mapping[str, Any]) -> PipelineTasks:
    """The five stage tasks with their results persisted under the run root of ``config``."""
    storage = result_storage(config)
    return PipelineTasks(**{
        name: globals()[name].with_options(result_storage=storage)
        for name in NIGHTLY_STAGES
    })


# ------------------------------------------------------------------------------------- lease
def run_once(stage: str, config: Mapping[str, Any], inputs: Any, compute: Any) -> tuple[dict[str, Any], bool]:
    """``(result, computed)``: run ``compute()`` under the lease on the stage's key, or reuse the
    result another run computed meanwhile (two runs on one storage root never compute, or write,
    the same stage at once; see :mod:`pivotrl.storage.lease`). The result and the artifacts it points at
    are recorded under ``.prefect-results/outputs`` while the lease is held."""
    from prefect.runtime import flow_run

    from pivotrl.storage.lease import stage_lease

    store, base = store_of(config), _base_key(stage, config, inputs)
    logger = get_run_logger()

    def waiting(holder: dict[str, Any]) -> None:
        logger.info("stage %s is being computed by another run (flow run %s, pid %s on %s): waiting for it",
                    stage, holder.get("flow_run_id"), holder.get("pid"), holder.get("host"))

    with stage_lease(store, base, describe={"stage": stage, "flow_run_id": str(flow_run.id)}, on_wait=waiting):
        index = _index_key(base)
        record = store.read_json(index) if store.exists(index) else {}
        root = store.root_url + "/"
        if "result" in record and all(store.exists(u[len(root):]) for u in record.get("artifacts", [])):
            logger.info("stage %s: reused the result computed by flow run %s", stage, record.get("flow_run_id"))
            return record["result"], False
        logger.info("stage %s: computing", stage)
        out = compute()
        uris = sorted(set(_artifact_uris(out, store.root_url)))
        store.write_json(index, {"artifacts": uris, "result": out, "flow_run_id": str(flow_run.id)})
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
    "demonstrations", "reference", "probe", "train", "evaluate", "pipeline_tasks", "PipelineTasks",
    "result_storage", "RESULTS_DIR", "NO_CACHE",
]
