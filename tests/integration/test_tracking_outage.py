"""A tracker outage never holds training up: a real MLflow server stopped in the middle of the
steps, then started again on the same store. The steps keep coming (each call only queues), the
outage costs one warning, and the steps kept meanwhile reach the server once it answers."""

from __future__ import annotations

import logging
import os
import sys
import threading
import time
from pathlib import Path

import pytest

from pivotrl.storage import ArtifactStore
from pivotrl.tracking.live import LiveLogger, logged_steps
from servers import free_port, server

pytestmark = pytest.mark.integration


def _mlflow(work: Path, port: int):
    cmd = [sys.executable, "-m", "mlflow", "server", "--host", "127.0.0.1", "--port", str(port), "--workers", "1",
           "--backend-store-uri", f"sqlite:///{work / 'mlflow.db'}", "--artifacts-destination", str(work / "artifacts")]
    return server(cmd, work / f"server-{time.monotonic_ns()}.log", ready=f"http://127.0.0.1:{port}/health",
                  what="mlflow server", cwd=work)


def _until(cond, what: str, timeout_s: float = 120.0) -> None:
    """Wait for ``cond()`` (a generous limit: this is no speed claim)."""
    deadline = time.monotonic() + timeout_s
    while not cond():
        assert time.monotonic() < deadline, f"gave up waiting for {what}"
        time.sleep(0.05)


class Watched:
    """The real tracker, with whether a log_metrics call is in flight right now."""

    def __init__(self, inner) -> None:
        self.inner, self.in_flight = inner, threading.Event()

    def log_metrics(self, run_id, points):
        self.in_flight.set()
        try:
            return self.inner.log_metrics(run_id, points)
        finally:
            self.in_flight.clear()


def test_training_steps_survive_a_tracker_outage(tmp_path, caplog):
    from mlflow.tracking import MlflowClient

    from pivotrl.tracking.mlflow import MlflowTracker

    caplog.set_level(logging.WARNING, logger="pivotrl.tracking")
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    store = ArtifactStore(str(tmp_path / "root"))
    with _mlflow(tmp_path, port) as proc:
        tracker = Watched(MlflowTracker(url))
        run_id = tracker.inner.start_run("outage", "night", {})
        live = LiveLogger(tracker, run_id, store, "train/k", retry_every_s=0.5, flush_s=120)
        for step in (1, 2):
            live({"step": step, "reward_mean": step / 10, "flag": True})
        _until(lambda: live.sent == [1, 2], "the first two steps")
        # The server hangs, its worker processes too: every call waits out its timeout.
        os.killpg(proc.pid, __import__("signal").SIGSTOP)
        live({"step": 3, "reward_mean": 0.3})
        _until(tracker.in_flight.is_set, "the send of step 3 to start")
        costs = []
        for step in (4, 5, 6):
            t0 = time.perf_counter()
            live({"step": step, "reward_mean": step / 10})
            costs.append(time.perf_counter() - t0)
            assert tracker.in_flight.is_set()  # the call returned while the send to the hung server goes on
        # Then it dies without answering (a resumed server would answer the kept steps at once).
        os.killpg(proc.pid, __import__("signal").SIGKILL)
    # Stopped for good now (the server's process group was ended); then started again on its store.
    _until(lambda: live.failures >= 1, "a failed send")
    kept = 6 - len(live.sent)  # step 3 may have been answered as the server woke up to stop
    assert live.sent[:2] == [1, 2] and kept >= 3
    with _mlflow(tmp_path, port):
        _until(lambda: live.sent == [1, 2, 3, 4, 5, 6], "the kept steps after the restart")
        assert live.close() == 0
        history = MlflowClient(url).get_metric_history(run_id, "train/reward_mean")
        assert sorted((m.step, m.value) for m in history) == [(s, s / 10) for s in range(1, 7)]
    assert logged_steps(store, "train/k", run_id) == {1, 2, 3, 4, 5, 6}
    warnings = [r.getMessage() for r in caplog.records]
    assert sum("does not answer" in w for w in warnings) == 1  # one warning for the outage
    assert any("answers again" in w and f"{kept} kept step(s) sent" in w for w in warnings), warnings
    print(f"logger call during the outage: at most {max(costs) * 1e3:.2f} ms (load {os.getloadavg()[0]:.1f})")


def test_steps_a_dead_tracker_never_took_are_counted(tmp_path, caplog):
    from pivotrl.tracking.mlflow import MlflowTracker

    caplog.set_level(logging.WARNING, logger="pivotrl.tracking")
    tracker = MlflowTracker(f"http://127.0.0.1:{free_port()}")  # nothing listens there
    live = LiveLogger(tracker, "0" * 32, ArtifactStore(str(tmp_path / "root")), "train/k", retry_every_s=0.2,
                      flush_s=60)
    for step in range(1, 4):
        live({"step": step, "reward_mean": 0.5})
    assert live.close() == 3
    assert any(w.getMessage().startswith("3 training step(s) not sent to the experiment tracker")
               for w in caplog.records)
    assert logged_steps(ArtifactStore(str(tmp_path / "root")), "train/k", "0" * 32) == set()
