"""Host memory of a CPU training process: keep the blocks the C allocator frees.

glibc hands large blocks back to the operating system as soon as they are freed: a block above
its mmap threshold (128 KiB, rising with use to at most 32 MiB) is a mapping of its own, unmapped
on ``free``, and the heap's top is trimmed once 128 KiB of it is free. A training step frees and
allocates the same large tensors every step (activations, the action logits, gradient buffers), so
every step faults its memory in again, each page zero-filled by the kernel. On SmolLM2-135M in
fp32 with two threads that is 1.0–1.5 M minor page faults and 2.8–3.9 s of system time in a 26-s
trainer step (``benchmarks/RESULTS.md`` §14l).

:func:`retain_freed_memory` sets, through ``mallopt(3)``, ``M_MMAP_MAX`` to 0 (no block gets a
mapping of its own: large blocks come from the heap and go back to it) and ``M_TRIM_THRESHOLD`` to
:data:`TRIM_THRESHOLD` (the heap's free top is kept up to 1 GiB). Freed memory then stays in the
process for the next step. The cost is resident memory: the process keeps its largest step's
footprint (+0.3–0.4 GiB on that model) until it exits. The settings hold for the whole process,
so they belong in processes that train (the pipeline's training stages each run in their own
process). Other C libraries (musl, macOS) are left alone.

Pure: imports only the standard library.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import logging
import platform

__all__ = ["TRIM_THRESHOLD", "retain_freed_memory"]

log = logging.getLogger(__name__)

#: ``M_TRIM_THRESHOLD`` while memory is retained (bytes): the heap's free top kept up to this size.
TRIM_THRESHOLD = 1 << 30

# mallopt(3) parameter numbers, from glibc's <malloc.h>.
_M_TRIM_THRESHOLD = -1
_M_MMAP_MAX = -4


def retain_freed_memory() -> bool:
    """Keep the memory this process frees for its next allocations (glibc only; see the module).

    Returns True when glibc accepted both settings, False on another C library or when
    ``mallopt`` refused one (nothing is changed then beyond what it accepted; a log record says
    which). Idempotent; never raises.
    """
    if platform.system() != "Linux" or platform.libc_ver()[0] != "glibc":
        log.debug("host memory: not glibc (%s, %s): allocator left as is", platform.system(), platform.libc_ver())
        return False
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        mallopt = libc.mallopt
    except (OSError, AttributeError) as exc:  # pragma: no cover - glibc always has mallopt
        log.debug("host memory: mallopt unavailable (%s)", exc)
        return False
    mallopt.argtypes, mallopt.restype = [ctypes.c_int, ctypes.c_int], ctypes.c_int
    ok = bool(mallopt(_M_MMAP_MAX, 0)) and bool(mallopt(_M_TRIM_THRESHOLD, TRIM_THRESHOLD))
    if not ok:  # pragma: no cover - glibc accepts both values
        log.warning("host memory: glibc refused mallopt(M_MMAP_MAX=0, M_TRIM_THRESHOLD=%d)", TRIM_THRESHOLD)
    return ok
