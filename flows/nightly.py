"""The nightly PivotRL flow: load → split → candidates → warm start → probe → filter → train →
evaluate → report. The flow only orders tasks; every step lives in ``pivotrl.tasks``.

Deployment entry point: ``flows/nightly.py:nightly`` (see ``infra/prefect.yaml``).
"""

from __future__ import annotations

from typing import Any

from prefect import flow, get_run_logger


def _checked_config(config_path: str, overrides: list[str] | None,
                    config: dict[str, Any] | None = None) -> dict[str, Any]:
    """The prepared config (:func:`pivotrl.pipeline.prepare.prepared_config`) as JSON, the form
    the tasks take: ``config`` when the caller prepared it already (the command line), else the
    config at ``config_path`` with ``overrides``, prepared here."""
    if config is not None:
        return config
    from pivotrl.pipeline.prepare import prepared_config

    return prepared_config(config_path, overrides).model_dump(mode="json")


@flow(name="pivotrl-nightly", log_prints=True)
def nightly(config_path: str = "configs/default.yaml", overrides: list[str] | None = None,
            config: dict[str, Any] | None = None) -> dict[str, Any]:
    """Run the whole pipeline for the config at ``config_path`` (with ``--set``-style overrides), or
    for ``config``, that config already prepared (``prepared_config(...).model_dump(mode="json")``).

    Returns the evaluation result: ``report_md``/``report_json`` URIs and the report dict.
    """
    from pivotrl.flows.shards import evaluate_stage, probe_stage
    from pivotrl.tasks.stages import pipeline_tasks

    from pivotrl.tasks.tracking import tracking_hooks

    config = _checked_config(config_path, overrides, config)
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
def probe_only(config_path: str = "configs/default.yaml", overrides: list[str] | None = None,
               config: dict[str, Any] | None = None) -> dict[str, Any]:
    """Demonstrations → warm start → probing → pivot set, without training (for inspecting pivots);
    ``config`` as in :func:`nightly`."""
    from pivotrl.flows.shards import probe_stage
    from pivotrl.tasks.stages import pipeline_tasks

    config = _checked_config(config_path, overrides, config)
    t = pipeline_tasks(config)
    demos = t.demonstrations(config)
    ref = t.reference(config, {"demos": demos})
    return probe_stage(t, config, {"demos": demos, "reference": ref})


if __name__ == "__main__":
    nightly()
