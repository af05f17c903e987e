"""Sample → score: the one place where actions are sampled at turn states and judged by a verifier.

Probing (:func:`pivotrl.pipeline.probe.probe_states`), training (:mod:`pivotrl.training.loop`)
and local evaluation (:func:`pivotrl.evaluation.local.evaluate_local`) all call
:func:`sample_and_score`, so they share one policy for a state whose verifier cannot decide:

    **An undecided state is dropped and counted, never scored.** When the verifier raises
    ``VerifierError`` for a state (its retries are spent: a crashed or timed-out sandbox, an
    injected fault) or returns a partial group (fewer results than actions), the state's
    :class:`ScoredState` has ``results = None`` and ``error`` set. Probing records it with status
    "verifier_error" (no μ̂ from a partial group), training drops its group (no advantages from a
    partial group) and counts it in ``dropped_groups``, local evaluation records it with status
    "verifier_error" and leaves it out of the accuracy. No reward is ever read as 0.

Other errors (a broken engine, a bug in a verifier that is not a ``VerifierError``) propagate.
Pure core: imports neither an engine backend nor Prefect.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Sequence

from pivotrl.core.errors import VerifierError
from pivotrl.rollout.base import generate_groups

__all__ = ["ScoredState", "sample_and_score", "sample_and_score_groups", "verifier_retries"]


@dataclass(frozen=True)
class ScoredState:
    """One state's sampled group and its verdicts.

    Attributes:
        state: the ``TurnState`` sampled at.
        prompt_ids: the encoded prompt the engine was given (token ids).
        samples: the n ``Generation`` objects, in sampling order.
        results: one ``VerifierResult`` per sample, or None when the verifier could not decide.
        error: why the verifier could not decide (None when it did).
        verifier_retries: tool requests the verifier retried while scoring this state.
    """

    state: Any
    prompt_ids: list[int]
    samples: list[Any]
    results: list[Any] | None
    error: str | None = None
    verifier_retries: int = 0

    @property
    def decided(self) -> bool:
        """True when every sample has a verdict."""
        return self.results is not None

    @property
    def rewards(self) -> list[float]:
        """The samples' rewards (floats in [0, 1]); raises ValueError for an undecided state."""
        if self.results is None:
            raise ValueError(f"turn state {self.state.state_id!r} has no rewards: {self.error}")
        return [float(r.reward) for r in self.results]


def verifier_retries(verifier: Any) -> int:
    """Retries made so far by ``verifier`` (``verifier.stats.retries``; 0 if it keeps no stats)."""
    stats = getattr(verifier, "stats", None)
    return int(getattr(stats, "retries", 0) or 0)


def sample_and_score(engine: Any, verifier: Any, states: Sequence[Any], prompts: Sequence[list[int]],
                     sampling: Any, *, seeds: Sequence[int] | None = None,
                     positions: Sequence[int] | None = None) -> list[ScoredState]:
    """Sample ``sampling.n`` actions at each state with one ``engine.generate`` call and score each
    group with ``verifier.score(state, texts)``.

    Args:
        engine: a rollout engine (``pivotrl.rollout``): ``generate(prompts, sampling[, seeds=])``.
        verifier: ``score(state, actions: list[str]) -> list[VerifierResult]``.
        states: the turn states, one per prompt.
        prompts: their encoded prompts (token ids), as the engine takes them.
        sampling: a ``SamplingConfig`` (n samples per prompt).
        seeds: one base seed per prompt (a state then samples the same in any batch); None: the
            engine seeds from ``sampling.seed`` and the prompt's position.
        positions: the prompts' positions in a larger batch that several engines share (seeded as
            if they stood there); exclusive with ``seeds``.

    Returns:
        One :class:`ScoredState` per state, input order. A state the verifier cannot decide is
        returned undecided (see the module docstring), never dropped silently and never scored 0.

    Raises:
        ValueError: ``states`` and ``prompts`` (or ``seeds``) differ in length.
    """
    if seeds is not None and positions is not None:
        raise ValueError("sample_and_score: give seeds or positions, not both")
    if positions is not None and len(positions) != len(prompts):
        raise ValueError(f"sample_and_score: {len(positions)} positions for {len(prompts)} prompts")
    if len(states) != len(prompts) or (seeds is not None and len(seeds) != len(prompts)):
        raise ValueError(f"sample_and_score: {len(states)} states, {len(prompts)} prompts"
                         + ("" if seeds is None else f", {len(seeds)} seeds"))
    if not prompts:
        return []
    prompts = [list(p) for p in prompts]
    if seeds is not None:
        gens = engine.generate(prompts, sampling, seeds=list(seeds))
    elif positions is not None:
        gens = engine.generate(prompts, sampling, positions=list(positions))
    else:
        gens = engine.generate(prompts, sampling)
    return _score(verifier, states, prompts, gens)


def sample_and_score_groups(engine: Any, verifier: Any,
                            groups: Sequence[tuple[Sequence[Any], Sequence[list[int]], Any]],
                            on_done: Callable[[int], Any] | None = None) -> list[list[ScoredState]]:
    """:func:`sample_and_score` for several batches ``(states, prompts, sampling)`` at once, each
    sampled as its own ``engine.generate(prompts, sampling)`` call would sample it, all served by
    one :func:`pivotrl.rollout.base.generate_groups` call (vLLM: one scheduler pass; ``on_done(k)``
    as k more prompts finish sampling, see there).

    Returns:
        One list of :class:`ScoredState` per group, in input order.

    Raises:
        ValueError: a group's states and prompts differ in length.
    """
    for states, prompts, _ in groups:
        if len(states) != len(prompts):
            raise ValueError(f"sample_and_score_groups: {len(states)} states, {len(prompts)} prompts")
    ids = [[list(p) for p in prompts] for _, prompts, _ in groups]
    gens = iter(generate_groups(engine, [(p, g[2]) for p, g in zip(ids, groups) if p], on_done))
    return [_score(verifier, g[0], p, next(gens)) if p else [] for p, g in zip(ids, groups)]


def _score(verifier: Any, states: Sequence[Any], prompts: Sequence[list[int]],
           gens: Sequence[Sequence[Any]]) -> list[ScoredState]:
    """Each state's generations scored with ``verifier.score`` (undecided states kept, see the module docstring)."""
    out: list[ScoredState] = []
    for state, ids, samples in zip(states, prompts, gens):
        samples = list(samples)
        texts = [g.text for g in samples]
        before = verifier_retries(verifier)
        try:
            results = list(verifier.score(state, texts))
            if len(results) != len(texts):  # a partial group is never scored
                raise VerifierError(f"turn state {state.state_id!r}: the verifier returned {len(results)} "
                                    f"results for {len(texts)} actions")
        except VerifierError as e:
            out.append(ScoredState(state, ids, samples, None, str(e), verifier_retries(verifier) - before))
            continue
        out.append(ScoredState(state, ids, samples, results, None, verifier_retries(verifier) - before))
    return out
