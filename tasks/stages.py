"""Prefect tasks of the nightly pipeline: one per stage, each a thin wrapper.

Every task takes the run config (as JSON) and the small result dicts of earlier tasks (URIs,
hashes, counts — never tensors or tables), runs one ``pivotrl.pipeline`` stage, publishes a
Prefect artifact and registers the artifacts it wrote as Prefect assets. Cache keys are content
hashes of the config and the inputs (not the default policy, which includes the run id and never
hits across runs); stages are also idempotent on their own content-addressed artifact keys, so a
cache miss on unchanged inputs costs a lookup. Heavy stages run in a child process (engine and
trainer memory live and die with the stage).

Task results (small JSON) are stored under ``<run.storage_root>/.prefect-results``
(:func:`result_storage`), beside the artifacts they point to: deleting a run root deletes its task
cache too, so a cache hit never points at deleted artifacts. :func:`pipeline_tasks` returns the
tasks bound to a config's result storage; flows call those.

Assets: each artifact is an asset keyed by its URI (content-addressed, so an artifact reused on a
later night is the same asset), with its manifest's inputs as upstream assets, so the Prefect UI
draws sources → trajectories → candidates → probes → pivots → policy → report (with π_ref feeding
probes and training). A cached task run emits no asset events (Prefect skips them on cache hits).
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import timedelta
from typing import Any, Mapping

from prefect import Task, task
from prefect.artifacts import create_link_artifact, create_markdown_artifact, create_table_artifact
from prefect.assets import Asset, AssetProperties, add_asset_metadata, materialize
from prefect.cache_policies import NO_CACHE

from pivotrl.data.schema import content_hash

#: Folder under the run root that holds Prefect's task results (the task cache).
RESULTS_DIR = ".prefect-results"


def _base_key(stage: str, config: Mapping[str, Any], inputs: Any) -> str:
    """Content hash of what a stage depends on: the config, the earlier stages' results, the
    identity of the files the config points at (model weights, demonstration files: size, mtime,
    ETag) and the code version — so new weights, new data or new code are never a cache hit."""
    from pivotrl.pipeline.common import inputs_fingerprint
    from pivotrl.storage import code_version

    cfg = _config_obj(config)
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


def _record_outputs(stage: str, config: Mapping[str, Any], inputs: Any, out: Mapping[str, Any]) -> None:
    """Write the list of artifacts a task run produced, checked before its cache is trusted."""
    store = _store(config)
    uris = sorted(set(_artifact_uris(out, store.root_url)))
    store.write_json(_index_key(_base_key(stage, config, inputs)), {"artifacts": uris})


def _cache_key(stage: str):
    def key(_ctx: Any, params: dict[str, Any]) -> str:
        config, inputs = params["config"], params.get("inputs")
        base = _base_key(stage, config, inputs)
        # A cached result is only trusted while every artifact it points at still exists (a
        # lifecycle rule or a manual clean-up may delete some); otherwise the key misses.
        try:
            store = _store(config)
            listed = store.read_json(_index_key(base))["artifacts"] if store.exists(_index_key(base)) else []
            root = store.root_url + "/"
            if any(not store.exists(u[len(root):]) for u in listed):
                import uuid

                return f"{base}-rerun-{uuid.uuid4().hex}"
        except Exception:  # the check is an optimisation; the stage itself is idempotent
            pass
        return base
    return key


def _retry_unless_permanent(_task: Any, _task_run: Any, state: Any) -> bool:
    """Retry transient failures (storage, sandbox, crashes); never config/data/model errors or a
    broken training invariant, which would fail the same way again."""
    from pivotrl.pipeline.entry import is_permanent

    try:
        exc = state.result(raise_on_failure=False)
    except Exception as e:  # the result itself could not be read
        exc = e
    return not (isinstance(exc, BaseException) and is_permanent(exc))


def _task(stage: str, retries: int):
    return task(
        name=stage, retries=retries, retry_delay_seconds=[5, 30, 120][:retries] or 0,
        retry_condition_fn=_retry_unless_permanent,
        cache_key_fn=_cache_key(stage), cache_expiration=timedelta(days=30), persist_result=True,
        result_serializer="json",
    )


def _config_obj(config: Mapping[str, Any]):
    from pivotrl.config import RunConfig

    return RunConfig.model_validate(dict(config))


def _store(config: Mapping[str, Any]):
    from pivotrl.pipeline.common import make_store

    return make_store(_config_obj(config))


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

    cfg = _config_obj(config)
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
        for name in ("demonstrations", "reference", "probe", "train", "evaluate")
    })


# ------------------------------------------------------------------------------------- assets
@materialize("pivotrl://artifact", name="register-asset", cache_policy=NO_CACHE, persist_result=False)
def _register(key: str, metadata: dict[str, Any]) -> str:
    """Record one artifact's materialisation (the asset itself is set per call with_options)."""
    add_asset_metadata(key, metadata)
    return key


