"""Machine-wide claims on CPUs, so that rollout engines started by separate processes of one machine
(Ray worker processes of a local cluster, in-process shard children, two runs) pin their threads to
different CPUs.

vLLM's CPU build pins each OpenMP thread of its model worker to one CPU of a bind list. A process
that picks "the first n CPUs I may run on" picks the same ones as its neighbours: Ray does not
restrict the affinity of its worker processes (a Ray CPU is a count, not a CPU id), so two engines
on a two-CPU machine both pinned to CPU 0 and shared it while CPU 1 idled. A claim is an exclusive,
non-blocking ``flock`` on a file per CPU id in a directory of the machine's temporary folder; the
kernel drops it when the holder closes it or dies, so a killed process never keeps a CPU.

Pure core: imports nothing beyond the standard library.
"""

from __future__ import annotations

import fcntl
import logging
import os
import tempfile
from pathlib import Path
from typing import Sequence

from pivotrl.core.errors import ConfigError

log = logging.getLogger("pivotrl.runtime.cpu_claims")

#: Environment variable naming the claims directory (default: ``<tempdir>/pivotrl-cpu-claims``).
CLAIMS_DIR_ENV = "PIVOTRL_CPU_CLAIMS_DIR"

__all__ = ["CLAIMS_DIR_ENV", "CpuClaim", "allowed_cpus", "claim_cpus", "claims_dir"]


def allowed_cpus() -> list[int]:
    """The CPU ids this process may run on (sorted; ``sched_getaffinity``, else 0..cpu_count-1)."""
    if hasattr(os, "sched_getaffinity"):
        return sorted(os.sched_getaffinity(0))
    return list(range(os.cpu_count() or 1))


def claims_dir() -> Path:
    """The directory of the claim files: ``$PIVOTRL_CPU_CLAIMS_DIR`` or ``<tempdir>/pivotrl-cpu-claims``.
    Processes see each other's claims only through the same directory (containers with private
    temporary folders do not)."""
    return Path(os.environ.get(CLAIMS_DIR_ENV) or Path(tempfile.gettempdir()) / "pivotrl-cpu-claims")


class CpuClaim:
    """CPUs chosen for one engine. ``cpus``: the ids to bind to (sorted, ``n`` of them);
    ``claimed``: those this claim holds exclusively; ``shared``: those also held by another claim
    (there were fewer free CPUs than asked for). Release with :meth:`release` (or by exiting)."""

    def __init__(self, cpus: list[int], held: dict[int, int]) -> None:
        self.cpus = sorted(cpus)
        self._held = dict(held)  # cpu id -> open file descriptor holding its lock
        self.claimed = sorted(held)
        self.shared = [c for c in self.cpus if c not in held]

    def release(self) -> None:
        """Drop the locks (idempotent)."""
        for fd in self._held.values():
            try:
                os.close(fd)  # closing the descriptor releases its flock
            except OSError:
                pass
        self._held.clear()

    def __enter__(self) -> "CpuClaim":
        return self

    def __exit__(self, *exc: object) -> None:
        self.release()

    def __del__(self) -> None:
        self.release()

    def __repr__(self) -> str:
        return f"CpuClaim(cpus={self.cpus}, shared={self.shared})"


def _try_lock(directory: Path, cpu: int) -> int | None:
    try:
        fd = os.open(directory / f"cpu-{cpu}.lock", os.O_RDWR | os.O_CREAT, 0o666)
    except OSError:
        return None
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError:
        os.close(fd)
        return None
    return fd


def claim_cpus(n: int | None, allowed: Sequence[int] | None = None, directory: str | os.PathLike[str] | None = None) -> CpuClaim:
    """Claim ``n`` CPUs of ``allowed`` (default :func:`allowed_cpus`; ``n`` None or larger: all).

    The free CPUs come first, in id order; when fewer than ``n`` are free, the rest are the lowest
    claimed ones, shared (logged as a warning), so the thread count never shrinks. A directory that
    cannot be written leaves every CPU unclaimed and the choice is the first ``n`` (as without
    claims). ``directory``: the claims directory (default :func:`claims_dir`).

    Raises:
        ConfigError: ``n`` < 1.
    """
    if n is not None and n < 1:
        raise ConfigError(f"claim_cpus: n must be >= 1, got {n!r}")
    cpus = sorted(int(c) for c in (allowed_cpus() if allowed is None else allowed))
    if not cpus:
        return CpuClaim([], {})
    n = len(cpus) if n is None else min(n, len(cpus))
    where = Path(directory) if directory is not None else claims_dir()
    try:
        where.mkdir(parents=True, exist_ok=True)
        if where.stat().st_uid == os.getuid():
            os.chmod(where, 0o1777)  # several users of one machine share it (like /tmp itself)
    except OSError:
        pass
    if not os.access(where, os.W_OK):
        log.debug("CPU claims directory %s is not writable: binding to the first %d CPUs", where, n)
        return CpuClaim(cpus[:n], {})
    held: dict[int, int] = {}
    for cpu in cpus:
        if len(held) == n:
            break
        fd = _try_lock(where, cpu)
        if fd is not None:
            held[cpu] = fd
    chosen = list(held) + [c for c in cpus if c not in held][: n - len(held)]
    claim = CpuClaim(chosen, held)
    if claim.shared:
        log.warning("only %d of the %d CPUs asked for are free (of %s): sharing CPUs %s with another engine",
                    len(held), n, cpus, claim.shared)
    return claim
