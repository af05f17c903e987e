"""The run's SIGINT/SIGTERM handler (pivotrl.pipeline.processes.StopOnSignal) on a small real tree:
a child that ignores SIGTERM is killed after the grace period; a second Ctrl-C does not wait."""

from __future__ import annotations

import signal
import subprocess
import sys
import textwrap
import time

import pytest

psutil = pytest.importorskip("psutil")

PARENT = textwrap.dedent("""
    import subprocess, sys, time
    from pivotrl.pipeline.processes import StopOnSignal
    StopOnSignal(grace_s=float(sys.argv[1])).install()
    stubborn = "import signal, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); time.sleep(120)"
    kids = [subprocess.Popen([sys.executable, "-c", stubborn]),
            subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"], start_new_session=True)]
    print("ready", *[k.pid for k in kids], flush=True)
    time.sleep(120)
""")


def _start(grace_s: float):
    proc = subprocess.Popen([sys.executable, "-c", PARENT, str(grace_s)], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    line = proc.stdout.readline().split()
    assert line[0] == "ready", proc.stderr.read()
    time.sleep(0.5)  # the stubborn child has installed its SIG_IGN
    return proc, [psutil.Process(int(p)) for p in line[1:]]


def _gone(kids) -> bool:
    return all(not k.is_running() or k.status() == psutil.STATUS_ZOMBIE for k in kids)


def test_first_signal_terminates_then_kills_after_the_grace_period():
    proc, kids = _start(grace_s=1.5)
    t0 = time.monotonic()
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(timeout=10) == 128 + signal.SIGTERM
    took = time.monotonic() - t0
    assert 1.4 < took < 6.0  # waited the grace period for the stubborn child, then killed it
    assert _gone(kids)
    assert "SIGTERM: stopping every process of the run" in proc.stderr.read()


def test_second_ctrl_c_exits_at_once():
    proc, kids = _start(grace_s=30.0)
    proc.send_signal(signal.SIGINT)
    deadline = time.monotonic() + 5
    while kids[1].is_running() and kids[1].status() != psutil.STATUS_ZOMBIE and time.monotonic() < deadline:
        time.sleep(0.05)  # the first stop is under way (the obedient child is gone; the stubborn one waits)
    t0 = time.monotonic()
    proc.send_signal(signal.SIGINT)
    assert proc.wait(timeout=10) == 128 + signal.SIGINT
    assert time.monotonic() - t0 < 3.0  # not the 30 s grace period
    time.sleep(0.2)
    assert _gone(kids)
    err = proc.stderr.read()
    assert "stopping now" in err
