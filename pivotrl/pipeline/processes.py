"""Stopping a run cleanly: every process of a run dies with it.

A run is a tree of processes: the CLI (or a flow-run process), Prefect's ephemeral API server,
one stage process at a time (started in its own session, see
:func:`pivotrl.pipeline.entry.run_stage_process`) and whatever the stage starts — vLLM engine
processes, DeepSpeed ranks, sandbox workers (their own sessions too). Three mechanisms:

- :func:`become_subreaper`: the CLI adopts orphaned descendants (Linux ``PR_SET_CHILD_SUBREAPER``),
  so a grandchild whose parent died early is still found in the CLI's tree; a reaper thread
  (:func:`reap_orphans`, every second) collects the exit status of each adopted orphan that ends
  (e.g. an engine's worker process outliving its engine), so none is left ``<defunct>``.
- :class:`StopOnSignal`: the CLI's SIGINT/SIGTERM handler. The first signal snapshots the whole
  tree, sends SIGTERM to every process (and to the process group of each stage), waits up to
  ``grace_s`` (5 s), SIGKILLs what is left and exits (130 for SIGINT, 143 for SIGTERM); a second
  signal SIGKILLs the tree and exits at once. Stages publish artifacts atomically (temporary key,
  then move; a ``_COMPLETE`` marker last), so a stop leaves nothing half-written visible and the
  next run resumes from what was published.
- :class:`StopChildOnInterrupt`: without the CLI's handler (a flow run in a worker, a script),
  :func:`pivotrl.pipeline.entry.run_stage_process` takes SIGINT over while it starts and streams a
  stage: the stage's tree is stopped wherever the signal lands (Python's own handler raised
  KeyboardInterrupt inside ``subprocess.Popen`` after the fork, leaving the started stage running)
  and KeyboardInterrupt is raised once it is gone. The stage's output is read in short ``select``
  slices (:func:`child_lines`), so that a signal's Python handler — this one, the CLI's, Python's
  own — runs within :data:`SIGNAL_CHECK_S` wherever the signal lands, also just before the wait.
- :func:`watch_parent`: a stage process kills its own process group when its parent dies (e.g. the
  CLI was SIGKILLed), so no stage outlives its run.

A run's temporary directories (:mod:`pivotrl.pipeline.tempdirs`) are removed by
:class:`StopOnSignal` before it exits.
"""

from __future__ import annotations

import gc
import multiprocessing
import os
import signal
import subprocess
import sys
import threading
import time
from typing import Any, Iterable, Iterator

from pivotrl.pipeline.tempdirs import remove_tempdirs
from pivotrl.storage.lease import release_held_leases

#: Seconds the processes of a run get between SIGTERM and SIGKILL.
GRACE_S = 5.0


#: Seconds between two passes of the reaper thread of a subreaper.
REAP_INTERVAL_S = 1.0
_REAPER: threading.Thread | None = None


def become_subreaper(*, reap: bool = True) -> bool:
    """Make this process the reaper of its orphaned descendants (Linux); False where unsupported.

    ``reap``: also start the daemon thread that collects the adopted orphans that end
    (:func:`reap_orphans` every :data:`REAP_INTERVAL_S`); a subreaper that never waits for its
    adopted children keeps each of them as a zombie until it exits."""
    global _REAPER
    if not sys.platform.startswith("linux"):
        return False
    try:
        import ctypes

        libc = ctypes.CDLL(None, use_errno=True)
        ok = libc.prctl(36, 1, 0, 0, 0) == 0  # PR_SET_CHILD_SUBREAPER
    except (OSError, AttributeError):
        return False
    if ok and reap and (_REAPER is None or not _REAPER.is_alive()):
        def loop() -> None:
            while True:
                time.sleep(REAP_INTERVAL_S)
                reap_orphans()

        _REAPER = threading.Thread(target=loop, name="reap-orphans", daemon=True)
        _REAPER.start()
    return ok


def _own_children() -> set[int]:
    """Pids of the children this process started and will wait for itself: live ``subprocess.Popen``
    objects (asyncio's subprocesses included) and multiprocessing children."""
    owned = {p.pid for p in multiprocessing.active_children()}
    for obj in gc.get_objects():
        # type(), not isinstance(): isinstance reads ``__class__``, which some deprecated module objects
        # (torch.distributed.reduce_op) answer with a FutureWarning
        if issubclass(type(obj), subprocess.Popen) and obj.returncode is None and obj.pid:
            owned.add(obj.pid)
    return owned


def reap_orphans() -> list[int]:
    """Collect the exit status of every ended child of this process that it did not start itself
    (an orphan it adopted as a subreaper); returns their pids. A child started here (a ``Popen``, a
    multiprocessing child) is left to its owner, whose ``wait`` must see its real exit code."""
    import psutil

    try:
        zombies = [p.pid for p in psutil.Process().children() if p.status() == psutil.STATUS_ZOMBIE]
    except psutil.Error:
        return []
    if not zombies:
        return []
    owned = _own_children()
    reaped = []
    for pid in zombies:
        if pid in owned:
            continue
        try:
            if os.waitpid(pid, os.WNOHANG)[0] == pid:
                reaped.append(pid)
        except ChildProcessError:  # its owner waited first
            pass
    return reaped


