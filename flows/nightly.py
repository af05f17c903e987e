"""The nightly PivotRL flow: load → split → candidates → warm start → probe → filter → train →
evaluate → report. The flow only orders tasks; every step lives in ``pivotrl.tasks``.

Deployment entry point: ``flows/nightly.py:nightly`` (see ``infra/prefect.yaml``).
"""

from __future__ import annotations

from typing import Any

from prefect import flow, get_run_logger


def _checked_config(config_path: str, overrides: list[str] | None) -> dict[str, Any]:
    """The validated config as JSON, sized to this machine (``run.sizing``, pivotrl.sizing), after
    checking its storage root (credentials, endpoint, bucket) so that a root that cannot work fails
    before any stage runs (StorageAccessError, not retried)."""
    from pivotrl.config import load_config
    from pivotrl.storage_check import check_sources, check_storage

    from pivotrl.sizing import sized_config

    cfg = load_config(config_path, overrides or [])
    check_storage(cfg.run.storage_root, cfg.run.storage_options)
    check_sources(cfg.data.sources)  # remote chat sources: credentials, endpoint, read access
    return sized_config(cfg, overrides or [], echo=print).model_dump(mode="json")  # run.sizing


@flow(name="pivotrl-nightly", log_prints=True)
def nightly(config_path: str = "configs/default.yaml", overrides: list[str] | None = None) -> dict[str, Any]:
    """Run the whole pipeline for the config at ``config_path`` (with ``--set``-style overrides).

    Returns the evaluation result: ``report_md``/``report_json`` URIs and the report dict.
    """
    from pivotrl.flows.shards import evaluate_stage, probe_stage
    from pivotrl.tasks.stages import pipeline_tasks

    from pivotrl.tasks.tracking import tracking_hooks

    config = _checked_config(config_path, overrides)
    t = pipeline_tasks(config)
    track = tracking_hooks(config)  # no-ops unless tracking.backend is set
    track.start()
    try:
        demos = t.demonstrations(config)
        track.stage("demonstrations", demos)
        ref = t.reference(config, {"demos": demos})
        track.stage("reference", ref)
        probe = probe_stage(t, config, {"demos": demos, "reference": ref})
        track.stage("probe", probe)
        train = t.train(config, {"probe": probe, "reference": ref})
        track.stage("train", train)
        result = evaluate_stage(t, config, {"demos": demos, "reference": ref, "probe": probe, "train": train})
        track.stage("evaluate", result)
    except BaseException:
        track.end("FAILED")
        raise
    track.end("FINISHED")
    from pivotrl.pipeline.results import EvalResult

    get_run_logger().info("report: %s", EvalResult.of(result).report_md)
    return result


@flow(name="pivotrl-probe", log_prints=True)
def probe_only(config_path: str = "configs/default.yaml", overrides: list[str] | None = None) -> dict[str, Any]:
    """Demonstrations → warm start → probing → pivot set, without training (for inspecting pivots)."""
    from pivotrl.flows.shards import probe_stage
    from pivotrl.tasks.stages import pipeline_tasks

    config = _checked_config(config_path, overrides)
    t = pipeline_tasks(config)
    demos = t.demonstrations(config)
    ref = t.reference(config, {"demos": demos})
    return probe_stage(t, config, {"demos": demos, "reference": ref})


if __name__ == "__main__":
    nightly()
