"""Experiment tracking: the smoke flow recorded in a real MLflow tracking server on loopback, read
back through MLflow's client; ``tracking: none`` imports no tracker; a tracker that cannot be
reached switches itself off without failing the run."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest

from pivotrl.config import load_config
from pivotrl.errors import ConfigError
from pivotrl.storage import ArtifactStore
from pivotrl.tracking import flatten_params

REPO = Path(__file__).resolve().parents[1]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def mlflow_server(tmp_path_factory):
    """``mlflow server`` (SQLite backend, artifacts proxied to a temporary folder) on 127.0.0.1."""
    work = tmp_path_factory.mktemp("mlflow")
    port = _free_port()
    url = f"http://127.0.0.1:{port}"
    log = open(work / "server.log", "wb")
    proc = subprocess.Popen(
        [sys.executable, "-m", "mlflow", "server", "--host", "127.0.0.1", "--port", str(port), "--workers", "1",
         "--backend-store-uri", f"sqlite:///{work / 'mlflow.db'}", "--artifacts-destination", str(work / "artifacts")],
        stdout=log, stderr=subprocess.STDOUT, cwd=work, start_new_session=True,
    )
    try:
        deadline = time.time() + 180
        while True:
            try:
                with urllib.request.urlopen(f"{url}/health", timeout=2) as r:
                    if r.status == 200:
                        break
            except OSError:
                pass
            if proc.poll() is not None or time.time() > deadline:
                raise RuntimeError(f"mlflow server did not start: {(work / 'server.log').read_text()[-2000:]}")
            time.sleep(0.5)
        yield url
    finally:
        os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
        log.close()


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory) -> Path:
    from pivotrl.testing import save_tiny_checkpoint

    return save_tiny_checkpoint(tmp_path_factory.mktemp("model") / "tiny")


@pytest.mark.integration
def test_smoke_flow_is_recorded_in_a_real_mlflow_server(mlflow_server, tiny_model, tmp_path, monkeypatch):
    from mlflow.tracking import MlflowClient
    from prefect.testing.utilities import prefect_test_harness

    from pivotrl.flows.nightly import nightly

    root = tmp_path / "root"
    monkeypatch.setenv("PREFECT_HOME", str(tmp_path / "prefect"))
    overrides = [f"run.storage_root={root}", f"model.source={tiny_model}", "tracking.backend=mlflow",
                 f"tracking.uri={mlflow_server}", "tracking.experiment=pivotrl-test"]
    with prefect_test_harness(server_startup_timeout=120):
        state = nightly(config_path=str(REPO / "configs" / "smoke.yaml"), overrides=overrides, return_state=True)
        result = state.result()
    flow_run_id = str(state.state_details.flow_run_id)

    client = MlflowClient(tracking_uri=mlflow_server)
    exp = client.get_experiment_by_name("pivotrl-test")
    runs = client.search_runs([exp.experiment_id])
    assert len(runs) == 1
    run = runs[0]
    assert run.info.status == "FINISHED" and run.info.run_name == "smoke"
    # Params: the resolved config, one dotted key each.
    cfg = load_config(str(REPO / "configs" / "smoke.yaml"), overrides)
    assert run.data.params["training.group_size"] == "4" == str(cfg.training.group_size)
    assert run.data.params["probing.num_probes"] == "4"
    assert run.data.params["model.source"] == str(tiny_model)
    assert json.loads(run.data.params["evaluation.seeds"]) == [0]
    assert not any(k.startswith("tracking.") for k in run.data.params)
    # A metric series with one point per training step, equal to metrics.parquet.
    store = ArtifactStore(str(root))
    metrics_key = f"{_train_key(store)}/metrics.parquet"
    m = store.read_parquet(metrics_key)
    history = client.get_metric_history(run.info.run_id, "train/reward_mean")
    assert [p.step for p in history] == list(m["step"]) == [1, 2]
    assert [p.value for p in history] == pytest.approx(list(m["reward_mean"]))
    assert len(client.get_metric_history(run.info.run_id, "train/refresh_max_abs_delta")) == 2
    # Stage summaries and evaluation.
    data = run.data.metrics
    assert data["probe/kept"] == result["report"]["meta"]["pivots"]
    assert data["demos/trajectories"] == 14
    assert 0.0 <= data["eval/pivotrl/full_task_success"] <= 1.0
    # The report artifact, byte for byte.
    listed = {f.path for f in client.list_artifacts(run.info.run_id, "report")}
    assert {"report/report.md", "report/report.json"} <= listed
    assert any(p.endswith(".png") for p in listed)
    local = client.download_artifacts(run.info.run_id, "report/report.md", str(tmp_path / "dl"))
    ekey = result["report_md"].removeprefix(store.root_url + "/")
    assert Path(local).read_bytes() == store.read_bytes(ekey)
    # Lineage tags equal to the manifests' hashes.
    tags = run.data.tags
    pivots = store.read_manifest(f"{_key_of(store, 'pivots/', 'pivots.parquet')}")
    probes = store.read_manifest(f"{_key_of(store, 'probes/', 'probes.parquet')}")
    trajs = store.read_manifest(f"{_key_of(store, 'demos/', 'trajectories.parquet')}")
    report = store.read_manifest(result["report_json"].removeprefix(store.root_url + "/"))
    assert tags["pivotrl.pivots.sha256"] == pivots.sha256
    assert tags["pivotrl.probes.sha256"] == probes.sha256
    assert tags["pivotrl.reference.hash"] == pivots.extra["reference_hash"] == probes.extra["reference_hash"]
    assert tags["pivotrl.trajectories.sha256"] == trajs.sha256
    assert tags["pivotrl.report.sha256"] == report.sha256
    assert tags["pivotrl.metrics.sha256"] == store.read_manifest(metrics_key).sha256
    sources = {k: v for k, v in trajs.inputs.items()}
    assert len(sources) == 2
    for i, (name, rec) in enumerate(sorted(sources.items())):
        assert tags[f"pivotrl.source.{i}.uri"] == rec["uri"]
        assert tags[f"pivotrl.source.{i}.sha256"] == str(rec["sha256"])
    assert tags["pivotrl.verifier.name"] == cfg.verifier.name == pivots.extra["verifier"]
    assert len(tags["pivotrl.verifier.code_hash"]) == 16
    assert tags["pivotrl.code_version"] == report.code_version
    assert tags["prefect.flow_run_id"] == flow_run_id


def _key_of(store: ArtifactStore, prefix: str, name: str) -> str:
    keys = [k for k in store.list(prefix.rstrip("/")) if k.endswith("/" + name)]
    assert len(keys) == 1, keys
    return keys[0]


def _train_key(store: ArtifactStore) -> str:
    return _key_of(store, "train/", "metrics.parquet").rsplit("/", 1)[0]


def test_tracking_none_imports_no_tracker_library():
    code = ("import sys; from pivotrl.config import load_config; from pivotrl.tracking import make_tracker;"
            "t = make_tracker(load_config('configs/smoke.yaml')); t.log_metrics('', [('a', 1.0, 1)]);"
            "print(type(t).__name__, 'mlflow' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, check=True)
    assert out.stdout.split() == ["NoTracker", "False"]


def test_unreachable_tracker_is_switched_off_with_a_warning(tmp_path, monkeypatch, caplog):
    from pivotrl.tracking import RunRecorder

    monkeypatch.setenv("MLFLOW_HTTP_REQUEST_MAX_RETRIES", "0")
    monkeypatch.setenv("MLFLOW_HTTP_REQUEST_TIMEOUT", "2")
    cfg = load_config(str(REPO / "configs" / "smoke.yaml"),
                      [f"run.storage_root={tmp_path}", "tracking.backend=mlflow", f"tracking.uri=http://127.0.0.1:{_free_port()}"])
    rec = RunRecorder(cfg, ArtifactStore(str(tmp_path)))
    assert rec.start() == ""
    rec.stage("probe", {"stats": {"total": {"kept": 3}}})  # a no-op now, no error
    rec.end()
    assert any("experiment tracking switched off" in r.getMessage() and "127.0.0.1" in r.getMessage()
               for r in caplog.records)


def test_config_params_are_flat_and_credentials_stay_out_of_the_uri():
    assert flatten_params({"a": {"b": 1, "c": [1, 2], "d": {}}, "e": None}) == {
        "a.b": "1", "a.c": "[1, 2]", "a.d": "{}", "e": "null"}
    with pytest.raises(ConfigError, match="tracking.uri.*MLFLOW_TRACKING_PASSWORD"):
        load_config(str(REPO / "configs" / "smoke.yaml"), ["tracking.uri=https://me:secret@mlflow.example:5000"])
