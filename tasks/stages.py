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


def _cache_key(stage: str):
    def key(_ctx: Any, params: dict[str, Any]) -> str:
        return f"pivotrl-{stage}-" + content_hash({"config": params["config"], "inputs": params.get("inputs")})
    return key


def _task(stage: str, retries: int):
    return task(
        name=stage, retries=retries, retry_delay_seconds=[5, 30, 120][:retries] or 0,
        cache_key_fn=_cache_key(stage), cache_expiration=timedelta(days=30), persist_result=True,
        result_serializer="json",
    )


def _config_obj(config: Mapping[str, Any]):
    from pivotrl.config import RunConfig

    return RunConfig.model_validate(dict(config))


def _store(config: Mapping[str, Any]):
    from pivotrl.storage import ArtifactStore

    cfg = _config_obj(config)
    return ArtifactStore(cfg.run.storage_root, cfg.run.storage_options or None)


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

    out = build_demonstrations(_config_obj(config), _store(config))
    create_table_artifact(
        key="demonstrations", description="Demonstrations and turn-state candidates",
        table=[{"item": k, "value": str(v)} for k, v in out["counts"].items()],
    )
    register_assets(config, [out["trajectories"], out["candidates"]])
    return out


def _stage_process(stage: str, config: dict[str, Any], inputs: dict[str, Any]) -> dict[str, Any]:
    from pivotrl.pipeline.entry import run_stage_process

    return run_stage_process(stage, config, inputs, threads=_config_obj(config).rollout.num_threads)


@_task("reference", retries=1)
def reference(config: dict[str, Any], inputs: dict[str, Any]) -> dict[str, Any]:
    """Resolve the base model; supervised warm start on the warm-start split → π_ref."""
    out = _stage_process("reference", config, inputs)
    if out.get("ref_key"):
        register_assets(config, [_store(config).url(f"{out['ref_key']}.sft.json")])
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
    return out


@_task("train", retries=2)
def train(config: dict[str, Any], inputs: dict[str, Any]) -> dict[str, Any]:
    """PivotRL epochs on the pivot set; resumes from the latest checkpoint on retry."""
    out = _stage_process("train", config, inputs)
    create_markdown_artifact(key="training", markdown="## PivotRL training\n\n" + "\n".join(
        f"- {k}: {v}" for k, v in out["summary"].items()), description="Training summary")
    register_assets(config, [out["metrics"], _store(config).url(f"{out['train_key']}/summary.json")])
    return out


@_task("evaluate", retries=1)
def evaluate(config: dict[str, Any], inputs: dict[str, Any]) -> dict[str, Any]:
    """Full multi-turn task + local evaluation of base, π_ref and PivotRL; report."""
    out = _stage_process("evaluate", config, inputs)
    create_link_artifact(key="report", link=out["report_md"], link_text="PivotRL report (markdown)")
    register_assets(config, [out["report_json"]])
    return out


__all__ = [
    "demonstrations", "reference", "probe", "train", "evaluate", "pipeline_tasks", "PipelineTasks",
    "result_storage", "register_assets", "RESULTS_DIR", "NO_CACHE",
]
