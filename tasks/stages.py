"""Prefect tasks of the nightly pipeline: one per stage, each a thin wrapper.

Every task takes the run config (as JSON) and the small result dicts of earlier tasks (URIs,
hashes, counts — never tensors or tables), runs one ``pivotrl.pipeline`` stage and publishes a
Prefect artifact. Cache keys are content hashes of the config and the inputs (not the default
policy, which includes the run id and never hits across runs); stages are also idempotent on
their own content-addressed artifact keys, so a cache miss on unchanged inputs costs a lookup.
Heavy stages run in a child process (engine and trainer memory live and die with the stage).
"""

from __future__ import annotations

from datetime import timedelta
from typing import Any

from prefect import task
from prefect.artifacts import create_link_artifact, create_markdown_artifact, create_table_artifact
from prefect.cache_policies import NO_CACHE

from pivotrl.data.schema import content_hash


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


def _config_obj(config: dict[str, Any]):
    from pivotrl.config import RunConfig

    return RunConfig.model_validate(config)


@_task("demonstrations", retries=2)
def demonstrations(config: dict[str, Any], inputs: dict[str, Any] | None = None) -> dict[str, Any]:
    """Load + validate demonstrations, split by trajectory, extract turn-state candidates."""
    from pivotrl.pipeline.demos import build_demonstrations
    from pivotrl.storage import ArtifactStore

    cfg = _config_obj(config)
    out = build_demonstrations(cfg, ArtifactStore(cfg.run.storage_root, cfg.run.storage_options or None))
    c = out["counts"]
    create_table_artifact(
        key="demonstrations", description="Demonstrations and turn-state candidates",
        table=[{"item": k, "value": str(v)} for k, v in c.items()],
    )
    return out


def _stage_process(stage: str, config: dict[str, Any], inputs: dict[str, Any]) -> dict[str, Any]:
    from pivotrl.pipeline.entry import run_stage_process

    cfg = _config_obj(config)
    return run_stage_process(stage, config, inputs, threads=cfg.rollout.num_threads)


@_task("reference", retries=1)
def reference(config: dict[str, Any], inputs: dict[str, Any]) -> dict[str, Any]:
    """Resolve the base model; supervised warm start on the warm-start split → π_ref."""
    return _stage_process("reference", config, inputs)


@_task("probe", retries=2)
def probe(config: dict[str, Any], inputs: dict[str, Any]) -> dict[str, Any]:
    """Probe π_ref (m samples per candidate, verifier-scored) and select the pivot set."""
    out = _stage_process("probe", config, inputs)
    create_markdown_artifact(key="pivot-set", markdown=out["summary_md"], description="Pivot filter statistics")
    t = out["stats"]["total"]
    create_table_artifact(key="pivot-counts", table=[{"count": k, "value": v} for k, v in t.items()],
                          description="Pivot filter counts")
    return out


@_task("train", retries=2)
def train(config: dict[str, Any], inputs: dict[str, Any]) -> dict[str, Any]:
    """PivotRL epochs on the pivot set; resumes from the latest checkpoint on retry."""
    out = _stage_process("train", config, inputs)
    create_markdown_artifact(key="training", markdown="## PivotRL training\n\n" + "\n".join(
        f"- {k}: {v}" for k, v in out["summary"].items()), description="Training summary")
    return out


@_task("evaluate", retries=1)
def evaluate(config: dict[str, Any], inputs: dict[str, Any]) -> dict[str, Any]:
    """Full multi-turn task + local evaluation of base, π_ref and PivotRL; report."""
    out = _stage_process("evaluate", config, inputs)
    create_link_artifact(key="report", link=out["report_md"], link_text="PivotRL report (markdown)")
    return out


__all__ = ["demonstrations", "reference", "probe", "train", "evaluate", "NO_CACHE"]
