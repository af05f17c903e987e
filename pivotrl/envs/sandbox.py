"""Tool execution outside the caller's process: a pool of long-lived, resource-limited workers.

Each worker is a separate Python interpreter (``python -m pivotrl.envs.sandbox``) that talks to
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

With a :class:`~pivotrl.faults.FaultInjector` (``faults=``), the pool draws one fault per request
(in its own process, from the injector's private RNG); the worker sleeps the drawn latency and, for
a failure, exits with :data:`~pivotrl.faults.FAULT_EXIT_CODE` before running the function, which
the pool reports as reason ``"crash"`` (retryable) and replaces the worker.

In the pool, a request that gets no reply within ``timeout_s`` wall-clock seconds is killed (the
worker is replaced) and raises :class:`SandboxError` with reason ``"timeout"``; a worker that dies
mid-request (segfault, ``os._exit``) gives reason ``"crash"``; an exception raised by the function
itself gives reason ``"error"`` (the worker survives).
"""

from __future__ import annotations

import importlib
import json
import os
import queue
import select
import shutil
import signal
import struct
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Mapping, TypeVar

from pivotrl.errors import ConfigError, ToolExecutionError
from pivotrl.faults import FAULT_EXIT_CODE, FaultInjector, ToolFault

__all__ = ["BUILTIN_FUNCTIONS", "RetryStats", "SandboxError", "SandboxPool", "call_with_retries"]

# name → "module:function". Each function takes (payload, settings) and returns a JSON value;
# ``settings`` holds the pool's ``bfcl_root`` (str or None).
BUILTIN_FUNCTIONS: dict[str, str] = {
    "echo": "pivotrl.envs.sandbox:_fn_echo",
    "sleep": "pivotrl.envs.sandbox:_fn_sleep",
    "allocate": "pivotrl.envs.sandbox:_fn_allocate",
    "exit": "pivotrl.envs.sandbox:_fn_exit",
    "spin": "pivotrl.envs.sandbox:_fn_spin",
    "network": "pivotrl.envs.sandbox:_fn_network",
    "bfcl.execute_candidates": "pivotrl.verifiers.execution:execute_candidates",
}

_HEADER = struct.Struct(">Q")  # 8-byte big-endian length prefix of every JSON message
REASONS = ("timeout", "crash", "memory", "error")


class SandboxError(ToolExecutionError):
    """A sandboxed request failed; ``reason`` is one of "timeout", "crash", "memory", "error"."""

    def __init__(self, message: str, reason: str) -> None:
        super().__init__(message)
        self.reason = reason


# ----------------------------------------------------------------------------------- retry policy


@dataclass
class RetryStats:
    """How many calls were made through :func:`call_with_retries` and how many were retries."""

    calls: int = 0
    retries: int = 0
    failures: int = 0  # calls that failed after all retries
    last_errors: list[str] = field(default_factory=list)


R = TypeVar("R")


def call_with_retries(
    fn: Callable[[], R],
    retries: int,
    backoff_s: float,
    retry_on: tuple[type[BaseException], ...] = (ToolExecutionError,),
    stats: RetryStats | None = None,
    max_backoff_s: float | None = None,
) -> R:
    """Call ``fn()``; on an exception in ``retry_on`` try again up to ``retries`` more times.

    Waits ``min(backoff_s * 2**k, max_backoff_s)`` seconds before the k-th retry (k = 0, 1, ...;
    ``max_backoff_s=None``: no cap). Records the number of retries (and a final failure) in
    ``stats`` if given. Re-raises the last exception when every attempt failed; exceptions not in
    ``retry_on`` propagate at once.
    """
    if retries < 0 or backoff_s < 0 or (max_backoff_s is not None and max_backoff_s < 0):
        raise ConfigError(f"call_with_retries: retries={retries}, backoff_s={backoff_s}: both must be >= 0")
    if stats is not None:
        stats.calls += 1
    attempt = 0
    while True:
        try:
            return fn()
        except retry_on as e:
            if stats is not None:
                stats.last_errors = (stats.last_errors + [f"{type(e).__name__}: {e}"])[-10:]
            if attempt >= retries:
                if stats is not None:
                    stats.failures += 1
                raise
            if stats is not None:
                stats.retries += 1
            delay = backoff_s * (2**attempt)
            time.sleep(delay if max_backoff_s is None else min(delay, max_backoff_s))
            attempt += 1


