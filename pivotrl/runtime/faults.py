"""Seeded fault injection for reliability tests (config section ``faults``).

Every injected fault is decided by a :class:`FaultInjector`: a private ``random.Random`` seeded from
``run.seed`` and a stream name, so the decisions never touch the global ``random``/numpy/torch RNGs
that sampling uses, and a faulty run samples exactly the same actions as a fault-free one. What a
fault does is real:

- tool executions (``faults.tool_failure_rate``, ``faults.tool_latency_s``): a
  :class:`~pivotrl.envs.sandbox.SandboxPool` built with an injector draws one :class:`ToolFault`
  per request; the worker sleeps the drawn latency and, for a failure, dies (``os._exit``) before
  running the function, so the pool reports a crash and replaces the worker. The decision is made
  in the pool's process, so a replacement worker does not repeat it;
- artifact writes (``faults.storage_failure_rate``): the :class:`~pivotrl.storage.ArtifactStore`
  fails a write after uploading its temporary copy and before publishing it (its own seeded draw;
  see :func:`fault_seed` for the seed the pipeline gives it);
- the trainer (``faults.kill_trainer_at_step``): the training stage SIGKILLs its own process once.

Because a retried verifier request carries the same payload and the execution is deterministic,
enough retries give results identical to a fault-free run.
"""

from __future__ import annotations

import hashlib
import random
import threading
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Mapping

from pivotrl.core.errors import ConfigError

if TYPE_CHECKING:
    from pivotrl.config import RunConfig

__all__ = ["FAULT_EXIT_CODE", "FaultInjector", "ToolFault", "fault_seed"]

#: Exit code of a sandbox worker killed by an injected tool fault (EX_TEMPFAIL: "try again").
FAULT_EXIT_CODE = 75


def fault_seed(seed: int, stream: str, attempt: int = 0) -> int:
    """A 63-bit seed for one fault stream (``"tools"``, ``"storage"``...) of a run.

    Derived by sha256 from (``seed``, ``stream``, ``attempt``), so streams are independent of each
    other and of every sampling seed; ``attempt`` separates the retries of a whole stage (a stage
    re-run with the same seed would otherwise fail at exactly the same writes).
    """
    digest = hashlib.sha256(f"pivotrl-faults\0{seed}\0{stream}\0{attempt}".encode()).digest()
    return int.from_bytes(digest[:8], "big") >> 1


@dataclass(frozen=True)
class ToolFault:
    """The fault drawn for one tool request: ``fail`` (the worker dies before running it) and
    ``latency_s`` (seconds slept in the worker first, ≥ 0)."""

    fail: bool
    latency_s: float

    def to_dict(self) -> dict[str, Any]:
        return {"fail": self.fail, "latency_s": self.latency_s}

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> "ToolFault":
        return cls(bool(d.get("fail", False)), max(0.0, float(d.get("latency_s", 0.0))))


class FaultInjector:
    """Seeded draws of tool faults (thread-safe).

    Args:
        tool_failure_rate: probability in [0, 1] that a request fails (1.0 = every request; the
            config caps it below 1, tests may not).
        tool_latency_s: each request sleeps a uniform random delay in [0, tool_latency_s] seconds.
        seed: seed of the private RNG (see :func:`fault_seed`).

    Raises ConfigError for a rate outside [0, 1] or a negative latency.
    """

    def __init__(self, tool_failure_rate: float = 0.0, tool_latency_s: float = 0.0, seed: int = 0) -> None:
        if not 0.0 <= float(tool_failure_rate) <= 1.0:
            raise ConfigError(f"faults.tool_failure_rate = {tool_failure_rate}: must be in [0, 1]")
        if float(tool_latency_s) < 0.0:
            raise ConfigError(f"faults.tool_latency_s = {tool_latency_s}: must be ≥ 0")
        self.tool_failure_rate = float(tool_failure_rate)
        self.tool_latency_s = float(tool_latency_s)
        self.seed = int(seed)
        self._rng = random.Random(self.seed)
        self._lock = threading.Lock()
        self.drawn = 0  # requests a fault was drawn for
        self.failures = 0  # of which were made to fail

    @classmethod
    def from_config(cls, cfg: "RunConfig", stream: str = "tools") -> "FaultInjector | None":
        """The tool-fault injector of a run, or None when ``faults`` injects no tool fault."""
        f = cfg.faults
        if f.tool_failure_rate <= 0 and f.tool_latency_s <= 0:
            return None
        return cls(f.tool_failure_rate, f.tool_latency_s, fault_seed(cfg.run.seed, stream))

    @property
    def enabled(self) -> bool:
        return self.tool_failure_rate > 0 or self.tool_latency_s > 0

    def draw(self) -> ToolFault:
        """The fault of the next request: two draws from the private RNG, always (so the sequence of
        decisions does not depend on the rates)."""
        with self._lock:
            u_fail, u_lat = self._rng.random(), self._rng.random()
            fault = ToolFault(u_fail < self.tool_failure_rate, u_lat * self.tool_latency_s)
            self.drawn += 1
            self.failures += int(fault.fail)
        return fault

    def __repr__(self) -> str:
        return (f"FaultInjector(tool_failure_rate={self.tool_failure_rate}, tool_latency_s={self.tool_latency_s}, "
                f"seed={self.seed})")
