"""Local accuracy on held-out turn states (PivotRL's local pivot score).

At each state the demonstration history is given; only the one model call is judged, by the same
verifier as in training. This measures the local signal PivotRL optimises; it is reported beside,
never instead of, full-task success (a locally correct action does not guarantee task success).
"""

from __future__ import annotations

import dataclasses
import json
import logging
from collections import Counter
from typing import Any, Sequence

import pandas as pd

from pivotrl.data.schema import TurnState
from pivotrl.core.errors import ConfigError, StateTooLongError
from pivotrl.format.prompts import encode_state
from pivotrl.rollout.base import SamplingConfig
from pivotrl.rollout.scoring import sample_and_score_groups
from pivotrl.verifiers.base import NOT_DEMONSTRATED

__all__ = ["evaluate_local", "evaluate_local_groups"]

log = logging.getLogger(__name__)

_COLUMNS = [
    "state_id", "trajectory_id", "turn_index", "category", "status", "n_samples", "n_accepted",
    "accuracy", "parse_errors", "tokens_generated", "reasons", "samples",
]


def evaluate_local(
    engine: Any,
    tokenizer: Any,
    states: Sequence[TurnState],
    verifier: Any,
    *,
    sampling: SamplingConfig | None = None,
    n: int | None = None,
    max_context: int = 8192,
    tool_style: str = "compact",
    max_tool_output_chars: int | None = None,
    format: str = "pythonic",
    tool_parser: str = "pythonic",
    batch_size: int = 64,
    label: str = "local evaluation",
    cache_dir: str | None = None,
) -> tuple[pd.DataFrame, dict[str, Any]]:
    """Fraction of sampled actions the verifier accepts at each held-out state.

    Each state is rendered with :func:`pivotrl.format.prompts.encode_state` (the training renderer),
    ``n`` actions are sampled from ``engine`` and scored with ``verifier.score(state, texts)``.
    States whose prompt plus ``sampling.max_tokens`` does not fit ``max_context`` are skipped and
    counted (status "too_long"), never truncated.

    Args:
        engine: rollout engine; ``generate`` is called with up to ``batch_size`` prompts at once.
        tokenizer: the policy's tokenizer.
        states: held-out turn states (the demonstration history before one call).
        verifier: an object with ``score(state, actions) -> list[VerifierResult]``.
        sampling: ``SamplingConfig``; default greedy (temperature 0), 256 max tokens.
        n: samples per state (m ≥ 1); overrides ``sampling.n`` when given.
        max_context: the engine's context window, tokens.
        label: what the progress lines call this evaluation (e.g. which states, which policy).
        cache_dir: the cache folder whose ``calibration.json`` gives the generation MFU's peak
            (:mod:`pivotrl.runtime.generation`); None: no MFU.
        tool_style, max_tool_output_chars: passed to the renderer, as in training.
        batch_size: prompts per ``generate`` call (≥ 1).

    Returns:
        ``(per_state, summary)``. ``per_state``: one row per state with state_id, trajectory_id,
        turn_index, category, status ("ok" | "too_long" | "verifier_error": the verifier could not
        decide, see :mod:`pivotrl.rollout.scoring`; counted, never scored), n_samples, n_accepted, accuracy
        (n_accepted / n_samples, NaN when skipped), parse_errors (results with reason
        "parse_error"), tokens_generated, reasons ({reason: count} over the samples).
        ``summary``: n_states (evaluated), n_too_long, n_verifier_error, n_samples, n_accepted, accuracy (accepted
        samples / samples), mean_state_accuracy, any_accepted_rate (states with ≥ 1 accepted
        sample / states), parse_error_rate (per sample), n_accepted_not_demonstrated (accepted
        samples whose calls differ from the demonstration's), tokens_generated, temperature, n, and,
        from an engine with a generation meter, the ``gen_*`` numbers of the engine pass
        (:meth:`pivotrl.runtime.generation.GenerationTotals.metrics`: prompt and prefilled tokens,
        generated tokens, TFLOP, seconds, tokens/s, MFU; the pass's, shared by every job served in it).

    Raises:
        ConfigError: n < 1, batch_size < 1, or max_context not above sampling.max_tokens.
    """
    if sampling is None:
        sampling = SamplingConfig(n=1, temperature=0.0, max_tokens=256)
    if n is not None:
        if not isinstance(n, int) or n < 1:
            raise ConfigError(f"evaluate_local: n must be an integer >= 1, got {n!r}")
        sampling = dataclasses.replace(sampling, n=n)
    return evaluate_local_groups(engine, tokenizer, [(states, sampling)], verifier, max_context=max_context,
                                 tool_style=tool_style, max_tool_output_chars=max_tool_output_chars, format=format,
                                 tool_parser=tool_parser, batch_size=batch_size, label=label, cache_dir=cache_dir)[0]


