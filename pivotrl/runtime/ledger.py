"""The cost ledger of a training or evaluation run: what was paid for, counted where it happens.

One :class:`CostLedger` per run (a PivotRL training run, an SFT baseline, an end-to-end RL
baseline, one evaluation). Counters (all integers unless named ``_s`` or ``_bytes``):

* ``tool_executions`` - tool calls executed in a live environment by the policy (full-task
  episodes); ``tool_retries`` - executions (or verifier executions) that were retried;
* ``verifier_executions`` - actions scored by a verifier (local rollouts, probes);
* ``model_calls`` - model calls, i.e. rollout turns: one generated action each;
* ``generated_tokens`` - tokens sampled by the rollout engine (every model call);
* ``trainer_tokens`` - tokens through the trainable policy's forward and backward passes as
  processed (with the shared state prefix counted once per group);
  ``trainer_tokens_naive`` - the same work without prefix sharing (state + action per action),
  the figure a trainer that re-encodes every sequence would pay; ``reference_tokens`` - tokens
  through the frozen π_ref (forward only);
* ``optimizer_steps`` - optimiser updates;
* ``wall_s`` - wall time per stage name (seconds), :meth:`stage` measures one;
* ``peak_memory_bytes`` - the largest resident set (and CUDA peak, when CUDA is used) seen by
  :meth:`note_memory`.

Ledgers add (``a + b``, :meth:`total`), serialise (:meth:`to_dict` / :meth:`from_dict`) and are
written beside the metrics of a run as ``ledger.json`` with a manifest (see
``pivotrl.pipeline.compare``). Pure Python: imports nothing heavy.
"""

from __future__ import annotations

import contextlib
import sys
import time
from dataclasses import dataclass, field, fields
from typing import Any, Iterator, Mapping, Sequence

from pivotrl.core.errors import DataError

__all__ = ["COUNTERS", "CostLedger", "current_peak_memory"]

#: The integer counters of a ledger, in report order.
COUNTERS: tuple[str, ...] = (
    "model_calls",
    "generated_tokens",
    "tool_executions",
    "tool_retries",
    "verifier_executions",
    "trainer_tokens",
    "trainer_tokens_naive",
    "reference_tokens",
    "optimizer_steps",
)


def current_peak_memory() -> int:
    """Peak resident set size of this process in bytes (Linux: ``ru_maxrss`` is KiB; macOS: bytes),
    or the CUDA peak allocation if it is larger. 0 where neither is measurable."""
    peak = 0
    try:
        import resource

        rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
        peak = int(rss if sys.platform == "darwin" else rss * 1024)
    except (ImportError, OSError):  # pragma: no cover - non-POSIX
        pass
    torch = sys.modules.get("torch")
    if torch is not None and torch.cuda.is_available():  # pragma: no cover - GPU only
        peak = max(peak, int(torch.cuda.max_memory_allocated()))
    return peak