# -------------------------------------------------------------------------------------- the pool


def _package_parent() -> str:
    import pivotrl

    return str(Path(pivotrl.__file__).resolve().parent.parent)


def _write_msg(stream: Any, obj: Any) -> None:
    data = json.dumps(obj, ensure_ascii=False).encode("utf-8")
    stream.write(_HEADER.pack(len(data)) + data)
    stream.flush()


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
            [sys.executable, "-u", "-m", "pivotrl.envs.sandbox", json.dumps({**settings, "base_dir": self.base_dir})],
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
            _write_msg(self.proc.stdin, msg)
        except (BrokenPipeError, OSError):
            raise self._died(fn) from None
        deadline = time.monotonic() + timeout_s
        fd = self.proc.stdout.fileno()
        header = self._read_exact(fd, _HEADER.size, deadline, fn, timeout_s)
        (n,) = _HEADER.unpack(header)
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
        faults: a :class:`~pivotrl.faults.FaultInjector` deciding injected failures and latency per
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


# -------------------------------------------------------------------------------- worker side


def _fn_echo(payload: Any, settings: Mapping[str, Any]) -> Any:
    """Return the payload unchanged (a health check)."""
    return payload


def _fn_sleep(payload: Any, settings: Mapping[str, Any]) -> Any:
    """Sleep ``payload["seconds"]`` seconds (None: forever); returns the cwd's entries."""
    seconds = payload.get("seconds") if isinstance(payload, Mapping) else None
    if seconds is None:
        while True:
            time.sleep(3600)
    time.sleep(float(seconds))
    return sorted(os.listdir("."))


def _fn_allocate(payload: Any, settings: Mapping[str, Any]) -> Any:
    """Allocate ``payload["mb"]`` MiB in 16 MiB blocks (None: without bound); returns MiB held."""
    limit = payload.get("mb") if isinstance(payload, Mapping) else None
    blocks = []
    while limit is None or len(blocks) * 16 < limit:
        blocks.append(bytearray(16 << 20))
    return len(blocks) * 16


def _fn_spin(payload: Any, settings: Mapping[str, Any]) -> Any:
    """Busy-loop on the CPU for ``payload["seconds"]`` seconds (None: forever); returns loop count."""
    seconds = payload.get("seconds") if isinstance(payload, Mapping) else None
    end = None if seconds is None else time.monotonic() + float(seconds)
    n = 0
    while end is None or time.monotonic() < end:
        n += 1
    return n


def _fn_exit(payload: Any, settings: Mapping[str, Any]) -> Any:
    """Terminate the worker at once with ``os._exit(payload["code"])`` (a crash)."""
    code = payload.get("code", 3) if isinstance(payload, Mapping) else 3
    os._exit(int(code))


def _fn_network(payload: Any, settings: Mapping[str, Any]) -> Any:
    """Try to open an internet socket; returns the error text (the guard must refuse)."""
    import socket

    try:
        s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        s.close()
        return "allowed"
    except PermissionError as e:
        return f"refused: {e}"


def _block_network() -> None:
    import socket

    real_socket = socket.socket

    class _GuardedSocket(real_socket):  # type: ignore[misc, valid-type]
        def __init__(self, family: Any = -1, *args: Any, **kwargs: Any) -> None:
            fam = socket.AF_INET if family == -1 else family
            if fam != socket.AF_UNIX:
                raise PermissionError("network access is disabled in the pivotrl sandbox")
            super().__init__(family, *args, **kwargs)

    def _refuse(*args: Any, **kwargs: Any) -> Any:
        raise PermissionError("network access is disabled in the pivotrl sandbox")

    socket.socket = _GuardedSocket  # type: ignore[misc]
    socket.create_connection = _refuse  # type: ignore[assignment]
    socket.getaddrinfo = _refuse  # type: ignore[assignment]
    socket.gethostbyname = _refuse  # type: ignore[assignment]


