"""Rollout records: every sampled action of probing, training and evaluation, kept per step.

One row per sampled action, columns :data:`ROLLOUT_COLUMNS`:

* ``stage``: ``probe`` (π_ref, m samples per candidate), ``train`` (π_old, K samples per pivot) or
  ``evaluate`` (the evaluated policy on the pivot set, samples at the probe temperature);
* ``policy``: ``reference``, ``policy`` (π_old at a training step) or the evaluated policy's name;
* ``policy_step``: training steps taken by the policy that sampled the action (0 = π_ref; for a
  training row, the step it was sampled *for* minus one: π_old of step N has taken N-1 steps);
* ``step``: the record's step (0 for probing, N for training step N, the final step count for
  evaluation); ``state_id``, ``sample_index``;
* ``action_text``, ``action_tokens`` (-1 where the engine's count was not kept);
* ``reward`` and ``reason`` (the verifier's result);
* ``advantage``: the action's advantage in its group (training rows only; the configured
  estimator, as the trainer computed it), NaN elsewhere;
* ``ratio``: whole-turn ratio π_θ(a|s)/π_old(a|s) after the step's updates, with π_old the
  engine's sampling log-probs (exact in fp32; in bf16 within the engine/trainer kernel noise).
  Training rows of a single-process trainer only; NaN elsewhere.

Where: training records are written once per step as ``<train key>/rollouts/step-<N>.parquet``
(never overwritten: a resumed run finds the steps it already wrote); probing records are read from
``probes.parquet`` (which keeps every sample) and evaluation records from ``<eval key>/rollouts.parquet``.
:func:`read_rollouts` gathers all of them under any prefix of the run root.
"""

from __future__ import annotations

import json
import math
from typing import Any, Iterable, Sequence

import pandas as pd

from pivotrl.core.errors import StorageError

__all__ = ["ROLLOUT_COLUMNS", "train_records", "probe_records", "eval_records", "write_train_step",
           "read_rollouts", "pivot_changes", "render_rollouts", "changes_markdown", "record_train_step",
           "record_evaluation"]

ROLLOUT_COLUMNS = ["stage", "policy", "policy_step", "step", "state_id", "sample_index", "action_text",
                   "action_tokens", "reward", "reason", "advantage", "ratio"]
_DTYPES = {"policy_step": "int64", "step": "int64", "sample_index": "int64", "action_tokens": "int64",
           "reward": "float64", "advantage": "float64", "ratio": "float64"}


def _frame(rows: list[dict[str, Any]]) -> pd.DataFrame:
    return pd.DataFrame(rows, columns=ROLLOUT_COLUMNS).astype(_DTYPES)


def train_records(step: int, scored: Sequence[tuple[str, Sequence[Any], Sequence[Any]]], *, estimator: str,
                  delta: float, new_logprobs: Sequence[Sequence[Sequence[float]]] | None = None) -> pd.DataFrame:
    """Rows of training step ``step`` (1-based).

    ``scored``: per pivot group, ``(state_id, generations, verifier results)`` (K each; generations
    have ``text``, ``token_ids``, ``rollout_logprobs``); ``new_logprobs``: per group and action the
    per-token log-probs under the updated policy (None → ratio NaN). A group of fewer than two
    actions gets NaN advantages (the trainer cannot use it either).
    """
    import torch

    from pivotrl.objective.advantages import compute_advantages

    rows: list[dict[str, Any]] = []
    for g, (state_id, gens, results) in enumerate(scored):
        rewards = [float(r.reward) for r in results]
        adv = (compute_advantages(torch.tensor(rewards, dtype=torch.float64), estimator, delta).tolist()
               if len(rewards) >= 2 else [math.nan] * len(rewards))
        for k, (gen, res) in enumerate(zip(gens, results)):
            ratio = math.nan
            if new_logprobs is not None and gen.rollout_logprobs:
                log_ratio = sum(new_logprobs[g][k]) - sum(float(x) for x in gen.rollout_logprobs)
                ratio = math.exp(max(min(log_ratio, 20.0), -20.0))
            rows.append({"stage": "train", "policy": "policy", "policy_step": step - 1, "step": step,
                         "state_id": state_id, "sample_index": k, "action_text": gen.text,
                         "action_tokens": len(gen.token_ids), "reward": rewards[k], "reason": res.reason,
                         "advantage": float(adv[k]), "ratio": ratio})
    return _frame(rows)


