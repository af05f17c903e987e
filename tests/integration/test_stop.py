"""Ctrl-C on ``pivotrl run`` and ``pivotrl compare``: every process of the run stops, and a rerun completes.

A real run of the smoke config (tiny random model, transformers engine, ephemeral Prefect server
started by the CLI) is interrupted with SIGINT during the warm start, during probing and during
training (there with a second SIGINT right after the first: it must exit at once too), and with
SIGTERM during evaluation. Every
process ever seen in the CLI's tree (the Prefect server, stage processes, sandbox workers) must be
gone when the CLI has exited; then a rerun resumes from what was published and finishes, and
``pivotrl compare`` on that run is interrupted during its SFT baseline the same way.
"""

from __future__ import annotations

import os
import queue
import re
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import psutil
import pytest

pytestmark = pytest.mark.integration

REPO = Path(__file__).resolve().parents[2]
#: A run that has not exited this long after the signal hangs. Not a speed claim: a quiet machine stops
#: in a few seconds; a loaded one may take longer, and that is not what this test is about.
STOP_LIMIT_S = 120.0


class Run:
    """``pivotrl <command>`` on the smoke config in a child process; its output lines and the set of
    processes ever seen in its tree."""

    def __init__(self, tmp: Path, model: Path, command: str = "run") -> None:
        env = {k: v for k, v in os.environ.items() if not k.startswith("PREFECT_API")}
        # A cache of its own (what a killed stage leaves there stays in tmp), sharing the BFCL data.
        env.update(PREFECT_HOME=str(tmp / "prefect"), PIVOTRL_PROGRESS_INTERVAL_S="2", OMP_NUM_THREADS="1",
                   PYTHONUNBUFFERED="1", PIVOTRL_CACHE_DIR=str(_run_cache(tmp)))
        cli = Path(sys.executable).with_name("pivotrl")
        sets = [f"run.storage_root={tmp / 'runs'}", f"model.source={model}"]
        cmd = [str(cli), command, "--config", str(REPO / "configs" / "smoke.yaml")]
        for s in sets:
            cmd += ["--set", s]
        self.proc = subprocess.Popen(cmd, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                     text=True)
        self.lines: list[str] = []
        self._q: queue.Queue[str] = queue.Queue()
        self.seen: dict[tuple[int, float], psutil.Process] = {}
        self._cmdline: dict[tuple[int, float], str] = {}
        self._done = threading.Event()
        threading.Thread(target=self._read, daemon=True).start()
        threading.Thread(target=self._watch, daemon=True).start()

    @property
    def cmdlines(self) -> list[str]:
        """The command line of every process seen in the tree (the last one read while it ran)."""
        return list(self._cmdline.values())

    def _read(self) -> None:
        for line in self.proc.stdout:
            self.lines.append(line)
            self._q.put(line)

    def _watch(self) -> None:
        root = psutil.Process(self.proc.pid)
        while not self._done.is_set():
            try:
                for p in root.children(recursive=True):
                    key = (p.pid, p.create_time())
                    self.seen.setdefault(key, p)
                    # read again on every pass: a child seen between fork and exec still shows its
                    # parent's command line; a process that has exited shows none (kept as last read)
                    if cmd := " ".join(p.cmdline()):
                        self._cmdline[key] = cmd
            except psutil.Error:
                pass
            time.sleep(0.1)

    def wait_for(self, pattern: str, timeout: float = 240.0) -> str:
        rx = re.compile(pattern)
        end = time.monotonic() + timeout
        while time.monotonic() < end:
            try:
                line = self._q.get(timeout=1.0)
            except queue.Empty:
                if self.proc.poll() is not None:
                    break
                continue
            if rx.search(line):
                return line
        raise AssertionError(f"{pattern!r} never appeared; output:\n{''.join(self.lines[-40:])}")

    def interrupt(self, *, times: int = 1, sig: int = signal.SIGINT) -> float:
        """``sig`` (``times`` times, 0.2 s apart); returns seconds until the CLI exited."""
        t0 = time.monotonic()
        for i in range(times):
            if i:
                time.sleep(0.2)
            self.proc.send_signal(sig)
        try:
            self.proc.wait(timeout=STOP_LIMIT_S)
        finally:
            self._done.set()
        return time.monotonic() - t0

    def leftovers(self) -> list[str]:
        left = []
        for p in self.seen.values():
            try:
                if p.is_running() and p.status() != psutil.STATUS_ZOMBIE:
                    left.append(f"{p.pid} {' '.join(p.cmdline())[:120]}")
            except psutil.Error:
                pass
        return left


