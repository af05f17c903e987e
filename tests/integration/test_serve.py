"""`make serve` (infra/serve.sh) and Ctrl-C on it: the server, the deployment and the worker come up,
and a SIGINT to its process group (what Ctrl-C sends) leaves no process running and the port free."""

from __future__ import annotations

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
    env = {**os.environ, "PREFECT_HOME": home, "PREFECT_SERVER_API_PORT": str(port),
           "PREFECT_SERVER_ANALYTICS_ENABLED": "false", "VENV": str(Path(sys.executable).parent.parent)}
    env.pop("PREFECT_API_URL", None)
    log = open(tmp_path / "serve.log", "w")
    # A terminal's shell starts with SIGINT at its default (a test runner started in the background
    # may have it ignored, and bash cannot trap a signal ignored on entry).
    proc = subprocess.Popen(["bash", "infra/serve.sh"], cwd=REPO, env=env, stdout=log, stderr=subprocess.STDOUT,
                            start_new_session=True, preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    try:
        deadline = time.time() + 180
        while "Worker" not in (tmp_path / "serve.log").read_text() and time.time() < deadline:
            assert proc.poll() is None, (tmp_path / "serve.log").read_text()[-3000:]
            time.sleep(1)
        text = (tmp_path / "serve.log").read_text()
        assert "deployed; trigger a run now" in text and "Worker" in text, text[-3000:]
        urllib.request.urlopen(f"http://127.0.0.1:{port}/api/health", timeout=5)
        assert len(_pids_with(home)) >= 3  # the script, the server, the worker
        t0 = time.time()
        os.killpg(proc.pid, signal.SIGINT)  # Ctrl-C: SIGINT to the terminal's foreground process group
        proc.wait(timeout=120)
        deadline = time.time() + 30
        while _pids_with(home) and time.time() < deadline:
            time.sleep(0.5)
        assert _pids_with(home) == []
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