def descendants(pid: int | None = None) -> list[Any]:
    """Every live descendant of ``pid`` (default: this process) as psutil.Process objects."""
    import psutil

    try:
        return psutil.Process(pid or os.getpid()).children(recursive=True)
    except psutil.Error:
        return []


def _signal_all(procs: Iterable[Any], sig: int) -> None:
    import psutil

    groups = set()
    for p in procs:
        try:
            pgid = os.getpgid(p.pid)
            if pgid == p.pid and pgid != os.getpgrp():  # a stage (or worker) leading its own group
                groups.add(pgid)
            p.send_signal(sig)
        except (psutil.Error, ProcessLookupError, PermissionError):
            pass
    for g in groups:
        try:
            os.killpg(g, sig)
        except (ProcessLookupError, PermissionError):
            pass


def stop_tree(procs: list[Any], grace_s: float = GRACE_S) -> list[Any]:
    """SIGTERM ``procs`` (and the process groups they lead), wait up to ``grace_s``, SIGKILL the
    rest; returns the processes still alive after that (normally none)."""
    import psutil

    _signal_all(procs, signal.SIGTERM)
    _, alive = psutil.wait_procs(procs, timeout=grace_s)
    if alive:
        _signal_all(alive, signal.SIGKILL)
        _, alive = psutil.wait_procs(alive, timeout=2.0)
    return alive


def _say(text: str) -> None:
    try:
        os.write(2, text.encode())  # not sys.stderr: a signal handler may interrupt its buffer
    except OSError:
        pass


class StopOnSignal:
    """SIGINT/SIGTERM handler of a run (see the module docstring); :meth:`install` it in the main thread."""

    def __init__(self, grace_s: float = GRACE_S) -> None:
        self.grace_s = grace_s
        self.stopping = False
        self._seen: dict[int, Any] = {}

    def install(self) -> "StopOnSignal":
        become_subreaper()
        signal.signal(signal.SIGINT, self._handle)
        signal.signal(signal.SIGTERM, self._handle)
        return self

    def _handle(self, signum: int, _frame: Any) -> None:
        code = 128 + signum
        if self.stopping:  # second signal: no more waiting
            _say("\nstopping now\n")
            _signal_all(list(self._seen.values()) + descendants(), signal.SIGKILL)
            remove_tempdirs()
            os._exit(code)
        self.stopping = True
        name = signal.Signals(signum).name
        t0 = time.monotonic()
        _say(f"\n{name}: stopping every process of the run (again to exit at once) ...\n")
        procs = descendants()
        self._seen = {p.pid: p for p in procs}
        left = stop_tree(procs, self.grace_s)
        left += stop_tree(descendants(), 1.0)  # anything started meanwhile
        remove_tempdirs()  # os._exit runs no finally: the stages' spec files go here
        release_held_leases()  # nor the stages' leases
        _say(f"stopped in {time.monotonic() - t0:.1f} s"
             + (f"; still alive: {sorted(p.pid for p in left)}" if left else "")
             + ". Published artifacts are kept; the next run resumes from them.\n")
        os._exit(code)


def watch_parent(interval_s: float = 1.0) -> threading.Thread | None:
    """In a stage process that leads its own process group: a daemon thread that kills the group
    (the stage and its engine/ranks) when the parent process dies. None when not a group leader."""
    if os.getpgrp() != os.getpid():
        return None
    parent = os.getppid()

    def watch() -> None:
        while True:
            time.sleep(interval_s)
            if os.getppid() != parent:
                _signal_all(descendants(), signal.SIGKILL)
                os.killpg(os.getpgrp(), signal.SIGKILL)

    t = threading.Thread(target=watch, name="watch-parent", daemon=True)
    t.start()
    return t


#: Longest time (seconds) the main thread waits on a child's output or exit before it runs
#: Python's pending signal handlers (see :func:`child_lines`).
SIGNAL_CHECK_S = 0.2


def child_lines(proc: subprocess.Popen, poll_s: float = SIGNAL_CHECK_S) -> Iterator[str]:
    """The lines a child writes to its ``stdout`` pipe (``proc`` started with ``stdout=PIPE``),
    each as it comes, until end of file; universal newlines, as ``text=True`` reads them, and
    undecodable bytes replaced. The text ``proc.stdout`` wrapper, if any, is not read.

    Waits in ``select`` slices of at most ``poll_s`` seconds and reads only what is there, so a
    signal's Python handler runs within ``poll_s`` wherever the signal lands. A blocking read
    (``for line in proc.stdout``) does not: a SIGINT that arrives after Python last checked for
    signals and before the read starts to wait has its C handler run and interrupts nothing, and
    its Python handler (KeyboardInterrupt, :class:`StopChildOnInterrupt`, :class:`StopOnSignal`)
    then waits for the child's next output — for a stage busy loading a model, or the child that
    was to be stopped, possibly never."""
    import codecs
    import io
    import selectors

    assert proc.stdout is not None
    fd = proc.stdout.fileno()
    encoding = getattr(proc.stdout, "encoding", None) or "utf-8"
    decoder = io.IncrementalNewlineDecoder(codecs.getincrementaldecoder(encoding)(errors="replace"), translate=True)
    pending = ""
    with selectors.DefaultSelector() as sel:
        sel.register(fd, selectors.EVENT_READ)
        while True:
            if not sel.select(poll_s):
                continue  # back in Python: a handler of a signal that arrived meanwhile runs here
            chunk = os.read(fd, 65536)
            pending += decoder.decode(chunk, final=not chunk)
            *lines, pending = pending.split("\n")
            for line in lines:
                yield line + "\n"
            if not chunk:
                if pending:
                    yield pending
                return


