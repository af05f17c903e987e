"""The comparison flow: the nightly stages up to PivotRL training (cached), then the SFT and
end-to-end RL baselines from the same π_ref and one evaluation of all of them.

Deployment entry point: ``flows/compare.py:compare``.
"""

from __future__ import annotations

from typing import Any

from prefect import flow, get_run_logger


@flow(name="pivotrl-compare", log_prints=True)
def compare(config_path: str = "configs/default.yaml", overrides: list[str] | None = None,
            config: dict[str, Any] | None = None) -> dict[str, Any]:
    """PivotRL vs SFT vs end-to-end RL for the config at ``config_path`` (``--set`` overrides), or for
    ``config``, that config already prepared (as in ``flows/nightly.py``).

    Returns the comparison result: ``report_md``/``report_json`` URIs and the report dict.
    """
    from pivotrl.flows.nightly import _checked_config
    from pivotrl.tasks.compare import compare_tasks
    from pivotrl.tasks.stages import pipeline_tasks

    # checked and sized like the nightly run (run.sizing), so the shared stages are the nightly run's
    config = _checked_config(config_path, overrides, config)
    t = pipeline_tasks(config)
    c = compare_tasks(config)
    demos = t.demonstrations(config)
    ref = t.reference(config, {"demos": demos})
    probe = t.probe(config, {"demos": demos, "reference": ref})
    train = t.train(config, {"probe": probe, "reference": ref})
    sft = c.sft_baseline(config, {"demos": demos, "reference": ref, "probe": probe, "train": train})
    e2e = c.e2e_baseline(config, {"demos": demos, "reference": ref, "probe": probe, "train": train})
    result = c.compare_evaluate(config, {"demos": demos, "reference": ref, "probe": probe, "train": train,
                                         "sft": sft, "e2e": e2e})
    get_run_logger().info("comparison report: %s", result["report_md"])
    return result


if __name__ == "__main__":
    compare()
