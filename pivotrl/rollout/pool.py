"""Several rollout engines behind the one-engine interface (``rollout.num_engines``).

An :class:`EnginePool` holds N engines (``pivotrl.rollout``: transformers or vLLM), each with its
own copy of the policy, and is itself a rollout engine: ``generate`` splits the prompts of a call
across the engines, the engines generate concurrently (one thread per engine: the transformers
engine runs torch ops, which release the GIL; a vLLM engine waits on its own engine-core process),
and the results come back in input order. ``load_weights`` refreshes every engine;
:meth:`EnginePool.refresh_deltas` checks each one against the trainer.

**The split** is deterministic, never by timing: with n prompts, engine j serves the contiguous
block of positions ``[j·n // N, (j+1)·n // N)`` (:func:`split_positions`), so a state's engine
depends only on its position in the batch.

**Seeds.** A prompt is sampled with the seed it would get from one engine given the whole batch:
with ``sampling.seed`` set, the prompt at batch position i draws from ``sample_seed(seed, i, k)``
(engines receive their block's global positions as ``positions=``); with per-prompt ``seeds``, from
``sample_seed(seeds[i], 0, k)`` as before. So a run's samples are the same for every N: exactly
for the transformers engine (each prompt is decoded on its own), and for vLLM up to the
floating-point effects of batching different prompts together.

With one engine the pool calls it exactly as the loop called a single engine (no ``positions``
argument), so ``num_engines: 1`` is today's behaviour, byte for byte.

Pure core: imports no engine backend.
"""

from __future__ import annotations

import os
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Callable, Sequence

from pivotrl.core.errors import ConfigError

__all__ = ["EnginePool", "engine_cpus", "refresh_delta", "split_positions"]


