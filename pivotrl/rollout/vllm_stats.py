"""What the vLLM engine learns from vLLM while it generates, for :class:`pivotrl.rollout.vllm.VLLMEngine`:
:class:`PrefillStats` (each child request's prefix-cache hit, from the engine's statistics: the
generation meter's prefill count) and :class:`Ticks` (a request finished: the progress of one
scheduler pass). Imports nothing from vLLM: both fill the interfaces vLLM calls.
"""

from __future__ import annotations

import time
from typing import Any, Callable

__all__ = ["PrefillStats", "Ticks"]


class PrefillStats:
    """The prompt tokens each request's prefill passes found in vLLM's prefix cache, from the
    engine's own statistics: a stat logger (the methods of vLLM's ``StatLoggerBase``) that the
    engine's ``LLMEngine`` feeds every step and that prints nothing.

    vLLM runs an n-sample request as n child requests, each admitted on its own with its own
    prefix-cache hit; ``RequestOutput.num_cached_tokens`` is that of the child finishing last. The
    per-request statistics of every finished child (``IterationStats.finished_requests``: the
    request id the caller sees and ``num_cached_tokens``) give each child's hit: :meth:`take`
    returns them for one request. :attr:`queries` and :attr:`hits` are the scheduler's prefix-cache
    counters (``SchedulerStats.prefix_cache_stats``, behind ``vllm:prefix_cache_queries`` and
    ``vllm:prefix_cache_hits``): over a generate call, queries − hits equals the sum of the
    children's ``prompt − cached`` (tested; with prefix caching off the scheduler counts nothing
    while each child's statistics still say 0 cached). A child preempted and resumed counts its
    first prefill only.
    """

    def __init__(self) -> None:
        self.cached: dict[str, list[int]] = {}
        self.queries = 0
        self.hits = 0

    @classmethod
    def attach(cls, llm: Any, keep_vllm_loggers: bool) -> "PrefillStats | None":
        """A counter fed by ``llm``'s engine (built with ``disable_log_stats=False``), replacing
        vLLM's stat loggers unless ``keep_vllm_loggers``; None where the engine has no stat-logger
        manager (another vLLM)."""
        loggers = getattr(getattr(getattr(llm, "llm_engine", None), "logger_manager", None), "stat_loggers", None)
        if not isinstance(loggers, list):
            return None
        counter = cls()
        if keep_vllm_loggers:
            loggers.append(counter)
        else:
            loggers[:] = [counter]
        return counter

    def record(self, scheduler_stats: Any, iteration_stats: Any, mm_cache_stats: Any = None,
               engine_idx: int = 0) -> None:
        prefix = getattr(scheduler_stats, "prefix_cache_stats", None)
        if prefix is not None:
            self.queries += int(prefix.queries)
            self.hits += int(prefix.hits)
        for req in getattr(iteration_stats, "finished_requests", None) or []:
            self.cached.setdefault(str(req.request_id), []).append(int(req.num_cached_tokens))

    def take(self, request_id: str) -> list[int]:
        """The cached prompt tokens of each finished child of ``request_id`` (removed from here)."""
        return self.cached.pop(str(request_id), [])

    def forget(self) -> None:
        self.cached.clear()

    def log(self) -> None:
        return None

    def log_engine_initialized(self) -> None:
        return None

    def record_sleep_state(self, *args: Any, **kwargs: Any) -> None:
        return None

    def record_admission_rejection(self, reason: str) -> None:
        return None


class Ticks:
    """A stand-in for the ``tqdm`` class vLLM's ``LLM.generate(use_tqdm=...)`` accepts: called with
    an iterable it returns it (prompt rendering); called with ``total=`` it returns a bar whose
    ``update`` (once per finished request) calls ``on_done(1)``."""

    def __init__(self, on_done: Callable[[int], Any]) -> None:
        self.on_done = on_done

    def __call__(self, iterable: Any = None, **_: Any) -> Any:
        return iterable if iterable is not None else _TickBar(self.on_done)


class _TickBar:
    def __init__(self, on_done: Callable[[int], Any]) -> None:
        self.on_done, self.n, self.postfix, self._t0 = on_done, 0, "", time.monotonic()

    @property
    def format_dict(self) -> dict[str, float]:
        return {"elapsed": max(time.monotonic() - self._t0, 1e-9)}

    def update(self, n: int = 1) -> None:
        self.n += n
        self.on_done(1)

    def refresh(self) -> None:
        return None

    def close(self) -> None:
        return None
