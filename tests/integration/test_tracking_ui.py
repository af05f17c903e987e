"""The MLflow web UI a person opens (`make tracking`): the full ``mlflow`` server of its own
environment (``.venv-tracking``, from infra/constraints-tracking.txt) over the local store that the
project's ``mlflow-skinny`` client writes under a run root, opened in headless Chromium: the UI's
page lists the experiment and its run, and the run's page shows its metrics and lineage tags.

Skipped, saying so, without ``.venv-tracking`` (``make tracking`` creates it: about 5 minutes and
850 MB) or without Chromium.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from browser import CHROMIUM, NO_CHROMIUM, chromium_page
from servers import free_port, server

pytestmark = pytest.mark.integration

REPO = Path(__file__).resolve().parents[2]
MLFLOW = REPO / os.environ.get("TRACKING_VENV", ".venv-tracking") / "bin" / "mlflow"


@pytest.mark.skipif(not MLFLOW.exists(), reason=f"no {MLFLOW.relative_to(REPO)} (created by `make tracking`)")
@pytest.mark.skipif(CHROMIUM is None, reason=NO_CHROMIUM)
def test_mlflow_ui_shows_the_run_its_metrics_and_lineage_tags(tmp_path):
    import mlflow  # noqa: F401  (mlflow-skinny, the tracking extra: missing, this fails)
    from pivotrl.tracking.mlflow import MlflowTracker, local_store

    root = tmp_path / "runs"
    uri, artifacts = local_store(str(root))  # what tracking.backend=mlflow without a uri writes
    tracker = MlflowTracker(uri, artifacts)
    run_id = tracker.start_run("pivotrl-ui-check", "ui-check", {"prefect.flow_run_id": "0123-abcd"})
    tracker.log_params(run_id, {"training.group_size": "8", "probing.lambda_diff": "0.5"})
    rewards = [0.1875, 0.15625, 0.0, 0.1875]
    tracker.log_metrics(run_id, [("train/reward_mean", r, step) for step, r in enumerate(rewards, 1)]
                        + [("eval/pivotrl/full_task_success", 0.25, 0)])
    tracker.set_tags(run_id, {"pivotrl.pivots.sha256": "5f1d" * 16, "pivotrl.code_version": "0.1+test"})
    tracker.end_run(run_id)
    experiment_id = tracker._experiment_id("pivotrl-ui-check")

    port = free_port()
    store = root / "mlflow"
    cmd = [str(MLFLOW), "server", "--host", "127.0.0.1", "--port", str(port), "--workers", "1",
           "--backend-store-uri", "sqlite:///mlflow.db", "--default-artifact-root", "./artifacts"]
    with server(cmd, tmp_path / "mlflow-server.log", ready=f"http://127.0.0.1:{port}/health", what="mlflow server",
                timeout_s=240, cwd=store, env={**os.environ, "PYTHONPATH": ""}):
        with chromium_page(tmp_path, height=1600) as page:
            page.goto(f"http://127.0.0.1:{port}/#/experiments/{experiment_id}")
            listed = page.wait_for("document.body.innerText.includes('ui-check') && document.body.innerText", 120)
            assert listed and "pivotrl-ui-check" in listed, f"the experiment page did not list the run:\n{listed}"
            page.goto(f"http://127.0.0.1:{port}/#/experiments/{experiment_id}/runs/{run_id}")
            text = page.wait_for("document.body.innerText.includes('train/reward_mean') && "
                                 "document.body.innerText.includes('pivotrl.pivots.sha256') && document.body.innerText",
                                 120)
            shot = os.environ.get("PIVOTRL_MLFLOW_SCREENSHOT")
            if shot:
                page.screenshot(shot)
    assert text, "the run page did not show the metric and the lineage tag"
    assert "landing page (index.html) not found" not in text
    for needed in ("train/reward_mean", "eval/pivotrl/full_task_success", "pivotrl.pivots.sha256", "5f1d" * 16,
                   "training.group_size"):
        assert needed in text, needed