def evaluate_local_groups(
    engine: Any,
    tokenizer: Any,
    jobs: Sequence[tuple[Sequence[TurnState], SamplingConfig]],
    verifier: Any,
    *,
    max_context: int = 8192,
    tool_style: str = "compact",
    max_tool_output_chars: int | None = None,
    format: str = "pythonic",
    tool_parser: str = "pythonic",
    batch_size: int = 64,
    label: str = "local evaluation",
    cache_dir: str | None = None,
) -> list[tuple[pd.DataFrame, dict[str, Any]]]:
    """:func:`evaluate_local` for several ``(states, sampling)`` jobs at once (e.g. the held-out
    states greedy and with m samples, the stop decisions, the out-of-domain states), each job
    scored as its own :func:`evaluate_local` call scores it (the same batches of ``batch_size``
    prompts, seeded alike), but all sampled in one engine call
    (:func:`pivotrl.rollout.scoring.sample_and_score_groups`), so the engine's batch stays full
    until the last sample of any job is done.

    Returns:
        One ``(per_state, summary)`` per job, in order (see :func:`evaluate_local`).

    Raises:
        ConfigError: batch_size < 1, or max_context not above a job's ``sampling.max_tokens``.
    """
    if not isinstance(batch_size, int) or batch_size < 1:
        raise ConfigError(f"evaluate_local: batch_size must be an integer >= 1, got {batch_size!r}")
    opts: dict[str, Any] = {"tool_style": tool_style, "format": format, "tool_parser": tool_parser}
    if max_tool_output_chars is not None:
        opts["max_tool_output_chars"] = max_tool_output_chars

    prepared = [_encode(tokenizer, states, sampling, max_context, opts) for states, sampling in jobs]
    # Each job in batches of batch_size prompts, as separate calls would send them.
    groups = [(j, todo[a : a + batch_size]) for j, (_, todo) in enumerate(prepared)
              for a in range(0, len(todo), batch_size)]

    from pivotrl.core.progress import Progress
    from pivotrl.runtime.generation import generation_peak, since, snapshot

    total = sum(len(todo) for _, todo in prepared)
    before = snapshot(engine)
    with Progress(label, total, "states", enabled=bool(total)) as bar:
        # States counted as the engine finishes them inside its pass; scored after it.
        scored = sample_and_score_groups(engine, verifier, [
            ([jobs[j][0][i] for i, _ in chunk], [ids for _, ids in chunk], jobs[j][1]) for j, chunk in groups],
            on_done=bar.update)
        gen = since(engine, before)
        peak = generation_peak(gen, cache_dir)
        gen_metrics = gen.metrics(peak) if gen is not None else {}
        if gen is not None and gen.requests:
            for name, value in gen.counters(peak).items():
                bar.set_counter(name, value)
            log.info(gen.line(label, peak))
        for (j, chunk), group in zip(groups, scored):
            rows = prepared[j][0]
            for (i, _), g in zip(chunk, group):
                if g.decided:
                    _score_state(rows[i], g.results, g.samples)
                else:  # undecided: counted, left out of the accuracy (pivotrl.rollout.scoring)
                    rows[i].update(status="verifier_error", n_samples=0, n_accepted=0, accuracy=float("nan"),
                                   parse_errors=0, tokens_generated=sum(len(x.token_ids) for x in g.samples),
                                   reasons={"verifier_error": len(g.samples)}, samples="[]")
    out = []
    for (rows, _), (states, sampling) in zip(prepared, jobs):
        table, summary = _summarise(rows, len(states), sampling)
        out.append((table, {**summary, **gen_metrics}))  # the pass's generation, on each of its jobs
    return out


