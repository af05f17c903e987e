"""Real servers for the integration tests, on 127.0.0.1: a free port, a child server process
started in its own session and waited for on a health URL, and its stop (the whole process group).

Used by the MLflow, vLLM-serve, Prefect and S3 (moto) tests; each test keeps its own command line.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import time
import urllib.request
from contextlib import contextmanager
from pathlib import Path
from typing import Callable, Iterator, Mapping, Sequence


def free_port() -> int:
    """A TCP port on 127.0.0.1 that was free a moment ago."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def healthy(url: str) -> bool:
    """True when a GET of ``url`` answers 200 within 2 s."""
    try:
        with urllib.request.urlopen(url, timeout=2) as r:
            return r.status == 200
    except OSError:
        return False


def stop(proc: subprocess.Popen, timeout_s: float = 30) -> None:
    """SIGTERM to ``proc``'s process group (it leads its own session), SIGKILL after ``timeout_s``."""
    if proc.poll() is not None:
        return
    os.killpg(proc.pid, signal.SIGTERM)
    try:
        proc.wait(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()


@contextmanager
def server(cmd: Sequence[str], log_path: Path, *, ready: str | Callable[[], bool], what: str, timeout_s: float = 180,
           env: Mapping[str, str] | None = None, cwd: Path | str | None = None, poll_s: float = 0.5
           ) -> Iterator[subprocess.Popen]:
    """Start ``cmd`` (stdout and stderr to ``log_path``, its own session), wait until ``ready``
    (a health URL answering 200, or a callable returning True), yield the process, stop it after.

    Raises RuntimeError with the end of the log when the process exits or ``timeout_s`` passes
    before it is ready.
    """
    check = ready if callable(ready) else (lambda: healthy(ready))
    log = open(log_path, "wb")
    proc = subprocess.Popen(list(cmd), stdout=log, stderr=subprocess.STDOUT, env=None if env is None else dict(env),
                            cwd=cwd, start_new_session=True)
    try:
        deadline = time.time() + timeout_s
        while not check():
            if proc.poll() is not None or time.time() > deadline:
                raise RuntimeError(f"{what} did not start (exit code {proc.poll()}):\n"
                                   f"{Path(log_path).read_text(errors='replace')[-3000:]}")
            time.sleep(poll_s)
        yield proc
    finally:
        stop(proc)
        log.close()
