"""The PivotRL training loop (PivotRL §3, stage 2): rollout → score → groups → ``train_step`` →
refresh π_old in the rollout engine → checkpoint, once per batch of pivots.

:func:`run_rl_loop` knows nothing of the artifact store, keys or Prefect: it takes a trainer
(:class:`pivotrl.training.pivotrl.PivotRLTrainer`), a rollout engine (``pivotrl.rollout``), a
verifier, the pivots with their encoded prompts and the pivot order, and calls
:class:`LoopHooks` for what the pipeline adds (fault injection, rollout records, the experiment
tracker, checkpoints on the store: see ``pivotrl.pipeline.train``). So it runs in a unit test with
the transformers engine, a tiny random model and a toy verifier.

Data parallel: every rank trains on the same global batch. Where the rollout engines live is
``hosts`` (:mod:`pivotrl.training.rank_engines`, ``rollout.engine_placement``): by default rank 0
alone owns the engine and the verifier (``None`` on the other ranks) and broadcasts each batch's
groups; with engines on several ranks (one per node, or one every N ranks) each host rank samples
and scores its block of the batch and the blocks are all-gathered.

Several engines (``rollout.num_engines`` > 1 on rank 0, an :class:`pivotrl.rollout.pool.EnginePool`,
or one engine on each of several host ranks): the batch's states are split across the engines in
order (engine j serves block j of the batch positions), they generate concurrently, each state
seeded by its position in the whole batch (the same samples as one engine would draw), and after
every step *every* engine is refreshed and checked against the trainer; a row then also carries
``engines``, ``refresh_verified_engines`` (engines whose check passed; 0 when nothing was checked),
``refresh_max_abs_delta_e<j>`` and ``rollout_states_e<j>`` (states engine j sampled at). With one
engine the rows are as before.

The refresh check: the engines sample step t+1's batch with the weights refreshed after step t, and
report each sampled token's log-prob (``Group.sampler_logprobs``); ``train_step`` computes the
trainer's π_old on the same tokens for the loss, and their difference, per engine
(``sampler_mismatch_*``), is the check of that refresh, read for free right after the step's update
and before anything of it is recorded. Only the refresh after the last step (no batch samples it), and
every refresh when the batch carried no sampling log-probs, are checked by scoring: each engine's
log-probs of the first trained group's actions against the trainer's (:func:`refresh_step`).
"""

from __future__ import annotations

import json
import logging
import random
import shutil
import time
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, Sequence

from pivotrl.runtime.generation import generation_peak, side_by_side, since, snapshot
from pivotrl.training.checkpoints import broadcast
from pivotrl.training.rank_engines import all_gather, refresh_step, rollout_step
from pivotrl.training.refresh_check import BATCH_SOURCE, batch_check, check_refresh, engines_row, num_engines
from pivotrl.verifiers.base import count_not_demonstrated

if TYPE_CHECKING:
    from pivotrl.config import RunConfig

log = logging.getLogger("pivotrl.training")

__all__ = [
    "LoopHooks", "anchor_schedule", "pivot_schedule", "refilter_unused", "run_rl_loop", "steps_per_epoch",
]


def pivot_schedule(num_pivots: int, batch: int, epochs: int, seed: int, max_steps: int | None) -> list[list[int]]:
    """The pivot order of the whole run: one seeded permutation per epoch, cut into batches of
    ``batch`` pivot indices, the first ``max_steps`` batches (all when None).

    Deterministic in its arguments, so a resumed run consumes exactly the same sequence.
    """
    steps: list[list[int]] = []
    for e in range(epochs):
        order = list(range(num_pivots))
        random.Random(seed * 1_000_003 + e).shuffle(order)
        steps += [order[i : i + batch] for i in range(0, num_pivots, batch)]
    return steps[:max_steps] if max_steps else steps