def split_positions(n: int, num_engines: int) -> list[range]:
    """Engine j's share of n batch positions: ``range(j * n // N, (j + 1) * n // N)``, j < N.

    Blocks are contiguous, in order, and differ in size by at most one (an engine gets an empty
    range when n < N). Raises ConfigError for N < 1 or n < 0.
    """
    if num_engines < 1 or n < 0:
        raise ConfigError(f"split_positions: need num_engines >= 1 and n >= 0, got {num_engines}, {n}")
    return [range(j * n // num_engines, (j + 1) * n // num_engines) for j in range(num_engines)]


def engine_cpus(j: int, num_engines: int, allowed: Sequence[int] | None = None) -> list[int]:
    """The CPUs engine j of ``num_engines`` binds to: block j of the sorted ``allowed`` CPUs
    (default: those this process may run on), split as :func:`split_positions` splits a batch; with
    fewer CPUs than engines, engine j shares CPU ``j mod len(allowed)``."""
    if allowed is None:
        allowed = sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else range(os.cpu_count() or 1)
    cpus = sorted(int(c) for c in allowed)
    if len(cpus) < num_engines:
        return [cpus[j % len(cpus)]] if cpus else []
    return [cpus[i] for i in split_positions(len(cpus), num_engines)[j]]


def refresh_delta(engine: Any, prompt: list[int] | None, actions: Sequence[list[int]],
                  trainer_lps: Sequence[Sequence[float]]) -> tuple[float, float]:
    """Max and mean |Δ| per token (nats) between the engine's and the trainer's log-probs of
    ``actions`` (A action token lists after one ``prompt``; ``trainer_lps``: A lists of per-token
    log-probs), pooled over every token of every action; (0, 0) without an action.

    Several actions: in bf16 one action's mean is a noisy statistic (one sampled token of low
    probability can carry |Δ| > 1), so the check reads a group's actions together. The engine
    scores each distinct action once (a group often samples one short call several times; each
    scored action is a prompt prefilled again, the prefix cache being off for scoring); a repeated
    action counts as often as it was sampled."""
    pairs = [(list(map(int, a)), t) for a, t in zip(actions, trainer_lps) if len(a)]
    if not pairs:
        return 0.0, 0.0
    distinct = list(dict.fromkeys(tuple(a) for a, _ in pairs))
    scored = dict(zip(distinct, engine.score([prompt] * len(distinct), [list(a) for a in distinct])))
    deltas = [abs(e - float(b)) for a, t in pairs for e, b in zip(scored[tuple(a)], t)]
    return (max(deltas), sum(deltas) / len(deltas)) if deltas else (0.0, 0.0)


class EnginePool:
    """N rollout engines serving one batch together.

    Args:
        engines: the engines (at least one), each already loaded with the same policy.

    Attributes:
        engines: the engines, in engine-index order.
        served: after each ``generate``, the batch positions engine j served (``served[j]``).
        generation_seconds: wall time of all ``generate`` calls (s): the pool's generation time for
            :func:`pivotrl.runtime.generation.snapshot`, whose engines generate side by side.
    """

    def __init__(self, engines: Sequence[Any]) -> None:
        if not engines:
            raise ConfigError("EnginePool needs at least one rollout engine")
        self.engines = list(engines)
        self.served: list[list[int]] = [[] for _ in self.engines]
        self.generation_seconds = 0.0
        # One thread per engine, always the same one (a shared executor may hand a second engine's
        # call to the first engine's idle thread, so two engines would run one after the other).
        self._threads = [ThreadPoolExecutor(max_workers=1, thread_name_prefix=f"pivotrl-engine{j}")
                         for j in range(len(self.engines))]

    def __len__(self) -> int:
        return len(self.engines)

    @property
    def tokenizer(self) -> Any:
        return getattr(self.engines[0], "tokenizer", None)

    def _each(self, fn: Callable[[int], Any]) -> list[Any]:
        """``fn(j)`` for every engine, concurrently; results in engine order (first error raised)."""
        if len(self.engines) == 1:
            return [fn(0)]
        return [f.result() for f in [self._threads[j].submit(fn, j) for j in range(len(self.engines))]]

    def generate(self, prompts: Sequence[list[int]], sampling: Any, *, stop_fn: Any = None,
                 seeds: Sequence[int] | None = None) -> list[list[Any]]:
        """Sample ``sampling.n`` actions per prompt on the engines → ``[len(prompts)][n]``, input order.

        Engine j generates the prompts at :func:`split_positions` block j, seeded as described in
        the module docstring. Raises ConfigError when ``seeds`` and ``prompts`` differ in length;
        an engine's own error propagates.
        """
        if seeds is not None and len(seeds) != len(prompts):
            raise ConfigError(f"generate: {len(seeds)} seeds for {len(prompts)} prompts")
        t0 = time.perf_counter()
        try:
            return self._generate(prompts, sampling, stop_fn, seeds)
        finally:
            self.generation_seconds += time.perf_counter() - t0

    def _generate(self, prompts: Sequence[list[int]], sampling: Any, stop_fn: Any,
                  seeds: Sequence[int] | None) -> list[list[Any]]:
        extra = {} if stop_fn is None else {"stop_fn": stop_fn}
        blocks = split_positions(len(prompts), len(self.engines))
        self.served = [list(b) for b in blocks]
        if len(self.engines) == 1:
            one = {} if seeds is None else {"seeds": list(seeds)}
            return self.engines[0].generate(prompts, sampling, **one, **extra)

        def run(j: int) -> list[list[Any]]:
            b = blocks[j]
            if not len(b):
                return []
            part = [prompts[i] for i in b]
            if seeds is not None:
                return self.engines[j].generate(part, sampling, seeds=[seeds[i] for i in b], **extra)
            return self.engines[j].generate(part, sampling, positions=list(b), **extra)

        return [g for block in self._each(run) for g in block]

    def score(self, prompts: Sequence[list[int]], actions: Sequence[list[int]]) -> list[list[float]]:
        """Per-token log-probs of ``actions`` from engine 0 (every engine serves the same weights)."""
        return self.engines[0].score(prompts, actions)

    def load_weights(self, checkpoint_dir: str) -> None:
        """Refresh every engine from the HF checkpoint ``checkpoint_dir`` (concurrently)."""
        self._each(lambda j: self.engines[j].load_weights(checkpoint_dir))

    def update_weights(self, block: str, meta: Sequence[Any]) -> None:
        """Refresh every engine from a shared-memory block of weights (concurrently)."""
        self._each(lambda j: self.engines[j].update_weights(block, meta))

    def refresh_deltas(self, prompt: list[int] | None, actions: Sequence[list[int]],
                       trainer_lps: Sequence[Sequence[float]]) -> list[tuple[float, float] | None]:
        """Per engine: max and mean |Δ| per token (nats) between its log-probs of ``actions`` and the
        trainer's ``trainer_lps``, pooled over their tokens
        (:func:`pivotrl.training.rank_engines.refresh_delta`); None for every engine when there is
        no action to check."""
        if not any(actions):
            return [None] * len(self.engines)
        return self._each(lambda j: refresh_delta(self.engines[j], prompt, actions, trainer_lps))

    def close(self) -> None:
        """Close every engine (each one even if another fails; the first error is raised)."""
        first: BaseException | None = None
        for e in self.engines:
            try:
                e.close()
            except Exception as exc:  # noqa: BLE001 - close the others, then raise the first
                first = first or exc
        for t in self._threads:
            t.shutdown(wait=False)
        if first is not None:
            raise first