def _encode(tokenizer: Any, states: Sequence[TurnState], sampling: SamplingConfig, max_context: int,
            opts: dict[str, Any]) -> tuple[dict[int, dict[str, Any]], list[tuple[int, list[int]]]]:
    """(rows by state index, [(state index, prompt ids)] of the states that fit): each state rendered
    with :func:`pivotrl.format.prompts.encode_state`; one too long for ``max_context - sampling.max_tokens``
    gets its final row (status "too_long") now."""
    budget = max_context - sampling.max_tokens
    if budget < 1:
        raise ConfigError(f"max_context ({max_context}) must exceed sampling.max_tokens ({sampling.max_tokens})")
    rows: dict[int, dict[str, Any]] = {}
    todo: list[tuple[int, list[int]]] = []
    for i, state in enumerate(states):
        base = {
            "state_id": state.state_id,
            "trajectory_id": state.trajectory_id,
            "turn_index": state.turn_index,
            "category": state.category,
        }
        try:
            ids = list(encode_state(state, tokenizer, max_len=budget, **opts))
        except StateTooLongError:
            ids = None
        if ids is None:
            rows[i] = {**base, "status": "too_long", "n_samples": 0, "n_accepted": 0, "accuracy": float("nan"),
                       "parse_errors": 0, "tokens_generated": 0, "reasons": {}, "samples": "[]"}
        else:
            rows[i] = {**base, "status": "ok"}
            todo.append((i, ids))
    return rows, todo


def _summarise(rows: dict[int, dict[str, Any]], n_states: int, sampling: SamplingConfig
               ) -> tuple[pd.DataFrame, dict[str, Any]]:
    """The per-state table and the summary of one job (see :func:`evaluate_local`)."""
    df = pd.DataFrame([rows[i] for i in range(n_states)], columns=_COLUMNS)
    ok = df[df["status"] == "ok"]
    n_samples = int(ok["n_samples"].sum())
    n_accepted = int(ok["n_accepted"].sum())
    summary = {
        "n_states": len(ok),
        "n_too_long": int((df["status"] == "too_long").sum()),
        "n_verifier_error": int((df["status"] == "verifier_error").sum()),
        "n_samples": n_samples,
        "n_accepted": n_accepted,
        "accuracy": n_accepted / n_samples if n_samples else float("nan"),
        "mean_state_accuracy": float(ok["accuracy"].mean()) if len(ok) else float("nan"),
        "any_accepted_rate": float((ok["n_accepted"] > 0).mean()) if len(ok) else float("nan"),
        "parse_error_rate": int(ok["parse_errors"].sum()) / n_samples if n_samples else 0.0,
        # accepted samples whose call list differs from the demonstration's (the functional
        # verifier's equivalent actions: what imitating the one demonstrated action never teaches)
        "n_accepted_not_demonstrated": int(sum(int((r or {}).get(NOT_DEMONSTRATED, 0)) for r in ok["reasons"])),
        "tokens_generated": int(ok["tokens_generated"].sum()),
        "temperature": float(sampling.temperature),
        "n": int(sampling.n),
    }
    return df, summary


def _score_state(row: dict[str, Any], results: Sequence[Any], gens: Sequence[Any]) -> None:
    """Fill one state's row from its verifier results and generations."""
    accepted = sum(1 for r in results if r.accepted)
    reasons = Counter(r.reason for r in results)
    row.update(
        n_samples=len(results),
        n_accepted=accepted,
        accuracy=accepted / len(results) if results else float("nan"),
        parse_errors=reasons.get("parse_error", 0),
        tokens_generated=sum(len(g.token_ids) for g in gens),
        reasons=dict(reasons),
        # every sample, for the rollout records (pivotrl.provenance.rollouts)
        samples=json.dumps([{"text": g.text, "tokens": len(g.token_ids), "reward": float(r.reward),
                             "reason": r.reason} for g, r in zip(gens, results)], ensure_ascii=False),
    )
