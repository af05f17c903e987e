"""The probe table: probe the frozen reference policy on candidate states and select the pivot set.

PivotRL §3, stage 1: for each candidate state ``s``, m = ``probing.num_probes`` actions are sampled
from π_ref and scored by the verifier; μ̂(s) and the population σ̂²(s) of the m rewards decide
whether ``s`` is kept (σ̂² > 0 and μ̂ < λ_diff). What is kept is the *state*, never a probe.

Outputs:
- ``probes/<key>/probes.parquet``: one row per probed state — ``state_id``, ``category``,
  ``turn_index``, ``prompt_tokens``, ``rewards`` (m floats, JSON), ``mu``, ``var``,
  ``action_tokens_mean``, ``samples`` (the m texts, JSON), ``reasons`` (verifier reasons, JSON),
  ``sample_tokens`` (the m action lengths in tokens, JSON; a ``reasons`` entry ``"equivalent"`` is an
  accepted probe whose calls differ from the demonstration's, counted in ``stats.json`` as
  ``accepted_not_demonstrated``) — every sample is kept, so pass rates
  for another m or λ_diff can be re-derived without new rollouts (:func:`rederive_pivots`),
  ``status`` ("ok" | "too_long" | "verifier_error"), ``reason`` (why a state was skipped),
  ``decision`` (see ``pivotrl.pivots.filter.pivot_decision``; empty unless status is "ok") and
  ``verifier_retries`` (tool requests the verifier had to retry for this state: crashes, timeouts,
  injected faults; retries never change a verdict, a state whose retries run out is "verifier_error").
- ``pivots/<key>/pivots.parquet``: the kept candidate rows (state + verifier context) with μ̂, σ̂²;
  ``pivots/<key>/stats.json`` and ``summary.md``.
"""

from __future__ import annotations

import json
import logging
from collections import Counter
from typing import TYPE_CHECKING, Any, Mapping, Sequence

import numpy as np
import pandas as pd

from pivotrl.data.schema import TurnState
from pivotrl.core.hashing import content_hash
from pivotrl.core.errors import StateTooLongError
from pivotrl.pipeline.results import ReferenceResult

if TYPE_CHECKING:
    from pivotrl.config import RunConfig
from pivotrl.rollout.scoring import ScoredState, sample_and_score, verifier_retries  # noqa: F401 (re-export)

log = logging.getLogger(__name__)

#: 2: each state's samples are seeded by (probing seed, state id), not by its position in a batch,
#: so a state probes the same in any shard; the table keeps every sample's length.
#: 3: one probe stage at any scale (pivotrl.pipeline.probe_stage); a table written by the old sharded
#: path (no candidate-kind filter, the pythonic parser for every run) is never reused.
PROBE_VERSION = 3


def state_seed(seed: int, state_id: str) -> int:
    """The 63-bit base seed of one state's probes: sha256 of (``seed``, ``state_id``), so a state's m
    samples are the same whatever batch, shard or worker it is probed in."""
    import hashlib

    digest = hashlib.sha256(f"pivotrl-probe\0{seed}\0{state_id}".encode()).digest()
    return int.from_bytes(digest[:8], "big") >> 1


def candidate_kind_column(cand_df: pd.DataFrame) -> pd.Series:
    """Each candidate row's kind ("call", "stop", "text_rule", "text_no_rule"), from its verifier
    context (rows written before kinds existed: "call" if the demo calls tools, else "text_no_rule")."""
    def kind(ctx: str, demo: str) -> str:
        k = json.loads(ctx).get("candidate_kind")
        if k:
            return str(k)
        return "call" if json.loads(demo).get("tool_calls") else "text_no_rule"

    return pd.Series([kind(c, d) for c, d in zip(cand_df["verifier_context"], cand_df["demo_action"])],
                     index=cand_df.index, dtype=object)


def select_candidates(cand_df: pd.DataFrame, split: str, max_states: int | None, seed: int,
                      kinds: Sequence[str] | None = None) -> pd.DataFrame:
    """Rows of ``split`` (and, when ``kinds`` is given, of those candidate kinds: see
    ``pivotrl.data.states.candidate_kinds_for_pivots``); if ``max_states`` is set, a seeded sample
    of that many (stable order)."""
    df = cand_df[cand_df["split"] == split]
    if kinds is not None:
        df = df[candidate_kind_column(df).isin(list(kinds))]
    if max_states is not None and len(df) > max_states:
        df = df.sample(n=max_states, random_state=seed)
    return df.sort_values("state_id").reset_index(drop=True)


