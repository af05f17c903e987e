"""The worker side of the sandbox pool (:mod:`pivotrl.envs.sandbox`): ``python -m pivotrl.envs.sandbox_worker``.

A worker reads length-prefixed JSON requests on stdin, runs the named allow-listed function in a
fresh temporary directory under its resource limits (``RLIMIT_AS``, ``RLIMIT_CPU``, no network) and
writes the JSON reply on stdout. The ``_fn_*`` functions are the pool's built-in test functions.

Pure core: standard library only (plus the function modules the allow-list names).
"""

from __future__ import annotations

import importlib
import json
import os
import shutil
import struct
import sys
import tempfile
import time
from typing import Any, Callable, Mapping

from pivotrl.runtime.faults import FAULT_EXIT_CODE, ToolFault

FRAME_HEADER = struct.Struct(">Q")  # 8-byte big-endian length prefix of every JSON message


def write_message(stream: Any, obj: Any) -> None:
    data = json.dumps(obj, ensure_ascii=False).encode("utf-8")
    stream.write(FRAME_HEADER.pack(len(data)) + data)
    stream.flush()


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
        header = proto_in.read(FRAME_HEADER.size)
        if len(header) < FRAME_HEADER.size:
            break  # the pool closed our stdin
        (n,) = FRAME_HEADER.unpack(header)
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
            write_message(proto_out, reply)
        except MemoryError:
            write_message(proto_out, {"ok": False, "reason": "memory", "error": "out of memory writing the reply"})
    shutil.rmtree(base_dir, ignore_errors=True)


if __name__ == "__main__":
    _worker_main(json.loads(sys.argv[1]))
