"""What each stage task shows in the Prefect UI: its key facts as INFO logs of the run logger,
Prefect artifacts (markdown and tables), and lineage as asset-materialisation events.

Lineage is emitted as ``prefect.asset.materialization.succeeded`` events from within the stage's
own task run (the event Prefect's ``@materialize`` sends), so the task graph holds only the five
stage tasks: no bookkeeping task runs. The record of lineage stays the manifest beside each
artifact (``pivotrl lineage``); the events are the server's index of it (Events page, and the
Assets view on servers that have one).
"""

from __future__ import annotations

import math
from typing import Any, Mapping

from prefect import get_run_logger
from prefect.artifacts import create_markdown_artifact, create_table_artifact

#: Columns of the per-step training table (those present in metrics.parquet, in this order).
STEP_COLUMNS = ("step", "pivots", "groups", "dropped_groups", "reward_mean", "reward_std", "zero_variance_frac",
                "loss", "kl", "clip_frac", "ratio_mean", "grad_norm", "refresh_max_abs_delta", "rollout_s",
                "step_time_s", "trainer_s", "policy_tokens_per_s", "ref_tokens_per_s", "mfu")


def _fmt(v: Any) -> str:
    if isinstance(v, float) and v.is_integer() and abs(v) < 1e15:
        return str(int(v))
    if isinstance(v, float):
        return "nan" if math.isnan(v) else f"{v:.4g}"
    return str(v)


# ------------------------------------------------------------------------------------ stages
def shard(stage: str, index: int, out: Mapping[str, Any], *, reused: bool) -> dict[str, Any]:
    """One shard task run's outcome as a one-row table artifact ``<stage>-shard-<index>`` (one
    version per run): its key, whether it was reused from the store (no process, no engine) and
    the shard's own counts and worker. Returns the row."""
    row = {k: v for k, v in out.items() if isinstance(v, (str, int, float, bool)) or v is None}
    row.update({"index": index, "reused": reused, **{f"worker_{k}": v for k, v in (out.get("worker") or {}).items()}})
    create_table_artifact(key=f"{stage}-shard-{index}", table=[row],
                          description=f"{stage} shard {index}: " + ("reused from the store" if reused else "computed"))
    return row


def result_artifact(stage: str, result: Any) -> None:
    """The stage's typed result (``pivotrl.pipeline.results``) as a Markdown artifact
    ``<stage>-result``: every field with its value and its documented meaning."""
    create_markdown_artifact(key=f"{stage}-result", markdown=result.markdown(),
                             description=f"{type(result).__name__}: the {stage} stage's result, field by field")


def demonstrations(out: Mapping[str, Any]) -> None:
    c = out["counts"]
    get_run_logger().info("demonstrations: %s", ", ".join(f"{k}={_fmt(v)}" for k, v in c.items()))
    create_table_artifact(key="demonstrations", description="Demonstrations and turn-state candidates",
                          table=[{"item": k, "value": str(v)} for k, v in c.items()])


def reference(out: Mapping[str, Any]) -> None:
    from pivotrl.pipeline.results import ReferenceResult

    result_artifact("reference", ReferenceResult.of(out))
    sft = out.get("sft") or {}
    if not sft:
        get_run_logger().info("reference: base model %s (no warm start), hash %s", out["base_dir"], out["ref_hash"][:12])
        return
    m = sft.get("metrics") or {}
    get_run_logger().info("reference: warm start on %s examples (%s too long), checkpoint %s; %s",
                          sft.get("examples"), sft.get("skipped_too_long"), str(out["ref_hash"])[:12],
                          ", ".join(f"{k}={_fmt(v)}" for k, v in m.items() if isinstance(v, (int, float))))


def probe(out: Mapping[str, Any]) -> None:
    from pivotrl.pipeline.results import ProbeResult

    result_artifact("probe", ProbeResult.of(out))
    t = out["stats"]["total"]
    reasons = ("all_fail", "all_pass", "above_threshold", "skipped_too_long", "skipped_verifier_error")
    get_run_logger().info(
        "probe: %d states probed, %d pivots kept (λ_diff=%s, mean μ̂=%s); dropped by reason: %s",
        t["candidates"], t["kept"], out["stats"]["lambda_diff"], _fmt(out["stats"].get("mu_mean")),
        ", ".join(f"{r}={t.get(r, 0)}" for r in reasons))
    create_markdown_artifact(key="pivot-set", markdown=out["summary_md"], description="Pivot filter statistics")
    create_table_artifact(key="pivot-counts", table=[{"count": k, "value": v} for k, v in t.items()],
                          description="Pivot filter counts")


def _engines_note(row: Mapping[str, Any]) -> str:
    """``, engines verified 2/2 (states per engine 1/1)`` for a step with several rollout engines."""
    n = row.get("engines")
    if not isinstance(n, (int, float)) or n != n or n < 2:  # one engine (or NaN: a row without the column)
        return ""
    per = "/".join(str(int(row[f"rollout_states_e{j}"])) for j in range(int(n)) if f"rollout_states_e{j}" in row)
    return f", engines verified {int(row.get('refresh_verified_engines', 0))}/{int(n)} (states per engine {per})"