def write_train_step(store: Any, train_key: str, step: int, frame: pd.DataFrame) -> str:
    """Publish one training step's records (atomically); returns its URI."""
    return store.write_parquet(f"{train_key}/rollouts/step-{step:06d}.parquet", frame)


def probe_records(probes: pd.DataFrame, *, stage: str = "probe", policy: str = "reference",
                  step: int = 0) -> pd.DataFrame:
    """Rows of a probe table (``probes.parquet``, or the evaluation's re-probe of the pivots under the
    trained policy: ``stage="reprobe"``, ``policy="pivotrl"``, ``step`` = its training steps): every
    sample of every scored state."""
    rows: list[dict[str, Any]] = []
    for r in probes[probes["status"] == "ok"].itertuples(index=False):
        texts, rewards, reasons = json.loads(r.samples), json.loads(r.rewards), json.loads(r.reasons)
        tokens = json.loads(getattr(r, "sample_tokens", "[]") or "[]") or [-1] * len(texts)
        for k, (text, reward, reason, n) in enumerate(zip(texts, rewards, reasons, tokens)):
            rows.append({"stage": stage, "policy": policy, "policy_step": step, "step": step,
                         "state_id": r.state_id, "sample_index": k, "action_text": text, "action_tokens": int(n),
                         "reward": float(reward), "reason": reason, "advantage": math.nan, "ratio": math.nan})
    return _frame(rows)


def eval_records(frame: pd.DataFrame, *, policy: str, policy_step: int) -> pd.DataFrame:
    """Rows of a local evaluation frame whose ``samples`` column lists ``{text, tokens, reward, reason}``."""
    rows: list[dict[str, Any]] = []
    for r in frame[frame["status"] == "ok"].itertuples(index=False):
        for k, s in enumerate(json.loads(r.samples)):
            rows.append({"stage": "evaluate", "policy": policy, "policy_step": policy_step, "step": policy_step,
                         "state_id": r.state_id, "sample_index": k, "action_text": s["text"],
                         "action_tokens": int(s["tokens"]), "reward": float(s["reward"]), "reason": s["reason"],
                         "advantage": math.nan, "ratio": math.nan})
    return _frame(rows)


def read_rollouts(store: Any, prefix: str = "", *, step: int | None = None, state: str | None = None) -> pd.DataFrame:
    """Every rollout record under ``prefix`` of ``store`` (probe tables, training steps, evaluation),
    filtered by ``step`` and ``state`` (a state id), sorted by step, stage, state and sample.

    The store's root may be any folder of a run (``train/<key>``, ``probes/<key>``). Probe shard
    tables (``probes/shards/...``) are read only when the root is inside ``shards``: above it, the
    merged probe table holds the same rows.

    Raises StorageError when ``prefix`` holds no rollout records.
    """
    keys = store.list(prefix) if prefix else store.list("")
    frames: list[pd.DataFrame] = []
    for key in sorted(keys):
        rel = "/" + (key[len(prefix):].lstrip("/") if prefix and key.startswith(prefix) else key)
        if "/shards/" in rel:  # a shard's table is also in its merged table: read only the merge
            continue
        if rel.endswith("/probes.parquet"):
            frames.append(probe_records(store.read_parquet(key)))
        elif "/rollouts/step-" in rel and rel.endswith(".parquet") or rel.endswith("/rollouts.parquet"):
            frames.append(store.read_parquet(key))
    frames = [f for f in frames if len(f)]
    if not frames:
        where = store.url(prefix) if prefix else store.root_url
        raise StorageError(f"{where}: no rollout records (probes.parquet, rollouts/step-*.parquet or "
                           "rollouts.parquet) under it")
    df = pd.concat(frames, ignore_index=True)
    if step is not None:
        df = df[df["step"] == step]
    if state is not None:
        df = df[df["state_id"] == state]
    order = {"probe": 0, "train": 1, "evaluate": 2, "reprobe": 3}
    return df.assign(_o=df["stage"].map(order)).sort_values(
        ["step", "_o", "policy", "state_id", "sample_index"]).drop(columns="_o").reset_index(drop=True)


