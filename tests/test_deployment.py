"""The nightly deployment end to end: a real Prefect server on loopback, ``infra/prefect.yaml``
deployed with the Prefect CLI, a process worker, a run triggered by hand on the smoke config, and
the asset events the run leaves behind (the lineage graph the UI draws)."""

from __future__ import annotations

import json
import os
import re
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path
from typing import Any

import pytest

pytestmark = [pytest.mark.integration, pytest.mark.timeout(300)]

REPO = Path(__file__).resolve().parents[1]
PREFECT = str(Path(sys.executable).parent / "prefect")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _api(url: str, body: Any | None = None) -> Any:
    data = None if body is None else json.dumps(body).encode()
    req = urllib.request.Request(url, data=data, headers={"Content-Type": "application/json"},
                                 method="GET" if body is None else "POST")
    with urllib.request.urlopen(req, timeout=10) as r:
        return json.loads(r.read() or b"null")


def _stop(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(timeout=20)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()


@pytest.fixture(scope="module")
def prefect_server(tmp_path_factory):
    """``prefect server start`` on a free loopback port with its own PREFECT_HOME; yields (api url, env)."""
    home = tmp_path_factory.mktemp("prefect-home")
    port = _free_port()
    api = f"http://127.0.0.1:{port}/api"
    env = {**os.environ, "PREFECT_HOME": str(home), "PREFECT_API_URL": api,
           "PREFECT_SERVER_ANALYTICS_ENABLED": "false", "DO_NOT_TRACK": "1",
           "PREFECT_WORKER_QUERY_SECONDS": "2", "PREFECT_WORKER_PREFETCH_SECONDS": "0",
           "PIVOTRL_HOME": str(REPO)}
    for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(name, None)
    log = open(home / "server.log", "w")
    server = subprocess.Popen([PREFECT, "server", "start", "--host", "127.0.0.1", "--port", str(port)],
                              env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        deadline = time.time() + 90
        while True:
            try:
                _api(f"{api}/health")
                break
            except OSError:
                if server.poll() is not None or time.time() > deadline:
                    raise RuntimeError(f"prefect server did not start:\n{(home / 'server.log').read_text()[-3000:]}")
                time.sleep(0.5)
        yield api, env
    finally:
        _stop(server)
        log.close()


def _cli(env: dict[str, str], *args: str) -> str:
    out = subprocess.run([PREFECT, *args], env=env, cwd=REPO, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, f"prefect {' '.join(args)} failed:\n{out.stdout}\n{out.stderr}"
    return out.stdout


def test_nightly_deployment_runs_the_smoke_config(prefect_server, tmp_path):
    from pivotrl.testing import save_tiny_checkpoint

    api, env = prefect_server
    model = save_tiny_checkpoint(tmp_path / "tiny")
    root = tmp_path / "runs"

    _cli(env, "work-pool", "create", "pivotrl-process", "--type", "process", "--overwrite")
    _cli(env, "--no-prompt", "deploy", "--prefect-file", "infra/prefect.yaml", "--all")
    dep = _api(f"{api}/deployments/name/pivotrl-nightly/nightly")
    assert dep["entrypoint"] == "flows/nightly.py:nightly"
    assert dep["work_pool_name"] == "pivotrl-process"
    assert [s["schedule"]["cron"] for s in dep["schedules"]] == ["0 2 * * *"]
    assert dep["parameters"] == {"config_path": "configs/default.yaml", "overrides": []}

    worker_log = open(tmp_path / "worker.log", "w")
    worker = subprocess.Popen([PREFECT, "worker", "start", "--pool", "pivotrl-process"], env=env, cwd=REPO,
                              stdout=worker_log, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        params = {"config_path": "configs/smoke.yaml",
                  "overrides": [f"run.storage_root={root}", f"model.source={model}"]}
        out = _cli(env, "deployment", "run", "pivotrl-nightly/nightly", "--params", json.dumps(params))
        run_id = re.search(r"UUID:\s*([0-9a-f-]{36})", out).group(1)
        deadline = time.time() + 240
        while True:
            state = _api(f"{api}/flow_runs/{run_id}")["state"]
            if state["type"] in ("COMPLETED", "FAILED", "CRASHED", "CANCELLED") or time.time() > deadline:
                break
            time.sleep(2)
    finally:
        _stop(worker)
        worker_log.close()
    assert state["type"] == "COMPLETED", (tmp_path / "worker.log").read_text()[-4000:]

    reports = sorted(root.glob("eval/*/report.md"))
    assert len(reports) == 1 and (reports[0].parent / "report.json.manifest.json").exists()
    results = sorted(p.name.rsplit("-", 1)[0] for p in (root / ".prefect-results").iterdir() if p.name != "outputs")
    # outputs/: the artifacts each cached result points at (checked before a cache hit is trusted)
    assert len(list((root / ".prefect-results" / "outputs").iterdir())) == 5
    assert results == ["pivotrl-demonstrations", "pivotrl-evaluate", "pivotrl-probe", "pivotrl-reference",
                       "pivotrl-train"]

    # The asset graph: each materialisation names its upstream assets (the manifest's inputs).
    pivots = next(root.glob("pivots/*/pivots.parquet")).resolve()
    probes = next(root.glob("probes/*/probes.parquet")).resolve()
    candidates = next(root.glob("demos/*/candidates.parquet")).resolve()
    flt = {"filter": {"event": {"prefix": ["prefect.asset.materialization.succeeded"]},
                      "occurred": {"since": "2000-01-01T00:00:00Z"}}, "limit": 50}
    deadline = time.time() + 30
    while True:
        events = _api(f"{api}/events/filter", flt)["events"]
        by_asset = {e["resource"]["prefect.resource.id"]: e for e in events}
        if len(by_asset) >= 8 or time.time() > deadline:
            break
        time.sleep(1)
    kinds = sorted(e["payload"]["kind"] for e in by_asset.values())
    assert kinds == ["candidates", "pivots", "policy_checkpoint", "probes", "reference_checkpoint", "report",
                     "training_metrics", "trajectories"]
    upstream = {r["prefect.resource.id"] for r in by_asset[f"file://{pivots}"]["related"]
                if r.get("prefect.resource.role") == "asset"}
    assert upstream == {f"file://{probes}", f"file://{candidates}"}


# ------------------------------------------------------------------------ multi-node launch
def _node_command(spec_url: str, workdir: Path, *extra: str, env: dict[str, str] | None = None) -> list[str]:
    base = {k: v for k, v in os.environ.items()
            if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT",
                         "NODE_RANK", "JOB_COMPLETION_INDEX")}
    out = subprocess.run(
        [sys.executable, str(REPO / "infra" / "multinode" / "launch_train.py"), "node", "--spec", spec_url,
         "--workdir", str(workdir), "--python", "python3", "--dry-run", *extra],
        capture_output=True, text=True, timeout=120, env={**base, **(env or {})}, cwd=REPO,
    )
    assert out.returncode == 0, out.stderr
    return out.stdout.strip().splitlines()[-1].split(" ")


def test_multinode_launch_spec_goes_through_storage(tmp_path):
    """The launch spec is read from the run's storage; each node renders its own launcher command."""
    from pivotrl.config import load_config
    from pivotrl.storage import ArtifactStore

    cfg = load_config(str(REPO / "configs" / "multinode-gpu.yaml"))
    store = ArtifactStore(str(tmp_path / "runs"))
    spec = {"config": cfg.model_dump(mode="json"), "inputs": {"probe": {"pivots_key": "pivots/x"}, "reference": {}}}
    url = store.write_json("launch/rl_stage-test.json", spec)

    work = tmp_path / "node1"
    cmd = _node_command(url, work, "--launcher", "torchrun", env={"JOB_COMPLETION_INDEX": "1", "MASTER_ADDR": "head"})
    assert cmd == ["python3", "-m", "torch.distributed.run", "--nnodes=2", "--nproc-per-node=8", "--node-rank=1",
                   "--master-addr=head", "--master-port=29500", "-m", "pivotrl.training.rl_stage",
                   "--spec", str(work / "rl_stage-spec.json")]
    local = json.loads((work / "rl_stage-spec.json").read_text())
    assert local["inputs"] == spec["inputs"] and local["output"] == str(work / "rl_stage-result.json")

    cmd = _node_command(url, tmp_path / "node0", "--node-rank", "0")  # the config's launcher: deepspeed
    assert cmd == ["python3", "-m", "deepspeed.launcher.runner", "--hostfile=configs/hostfile", "--num_nodes=2",
                   "--no_ssh", "--node_rank=0", "--num_gpus=8", "--master_addr=node-0", "--master_port=29500",
                   "--module", "pivotrl.training.rl_stage", "--spec", str(tmp_path / "node0" / "rl_stage-spec.json")]
