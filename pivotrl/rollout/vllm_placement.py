"""Where a vLLM engine runs: the CPUs its worker binds to (CPU builds) and the GPUs it sees (GPU builds).

:func:`engine_cpu_bind` picks the ``VLLM_CPU_OMP_THREADS_BIND`` value of one CPU engine (a
comma-separated list of CPU ids) and claims those CPUs machine-wide so that engines of other
processes bind elsewhere; :func:`cpu_bind_list` is the list for given allowed CPUs;
:func:`visible_devices` maps node-local GPU indices through the process's own
``CUDA_VISIBLE_DEVICES``; :func:`is_cpu_platform` tells a CPU build of vLLM from a GPU one. All raise
ConfigError for impossible requests (fewer than one thread, no GPU index, an index not visible).
vLLM itself is imported only by :func:`is_cpu_platform`.
"""

from __future__ import annotations

import os
from typing import Any, Sequence

from pivotrl.core.errors import ConfigError

__all__ = ["cpu_bind_list", "engine_cpu_bind", "is_cpu_platform", "visible_devices"]


def cpu_bind_list(cpu_threads: int | None, environ: Any = None, allowed: Sequence[int] | None = None) -> str | None:
    """The ``VLLM_CPU_OMP_THREADS_BIND`` value for one CPU worker with ``cpu_threads`` threads.

    ``allowed``: CPU ids this process may run on (default ``os.sched_getaffinity(0)``); the first
    ``cpu_threads`` of them (sorted; None or more than there are: all) are returned as "0,1,...".
    Returns None, leaving vLLM's own choice, when ``environ`` (default ``os.environ``) already sets
    ``VLLM_CPU_OMP_THREADS_BIND``. Raises ConfigError if ``cpu_threads`` < 1.
    """
    environ = os.environ if environ is None else environ
    if cpu_threads is not None and cpu_threads < 1:
        raise ConfigError(f"cpu_threads must be >= 1, got {cpu_threads!r}")
    if environ.get("VLLM_CPU_OMP_THREADS_BIND"):
        return None
    if allowed is None:
        allowed = sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else range(os.cpu_count() or 1)
    cpus = sorted(int(c) for c in allowed)
    if not cpus:
        return None
    n = len(cpus) if cpu_threads is None else min(cpu_threads, len(cpus))
    return ",".join(str(c) for c in cpus[:n])


def visible_devices(device_ids: Sequence[int], environ: Any = None) -> str:
    """``CUDA_VISIBLE_DEVICES`` for an engine on the node-local GPUs ``device_ids``: the ids mapped
    through the process's own ``CUDA_VISIBLE_DEVICES`` when it sets one (index i = its i-th entry).
    Raises ConfigError for an empty list or an index the process cannot see."""
    environ = os.environ if environ is None else environ
    ids = [int(i) for i in device_ids]
    if not ids:
        raise ConfigError("device_ids: need at least one GPU index")
    seen = [d.strip() for d in str(environ.get("CUDA_VISIBLE_DEVICES", "")).split(",") if d.strip()]
    if not seen:
        return ",".join(str(i) for i in ids)
    if max(ids) >= len(seen) or min(ids) < 0:
        raise ConfigError(f"device_ids {ids}: this process sees {len(seen)} GPU(s) (CUDA_VISIBLE_DEVICES={','.join(seen)})")
    return ",".join(seen[i] for i in ids)


def engine_cpu_bind(cpu_threads: int | None, environ: Any = None, cpu_ids: Sequence[int] | None = None,
                    claims: str | os.PathLike[str] | None = None) -> tuple[str | None, Any]:
    """``(VLLM_CPU_OMP_THREADS_BIND value or None, CpuClaim or None)`` for one CPU engine.

    An explicit ``VLLM_CPU_OMP_THREADS_BIND`` in ``environ`` wins (None, None). Given ``cpu_ids``
    (one of several engines of this process, already disjoint): the first ``cpu_threads`` of them,
    unclaimed. Otherwise ``cpu_threads`` CPUs of this process's affinity are claimed machine-wide
    (:func:`pivotrl.runtime.cpu_claims.claim_cpus`, directory ``claims``), so engines of other processes
    bind to other CPUs while there are free ones; the caller releases the claim when the engine
    ends. Raises ConfigError if ``cpu_threads`` < 1.
    """
    from pivotrl.runtime.cpu_claims import claim_cpus

    environ = os.environ if environ is None else environ
    if cpu_ids is not None or environ.get("VLLM_CPU_OMP_THREADS_BIND"):
        return cpu_bind_list(cpu_threads, environ, allowed=cpu_ids), None
    claim = claim_cpus(cpu_threads, directory=claims)
    return (",".join(str(c) for c in claim.cpus) or None), claim


def is_cpu_platform() -> bool:
    try:
        from vllm.platforms import current_platform

        return bool(current_platform.is_cpu())
    except Exception:  # noqa: BLE001 - platform detection failing means "not the CPU build"
        return False