def _run_cache(tmp: Path) -> Path:
    from pivotrl.bfcl.wheel import ensure_bfcl

    cache = tmp / "cache"
    if not cache.exists():
        bfcl = ensure_bfcl(os.environ.get("PIVOTRL_CACHE_DIR") or Path.home() / ".cache" / "pivotrl")
        cache.mkdir()
        (cache / bfcl.name).symlink_to(bfcl, target_is_directory=True)
    return cache


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory):
    from pivotrl.testing import save_tiny_checkpoint

    return save_tiny_checkpoint(tmp_path_factory.mktemp("model") / "tiny")


def _interrupt_during(tmp: Path, model: Path, pattern: str, times: int = 1, sig: int = signal.SIGINT,
                      command: str = "run") -> Run:
    run = Run(tmp, model, command)
    run.wait_for(pattern)
    took = run.interrupt(times=times, sig=sig)
    left = run.leftovers()
    assert left == [], f"processes left after Ctrl-C: {left}"
    assert took < STOP_LIMIT_S, f"the run did not stop within {STOP_LIMIT_S:.0f} s of the signal ({took:.1f} s)"
    assert run.proc.returncode == 128 + sig
    out = "".join(run.lines)
    assert f"{signal.Signals(sig).name}: stopping every process of the run" in out
    cmds = "\n".join(run.cmdlines)
    assert "pivotrl.pipeline.entry" in cmds, cmds  # the stage process was in the tree
    assert "prefect" in cmds and "server" in cmds or "uvicorn" in cmds, cmds  # and Prefect's server
    if times == 1:  # a graceful stop releases the stage's lease (a second signal exits at once)
        assert sorted(p.name for p in (tmp / "runs" / "leases").glob("*")) == []
    return run


def test_ctrl_c_stops_every_process_in_every_stage_and_a_rerun_completes(tmp_path, tiny_model):
    first = _interrupt_during(tmp_path, tiny_model, r"warm start: \d+/\d+ micro-batches")
    assert not any("stage reference: finished" in line for line in first.lines)
    probe = _interrupt_during(tmp_path, tiny_model, r"probing: \d+/\d+ states")
    assert not any("stage probe: finished" in line for line in probe.lines)
    train = _interrupt_during(tmp_path, tiny_model, r"training: \d+/\d+ group updates", times=2)
    assert not any("stage train: finished" in line for line in train.lines)
    # The warm start finished in the second run: the third one reused it.
    assert any("stage reference: finished" in line for line in probe.lines)
    # SIGTERM (what `make` sends its recipe when it is terminated) stops the run the same way.
    evaluate = _interrupt_during(tmp_path, tiny_model, r"evaluation: \d+/\d+ turns", sig=signal.SIGTERM)
    assert not any("stage evaluate: finished" in line for line in evaluate.lines)

    rerun = Run(tmp_path, tiny_model)
    rc = rerun.proc.wait(timeout=600)
    rerun._done.set()
    out = "".join(rerun.lines)
    assert rc == 0, out[-3000:]
    assert "PivotRL run finished" in out and "report:" in out
    assert "stage reference: started" not in out  # published stages are not redone
    assert rerun.leftovers() == []

    # The comparison's own stages stop the same way (the run's stages are cached by then).
    sft = _interrupt_during(tmp_path, tiny_model, r"sft baseline", command="compare")
    out = "".join(sft.lines)
    assert "stage sft_baseline: started" in out and "comparison finished" not in out