def pivot_changes(df: pd.DataFrame, pivots: Iterable[str]) -> pd.DataFrame:
    """Per pivot: mean reward before and after training, and the change; largest change first.

    Before/after, the first pair recorded: π_ref's m probes and the trained policy's m samples of
    the evaluation's re-probe (same m, temperature and seed: n = m each); else the greedy evaluation
    of π_ref and of the PivotRL policy on the pivot set (n = 1 each); else π_ref's probes and the
    pivot's last training group. ``basis`` says which.
    """
    rows = []
    for sid in pivots:
        g = df[df["state_id"] == sid]
        probes = g[g["stage"] == "probe"]["reward"]
        reprobe = g[g["stage"] == "reprobe"]["reward"]
        ev_ref = g[(g["stage"] == "evaluate") & (g["policy"] == "reference")]["reward"]
        ev_new = g[(g["stage"] == "evaluate") & (g["policy"] == "pivotrl")]["reward"]
        tr = g[g["stage"] == "train"]
        if len(probes) and len(reprobe):
            before, after, basis = probes, reprobe, "probes vs re-probe"
        elif len(ev_ref) and len(ev_new):
            before, after, basis = ev_ref, ev_new, "greedy evaluation"
        else:
            before, after, basis = probes, tr[tr["step"] == tr["step"].max()]["reward"], "probes vs last training group"
        if not len(before) or not len(after):
            continue
        rows.append({"state_id": sid, "reference": float(before.mean()), "final": float(after.mean()),
                     "change": float(after.mean() - before.mean()), "n_reference": len(before), "n_final": len(after),
                     "trained_at_steps": ",".join(str(s) for s in sorted(set(tr["step"]))), "basis": basis})
    out = pd.DataFrame(rows, columns=["state_id", "reference", "final", "change", "n_reference", "n_final",
                                      "trained_at_steps", "basis"])
    return out.sort_values(["change", "state_id"], ascending=[False, True]).reset_index(drop=True)


def record_train_step(store: Any, train_key: str, step: int, scored: Sequence[tuple[str, Sequence[Any], Sequence[Any]]],
                      trainer: Any, groups: Sequence[Any], world: int, estimator: str, delta: float) -> str | None:
    """Write training step ``step``'s records (called by rank 0 after the step's updates).

    Ratios need the updated policy's log-probs of every action: one extra no-grad forward per group
    (the state once, its K actions on the shared prefix; not yet benchmarked); computed for a
    single-process trainer only (under ZeRO-3 every rank would have to join), else NaN.
    """
    if not scored:
        return None
    new_lp = None
    if world == 1 and groups and all(gen.token_ids for _, gens, _ in scored for gen in gens):
        import torch

        from pivotrl.training.logprobs import compute_group_logprobs

        by_state = {g.state_id: g for g in groups}
        new_lp = []
        with torch.no_grad():  # one pass per group, the state's prefix shared by its K actions
            for sid, gens, _ in scored:
                acts = [list(gen.token_ids) for gen in gens]
                lp = compute_group_logprobs(trainer.engine, by_state[sid].prompt_ids, acts,
                                            shared_prefix=trainer.settings.shared_prefix,
                                            prefix_method=trainer.settings.prefix_method).logprobs
                new_lp.append([lp[k, : len(a)].double().tolist() for k, a in enumerate(acts)])
    return write_train_step(store, train_key, step, train_records(step, scored, estimator=estimator, delta=delta,
                                                                  new_logprobs=new_lp))


