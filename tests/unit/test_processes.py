"""The run's SIGINT/SIGTERM handler (pivotrl.pipeline.processes.StopOnSignal) on a small real tree:
a child that ignores SIGTERM is killed after the grace period; a second Ctrl-C does not wait."""

from __future__ import annotations

import signal
import subprocess
import sys
import textwrap
from pathlib import Path
import time

import psutil
import pytest

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
    assert took > 1.4  # waited the 1.5-s grace period for the stubborn child (a lower bound: load cannot break it)
    assert _gone(kids)
    assert "SIGTERM: stopping every process of the run" in proc.stderr.read()


def test_second_ctrl_c_exits_at_once():
    proc, kids = _start(grace_s=30.0)
    proc.send_signal(signal.SIGINT)
    deadline = time.monotonic() + 5
    while kids[1].is_running() and kids[1].status() != psutil.STATUS_ZOMBIE and time.monotonic() < deadline:
        time.sleep(0.05)  # the first stop is under way (the obedient child is gone; the stubborn one waits)
    proc.send_signal(signal.SIGINT)
    assert proc.wait(timeout=10) == 128 + signal.SIGINT  # within 10 s: not after the 30-s grace period
    time.sleep(0.2)
    assert _gone(kids)
    err = proc.stderr.read()
    assert "stopping now" in err


# ------------------------------------------------- a stage's temporary spec directory never stays
STAGE_PARENT = textwrap.dedent("""
    import signal, sys
    from pivotrl.pipeline.entry import run_stage_process
    from pivotrl.pipeline.processes import StopOnSignal
    # Python's own SIGINT handler, as in a terminal: a test run launched as a background job of a
    # non-interactive shell passes SIGINT on as ignored, and Python then keeps ignoring it.
    signal.signal(signal.SIGINT, signal.default_int_handler)
    if sys.argv[1] == "handler":
        StopOnSignal(grace_s=2.0).install()
    # sys.argv[2] holds a sitecustomize that keeps the stage process busy at start-up
    run_stage_process("probe", {"run": {"storage_root": sys.argv[3]}}, {}, env={"PYTHONPATH": sys.argv[2]})
""")


def _stage_dirs(tmp):
    return sorted(tmp.glob("pivotrl-*"))


def _run_stage_parent(tmp_path, mode):
    import os

    tmp = tmp_path / "tmp"
    busy = tmp_path / "busy"
    tmp.mkdir(), busy.mkdir()
    (busy / "sitecustomize.py").write_text("import time\ntime.sleep(60)\n")
    proc = subprocess.Popen([sys.executable, "-c", STAGE_PARENT, mode, str(busy), str(tmp_path / "root")],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env={**os.environ, "TMPDIR": str(tmp)})
    deadline = time.monotonic() + 60
    while not list(tmp.glob("pivotrl-probe-*/spec.json")) and time.monotonic() < deadline:
        assert proc.poll() is None, proc.stderr.read()
        time.sleep(0.1)
    spec = list(tmp.glob("pivotrl-probe-*/spec.json"))
    assert spec and '"storage_root"' in spec[0].read_text()
    return proc, tmp


@pytest.mark.parametrize("mode, code", [("handler", 128 + signal.SIGINT), ("keyboard-interrupt", -signal.SIGINT)])
def test_ctrl_c_removes_the_stage_spec_directory(tmp_path, mode, code):
    proc, tmp = _run_stage_parent(tmp_path, mode)
    kids = psutil.Process(proc.pid).children(recursive=True)
    proc.send_signal(signal.SIGINT)
    try:
        rc = proc.wait(timeout=30)
    except subprocess.TimeoutExpired:  # a failure: leave nothing running for the tests after this one
        for p in [proc] + [k for k in kids if k.is_running()]:
            p.kill()
        raise
    assert rc == code
    assert _stage_dirs(tmp) == []
    assert _gone(kids)  # the busy stage process was stopped too


def test_a_failed_stage_leaves_no_spec_directory(tmp_path, monkeypatch):
    import tempfile

    from pivotrl.pipeline.entry import StageError, run_stage_process

    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    with pytest.raises(StageError, match="failed"):
        run_stage_process("probe", {"run": {"storage_root": str(tmp_path / "root"), "nope": 1}}, {})
    assert _stage_dirs(tmp_path) == []