def probe_states(
    engine: Any,
    tokenizer: Any,
    states: Sequence[TurnState],
    verifier: Any,
    *,
    num_probes: int,
    sampling: Any,
    max_context: int,
    max_tokens: int,
    prompt_kwargs: dict[str, Any] | None = None,
    batch_size: int = 16,
    progress: bool = True,
    cache_dir: str | None = None,
) -> pd.DataFrame:
    """Sample ``num_probes`` actions per state from ``engine`` and score them.

    States longer than ``max_context - max_tokens`` are skipped with status "too_long" (never
    truncated). A verifier that cannot decide for a state (``VerifierError``, raised once its
    retries are spent) drops the whole state with status "verifier_error": μ̂ is never computed
    from a partial group and no reward is read as 0. The retries spent on each state are read from
    ``verifier.stats.retries`` (a ``RetryStats``; 0 for verifiers without one).
    Returns the probe table described in the module docstring (one row per state, input order).
    """
    from pivotrl.format.prompts import encode_state

    prompt_kwargs = prompt_kwargs or {}
    rows: list[dict[str, Any]] = []
    encoded: list[tuple[TurnState, list[int]]] = []
    for s in states:
        try:
            ids = encode_state(s, tokenizer, max_len=max_context - max_tokens, **prompt_kwargs)
        except StateTooLongError as e:
            rows.append(_row(s, status="too_long", reason=str(e)))
            continue
        encoded.append((s, ids))

    from pivotrl.core.progress import Progress

    from pivotrl.runtime.generation import generation_peak, since, snapshot

    before, gen, peak = snapshot(engine), None, None
    with Progress("probing", len(encoded), "states", enabled=progress) as bar:
        for b in range(0, len(encoded), batch_size):
            chunk = encoded[b : b + batch_size]
            base = int(getattr(sampling, "seed", None) or 0)
            scored = sample_and_score(engine, verifier, [s for s, _ in chunk], [ids for _, ids in chunk], sampling,
                                      seeds=[state_seed(base, s.state_id) for s, _ in chunk])
            rows.extend(_probe_row(g) for g in scored)
            gen = since(engine, before)  # generation MFU so far (pivotrl.runtime.generation)
            if gen is not None and gen.requests:
                peak = peak or generation_peak(gen, cache_dir)
                for name, value in gen.counters(peak).items():
                    bar.set_counter(name, value)
            bar.update(len(chunk), samples=sum(len(g.samples) for g in scored))
    if gen is not None and gen.requests and progress:
        log.info(gen.line("probing", peak))
    order = {s.state_id: i for i, s in enumerate(states)}
    rows.sort(key=lambda r: order[r["state_id"]])
    return pd.DataFrame(rows, columns=PROBE_COLUMNS)


def _probe_row(g: ScoredState) -> dict[str, Any]:
    """The probe-table row of one sampled and scored state (see probe_states)."""
    from pivotrl.pivots.filter import probe_stats

    texts = [x.text for x in g.samples]
    if not g.decided:
        return _row(g.state, prompt_tokens=len(g.prompt_ids), status="verifier_error", reason=g.error or "",
                    samples=texts, verifier_retries=g.verifier_retries)
    rewards = g.rewards
    mu, var = probe_stats(rewards)
    return _row(
        g.state,
        prompt_tokens=len(g.prompt_ids),
        rewards=rewards,
        mu=float(mu),
        var=float(var),
        action_tokens_mean=float(np.mean([len(x.token_ids) for x in g.samples])),
        samples=texts,
        sample_tokens=[len(x.token_ids) for x in g.samples],
        reasons=[r.reason for r in g.results],
        status="ok",
        verifier_retries=g.verifier_retries,
    )


PROBE_COLUMNS = [
    "state_id", "trajectory_id", "category", "turn_index", "prompt_tokens", "rewards", "mu", "var",
    "action_tokens_mean", "samples", "reasons", "status", "reason", "decision", "verifier_retries",
    "sample_tokens",
]


def _row(s: TurnState, **kw: Any) -> dict[str, Any]:
    row = {
        "state_id": s.state_id,
        "trajectory_id": s.trajectory_id,
        "category": s.category,
        "turn_index": s.turn_index,
        "prompt_tokens": kw.get("prompt_tokens", -1),
        "rewards": json.dumps(kw.get("rewards", [])),
        "mu": kw.get("mu", float("nan")),
        "var": kw.get("var", float("nan")),
        "action_tokens_mean": kw.get("action_tokens_mean", float("nan")),
        "samples": json.dumps(kw.get("samples", []), ensure_ascii=False),
        "reasons": json.dumps(kw.get("reasons", [])),
        "status": kw["status"],
        "reason": kw.get("reason", ""),
        "decision": kw.get("decision", ""),
        "verifier_retries": int(kw.get("verifier_retries", 0)),
        "sample_tokens": json.dumps(kw.get("sample_tokens", [])),
    }
    return row


