"""`make serve` (infra/serve.sh) and Ctrl-C on it: the server, the deployment and the worker come up,
the terminal shows the URLs, the deployment and where the logs are while the server's and the
worker's full output goes to log files, and a SIGINT to its process group (what Ctrl-C sends) leaves
no process running and the port free."""

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

from servers import free_port

pytestmark = [pytest.mark.integration, pytest.mark.timeout(300)]

REPO = Path(__file__).resolve().parents[2]


def _pids_with(home: str) -> list[int]:
    """Processes whose environment holds PREFECT_HOME=home (the script, the server, the worker and
    anything they started), whatever session or process group they moved to."""
    needle = f"PREFECT_HOME={home}".encode()
    pids = []
    for entry in os.listdir("/proc"):
        if entry.isdigit() and int(entry) != os.getpid():
            try:
                with open(f"/proc/{entry}/environ", "rb") as f:
                    if needle in f.read().split(b"\0"):
                        pids.append(int(entry))
            except OSError:
                continue
    return pids


def test_serve_comes_up_and_ctrl_c_leaves_nothing_running(tmp_path):
    port = free_port()
    home = str(tmp_path / "home")
    logs = tmp_path / "serve-logs"
    env = {**os.environ, "PREFECT_HOME": home, "PREFECT_SERVER_API_PORT": str(port),
           "PREFECT_SERVER_ANALYTICS_ENABLED": "false", "VENV": str(Path(sys.executable).parent.parent),
           "PIVOTRL_SERVE_LOGS": str(logs), "PIVOTRL_CONFIG": "configs/smoke.yaml"}
    env.pop("PREFECT_API_URL", None)
    log = open(tmp_path / "serve.log", "w")
    # A terminal's shell starts with SIGINT at its default (a test runner started in the background
    # may have it ignored, and bash cannot trap a signal ignored on entry).
    proc = subprocess.Popen(["bash", "infra/serve.sh"], cwd=REPO, env=env, stdout=log, stderr=subprocess.STDOUT,
                            start_new_session=True, preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    try:
        deadline = time.time() + 180
        worker_log = logs / "worker.log"
        while not (worker_log.exists() and "Worker" in worker_log.read_text()) and time.time() < deadline:
            assert proc.poll() is None, (tmp_path / "serve.log").read_text()[-3000:]
            time.sleep(1)
        text = (tmp_path / "serve.log").read_text()
        # the terminal: URLs, the deployment with its schedule and config, the logs, how to run and stop
        for needed in (f"UI          http://127.0.0.1:{port}", f"API         http://127.0.0.1:{port}/api",
                       'deployment  pivotrl-nightly/nightly: cron "0 2 * * *" UTC, config_path=configs/smoke.yaml',
                       "run now", f"logs        {logs}/server.log, {logs}/worker.log", "stop        Ctrl-C",
                       "worker started"):
            assert needed in text, text
        assert len(text.splitlines()) <= 12 and "Traceback" not in text, text  # the server's banner is in its log
        # the full output is in the files: the server's banner, the deployment, the worker's start
        assert "Check out the dashboard" in (logs / "server.log").read_text()
        assert "Deployment 'pivotrl-nightly/nightly' successfully created" in (logs / "deploy.log").read_text()
        assert "Worker" in worker_log.read_text()
        urllib.request.urlopen(f"http://127.0.0.1:{port}/api/health", timeout=5)
        # the deployment's runs take the config it was served with
        dep = json.loads(urllib.request.urlopen(
            f"http://127.0.0.1:{port}/api/deployments/name/pivotrl-nightly/nightly", timeout=10).read())
        assert dep["parameters"]["config_path"] == "configs/smoke.yaml"
        assert len(_pids_with(home)) >= 3  # the script, the server, the worker
        t0 = time.time()
        os.killpg(proc.pid, signal.SIGINT)  # Ctrl-C: SIGINT to the terminal's foreground process group
        proc.wait(timeout=120)
        deadline = time.time() + 30
        while _pids_with(home) and time.time() < deadline:
            time.sleep(0.5)
        assert _pids_with(home) == []
        assert "stopped (logs: " in (tmp_path / "serve.log").read_text()
        print(f"Ctrl-C: everything stopped after {time.time() - t0:.1f} s")
        with socket.socket() as s:
            assert s.connect_ex(("127.0.0.1", port)) != 0  # nothing listens any more
    finally:
        for pid in _pids_with(home):
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        log.close()