def test_a_directory_left_by_a_killed_run_is_removed_by_the_next(tmp_path):
    proc, tmp = _run_stage_parent(tmp_path, "handler")
    kids = psutil.Process(proc.pid).children(recursive=True)
    proc.kill()  # SIGKILL: nothing of the run's own clean-up runs
    proc.wait(timeout=30)
    for k in kids:
        k.kill()
    left = _stage_dirs(tmp)
    assert len(left) == 1
    code = ("import tempfile, sys; tempfile.tempdir = sys.argv[1]\n"
            "from pivotrl.pipeline.tempdirs import stage_tempdir\n"
            "with stage_tempdir('train') as d: print(d)")
    out = subprocess.run([sys.executable, "-c", code, str(tmp)], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert _stage_dirs(tmp) == []  # the stale one swept, the new one removed at its end


def test_work_folders_of_killed_stages_in_the_cache_are_removed_and_live_ones_kept(tmp_path):
    """A train stage killed mid-run left its work folder (policy exports) in the cache directory;
    the next stage removes the folders whose creating process is gone, never a live one's."""
    import os

    from pivotrl.pipeline.tempdirs import remove_stale_tempdirs

    gone = subprocess.Popen([sys.executable, "-c", "pass"])
    gone.wait()
    dead = tmp_path / f"pivotrl-train-p{gone.pid}-abc"
    mine = tmp_path / f"pivotrl-train-p{os.getpid()}-def"
    parent = tmp_path / f"pivotrl-ranks-p{os.getppid()}-ghi"
    other = tmp_path / "pivotrl-train-xyz"  # not named by a process: left alone
    for d in (dead, mine, parent, other):
        (d / "hf").mkdir(parents=True)
    assert remove_stale_tempdirs(tmp_path) == [str(dead)]
    assert not dead.exists() and mine.exists() and parent.exists() and other.exists()


REAPER_SCRIPT = r"""
import subprocess, sys, time
import psutil
from pivotrl.pipeline.processes import become_subreaper
assert become_subreaper()
# An orphan: its parent exits at once, so this process adopts it; it ends 0.3 s later.
subprocess.run(["sh", "-c", "(sleep 0.3; exit 0) & exit 0"], check=True)
# A child of our own that ends with 3 and is waited for late: its owner must still read 3.
own = subprocess.Popen(["sh", "-c", "exit 3"])
time.sleep(3.0)  # the reaper runs about three times meanwhile
zombies = [p.pid for p in psutil.Process().children() if p.status() == psutil.STATUS_ZOMBIE]
print(own.wait(), zombies == [own.pid])
print([p.pid for p in psutil.Process().children() if p.status() == psutil.STATUS_ZOMBIE])
"""


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="PR_SET_CHILD_SUBREAPER is Linux's")
def test_a_subreaper_reaps_adopted_orphans_and_leaves_its_own_children_to_their_owner():
    out = subprocess.run([sys.executable, "-c", REAPER_SCRIPT], capture_output=True, text=True, timeout=60,
                         cwd=Path(__file__).resolve().parents[2])
    assert out.returncode == 0, out.stderr[-2000:]
    own_code, zombie_lines = out.stdout.strip().splitlines()
    assert own_code == "3 True"  # the adopted orphan was reaped; the own child waited for its owner
    assert zombie_lines == "[]"


# ----------------------------------------- a Ctrl-C at any moment of a stage's start stops it all
INTERRUPT_LOOP = textwrap.dedent("""
    import glob, json, os, signal, sys, tempfile, threading, time
    import psutil
    from pivotrl.pipeline.entry import run_stage_process

    signal.signal(signal.SIGINT, signal.default_int_handler)  # as in a terminal (see STAGE_PARENT)
    tmp = tempfile.gettempdir()
    busy, root, ran_out = sys.argv[1], sys.argv[2], sys.argv[3]
    for delay, other_thread in json.loads(sys.argv[4]):
        def ctrl_c():  # from the moment the spec is written (the stage process is being started)
            while not glob.glob(tmp + "/pivotrl-probe-*/spec.json"):
                time.sleep(0.0002)
            time.sleep(delay)
            os.kill(os.getpid(), signal.SIGINT)

        sender = threading.Thread(target=ctrl_c)
        sender.start()
        if other_thread:  # the kernel hands SIGINT to the sender thread; the main thread is told by Python's flag only
            signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGINT})
        try:
            run_stage_process("probe", {"run": {"storage_root": root}}, {},
                              env={"PYTHONPATH": busy, "BUSY_RAN_OUT": ran_out})
            outcome = "finished"
        except KeyboardInterrupt:
            outcome = "interrupted"
        except Exception as exc:
            outcome = type(exc).__name__
        finally:
            signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGINT})
        sender.join()
        time.sleep(0.05)
        left = [p for p in psutil.Process().children(recursive=True) if p.status() != psutil.STATUS_ZOMBIE]
        for p in left:  # a stage process nothing stopped: counted, then killed for the next round
            p.kill()
        stopped = not os.path.exists(ran_out)  # the busy stage did not run to its end by itself
        if not stopped:
            os.remove(ran_out)
        print("round", json.dumps([delay, other_thread, outcome, stopped, len(left), len(glob.glob(tmp + "/pivotrl-*"))]),
              flush=True)
""")

