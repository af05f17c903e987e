"""Prefect tasks of ``pivotrl compare``: the SFT and end-to-end RL baselines and the comparison.

Thin wrappers like the nightly tasks (``pivotrl.tasks.stages``): each stage reused from the store
under its own content key (:func:`pivotrl.pipeline.keys.stage_key`) or computed under the lease on
it, the same retry rule, each stage in its own process. The shared stages (demonstrations, warm start, probing, PivotRL
training) are the nightly tasks themselves, so a run root that ``pivotrl run`` filled is reused.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Mapping

from prefect import Task
from prefect.artifacts import create_markdown_artifact

from pivotrl.tasks import publish
from pivotrl.tasks.stages import config_of, run_stage_task, store_of, stage_task


def _summary_md(title: str, out: Mapping[str, Any]) -> str:
    led = out["ledger"]
    rows = "\n".join(f"- {k}: {v}" for k, v in out["summary"].items() if not isinstance(v, list))
    cost = ", ".join(f"{k} {led[k]}" for k in ("model_calls", "generated_tokens", "optimizer_steps", "trainer_tokens"))
    return f"## {title}\n\n{rows}\n\nledger: {cost}, wall {led['total_wall_s']:.1f} s\n"


@stage_task("sft_baseline", retries=1)
def sft_baseline(config: dict[str, Any], inputs: dict[str, Any]) -> dict[str, Any]:
    """SFT of π_ref on the pivot split's demonstrations, PivotRL's optimiser steps (and wall time)."""
    out, computed = run_stage_task("sft_baseline", config, inputs)
    create_markdown_artifact(key="sft-baseline", markdown=_summary_md("SFT baseline", out), description="SFT baseline")
    if computed:
        store = store_of(config)
        publish.emit_assets(store, [store.url(f"{out['key']}/summary.json"), store.url(f"{out['key']}/ledger.json")])
    return out


@stage_task("e2e_baseline", retries=1)
def e2e_baseline(config: dict[str, Any], inputs: dict[str, Any]) -> dict[str, Any]:
    """End-to-end GRPO on whole pivot-split tasks at PivotRL's budget (``compare.e2e_budget``)."""
    out, computed = run_stage_task("e2e_baseline", config, inputs)
    create_markdown_artifact(key="e2e-baseline", markdown=_summary_md("End-to-end RL baseline", out),
                             description="End-to-end RL baseline")
    if computed:
        store = store_of(config)
        publish.emit_assets(store, [store.url(f"{out['key']}/summary.json"), store.url(f"{out['key']}/ledger.json")])
    return out


@stage_task("compare_evaluate", retries=1)
def compare_evaluate(config: dict[str, Any], inputs: dict[str, Any]) -> dict[str, Any]:
    """Evaluate π_ref, PivotRL, SFT and E2E RL on the same items; the comparison report."""
    from pivotrl.evaluation.report import published_markdown  # matplotlib: only when a report is published

    out, computed = run_stage_task("compare_evaluate", config, inputs)
    store = store_of(config)
    # the plots beside report.md embedded (the UI cannot resolve a path relative to the report)
    create_markdown_artifact(key="comparison-report", markdown=published_markdown(store, out["key"]),
                             description="PivotRL vs SFT vs E2E RL")
    if computed:
        publish.emit_assets(store, [out["report_json"]])
    return out


@dataclass(frozen=True)
class CompareTasks:
    """The comparison's tasks (see :func:`compare_tasks`)."""

    sft_baseline: Task
    e2e_baseline: Task
    compare_evaluate: Task


def compare_tasks(config: Mapping[str, Any]) -> CompareTasks:
    """The three comparison tasks of the run of ``config``."""
    config_of(config)  # a bad config fails here, before any task runs
    return CompareTasks(**{name: globals()[name] for name in ("sft_baseline", "e2e_baseline", "compare_evaluate")})


__all__ = ["CompareTasks", "compare_evaluate", "compare_tasks", "e2e_baseline", "sft_baseline"]