@dataclass
class CostLedger:
    """Counted cost of one run (see the module docstring for every field's meaning and unit)."""

    name: str = ""
    model_calls: int = 0
    generated_tokens: int = 0
    tool_executions: int = 0
    tool_retries: int = 0
    verifier_executions: int = 0
    trainer_tokens: int = 0
    trainer_tokens_naive: int = 0
    reference_tokens: int = 0
    optimizer_steps: int = 0
    wall_s: dict[str, float] = field(default_factory=dict)
    peak_memory_bytes: int = 0

    # ----------------------------------------------------------------- counting hooks
    def add(self, **counts: int | float) -> None:
        """Add to integer counters by name; DataError for an unknown name or a negative count."""
        for key, value in counts.items():
            if key not in COUNTERS:
                raise DataError(f"ledger {self.name!r}: unknown counter {key!r}; known: {', '.join(COUNTERS)}")
            if value < 0:
                raise DataError(f"ledger {self.name!r}: {key} += {value}: counts are never negative")
            setattr(self, key, getattr(self, key) + int(value))

    def add_generations(self, generations: Sequence[Any]) -> None:
        """Count one model call per generation and its ``token_ids`` as generated tokens."""
        self.model_calls += len(generations)
        self.generated_tokens += sum(len(g.token_ids) for g in generations)

    def add_trainer_metrics(self, metrics: Mapping[str, float], naive_tokens: int) -> None:
        """Count one ``PivotRLTrainer.train_step`` result: its ``updates`` optimiser steps, its
        ``tokens`` (policy forward+backward, as processed) and ``ref_tokens``; ``naive_tokens`` is
        the caller's prefix-free figure (Σ over actions of state + action tokens, per update)."""
        self.optimizer_steps += int(metrics.get("updates", 0))
        self.trainer_tokens += int(metrics.get("tokens", 0))
        self.reference_tokens += int(metrics.get("ref_tokens", 0))
        self.trainer_tokens_naive += int(naive_tokens)

    def add_wall(self, stage: str, seconds: float) -> None:
        """Add ``seconds`` of wall time to ``stage``."""
        self.wall_s[stage] = self.wall_s.get(stage, 0.0) + float(seconds)

    @contextlib.contextmanager
    def stage(self, name: str) -> Iterator[None]:
        """Measure the wall time of a block under ``name`` and note the memory peak after it."""
        t0 = time.perf_counter()
        try:
            yield
        finally:
            self.add_wall(name, time.perf_counter() - t0)
            self.note_memory()

    def note_memory(self, peak_bytes: int | None = None) -> None:
        """Raise ``peak_memory_bytes`` to ``peak_bytes`` (default: :func:`current_peak_memory`)."""
        value = current_peak_memory() if peak_bytes is None else int(peak_bytes)
        self.peak_memory_bytes = max(self.peak_memory_bytes, value)

    # ----------------------------------------------------------------- arithmetic / io
    @property
    def total_wall_s(self) -> float:
        """Sum of the wall time of every stage (seconds)."""
        return float(sum(self.wall_s.values()))

    def __add__(self, other: CostLedger) -> CostLedger:
        out = CostLedger(name=self.name if self.name == other.name else f"{self.name}+{other.name}")
        for key in COUNTERS:
            setattr(out, key, getattr(self, key) + getattr(other, key))
        for src in (self.wall_s, other.wall_s):
            for k, v in src.items():
                out.add_wall(k, v)
        out.peak_memory_bytes = max(self.peak_memory_bytes, other.peak_memory_bytes)
        return out

    @classmethod
    def total(cls, ledgers: Sequence[CostLedger], name: str = "total") -> CostLedger:
        """The sum of ``ledgers`` (peak memory: the maximum), named ``name``."""
        out = CostLedger(name=name)
        for ledger in ledgers:
            out = out + ledger
        out.name = name
        return out

    def to_dict(self) -> dict[str, Any]:
        """JSON-able dict: name, every counter, ``wall_s`` per stage, ``total_wall_s``, peak memory."""
        d: dict[str, Any] = {f.name: getattr(self, f.name) for f in fields(self)}
        d["wall_s"] = dict(sorted(self.wall_s.items()))
        d["total_wall_s"] = self.total_wall_s
        return d

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> CostLedger:
        """Inverse of :meth:`to_dict`; DataError naming an unknown or non-numeric field."""
        known = {f.name for f in fields(cls)}
        extra = set(d) - known - {"total_wall_s"}
        if extra:
            raise DataError(f"ledger record has unknown field(s) {sorted(extra)}")
        try:
            kw: dict[str, Any] = {k: int(d[k]) for k in (*COUNTERS, "peak_memory_bytes") if k in d}
            kw["wall_s"] = {str(k): float(v) for k, v in dict(d.get("wall_s") or {}).items()}
        except (TypeError, ValueError) as err:
            raise DataError(f"ledger record {d.get('name', '?')!r}: non-numeric field ({err})") from None
        return cls(name=str(d.get("name", "")), **kw)

    def row(self) -> dict[str, Any]:
        """One flat row for a report table: name, counters, total wall time (s), peak memory (MiB)."""
        return {"method": self.name, **{k: getattr(self, k) for k in COUNTERS},
                "wall_s": round(self.total_wall_s, 3), "peak_memory_mib": round(self.peak_memory_bytes / 2**20, 1)}