#: The busy stage process: 15 s of start-up, then it notes that nothing stopped it and exits.
BUSY_STAGE = "import os, time\ntime.sleep(15)\nopen(os.environ['BUSY_RAN_OUT'], 'w').close()\nos._exit(7)\n"


def test_a_ctrl_c_at_any_moment_of_a_stage_start_stops_the_stage_and_raises_keyboard_interrupt(tmp_path):
    """SIGINT (Python's own handler, no CLI) sent 0 to 300 ms after the stage's spec is written:
    inside ``subprocess.Popen`` after the fork, between the Popen and the streaming loop, or while
    the parent waits on the stage's output. Every time the stage process is stopped (it does not
    run its 15-s start-up to the end), its spec directory removed and KeyboardInterrupt raised.

    In the rounds marked ``other_thread`` the main thread blocks SIGINT, so the kernel hands it to
    the thread that sends it: the main thread learns of it only from Python's flag, as when a
    SIGINT lands just before the parent starts to wait on the stage's output. A parent waiting in a
    blocking read then ran its handler only when the stage printed again, after its start-up; it
    now waits in short ``select`` slices (pivotrl.pipeline.processes.child_lines)."""
    import json
    import os

    tmp = tmp_path / "tmp"
    busy = tmp_path / "busy"
    tmp.mkdir(), busy.mkdir()
    (busy / "sitecustomize.py").write_text(BUSY_STAGE)
    rounds_in = [[d, False] for d in (0.0, 0.0, 0.0005, 0.001, 0.002, 0.005, 0.01, 0.03, 0.1)]
    rounds_in += [[d, True] for d in (0.0, 0.002, 0.01, 0.1, 0.3)]
    out = subprocess.run([sys.executable, "-c", INTERRUPT_LOOP, str(busy), str(tmp_path / "root"),
                          str(tmp_path / "ran-out"), json.dumps(rounds_in)],
                         capture_output=True, text=True, timeout=240, env={**os.environ, "TMPDIR": str(tmp)},
                         cwd=Path(__file__).resolve().parents[2])
    assert out.returncode == 0, out.stderr[-3000:]
    rounds = [json.loads(line[6:]) for line in out.stdout.splitlines() if line.startswith("round ")]
    assert [r[:2] for r in rounds] == rounds_in
    # [delay, other thread, outcome, stage stopped, processes left, dirs left]
    assert [r for r in rounds if r[2:] != ["interrupted", True, 0, 0]] == []
    assert "Exception ignored" not in out.stderr


def test_child_lines_reads_lines_as_text_mode_does():
    """Universal newlines, a last line without its newline, undecodable bytes replaced."""
    from pivotrl.pipeline.processes import child_lines

    code = ("import os, time; os.write(1, b'a\\r\\nb\\rc\\n'); time.sleep(0.3); "
            "os.write(1, b'half '); time.sleep(0.3); os.write(1, b'line\\n\\xff end')")
    proc = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True, encoding="utf-8")
    lines = list(child_lines(proc, poll_s=0.05))
    assert proc.wait(timeout=30) == 0
    proc.stdout.close()
    assert lines == ["a\n", "b\n", "c\n", "half line\n", "\ufffd end"]


def test_finding_this_processes_own_children_raises_no_warning_from_deprecated_module_objects():
    import warnings

    import torch.distributed  # noqa: F401  (holds reduce_op, whose __class__ warns)

    from pivotrl.pipeline.processes import _own_children

    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"])
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            assert child.pid in _own_children()
    finally:
        child.kill()
        child.wait()