def wait_child(proc: subprocess.Popen, poll_s: float = SIGNAL_CHECK_S) -> int:
    """``proc.wait()`` in slices of ``poll_s`` seconds, so that signal handlers run meanwhile
    (see :func:`child_lines`); returns the exit code."""
    while True:
        try:
            return proc.wait(timeout=poll_s)
        except subprocess.TimeoutExpired:
            continue


class StopChildOnInterrupt:
    """A Ctrl-C, while a process waits for one child (a stage process): stop the child, then raise
    KeyboardInterrupt where it is safe. Used as ``with StopChildOnInterrupt() as stop: ...
    stop.watch(proc.pid)``.

    Python's own SIGINT handler raises KeyboardInterrupt wherever the main thread is: inside
    ``subprocess.Popen`` after the fork (the child is started but no ``proc`` is returned, so
    nothing stops it), between the ``Popen`` and the ``try`` that would stop it, or inside a
    finalizer run by the garbage collector, where the exception is printed and swallowed (the
    process then waits on the child as if nothing happened). Within the block this class's
    handler raises nothing: the first SIGINT sends SIGTERM to the child's tree (at once if its pid
    is known, else when :meth:`watch` gets it), a watcher thread SIGKILLs what is left after
    ``grace_s`` (seconds), a second SIGINT SIGKILLs at once; the block's end waits for the child's
    tree to be gone and raises KeyboardInterrupt (in place of the error the stopped child caused).

    Only installed where SIGINT has Python's default handler and in the main thread; elsewhere (the
    CLI's :class:`StopOnSignal` is installed, a worker thread) the block changes nothing."""

    def __init__(self, grace_s: float = 3.0) -> None:
        self.grace_s = grace_s
        self.signalled = 0
        self.pid: int | None = None
        self._tree: list[Any] = []
        self._installed = False
        self._previous: Any = None
        self._watcher: threading.Thread | None = None
        self._done = False

    def __enter__(self) -> "StopChildOnInterrupt":
        if (threading.current_thread() is threading.main_thread()
                and signal.getsignal(signal.SIGINT) is signal.default_int_handler):
            self._previous = signal.signal(signal.SIGINT, self._handle)
            self._installed = True
        return self

    def _handle(self, _signum: int, _frame: Any) -> None:
        self.signalled += 1
        self._stop(signal.SIGTERM if self.signalled == 1 else signal.SIGKILL)

    def _stop(self, sig: int) -> None:
        if self.pid is None:
            return
        import psutil

        try:
            self._tree = [psutil.Process(self.pid)] + descendants(self.pid) + self._tree
        except psutil.Error:
            pass
        _signal_all(self._tree, sig)

    def watch(self, pid: int) -> None:
        """The child to stop: a SIGINT received before this call stops it now."""
        self.pid = pid
        if not self._installed:
            return
        if self.signalled:
            self._stop(signal.SIGTERM)

        def kill_after_grace() -> None:
            import psutil

            while not self.signalled:
                if not psutil.pid_exists(pid) or self._done:
                    return
                time.sleep(0.05)
            _, alive = psutil.wait_procs(list(self._tree), timeout=self.grace_s)
            _signal_all(alive, signal.SIGKILL)

        self._watcher = threading.Thread(target=kill_after_grace, name="stop-child", daemon=True)
        self._watcher.start()

    def __exit__(self, exc_type: Any, _exc: Any, _tb: Any) -> bool:
        self._done = True
        if not self._installed:
            return False
        try:
            if self.signalled:
                import psutil

                # The tree seen at the signal, with what it started since (psutil.Process objects:
                # a pid reused after the child was waited for is not signalled).
                tree = list(self._tree)
                for p in self._tree:
                    try:
                        tree += p.children(recursive=True)
                    except psutil.Error:
                        pass
                left = stop_tree(tree, self.grace_s)
                _signal_all(left, signal.SIGKILL)
        finally:
            signal.signal(signal.SIGINT, self._previous)
        if self.signalled and (exc_type is None or not issubclass(exc_type, KeyboardInterrupt)):
            raise KeyboardInterrupt  # a stopped child's failure is the interrupt, not a stage error
        return False