def register_assets(config: Mapping[str, Any], uris: list[str | None]) -> list[str]:
    """Register the artifacts at ``uris`` (each with a manifest) as Prefect assets, in order.

    The asset key is the artifact's URI — for a checkpoint summary, the checkpoint directory named
    in its manifest's ``extra.checkpoint`` — and the upstream assets are the manifest's inputs
    (sources such as ``pypi:…`` or a local model path become ``pypi://…`` / ``file://…``).
    Metadata: kind, sha256, size, config hash, code version and the manifest's ``extra``.
    Returns the asset keys registered; URIs without a manifest are skipped.
    """
    from pivotrl.lineage import asset_key

    store = _store(config)
    keys: list[str] = []
    for uri in uris:
        m = store.read_manifest_url(uri) if uri else None
        if m is None:
            continue
        key = asset_key(str(m.extra.get("checkpoint") or m.uri))
        if key is None:
            continue
        deps = [d for d in (asset_key(str(r.get("uri", ""))) for r in m.inputs.values()) if d and d != key]
        asset = Asset(key=key, properties=AssetProperties(name=f"{m.kind}: {key.rsplit('/', 2)[-2]}",
                                                          description=f"pivotrl {m.kind} artifact"))
        meta = {"kind": m.kind, "sha256": m.sha256, "size": m.size, "config_hash": m.config_hash,
                "code_version": m.code_version, "manifest": m.uri + ".manifest.json", **m.extra}
        _register.with_options(assets=[asset], asset_deps=sorted(set(deps)),
                               task_run_name=f"asset-{m.kind}")(key, meta)
        keys.append(key)
    return keys


# -------------------------------------------------------------------------------------- tasks
@_task("demonstrations", retries=2)
def demonstrations(config: dict[str, Any], inputs: dict[str, Any] | None = None) -> dict[str, Any]:
    """Load + validate demonstrations, split by trajectory, extract turn-state candidates."""
    from pivotrl.pipeline.demos import build_demonstrations
    from pivotrl.pipeline.entry import announce

    with announce("demonstrations"):
        out = build_demonstrations(_config_obj(config), _store(config))
    create_table_artifact(
        key="demonstrations", description="Demonstrations and turn-state candidates",
        table=[{"item": k, "value": str(v)} for k, v in out["counts"].items()],
    )
    register_assets(config, [out["trajectories"], out["candidates"]])
    _record_outputs("demonstrations", config, inputs, out)
    return out


def _stage_process(stage: str, config: dict[str, Any], inputs: dict[str, Any]) -> dict[str, Any]:
    from pivotrl.pipeline.entry import run_stage_process

    from prefect.runtime import task_run

    # A retried stage gets a fresh fault-injection stream (drills), else it would replay its failure.
    attempt = max(0, int(task_run.run_count or 1) - 1)
    return run_stage_process(stage, config, inputs, threads=_config_obj(config).rollout.num_threads, attempt=attempt)


@_task("reference", retries=1)
def reference(config: dict[str, Any], inputs: dict[str, Any]) -> dict[str, Any]:
    """Resolve the base model; supervised warm start on the warm-start split → π_ref."""
    out = _stage_process("reference", config, inputs)
    if out.get("ref_key"):
        register_assets(config, [_store(config).url(f"{out['ref_key']}.sft.json")])
    _record_outputs("reference", config, inputs, out)
    return out


@_task("probe", retries=2)
def probe(config: dict[str, Any], inputs: dict[str, Any]) -> dict[str, Any]:
    """Probe π_ref (m samples per candidate, verifier-scored) and select the pivot set."""
    out = _stage_process("probe", config, inputs)
    create_markdown_artifact(key="pivot-set", markdown=out["summary_md"], description="Pivot filter statistics")
    t = out["stats"]["total"]
    create_table_artifact(key="pivot-counts", table=[{"count": k, "value": v} for k, v in t.items()],
                          description="Pivot filter counts")
    register_assets(config, [out["probes"], out["pivots"]])
    _record_outputs("probe", config, inputs, out)
    return out


@_task("train", retries=2)
def train(config: dict[str, Any], inputs: dict[str, Any]) -> dict[str, Any]:
    """PivotRL epochs on the pivot set; resumes from the latest checkpoint on retry."""
    out = _stage_process("train", config, inputs)
    create_markdown_artifact(key="training", markdown="## PivotRL training\n\n" + "\n".join(
        f"- {k}: {v}" for k, v in out["summary"].items()), description="Training summary")
    register_assets(config, [out["metrics"], _store(config).url(f"{out['train_key']}/summary.json")])
    _record_outputs("train", config, inputs, out)
    return out


@_task("evaluate", retries=1)
def evaluate(config: dict[str, Any], inputs: dict[str, Any]) -> dict[str, Any]:
    """Full multi-turn task + local evaluation of base, π_ref and PivotRL; report."""
    out = _stage_process("evaluate", config, inputs)
    create_link_artifact(key="report", link=out["report_md"], link_text="PivotRL report (markdown)")
    register_assets(config, [out["report_json"]])
    _record_outputs("evaluate", config, inputs, out)
    return out


__all__ = [
    "demonstrations", "reference", "probe", "train", "evaluate", "pipeline_tasks", "PipelineTasks",
    "result_storage", "register_assets", "RESULTS_DIR", "NO_CACHE",
]
