"""Tool execution outside the caller's process: a pool of long-lived, resource-limited workers.

Each worker is a separate Python interpreter (``python -m pivotrl.envs.sandbox_worker``) that talks to
the pool over its stdin/stdout pipes (length-prefixed JSON). A request names a function from the
pool's allow-list and carries a JSON payload; the reply is the function's JSON result.

Inside a worker:

- ``RLIMIT_AS`` caps its address space at ``memory_mb`` (a runaway allocation raises MemoryError,
  reported as reason ``"memory"``, and the worker is replaced);
- ``RLIMIT_CPU`` gives each request at most ``cpu_s`` seconds of CPU time (the soft limit is moved
  forward before every request; exceeding it kills the worker with SIGXCPU → reason ``"timeout"``);
- every request runs in a fresh, empty temporary working directory, removed afterwards;
- the worker leads its own process group, so killing it also kills anything a tool started;
- network access is blocked *best-effort*: creating an internet socket (``socket.socket`` for any
  family but AF_UNIX), ``socket.create_connection`` and name resolution raise PermissionError.
  This is a guard against accidents, not a kernel sandbox: code that reaches the C-level
  ``_socket`` module or spawns programs is not stopped. Run untrusted code in a container.

With a :class:`~pivotrl.runtime.faults.FaultInjector` (``faults=``), the pool draws one fault per request
(in its own process, from the injector's private RNG); the worker sleeps the drawn latency and, for
a failure, exits with :data:`~pivotrl.runtime.faults.FAULT_EXIT_CODE` before running the function, which
the pool reports as reason ``"crash"`` (retryable) and replaces the worker.

In the pool, a request that gets no reply within ``timeout_s`` wall-clock seconds is killed (the
worker is replaced) and raises :class:`SandboxError` with reason ``"timeout"``; a worker that dies
mid-request (segfault, ``os._exit``) gives reason ``"crash"``; an exception raised by the function
itself gives reason ``"error"`` (the worker survives).
"""

from __future__ import annotations

import json
import os
import queue
import select
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any, Mapping

from pivotrl.envs.sandbox_worker import FRAME_HEADER, write_message
from pivotrl.core.errors import ConfigError, ToolExecutionError
from pivotrl.runtime.faults import FAULT_EXIT_CODE, FaultInjector, ToolFault
from pivotrl.core.retry import RetryStats, call_with_retries  # re-exported: the one retry mechanism

__all__ = ["BUILTIN_FUNCTIONS", "RetryStats", "SandboxError", "SandboxPool", "call_with_retries"]

# name → "module:function". Each function takes (payload, settings) and returns a JSON value;
# ``settings`` holds the pool's ``bfcl_root`` (str or None).
BUILTIN_FUNCTIONS: dict[str, str] = {
    "echo": "pivotrl.envs.sandbox_worker:_fn_echo",
    "sleep": "pivotrl.envs.sandbox_worker:_fn_sleep",
    "allocate": "pivotrl.envs.sandbox_worker:_fn_allocate",
    "exit": "pivotrl.envs.sandbox_worker:_fn_exit",
    "spin": "pivotrl.envs.sandbox_worker:_fn_spin",
    "network": "pivotrl.envs.sandbox_worker:_fn_network",
    "bfcl.execute_candidates": "pivotrl.verifiers.execution:execute_candidates",
}

REASONS = ("timeout", "crash", "memory", "error")


class SandboxError(ToolExecutionError):
    """A sandboxed request failed; ``reason`` is one of "timeout", "crash", "memory", "error"."""

    def __init__(self, message: str, reason: str) -> None:
        super().__init__(message)
        self.reason = reason


# -------------------------------------------------------------------------------------- the pool


def _package_parent() -> str:
    import pivotrl

    return str(Path(pivotrl.__file__).resolve().parent.parent)