def apply_pivot_filter(probe_df: pd.DataFrame, lambda_diff: float) -> pd.DataFrame:
    """Fill ``decision`` for every "ok" row with the pivot rule (σ̂² > 0 and μ̂ < λ_diff).

    Returns a copy; rows whose status is not "ok" get decision "skipped_<status>".
    """
    from pivotrl.pivots.filter import pivot_decision

    df = probe_df.copy()
    df["decision"] = [
        pivot_decision(float(mu), float(var), lambda_diff) if st == "ok" else f"skipped_{st}"
        for mu, var, st in zip(df["mu"], df["var"], df["status"])
    ]
    return df


def accepted_counts(frame: pd.DataFrame) -> dict[str, int]:
    """``accepted_samples`` (probes with reward 1) and ``accepted_not_demonstrated``: those whose call
    list differs from the demonstration's yet were accepted (reason
    :data:`~pivotrl.verifiers.base.NOT_DEMONSTRATED`: the execution verifier's functional
    equivalence), read from the ``reasons`` column."""
    from pivotrl.verifiers.base import count_not_demonstrated

    accepted = other = 0
    # a table written before the reasons column existed counts no equivalent actions
    reasons_col = frame["reasons"] if "reasons" in frame else ["[]"] * len(frame)
    for rewards, reasons in zip(frame["rewards"], reasons_col):
        accepted += sum(1 for r in json.loads(rewards) if r == 1.0)
        other += count_not_demonstrated(json.loads(reasons))
    return {"accepted_samples": int(accepted), "accepted_not_demonstrated": int(other)}


def pivot_stats(probe_df: pd.DataFrame, lambda_diff: float) -> dict[str, Any]:
    """Counts of the filter: candidates, all-fail, all-pass, above threshold, kept, skipped;
    per category and per turn index; the μ̂ histogram (bins of width 1/m over [0, 1])."""
    d = probe_df
    ok = d[d["status"] == "ok"]

    def counts(frame: pd.DataFrame) -> dict[str, int]:
        c = Counter(frame["decision"])
        return {
            "candidates": int(len(frame)),
            "all_fail": int(c.get("all_fail", 0)),
            "all_pass": int(c.get("all_pass", 0)),
            "above_threshold": int(c.get("above_threshold", 0)),
            "kept": int(c.get("kept", 0)),
            "skipped_too_long": int(c.get("skipped_too_long", 0)),
            "skipped_verifier_error": int(c.get("skipped_verifier_error", 0)),
            **accepted_counts(frame),
        }

    m = max((len(json.loads(r)) for r in ok["rewards"]), default=1)
    # Tables written before the column existed count no retries.
    retries = int(d["verifier_retries"].sum()) if "verifier_retries" in d else 0
    hist, edges = np.histogram(ok["mu"].to_numpy(dtype=float), bins=m + 1, range=(-0.5 / m, 1 + 0.5 / m))
    return {
        "lambda_diff": lambda_diff,
        "total": counts(d),
        "per_category": {k: counts(g) for k, g in d.groupby("category")},
        "per_turn_index": {int(k): counts(g) for k, g in d.groupby("turn_index")},
        "mu_histogram": {"bin_centers": [round(float(x), 4) for x in (edges[:-1] + edges[1:]) / 2],
                         "counts": [int(x) for x in hist]},
        "mu_mean": float(ok["mu"].mean()) if len(ok) else float("nan"),
        "verifier_retries": retries,
    }


def stats_markdown(stats: dict[str, Any]) -> str:
    """A markdown summary of ``pivot_stats`` (for the Prefect artifact and the run report)."""
    cols = ["candidates", "all_fail", "all_pass", "above_threshold", "kept", "skipped_too_long",
            "skipped_verifier_error"]
    lines = [f"## Pivot set (λ_diff = {stats['lambda_diff']})", "",
             "| group | " + " | ".join(cols) + " |", "|---" * (len(cols) + 1) + "|"]
    lines.append("| **all** | " + " | ".join(str(stats["total"][c]) for c in cols) + " |")
    for name, c in stats["per_category"].items():
        lines.append(f"| {name} | " + " | ".join(str(c[k]) for k in cols) + " |")
    for ti, c in stats["per_turn_index"].items():
        lines.append(f"| turn {ti} | " + " | ".join(str(c[k]) for k in cols) + " |")
    h = stats["mu_histogram"]
    lines += ["", "μ̂ histogram (probes that succeeded / m): " +
              ", ".join(f"{c:.2f}: {n}" for c, n in zip(h["bin_centers"], h["counts"]))]
    lines += ["", f"Verifier retries (tool requests repeated after a crash or timeout): "
              f"{stats.get('verifier_retries', 0)}; states dropped after their retries ran out: "
              f"{stats['total']['skipped_verifier_error']}"]
    total = stats["total"]
    if "accepted_not_demonstrated" in total:
        per = "; ".join(f"{name}: {c['accepted_not_demonstrated']}" for name, c in stats["per_category"].items())
        lines += ["", f"Accepted probes whose calls differ from the demonstration's (rewarded by execution, "
                      f"same state and outputs): {total['accepted_not_demonstrated']} of "
                      f"{total['accepted_samples']} accepted ({per})"]
    return "\n".join(lines) + "\n"