def _worker_main(settings: Mapping[str, Any]) -> None:
    import resource

    proto_in = os.fdopen(os.dup(0), "rb")
    proto_out = os.fdopen(os.dup(1), "wb")
    # Tool code that prints must not corrupt the protocol: fd 0/1 point to /dev/null from now on.
    devnull = os.open(os.devnull, os.O_RDWR)
    os.dup2(devnull, 0)
    os.dup2(devnull, 1)
    sys.stdout = open(os.devnull, "w")  # noqa: SIM115 - lives as long as the worker

    mem = int(settings["memory_mb"]) << 20
    resource.setrlimit(resource.RLIMIT_AS, (mem, mem))
    cpu_s = float(settings["cpu_s"])
    _, cpu_hard = resource.getrlimit(resource.RLIMIT_CPU)
    _block_network()
    bfcl_root = settings.get("bfcl_root")
    if bfcl_root and bfcl_root not in sys.path:
        sys.path.insert(0, bfcl_root)
    functions: Mapping[str, str] = settings["functions"]
    resolved: dict[str, Callable[[Any, Mapping[str, Any]], Any]] = {}
    base_dir = settings.get("base_dir") or tempfile.mkdtemp(prefix="pivotrl-sandbox-")

    while True:
        header = proto_in.read(_HEADER.size)
        if len(header) < _HEADER.size:
            break  # the pool closed our stdin
        (n,) = _HEADER.unpack(header)
        request = json.loads(proto_in.read(n).decode("utf-8"))
        fn_name = request.get("fn")
        if request.get("fault"):
            fault = ToolFault.from_dict(request["fault"])
            if fault.latency_s:
                time.sleep(fault.latency_s)
            if fault.fail:
                os._exit(FAULT_EXIT_CODE)  # an injected crash: the pool replaces this worker
        workdir = tempfile.mkdtemp(dir=base_dir)
        try:
            os.chdir(workdir)
            usage = resource.getrusage(resource.RUSAGE_SELF)
            used = usage.ru_utime + usage.ru_stime
            soft = int(used + cpu_s) + 1
            hard = cpu_hard if cpu_hard == resource.RLIM_INFINITY else max(cpu_hard, soft)
            resource.setrlimit(resource.RLIMIT_CPU, (soft, hard))
            if fn_name not in functions:
                raise PermissionError(f"function {fn_name!r} is not in the allow-list")
            if fn_name not in resolved:
                module, _, attr = functions[fn_name].partition(":")
                resolved[fn_name] = getattr(importlib.import_module(module), attr)
            result = resolved[fn_name](request.get("payload"), settings)
            reply: dict[str, Any] = {"ok": True, "result": result}
            json.dumps(reply)  # a non-JSON result is the function's error, reported below
        except MemoryError:
            reply = {"ok": False, "reason": "memory", "error": f"exceeded the {settings['memory_mb']} MiB memory limit"}
        except BaseException as e:  # noqa: BLE001 - every failure of the function is reported
            reply = {"ok": False, "reason": "error", "error": f"{type(e).__name__}: {e}"}
        finally:
            os.chdir(base_dir)
            shutil.rmtree(workdir, ignore_errors=True)
        try:
            _write_msg(proto_out, reply)
        except MemoryError:
            _write_msg(proto_out, {"ok": False, "reason": "memory", "error": "out of memory writing the reply"})
    shutil.rmtree(base_dir, ignore_errors=True)


if __name__ == "__main__":
    _worker_main(json.loads(sys.argv[1]))
