"""The nightly PivotRL flow: load → split → candidates → warm start → probe → filter → train →
evaluate → report. The flow only orders tasks; every step lives in ``pivotrl.tasks``.

Deployment entry point: ``flows/nightly.py:nightly`` (see ``infra/prefect.yaml``).
"""

from __future__ import annotations

from typing import Any

from prefect import flow, get_run_logger


@flow(name="pivotrl-nightly", log_prints=True)
def nightly(config_path: str = "configs/default.yaml", overrides: list[str] | None = None) -> dict[str, Any]:
    """Run the whole pipeline for the config at ``config_path`` (with ``--set``-style overrides).

    Returns the evaluation result: ``report_md``/``report_json`` URIs and the report dict.
    """
    from pivotrl.config import load_config
    from pivotrl.flows.shards import probe_stage
    from pivotrl.tasks.stages import pipeline_tasks

    config = load_config(config_path, overrides or []).model_dump(mode="json")
    t = pipeline_tasks(config)
    demos = t.demonstrations(config)
    ref = t.reference(config, {"demos": demos})
    probe = probe_stage(t, config, {"demos": demos, "reference": ref})
    train = t.train(config, {"probe": probe, "reference": ref})
    result = t.evaluate(config, {"demos": demos, "reference": ref, "probe": probe, "train": train})
    get_run_logger().info("report: %s", result["report_md"])
    return result


@flow(name="pivotrl-probe", log_prints=True)
def probe_only(config_path: str = "configs/default.yaml", overrides: list[str] | None = None) -> dict[str, Any]:
    """Demonstrations → warm start → probing → pivot set, without training (for inspecting pivots)."""
    from pivotrl.config import load_config
    from pivotrl.flows.shards import probe_stage
    from pivotrl.tasks.stages import pipeline_tasks

    config = load_config(config_path, overrides or []).model_dump(mode="json")
    t = pipeline_tasks(config)
    demos = t.demonstrations(config)
    ref = t.reference(config, {"demos": demos})
    return probe_stage(t, config, {"demos": demos, "reference": ref})


if __name__ == "__main__":
    nightly()
