"""What a 60-s MLflow outage costs a training loop (issue: "a 60-s tracker outage adds under 5 s
to training").

A loop of ``--steps`` steps of ``--step-s`` seconds each (a sleep standing in for a training step)
hands every step's metrics row to :class:`pivotrl.tracking.live.LiveLogger`, as the train stage
does, and closes it at the end (the stage's last wait). Run twice, interleaved with nothing else:
the MLflow server up throughout (baseline), then the server stopped at ``--down-at`` s and started
again (same SQLite store) ``--outage-s`` s later. Printed: both walls, the difference, the longest
single logger call, and whether every step reached the server.

    python benchmarks/bench_tracker_outage.py [--steps 90 --step-s 1.0 --down-at 10 --outage-s 60]
"""

from __future__ import annotations

import argparse
import os
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import load1, md_table  # noqa: E402


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _start(work: Path, port: int) -> subprocess.Popen:
    cmd = [sys.executable, "-m", "mlflow", "server", "--host", "127.0.0.1", "--port", str(port), "--workers", "1",
           "--backend-store-uri", f"sqlite:///{work / 'mlflow.db'}", "--artifacts-destination", str(work / "art")]
    proc = subprocess.Popen(cmd, cwd=work, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
    deadline = time.time() + 180
    while time.time() < deadline:
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=2):
                return proc
        except OSError:
            time.sleep(0.3)
    raise RuntimeError("mlflow server did not start")


def _stop(proc: subprocess.Popen) -> None:
    os.killpg(proc.pid, signal.SIGTERM)
    proc.wait(timeout=60)


def run(steps: int, step_s: float, outage: tuple[float, float] | None, work: Path, port: int) -> dict:
    from mlflow.tracking import MlflowClient

    from pivotrl.storage import ArtifactStore
    from pivotrl.tracking.live import LiveLogger
    from pivotrl.tracking.mlflow import MlflowTracker

    server = [_start(work, port)]
    url = f"http://127.0.0.1:{port}"
    tracker = MlflowTracker(url)
    run_id = tracker.start_run("outage-bench", "outage" if outage else "baseline", {})
    live = LiveLogger(tracker, run_id, ArtifactStore(str(work / "root")), "train/bench")
    timers = []
    if outage:
        down_at, length = outage
        timers = [threading.Timer(down_at, lambda: _stop(server[0])),
                  threading.Timer(down_at + length, lambda: server.__setitem__(0, _start(work, port)))]
    loads, longest = [load1()], 0.0
    t0 = time.perf_counter()
    for t in timers:
        t.start()
    for step in range(1, steps + 1):
        time.sleep(step_s)  # the training step
        c0 = time.perf_counter()
        live({"step": step, "reward_mean": step / steps})
        longest = max(longest, time.perf_counter() - c0)
    unsent = live.close()
    wall = time.perf_counter() - t0
    loads.append(load1())
    for t in timers:
        t.join()
    got = len(MlflowClient(url).get_metric_history(run_id, "train/reward_mean"))
    _stop(server[0])
    return {"wall": wall, "longest": longest, "unsent": unsent, "got": got, "load": f"{min(loads):.1f}–{max(loads):.1f}"}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=90)
    ap.add_argument("--step-s", type=float, default=1.0)
    ap.add_argument("--down-at", type=float, default=10.0)
    ap.add_argument("--outage-s", type=float, default=60.0)
    a = ap.parse_args()
    with tempfile.TemporaryDirectory(prefix="pivotrl-outage-") as tmp:
        base = run(a.steps, a.step_s, None, Path(tmp) / "a", _port()) if (Path(tmp) / "a").mkdir() is None else None
        down = run(a.steps, a.step_s, (a.down_at, a.outage_s), Path(tmp) / "b", _port()) \
            if (Path(tmp) / "b").mkdir() is None else None
    rows = [[name, r["wall"], r["wall"] - a.steps * a.step_s, r["longest"] * 1e3, f"{r['got']}/{a.steps}", r["unsent"],
             r["load"]] for name, r in (("server up", base), (f"{a.outage_s:.0f}-s outage", down))]
    print(md_table(["run", "wall s", "over the steps' own time s", "longest logger call ms", "steps in MLflow",
                    "unsent at close", "load"], rows))
    print(f"\noutage cost: {down['wall'] - base['wall']:+.2f} s over {a.steps} steps of {a.step_s} s")


if __name__ == "__main__":
    main()