def steps_per_epoch(cfg: "RunConfig", num_pivots: int) -> int:
    """Batches per epoch: ``ceil(num_pivots / training.pivots_per_batch)``."""
    return -(-num_pivots // cfg.training.pivots_per_batch)


def refilter_unused(cfg: "RunConfig", num_pivots: int, steps: int) -> str | None:
    """Why ``training.refilter_between_epochs`` will do nothing in a run of ``steps`` steps (the
    run ends within its first epoch: ``training.max_steps`` or a single epoch), or None when a
    re-filter will run (or none was asked for)."""
    per_epoch = steps_per_epoch(cfg, num_pivots)
    if not cfg.training.refilter_between_epochs or steps > per_epoch:
        return None
    return (f"training.refilter_between_epochs is on but will not run: the run has {steps} step(s) and its first "
            f"epoch has {per_epoch} (training.max_steps or training.epochs ends it within the first "
            "epoch), and the pivot set is re-filtered only between epochs")


def _refilter(engine: Any, verifier: Any, pivots: Sequence[Any], prompts: Sequence[list[int]], active: list[int],
              cfg: "RunConfig", step: int) -> tuple[list[int], dict[str, int]]:
    """Re-probe and re-filter the pivot set between epochs (seed §5: after updates a pivot may stop
    satisfying the filter): rank 0 samples ``probing.num_probes`` actions at each still-active pivot
    from the engine (π_old = the current policy) with the probing settings, scores them, and keeps the
    pivots whose μ̂, σ̂² still pass the pivot rule at ``probing.lambda_diff``
    (:func:`pivotrl.pivots.filter.pivot_decision`). A pivot the verifier cannot decide stays active.
    Returns the pivots of ``active`` still inside the filter, and counts."""
    from pivotrl.pivots.filter import pivot_decision, probe_stats
    from pivotrl.rollout.base import SamplingConfig
    from pivotrl.rollout.scoring import sample_and_score

    pr = cfg.probing
    sampling = SamplingConfig(n=pr.num_probes, temperature=pr.temperature, top_p=pr.top_p, top_k=pr.top_k,
                              max_tokens=cfg.rollout.max_tokens, seed=pr.seed * 100_019 + step)
    keep: list[int] = []
    counts = {"kept": 0, "all_pass": 0, "all_fail": 0, "above_threshold": 0, "undecided": 0}
    for i, g in zip(active, sample_and_score(engine, verifier, [pivots[i] for i in active],
                                             [prompts[i] for i in active], sampling)):
        if not g.decided:
            counts["undecided"] += 1
            keep.append(i)
            continue
        mu, var = probe_stats(g.rewards)
        decision = pivot_decision(mu, var, pr.lambda_diff)
        counts[decision if decision in counts else "kept"] += 1
        if decision == "kept":
            keep.append(i)
    return keep, counts


def _noop(*_: Any) -> None:
    return None


@dataclass(frozen=True)
class LoopHooks:
    """What the caller adds around each step (every hook is optional).

    Attributes:
        before_step: ``(step)`` on every rank before step ``step`` (0-based) samples (fault injection).
        record_step: ``(step, scored, groups)`` on rank 0 after the update; ``step`` is 1-based,
            ``scored`` is ``[(state_id, generations, verifier results)]`` of the trained groups.
        log_row: ``(row)`` on rank 0 with each step's metrics row (the experiment tracker).
        save_checkpoint: ``(key_step, rows)`` on every rank when a checkpoint is due (1-based step,
            the metrics rows so far).
        evaluate: ``(step) -> {column: value}`` on rank 0 with the engine serving the policy after
            ``step`` steps (0: before the first), when ``training.eval_every`` asks (every N
            steps and after the last); its columns join that step's row (step 0's, prefixed
            ``heldout_before_`` in place of ``heldout_``, join the first row).
    """

    before_step: Callable[[int], Any] = _noop
    record_step: Callable[[int, list, list], Any] = _noop
    log_row: Callable[[dict], Any] = _noop
    save_checkpoint: Callable[[int, list[dict]], Any] = _noop
    evaluate: Callable[[int], dict] = lambda step: {}


def run_rl_loop(trainer: Any, engine: Any, verifier: Any, pivots: Sequence[Any], prompts: Sequence[list[int]],
                schedule: Sequence[Sequence[int]], cfg: "RunConfig", work: Path, *, start: int = 0,
                rows: list[dict] | None = None, hooks: LoopHooks | None = None, rank: int = 0, world: int = 1,
                progress: bool = True, hosts: Sequence[int] = (0,), num_pivots: int | None = None) -> list[dict]:
    """Run steps ``start .. len(schedule) - 1`` of PivotRL training and return every step's metrics row.

    Args:
        trainer: a ``PivotRLTrainer`` (``train_step``, ``export_hf``, ``group_logprobs``).
        engine: the rollout engine serving π_old on a host rank (None elsewhere), or an
            ``EnginePool`` of several on rank 0; refreshed in place (``load_weights``, every engine)
            after every step.
        verifier: ``score(state, actions)`` (on the host ranks; None elsewhere).
        pivots: the pivot set (``TurnState``-like: a ``state_id``, whatever the verifier reads).
        prompts: each pivot's encoded prompt (token ids).
        schedule: pivot indices per step (:func:`pivot_schedule`).
        cfg: the run's validated config (model.dtype resolved); the loop reads ``training``
            (group_size, checkpoint_every, refresh_tolerance, pivots_per_batch, updates_per_batch,
            eval_every, refilter_between_epochs), ``rollout`` (max_tokens, weight_sync), ``run.seed``,
            ``model.dtype`` and, to re-filter, ``probing``. Step ``t``'s rollouts are seeded
            ``run.seed * 100_003 + t``.
        work: a scratch directory for the per-step HF exports (deleted as the loop goes).
        start, rows: resume at step ``start`` with the metrics rows of the steps before it.
        hooks: :class:`LoopHooks`.
        rank, world: this process's rank and the world size.
        hosts: the ranks that own an engine (``pivotrl.training.rank_engines.engine_host_ranks``;
            default rank 0 alone).
        num_pivots: how many of ``pivots`` are pivots (default all); the rest are anchor states
            (``training.anchors_per_batch``, :func:`anchor_schedule`): trained like pivots, never
            re-filtered, counted apart in the rows.

    Each row: step (1-based), pivots, anchors and anchor_reward_mean (the mean reward of the anchor
    groups' actions; only with anchor states), groups, dropped_groups, verifier_retries,
    accepted_not_demonstrated (this batch's accepted actions whose call list differs from the
    demonstration's, :data:`pivotrl.verifiers.base.NOT_DEMONSTRATED`), the trainer's
    metrics (reward_mean, kl, ...), rollout_s, step_time_s, refresh_s (writing the weights — the
    shared-memory block or the HF export — plus the engine's reload, on rank 0), refresh_max_abs_delta and
    refresh_mean_abs_delta (engine vs trainer log-probs, nats per token, the check this step read:
    from this step's batch, or by scoring after this step's refresh; the largest over the engines of
    a pool, whose per-engine columns the module docstring lists), refresh_scored (1.0 where the check
    scored after this step's refresh, 0.0 where it was read from this step's batch),
    rollout_tokens (tokens generated for the step's trained groups), the rollout's generation over
    every host rank's engines (``gen_*``: prompt/prefilled/generated tokens, TFLOP, seconds, MFU;
    with several host ranks their sum, the seconds of the slowest,
    :func:`pivotrl.runtime.generation.side_by_side`, the same on every rank;
    :meth:`pivotrl.runtime.generation.GenerationTotals.metrics`), and the columns of
    ``hooks.evaluate`` at the steps ``training.eval_every`` names (see :class:`LoopHooks`).

    Raises:
        TrainingError: the engine does not serve the trainer's weights after a refresh
            (:func:`check_refresh`), raised at the step whose batch (or, after the last step, whose
            scoring) showed it.
    """
    from pivotrl.core.progress import Progress

    hooks = hooks or LoopHooks()
    rows = list(rows or [])
    lead = rank == 0
    work = Path(work)
    # Progress by group updates (pivots × updates per batch), counted inside each step.
    tr = cfg.training
    n_piv = len(pivots) if num_pivots is None else int(num_pivots)
    anchor_ids = {getattr(p, "state_id", None) for p in pivots[n_piv:]}
    per_step = (tr.pivots_per_batch + min(tr.anchors_per_batch, len(pivots) - n_piv)) * tr.updates_per_batch
    bar = Progress("training", (len(schedule) - start) * per_step, "group updates",
                   enabled=lead and progress).__enter__()
    trainer.on_groups = lambda n: bar.update(n * world)
    per_epoch = steps_per_epoch(cfg, n_piv) if tr.refilter_between_epochs else 0
    note = refilter_unused(cfg, n_piv, len(schedule))
    if note and lead:
        log.warning(note)
    # Pivots still inside the filter (all of them unless re-filtered; a resumed run takes the last
    # re-filter decision from its rows).
    active = next((json.loads(r["refilter_active"]) for r in reversed(rows)
                   if isinstance(r.get("refilter_active"), str)), list(range(n_piv)))
    before: dict[str, Any] = {}  # held-out accuracy of the starting policy (the learning curve's step 0)
    if lead and tr.eval_every and start == 0:
        before = {k.replace("heldout_", "heldout_before_", 1): v for k, v in hooks.evaluate(0).items()}
    n_engines = num_engines(engine, hosts, world)
    try:
        for step in range(start, len(schedule)):
            t0 = time.time()
            hooks.before_step(step)
            refiltered: dict[str, Any] = {}
            if per_epoch and step > 0 and step % per_epoch == 0:
                counts: dict[str, int] = {}
                if lead:
                    active, counts = _refilter(engine, verifier, pivots, prompts, active, cfg, step)
                    log.info("re-filter before epoch %d: %d of the pivots stay inside the filter (%s)",
                             step // per_epoch + 1, len(active), counts)
                active, counts = broadcast((active, counts), world)
                refiltered = {"refilter_active": json.dumps(sorted(active)),
                              **{f"refilter_{k}": v for k, v in counts.items()}}
            keep = set(active) | set(range(n_piv, len(pivots)))  # anchors are never re-filtered
            idx = [i for i in schedule[step] if i in keep]
            gen_before = snapshot(engine)
            batch, served = rollout_step(engine, verifier, pivots, prompts, idx, cfg, step, rank=rank,
                                         world=world, hosts=hosts)
            gen = since(engine, gen_before)  # this rank's engines' rollout generation (pivotrl.runtime.generation)
            if len(hosts) > 1:
                # Every host rank's engine sampled its block: the step's generation is theirs together.
                # Every rank takes part (rollout_step gathered on all of them just before), with None
                # where a rank has no engine; the same totals then on every rank.
                gen = side_by_side(all_gather(gen, world))
            gen_peak = generation_peak(gen, cfg.run.local_cache()) if gen is not None and gen.requests else None
            groups, dropped, retries = batch.groups, batch.dropped, batch.retries
            t_roll = time.time() - t0
            metrics = trainer.train_step(groups) if groups else {}
            # The refresh check, read from this batch: the engines sampled it with the weights the
            # trainer holds as π_old (the refresh after the previous step, or the first load), so
            # their sampling log-probs must match the trainer's on every trained token.
            checked = batch_check(metrics, n_engines)
            for j, d in enumerate(checked or []):
                if d is not None:
                    check_refresh(step + 1, d[0], d[1], tr.refresh_tolerance, cfg.model.dtype,
                                  engine=j if len(checked) > 1 else None, source=BATCH_SOURCE)
            if lead:
                hooks.record_step(step + 1, batch.scored, groups)
            # Refresh π_old inside the running engines (no restart), then check that it took: each
            # engine's log-probs of a fixed action must match the trainer's.
            # rollout.weight_sync: memory = a shared-memory block per host rank; disk = an HF export
            # (every host rank reads its own: its node's disk).
            t_sync = time.perf_counter()
            export: Any = work / f"policy-{step}"
            if cfg.rollout.weight_sync == "memory":
                export = trainer.shared_weights(writers=list(hosts))
            else:
                if list(hosts) == [0]:
                    trainer.export_hf(str(export))
                else:
                    trainer.export_hf(str(export), writers=list(hosts))
                export = str(export)
            t_write = time.perf_counter() - t_sync
            # The refreshed weights are checked by the next batch; only those that no batch samples
            # (after the last step) or an engine without sampling log-probs need a scoring pass: every
            # action of the first trained group (one prompt, K actions), by the engine and the trainer.
            scored = step + 1 == len(schedule) or checked is None
            probe_prompt = groups[0].prompt_ids if groups else None
            check = [a for a in groups[0].actions if a] if groups and scored else []
            trainer_lps = trainer.group_logprobs(probe_prompt, check) if check else []
            timing: dict[str, float] = {}
            d_max, d_mean, per_engine = refresh_step(engine, export, probe_prompt, check, trainer_lps,
                                                     rank=rank, world=world, hosts=hosts, timing=timing)
            if not scored:
                d_max, d_mean = (max(d[i] for d in checked if d is not None) if any(checked) else 0.0
                                 for i in (0, 1))
                per_engine = checked if len(checked) > 1 else []
            engine_cols = engines_row(per_engine, served, cfg) if per_engine else {}
            shutil.rmtree(work / f"policy-{step - 1}", ignore_errors=True)
            row = {"step": step + 1, "pivots": sum(1 for i in idx if i < n_piv), **_anchor_columns(idx, n_piv, groups,
                                                                                               anchor_ids),
                   "groups": len(groups), "dropped_groups": dropped,
                   "verifier_retries": retries,
                   # accepted actions whose calls differ from the demonstration's (execution verifier)
                   "accepted_not_demonstrated": sum(count_not_demonstrated([r.reason for r in res])
                                                    for _, _, res in batch.scored),
                   **{k: float(v) for k, v in metrics.items() if isinstance(v, (int, float))},
                   "rollout_s": round(t_roll, 3), "step_time_s": round(time.time() - t0, 3),
                   "refresh_s": round(t_write + timing.get("reload_s", 0.0), 4),
                   "refresh_scored": float(scored),
                   "refresh_max_abs_delta": d_max, "refresh_mean_abs_delta": d_mean, **engine_cols, **refiltered,
                   "rollout_tokens": sum(len(a) for g in groups for a in g.actions),  # generated, trained groups
                   **(gen.metrics(gen_peak) if gen is not None else {})}
            if gen is not None and gen.requests:
                for name, value in gen.counters(gen_peak).items():
                    bar.set_counter(name, value)
            if step == 0:
                row.update(before)
            if lead and tr.eval_every and ((step + 1) % tr.eval_every == 0 or step + 1 == len(schedule)):
                row.update(hooks.evaluate(step + 1))  # the engine serves the policy after this step
            rows.append(row)
            if lead:
                hooks.log_row(row)
            # Groups not trained (dropped, zero advantage, a short last batch) still count as done.
            bar.update((step + 1 - start) * per_step - bar.done, steps=1)
            for j, d in enumerate((per_engine or [(d_max, d_mean)]) if scored else []):
                if d is not None:
                    check_refresh(step + 1, d[0], d[1], tr.refresh_tolerance, cfg.model.dtype,
                                  engine=j if per_engine else None)
            if (step + 1) % tr.checkpoint_every == 0 or step + 1 == len(schedule):
                hooks.save_checkpoint(step + 1, rows)
        bar.__exit__(None, None, None)
    finally:
        bar.close()
    return rows


def _anchor_columns(idx: Sequence[int], n_piv: int, groups: Sequence[Any], anchor_ids: set) -> dict[str, Any]:
    """A step's anchor columns: ``anchors`` (anchor states in the batch) and ``anchor_reward_mean``
    (mean reward of their groups' actions; NaN when none was decided); {} in a run without anchors."""
    if not anchor_ids:
        return {}
    rewards = [r for g in groups if g.state_id in anchor_ids for r in g.rewards]
    return {"anchors": sum(1 for i in idx if i >= n_piv),
            "anchor_reward_mean": sum(rewards) / len(rewards) if rewards else float("nan")}


def anchor_schedule(schedule: Sequence[Sequence[int]], num_pivots: int, num_anchors: int, per_batch: int,
                    seed: int) -> list[list[int]]:
    """``schedule`` with ``per_batch`` anchor indices (``num_pivots .. num_pivots + num_anchors - 1``)
    appended to every batch: a seeded permutation of the anchors, cycled (a new permutation each
    pass), so every anchor is trained before any is trained twice. Unchanged when either count is 0."""
    if not num_anchors or not per_batch:
        return [list(b) for b in schedule]
    out: list[list[int]] = []
    order: list[int] = []
    passes = 0
    for batch in schedule:
        extra: list[int] = []
        while len(extra) < min(per_batch, num_anchors):
            if not order:
                order = list(range(num_pivots, num_pivots + num_anchors))
                random.Random(seed * 1_000_033 + passes).shuffle(order)
                passes += 1
            a = order.pop(0)
            if a not in extra:
                extra.append(a)
            else:
                order.append(a)
        out.append(list(batch) + extra)
    return out