class _Worker:
    """One worker process and its pipes (used by one thread at a time)."""

    def __init__(self, settings: Mapping[str, Any]) -> None:
        env = dict(os.environ)
        env["PYTHONPATH"] = os.pathsep.join([_package_parent()] + ([env["PYTHONPATH"]] if env.get("PYTHONPATH") else []))
        env["PYTHONDONTWRITEBYTECODE"] = "1"
        env.setdefault("OMP_NUM_THREADS", "1")
        self._stderr = tempfile.TemporaryFile()
        # The worker's scratch directory belongs to this side: a killed worker cannot remove it.
        self.base_dir = tempfile.mkdtemp(prefix="pivotrl-sandbox-")
        self.proc = subprocess.Popen(
            [sys.executable, "-u", "-m", "pivotrl.envs.sandbox_worker", json.dumps({**settings, "base_dir": self.base_dir})],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=self._stderr,
            env=env,
            start_new_session=True,
        )

    def request(self, fn: str, payload: Any, timeout_s: float, fault: ToolFault | None = None) -> Any:
        msg: dict[str, Any] = {"fn": fn, "payload": payload}
        if fault is not None:
            msg["fault"] = fault.to_dict()
        try:
            write_message(self.proc.stdin, msg)
        except (BrokenPipeError, OSError):
            raise self._died(fn) from None
        deadline = time.monotonic() + timeout_s
        fd = self.proc.stdout.fileno()
        header = self._read_exact(fd, FRAME_HEADER.size, deadline, fn, timeout_s)
        (n,) = FRAME_HEADER.unpack(header)
        body = self._read_exact(fd, n, deadline, fn, timeout_s)
        reply = json.loads(body.decode("utf-8"))
        if reply.get("ok"):
            return reply["result"]
        reason = reply.get("reason", "error")
        raise SandboxError(f"sandbox function {fn!r} failed ({reason}): {reply.get('error', '')}", reason)

    def _read_exact(self, fd: int, n: int, deadline: float, fn: str, timeout_s: float) -> bytes:
        chunks: list[bytes] = []
        got = 0
        while got < n:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                self.kill()
                raise SandboxError(f"sandbox function {fn!r} timed out after {timeout_s:g} s; worker replaced", "timeout")
            ready, _, _ = select.select([fd], [], [], remaining)
            if not ready:
                continue
            chunk = os.read(fd, min(n - got, 1 << 20))
            if not chunk:
                raise self._died(fn)
            chunks.append(chunk)
            got += len(chunk)
        return b"".join(chunks)

    def _died(self, fn: str) -> SandboxError:
        try:
            code = self.proc.wait(timeout=5)
        except subprocess.TimeoutExpired:
            self.kill()
            code = self.proc.returncode
        self._stderr.seek(0)
        tail = self._stderr.read()[-800:].decode("utf-8", "replace").strip()
        if code is not None and code < 0 and -code == getattr(signal, "SIGXCPU", -1):
            reason, what = "timeout", "exceeded its CPU-time limit"
        elif code == FAULT_EXIT_CODE:
            reason, what = "crash", f"died of an injected tool fault (exit code {code}, faults.tool_failure_rate)"
        else:
            reason, what = "crash", f"died (exit code {code})"
        detail = f"; stderr: {tail}" if tail else ""
        return SandboxError(f"sandbox worker {what} while running {fn!r}{detail}", reason)

    def alive(self) -> bool:
        return self.proc.poll() is None

    def kill(self) -> None:
        if self.proc.poll() is None:
            try:
                os.killpg(self.proc.pid, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                self.proc.kill()
        self.proc.wait()
        self.close_files()

    def close_files(self) -> None:
        for f in (self.proc.stdin, self.proc.stdout, self._stderr):
            try:
                if f is not None:
                    f.close()
            except OSError:
                pass
        shutil.rmtree(self.base_dir, ignore_errors=True)

    def shutdown(self) -> None:
        if self.proc.poll() is None and self.proc.stdin is not None:
            try:
                self.proc.stdin.close()  # EOF: the worker loop exits
                self.proc.wait(timeout=2)
            except (OSError, subprocess.TimeoutExpired):
                pass
        self.kill()


class SandboxPool:
    """A pool of ``num_workers`` long-lived sandbox worker processes (thread-safe).

    Args:
        num_workers: worker processes (requests run in parallel up to this number).
        timeout_s: wall-clock limit of one request, seconds.
        memory_mb: address-space limit (RLIMIT_AS) of each worker, MiB.
        cpu_s: CPU-time limit of one request (RLIMIT_CPU), seconds; default ``2 * timeout_s``.
        bfcl_root: directory containing ``bfcl_eval/`` (passed to worker functions as
            ``settings["bfcl_root"]``), or None.
        functions: extra allow-listed functions, ``name → "module:function"`` (the module must be
            importable in a fresh interpreter); added to :data:`BUILTIN_FUNCTIONS`.
        faults: a :class:`~pivotrl.runtime.faults.FaultInjector` deciding injected failures and latency per
            request (None = no injection).

    Use as a context manager or call :meth:`close`. Workers start lazily, on first use.
    """

    def __init__(
        self,
        num_workers: int = 1,
        timeout_s: float = 10.0,
        memory_mb: int = 1024,
        cpu_s: float | None = None,
        bfcl_root: str | os.PathLike[str] | None = None,
        functions: Mapping[str, str] | None = None,
        faults: FaultInjector | None = None,
    ) -> None:
        if num_workers < 1:
            raise ConfigError(f"SandboxPool: num_workers={num_workers}: must be >= 1")
        if timeout_s <= 0:
            raise ConfigError(f"SandboxPool: timeout_s={timeout_s}: must be > 0")
        if memory_mb < 64:
            raise ConfigError(f"SandboxPool: memory_mb={memory_mb}: must be >= 64 (a Python interpreter needs it)")
        self.num_workers = num_workers
        self.timeout_s = float(timeout_s)
        self.cpu_s = float(cpu_s) if cpu_s is not None else 2.0 * float(timeout_s)
        if self.cpu_s <= 0:
            raise ConfigError(f"SandboxPool: cpu_s={cpu_s}: must be > 0")
        self.functions = {**BUILTIN_FUNCTIONS, **dict(functions or {})}
        for name, target in self.functions.items():
            if ":" not in target:
                raise ConfigError(f"SandboxPool: function {name!r} → {target!r}: expected 'module:function'")
        self._settings = {
            "memory_mb": int(memory_mb),
            "cpu_s": self.cpu_s,
            "bfcl_root": None if bfcl_root is None else str(bfcl_root),
            "functions": self.functions,
        }
        self._idle: queue.LifoQueue[_Worker | None] = queue.LifoQueue()
        for _ in range(num_workers):
            self._idle.put(None)  # a slot; the worker starts on first use
        self._all: set[_Worker] = set()
        self._lock = threading.Lock()
        self._closed = False
        self.replaced = 0  # workers killed and replaced (timeouts, crashes, memory errors)
        self.faults = faults if faults is not None and faults.enabled else None

    def call(self, fn: str, payload: Any = None) -> Any:
        """Run allow-listed function ``fn`` on the JSON ``payload`` in a worker; its JSON result.

        Raises ConfigError for a name not in the allow-list, SandboxError (a ToolExecutionError)
        with ``reason`` "timeout" | "crash" | "memory" | "error" when the request fails.
        """
        if fn not in self.functions:
            raise ConfigError(f"sandbox function {fn!r} is not allowed; allowed: {', '.join(sorted(self.functions))}")
        if self._closed:
            raise ToolExecutionError("the sandbox pool is closed")
        worker = self._idle.get()
        try:
            if worker is None or not worker.alive():
                worker = self._start(worker)
            fault = self.faults.draw() if self.faults is not None else None
            try:
                return worker.request(fn, payload, self.timeout_s, fault)
            except Exception as e:
                if isinstance(e, SandboxError) and e.reason == "error":
                    raise  # the function raised; the worker itself is fine
                # The worker is dead or its protocol state is unknown: replace it.
                self._discard(worker)
                worker = None
                with self._lock:
                    self.replaced += 1
                if isinstance(e, SandboxError):
                    raise
                raise SandboxError(f"sandbox worker protocol failure in {fn!r}: {type(e).__name__}: {e}", "crash") from e
        finally:
            self._idle.put(worker)

    def _start(self, old: _Worker | None) -> _Worker:
        if old is not None:
            self._discard(old)
        w = _Worker(self._settings)
        with self._lock:
            self._all.add(w)
        return w

    def _discard(self, w: _Worker) -> None:
        w.kill()
        with self._lock:
            self._all.discard(w)

    def close(self) -> None:
        """Stop every worker (idempotent)."""
        self._closed = True
        with self._lock:
            workers = list(self._all)
            self._all.clear()
        for w in workers:
            w.shutdown()

    def __enter__(self) -> "SandboxPool":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    def __del__(self) -> None:  # pragma: no cover - best effort at interpreter exit
        try:
            self.close()
        except Exception:
            pass