def record_evaluation(store: Any, eval_key: str, frames: Sequence[pd.DataFrame], *, probes_key: str,
                      train_key: str, train_steps: int, report_md: Any,
                      reprobe: pd.DataFrame | None = None) -> str | None:
    """Write the evaluation's records on the pivot set (``<eval key>/rollouts.parquet``: the local
    evaluation ``frames`` and the pivots' ``reprobe`` table under the trained policy) and append the
    pivots that improved most and least to the report at the local path ``report_md``."""
    from pathlib import Path

    if not frames and reprobe is None:
        return None
    recs = [eval_records(f, policy=str(f["policy"].iloc[0]), policy_step=train_steps if str(f["policy"].iloc[0])
                         == "pivotrl" else 0) for f in frames if len(f)]
    if reprobe is not None and len(reprobe):
        recs.append(probe_records(reprobe, stage="reprobe", policy="pivotrl", step=train_steps))
    ev = pd.concat(recs, ignore_index=True) if recs else _frame([])
    uri = store.write_parquet(f"{eval_key}/rollouts.parquet", ev)
    parts = [ev, probe_records(store.read_parquet(f"{probes_key}/probes.parquet"))]
    parts += [store.read_parquet(k) for k in store.list(f"{train_key}/rollouts") if k.endswith(".parquet")]
    allrec = pd.concat([p for p in parts if len(p)], ignore_index=True)
    pivots = sorted(set(ev["state_id"]))
    section = changes_markdown(pivot_changes(allrec, pivots), store.root_url)
    if section:
        path = Path(report_md)
        path.write_text(path.read_text(encoding="utf-8") + section, encoding="utf-8")
    return uri


_BASIS = {
    "probes vs re-probe": "π_ref's m probes against the trained policy's m samples when the evaluation re-probed "
                          "the pivot set (same m, temperature and seed)",
    "greedy evaluation": "π_ref's and the trained policy's greedy action on the pivot set (n = 1 each)",
    "probes vs last training group": "π_ref's probes against the pivot's last training group",
}


def changes_markdown(changes: pd.DataFrame, uri: str, n: int = 3) -> str:
    """A report section naming the ``n`` pivots whose mean reward rose most and the ``n`` it rose
    least (or fell), each marked improved / worsened / unchanged, with the command that prints their
    records."""
    if not len(changes):
        return ""
    lines = ["", "## Pivots that changed most", "",
             "Mean reward of each pivot's samples before and after training: "
             f"{'; '.join(_BASIS.get(b, b) for b in dict.fromkeys(str(x) for x in changes['basis']))}. "
             f"Records: `pivotrl rollouts {uri} --state <id>`.", "",
             "| | pivot | π_ref | final | Δ | n (ref/final) | trained at steps |", "|---|---|---|---|---|---|---|"]
    picks = [("most", changes.head(n))]
    if len(changes) > n:
        picks.append(("least", changes.tail(min(n, len(changes) - n)).iloc[::-1]))
    for label, part in picks:
        for r in part.itertuples(index=False):
            # by the sign of the change: the top rows are the largest changes, the bottom rows the smallest
            what = "unchanged" if abs(r.change) < 5e-3 else "improved" if r.change > 0 else "worsened"
            lines.append(f"| {what} | `{r.state_id}` | {r.reference:.2f} | {r.final:.2f} | "
                         f"{r.change:+.2f} | {r.n_reference}/{r.n_final} | {r.trained_at_steps or '-'} |")
    return "\n".join(lines) + "\n"


def render_rollouts(df: pd.DataFrame, width: int = 60) -> list[str]:
    """Text table of rollout records, one line per sampled action."""
    head = f"{'stage':<8} {'step':>4} {'policy':<10} {'state':<28} {'k':>2} {'reward':>6} {'adv':>7} " \
           f"{'ratio':>7} {'tok':>4}  {'reason':<16} action"
    lines = [head, "-" * len(head)]
    for r in df.itertuples(index=False):
        text = " ".join(str(r.action_text).split())
        text = text if len(text) <= width else text[: width - 1] + "…"
        adv = "" if math.isnan(r.advantage) else f"{r.advantage:+.3f}"
        ratio = "" if math.isnan(r.ratio) else f"{r.ratio:.3f}"
        tok = "" if r.action_tokens < 0 else str(r.action_tokens)
        lines.append(f"{r.stage:<8} {r.step:>4} {r.policy:<10} {r.state_id:<28} {r.sample_index:>2} "
                     f"{r.reward:>6.2f} {adv:>7} {ratio:>7} {tok:>4}  {r.reason:<16} {text}")
    return lines