def train(out: Mapping[str, Any], metrics: "Any") -> None:
    """``metrics``: the training metrics DataFrame (one row per step)."""
    from pivotrl.pipeline.results import TrainResult

    result_artifact("train", TrainResult.of(out))
    logger = get_run_logger()
    rows = metrics.to_dict("records") if metrics is not None else []
    cols = [c for c in STEP_COLUMNS if rows and c in rows[0]]
    for r in rows:
        logger.info("train step %d: %s%s", int(r["step"]), ", ".join(f"{c}={_fmt(r[c])}" for c in cols if c != "step"),
                    _engines_note(r))
    s = out["summary"] or {}
    logger.info("train: %s steps on %s pivots, final reward %s, policy %s", s.get("steps"), s.get("pivots"),
                _fmt(s.get("final_reward_mean")), s.get("policy"))
    for warning in s.get("warnings") or []:
        logger.warning("train: %s", warning)
    lines = ["## PivotRL training", "", "| item | value |", "|---|---|"]
    lines += [f"| {k} | {_fmt(v)} |" for k, v in s.items()]
    if rows:
        lines += ["", "### Per step", "", "| " + " | ".join(cols) + " |", "|---" * len(cols) + "|"]
        lines += ["| " + " | ".join(_fmt(r[c]) for c in cols) + " |" for r in rows]
    create_markdown_artifact(key="training", markdown="\n".join(lines), description="Training summary and per-step numbers")
    if rows:
        create_table_artifact(key="training-steps", table=[{c: r[c] for c in cols} for r in rows],
                              description="PivotRL training, one row per step")


def evaluate(out: Mapping[str, Any], report_md: str) -> None:
    """``report_md``: the text of report.md with its plots embedded as data URIs
    (:func:`pivotrl.evaluation.report.published_markdown`), published as is (its tables render in the UI)."""
    from pivotrl.pipeline.results import EvalResult

    result_artifact("evaluate", EvalResult.of(out))
    logger = get_run_logger()
    for row in (out.get("report") or {}).get("policies", []):
        if row.get("evaluated"):
            logger.info("evaluate %s: full-task success %s (%s/%s tasks), turn pass rate %s, local accuracy %s "
                        "(%s/%s samples)", row["policy"], _fmt(row.get("full_task_success")), row.get("tasks_succeeded"),
                        row.get("tasks"), _fmt(row.get("turn_pass_rate")), _fmt(row.get("local_pivot_accuracy")),
                        row.get("local_accepted"), row.get("local_samples"))
    logger.info("report: %s", out["report_md"])
    create_markdown_artifact(key="report", markdown=report_md,
                             description=f"PivotRL report (same text as {out['report_md']})")


# ------------------------------------------------------------------------------------ assets
def emit_assets(store: Any, uris: list[str | None]) -> list[str]:
    """Emit one asset-materialisation event per artifact at ``uris`` (each with a manifest), from
    the current task run. The asset key is the artifact's URI — for a checkpoint summary the
    checkpoint directory named in ``extra.checkpoint`` — related to its upstream assets (the
    manifest's inputs, role ``asset``) and to the flow and task run. Payload: kind, sha256, size,
    config hash, code version, manifest URI and the manifest's ``extra``. Returns the keys emitted."""
    from prefect.events import emit_event
    from prefect.runtime import flow_run, task_run

    from pivotrl.provenance.lineage import asset_key

    keys: list[str] = []
    for uri in uris:
        m = store.read_manifest_url(uri) if uri else None
        key = asset_key(str(m.extra.get("checkpoint") or m.uri)) if m is not None else None
        if key is None:
            continue
        deps = sorted({d for d in (asset_key(str(r.get("uri", ""))) for r in m.inputs.values()) if d and d != key})
        related = [{"prefect.resource.id": d, "prefect.resource.role": "asset"} for d in deps]
        related += [{"prefect.resource.id": f"prefect.flow-run.{flow_run.id}", "prefect.resource.role": "flow-run"},
                    {"prefect.resource.id": f"prefect.task-run.{task_run.id}", "prefect.resource.role": "task-run"}]
        payload = {"kind": m.kind, "sha256": m.sha256, "size": m.size, "config_hash": m.config_hash,
                   "code_version": m.code_version, "manifest": m.uri + ".manifest.json", **m.extra}
        emit_event(event="prefect.asset.materialization.succeeded",
                   resource={"prefect.resource.id": key, "prefect.resource.name": f"{m.kind}: {key.rsplit('/', 2)[-2]}"},
                   related=related, payload=payload)
        keys.append(key)
    return keys


__all__ = ["demonstrations", "reference", "probe", "train", "evaluate", "emit_assets", "result_artifact", "STEP_COLUMNS"]