def probe_key(candidates_hash: str, ref_hash: str, probing: dict[str, Any], verifier: dict[str, Any],
              prompt: dict[str, Any], engine: Any) -> str:
    """Content address of a probe table: candidates, reference weights, probing/verifier/prompt
    settings, the engine settings that change samples (name, max_tokens, dtype, context) and the
    code that decides the rewards (verifiers, parser, renderer, environments, sampling: see
    :mod:`pivotrl.provenance.code_digest`) — λ_diff excluded: changing it re-filters without re-probing."""
    from pivotrl.provenance.code_digest import stage_code_digest

    probing = {k: v for k, v in probing.items() if k != "lambda_diff"}
    return "probes/" + content_hash(
        {"candidates": candidates_hash, "reference": ref_hash, "probing": probing, "verifier": verifier,
         "prompt": prompt, "engine": engine, "version": PROBE_VERSION,
         "code": stage_code_digest("probe")}
    )[:16]


def rederive_pivots(probe_df: pd.DataFrame, lambda_diff: float, *, num_probes: int | None = None) -> pd.DataFrame:
    """Re-derive μ̂, σ̂² and the pivot decision from the stored per-sample rewards, without new
    rollouts: with ``num_probes`` = m' ≤ m, from the first m' samples of each state (each state's
    samples are independent draws, so this is what probing with m' would have given), and with
    another ``lambda_diff``. ``rewards``/``reasons``/``samples``/``sample_tokens`` are cut to m'.

    Returns a copy of the table (same columns). Raises ValueError if m' < 1 or a state has fewer
    than m' samples.
    """
    from pivotrl.pivots.filter import probe_stats

    df = probe_df.copy()
    if num_probes is not None:
        if num_probes < 1:
            raise ValueError(f"num_probes = {num_probes}: must be ≥ 1")
        mus, vars_ = [], []
        for i, (st, raw) in enumerate(zip(df["status"], df["rewards"])):
            rewards = json.loads(raw)
            if st != "ok":
                mus.append(float("nan")), vars_.append(float("nan"))
                continue
            if len(rewards) < num_probes:
                raise ValueError(f"state {df['state_id'].iloc[i]!r} has {len(rewards)} samples, fewer than {num_probes}")
            mu, var = probe_stats(rewards[:num_probes])
            mus.append(float(mu)), vars_.append(float(var))
        df["mu"], df["var"] = mus, vars_
        for col in ("rewards", "reasons", "samples", "sample_tokens"):
            if col in df:
                df[col] = [json.dumps(json.loads(v)[:num_probes], ensure_ascii=False) for v in df[col]]
    return apply_pivot_filter(df, lambda_diff)


# ------------------------------------------------------------------------------ the stage
def probe_table_key(cfg: RunConfig, candidates_hash: str, ref: ReferenceResult | Mapping[str, Any]) -> str:
    """The content key of a probe table over the candidates with content hash ``candidates_hash``
    (the whole pivot split, or one shard of it): :func:`probe_key` with the
    run's probing, verifier, prompt and engine settings (the resolved dtype)."""
    from pivotrl.pipeline.reference import prompt_identity
    from pivotrl.runtime.precision import with_resolved_dtype

    cfg = with_resolved_dtype(cfg)
    return probe_key(candidates_hash, ReferenceResult.of(ref).ref_hash, cfg.probing.model_dump(mode="json"),
                     cfg.verifier.model_dump(mode="json"), prompt_identity(cfg, ref),
                     {"engine": cfg.rollout.engine, "max_tokens": cfg.rollout.max_tokens,
                      "dtype": cfg.model.dtype, "max_context": cfg.model.max_context,
                      "include_stop_decisions": cfg.quality.include_stop_decisions})


def pivot_set_key(probes_key: str, lambda_diff: float) -> str:
    """``pivots/<16 hex>-<8 hex>``: the pivot set selected with ``lambda_diff`` from the probe table
    under ``probes_key`` (``probes/<16 hex>``)."""
    return probes_key.replace("probes/", "pivots/", 1) + "-" + content_hash({"lambda_diff": lambda_diff})[:8]
