"""``pivotrl compare``: PivotRL beside an SFT and an end-to-end RL baseline from the same π_ref.

Stages (each ``(cfg, store, inputs) -> result dict``, content-addressed like the nightly stages):

* :func:`stage_sft_baseline` - supervised training of π_ref on the demonstrations of the *pivot*
  split (the trajectories PivotRL's states come from), **the same number of optimiser steps** as
  the PivotRL run (``compare.sft_budget = optimizer_steps``): batches of ``compare.sft_batch_size``
  cut from a stream of seeded epoch orders (:func:`pivotrl.training.sft.batch_orders`, ``cycle``).
  With ``sft_budget = wall_time`` the same run goes on over the same stream to the first step past
  PivotRL's probing and training wall time (at least to PivotRL's step count, at most
  ``compare.sft_max_steps``) and gives two policies: ``policy`` at PivotRL's step count and
  ``policy_wall`` at its wall time, each with its own ledger (``ledger.json``, ``ledger_wall.json``:
  the tokens and optimiser-step wall time to that step).
* :func:`stage_e2e_baseline` - GRPO on whole tasks of the pivot split (``pivotrl.training.e2e``),
  same trainer settings as PivotRL, with PivotRL's probing and training together as its budget:
  **the same generated tokens** (``compare.e2e_budget = generated_tokens``), **the same rollout
  turns** (``rollout_turns``: model calls, PivotRL's probe samples and training samples against
  E2E RL's model calls in episodes) or **the same wall time** (``wall_time``); the loop stops at the
  first step past the budget, and ``compare.e2e_max_steps`` caps it whatever the budget. With
  ``training.eval_every`` it measures PivotRL's held-out curve on its own engine (the same states,
  greedy measure and cadence, :func:`pivotrl.pipeline.curve.heldout_curve_hook`), each point with
  the rollout turns sampled to it (``summary.heldout_curve``; every step in ``metrics.parquet``).
* :func:`pivotrl_ledger` - PivotRL's cost, counted from its probe table and training metrics.
* :func:`stage_compare_evaluate` - in ``pivotrl.pipeline.compare_eval``.

Every baseline records the checkpoint hash it started from (``start_hash``), which must equal the
reference's (``ref_hash``), and writes ``ledger.json`` (a :class:`pivotrl.runtime.ledger.CostLedger`)
with a manifest beside its summary.
"""

from __future__ import annotations

import logging
import math
import shutil
import tempfile
from pathlib import Path
from typing import Any

import pandas as pd

from pivotrl.provenance.code_digest import STAGE_MODULES, module_digest
from pivotrl.config import RunConfig
from pivotrl.core.hashing import content_hash
from pivotrl.core.errors import StateTooLongError
from pivotrl.runtime.ledger import CostLedger
from pivotrl.pipeline.common import make_rollout_engine, prompt_kwargs
from pivotrl.pipeline.demos import cache_dir, read_trajectories
from pivotrl.pipeline.reference import TRAINER_DTYPE, reference_dir
from pivotrl.training.loop import pivot_schedule
from pivotrl.storage import ArtifactStore
from pivotrl.storage.dirs import COMPLETE_MARKER

log = logging.getLogger("pivotrl.pipeline.compare")

__all__ = ["cached_e2e_baseline", "cached_sft_baseline", "e2e_baseline_key", "pivotrl_ledger", "sft_baseline_key",
           "stage_e2e_baseline", "stage_sft_baseline"]

def compare_code_digest(module: str = "pivotrl.pipeline.compare") -> str:
    """The digest of the code of a ``pivotrl compare`` stage: the import closure of ``module``
    without the nightly stages' modules, whose outputs enter through their keys
    (:func:`pivotrl.provenance.code_digest.module_digest`)."""
    return module_digest(module, exclude=tuple(STAGE_MODULES.values()))


def _metrics(store: ArtifactStore, train: dict[str, Any]) -> list[dict[str, Any]]:
    key = f"{train['train_key']}/metrics.parquet"
    return store.read_parquet(key).to_dict("records") if store.exists(key) else []


def pivotrl_ledger(cfg: RunConfig, store: ArtifactStore, probe: dict[str, Any], train: dict[str, Any],
                   ref: dict[str, Any]) -> CostLedger:
    """PivotRL's cost from its artifacts: probing (m samples per probed state, each verified) and
    training (K samples per pivot per step, trainer tokens, optimiser steps, wall time).

    ``model_calls`` (rollout turns) are counted as the learning curve counts them, so the curve's
    last point equals them: the probe's m per probed state
    (:func:`pivotrl.pipeline.curve.probe_row_turns`) and each step's sampled actions, dropped groups'
    and the re-filter's included (:func:`pivotrl.evaluation.learning_curve.pivotrl_step_turns`).
    Naive-equivalent trainer tokens are recomputed from the pivot schedule: Σ over steps, updates
    and sampled actions of (state tokens + action tokens).
    """
    from pivotrl.data.states import frame_to_states
    from pivotrl.evaluation.learning_curve import pivotrl_step_turns
    from pivotrl.pipeline.curve import probe_row_turns
    from pivotrl.runtime.models import load_tokenizer
    from pivotrl.format.prompts import encode_state

    led = CostLedger(name="pivotrl")
    probes = store.read_parquet(f"{probe['probes_key']}/probes.parquet")
    for rec in probes.to_dict("records"):  # one row per probed state; rewards: the m verdicts
        m = probe_row_turns(rec)
        mean_tokens = rec.get("action_tokens_mean")
        led.add(model_calls=m, verifier_executions=m, tool_retries=int(rec.get("verifier_retries") or 0),
                generated_tokens=int(round(m * mean_tokens)) if m and mean_tokens == mean_tokens else 0)
    try:
        led.add_wall("probe", float(store.read_manifest(f"{probe['probes_key']}/probes.parquet").extra.get("wall_s", 0.0)))
    except Exception:  # a manifest without timing: the probe wall time is unknown, not zero
        log.warning("probe manifest has no wall time; the ledger leaves it out")
    rows = _metrics(store, train)
    naive = 0
    if rows:
        pivots = frame_to_states(store.read_parquet(f"{probe['pivots_key']}/pivots.parquet"))
        tok = load_tokenizer(reference_dir(cfg, store, ref))
        plen = [len(encode_state(s, tok, max_len=cfg.model.max_context - cfg.rollout.max_tokens, **prompt_kwargs(cfg)))
                for s in pivots]
        tr = cfg.training
        schedule = pivot_schedule(len(pivots), tr.pivots_per_batch, tr.epochs, cfg.run.seed, tr.max_steps)
        for row, idx in zip(rows, schedule):
            updates = int(row.get("updates", 0) or 0)
            naive += updates * (tr.group_size * sum(plen[i] for i in idx) + int(row.get("action_tokens", 0) or 0))
    for row in rows:
        led.add(model_calls=pivotrl_step_turns(row, cfg.training.group_size, cfg.probing.num_probes),
                verifier_executions=int(row.get("actions", 0) or 0),
                generated_tokens=int(row.get("action_tokens", 0) or 0),
                tool_retries=int(row.get("verifier_retries", 0) or 0))
        led.add_trainer_metrics(row, 0)
        led.add_wall("rollout", float(row.get("rollout_s", 0.0) or 0.0))
        led.add_wall("train", float(row.get("step_time_s", 0.0) or 0.0) - float(row.get("rollout_s", 0.0) or 0.0))
    led.add(trainer_tokens_naive=naive)
    return led


def _write(store: ArtifactStore, key: str, summary: dict[str, Any], ledger: CostLedger, kind: str,
           demos: dict[str, Any], ref: dict[str, Any], train: dict[str, Any], cfg: RunConfig,
           more_ledgers: dict[str, CostLedger] | None = None) -> None:
    """The baseline's ledger (and ``more_ledgers``, file name → ledger) and summary, written last;
    the summary's manifest describes its policy directory (``extra.checkpoint``) and names what it
    came from: the trajectories, π_ref and the PivotRL run whose budget it matched, so ``pivotrl
    lineage`` follows a baseline policy back to them."""
    conf = {"compare": cfg.compare.model_dump(mode="json"), "training": cfg.training.model_dump(mode="json")}
    inputs = {"trajectories": demos["trajectories"],
              "reference": store.url(ref["ref_key"]) if ref.get("ref_key") else ref["base_dir"],
              "pivotrl_run": store.url(f"{train['train_key']}/summary.json")}
    store.write_artifact(f"{key}/ledger.json", ledger.to_dict(), kind="cost_ledger", inputs=inputs, config=conf)
    for name, more in (more_ledgers or {}).items():
        store.write_artifact(f"{key}/{name}", more.to_dict(), kind="cost_ledger", inputs=inputs, config=conf)
    store.write_artifact(f"{key}/summary.json", summary, kind=kind, inputs=inputs, config=conf,
                         extra={"seed": cfg.run.seed, "checkpoint": store.url(f"{key}/policy")})


def _cached(store: ArtifactStore, key: str) -> dict[str, Any] | None:
    if store.exists(f"{key}/summary.json") and store.exists(f"{key}/ledger.json"):
        out = {"key": key, "policy_key": f"{key}/policy", "summary": store.read_json(f"{key}/summary.json"),
               "ledger": store.read_json(f"{key}/ledger.json")}
        if store.exists(f"{key}/ledger_wall.json"):  # SFT with the wall-time budget: its second policy
            out.update(policy_wall_key=f"{key}/policy_wall", ledger_wall=store.read_json(f"{key}/ledger_wall.json"))
        return out
    return None


def cached_sft_baseline(cfg: RunConfig, store: ArtifactStore, demos: dict[str, Any], ref: dict[str, Any],
                        probe: dict[str, Any], train: dict[str, Any]) -> dict[str, Any] | None:
    """The result of :func:`stage_sft_baseline` if its summary and ledger exist under its key, else None."""
    return _cached(store, sft_baseline_key(cfg, demos, ref, probe, train))


def cached_e2e_baseline(cfg: RunConfig, store: ArtifactStore, demos: dict[str, Any], ref: dict[str, Any],
                        probe: dict[str, Any], train: dict[str, Any]) -> dict[str, Any] | None:
    """The result of :func:`stage_e2e_baseline` if its summary and ledger exist under its key, else None."""
    return _cached(store, e2e_baseline_key(cfg, demos, ref, probe, train))


def _settings(cfg: RunConfig, prefix: str) -> dict[str, Any]:
    """The ``compare`` settings of one baseline (names starting with ``prefix``), as JSON values."""
    return {k: v for k, v in cfg.compare.model_dump(mode="json").items() if k.startswith(prefix)}


def sft_baseline_key(cfg: RunConfig, demos: dict[str, Any], ref: dict[str, Any], probe: dict[str, Any],
                     train: dict[str, Any]) -> str:
    """``compare/sft/<16 hex>``: π_ref's hash, the demonstrations' key, the PivotRL run whose
    optimiser steps (and wall time) the baseline matches (its probe table and train keys), the
    ``compare.sft_*`` settings (the other settings of ``compare`` leave it cached),
    the learning rate, ``prompt``, the dtype, the seed and the code. Reads nothing (the task computes
    it before a stage process starts)."""
    return "compare/sft/" + content_hash({"ref": ref["ref_hash"], "demos": demos["key"], "train": train["train_key"],
                                          "probes": probe["probes_key"], "compare": _settings(cfg, "sft_"),
                                          "lr": cfg.training.lr,
                                          "prompt": cfg.prompt.model_dump(mode="json"), "dtype": cfg.model.dtype,
                                          "seed": cfg.run.seed, "code": compare_code_digest()})[:16]


def e2e_baseline_key(cfg: RunConfig, demos: dict[str, Any], ref: dict[str, Any], probe: dict[str, Any],
                     train: dict[str, Any]) -> str:
    """``compare/e2e/<16 hex>``: π_ref's hash, the demonstrations' key, the PivotRL run whose cost is
    the budget (its probe table and train keys), the ``compare.e2e_*`` settings, ``training``,
    ``rollout``, ``prompt``, the judge, the dtype, the seed and the code. Reads nothing (the task
    computes it before a stage process starts)."""
    return "compare/e2e/" + content_hash({"ref": ref["ref_hash"], "demos": demos["key"], "probes": probe["probes_key"],
                                          "train": train["train_key"], "compare": _settings(cfg, "e2e_"),
                                          "training": cfg.training.model_dump(mode="json"),
                                          "rollout": cfg.rollout.model_dump(mode="json"),
                                          "prompt": cfg.prompt.model_dump(mode="json"), "judge": cfg.quality.judge,
                                          "dtype": cfg.model.dtype, "seed": cfg.run.seed, "code": compare_code_digest()})[:16]


def stage_sft_baseline(cfg: RunConfig, store: ArtifactStore, demos: dict[str, Any], ref: dict[str, Any],
                       probe: dict[str, Any], train: dict[str, Any]) -> dict[str, Any]:
    """SFT of π_ref on the pivot split's demonstrations, with PivotRL's number of optimiser steps
    and, with ``compare.sft_budget = wall_time``, also to PivotRL's probing and training wall time
    (the module docstring).

    Returns {"key", "policy_key", "summary" (budget, steps, target_steps, examples, start_hash,
    and for wall_time budget_wall_s, wall_steps, wall_s, wall_reached, ...), "ledger"} and for
    wall_time also "policy_wall_key", "ledger_wall". With a PivotRL run of 0 steps the policy at
    its step count is π_ref; without an example every policy is π_ref.
    """
    from pivotrl.runtime.models import checkpoint_hash, load_tokenizer
    from pivotrl.format.prompts import build_sft_examples
    from pivotrl.training.sft import run_sft

    target = sum(int(r.get("updates", 0) or 0) for r in _metrics(store, train))
    cp = cfg.compare
    by_wall = cp.sft_budget == "wall_time"
    key = sft_baseline_key(cfg, demos, ref, probe, train)
    hit = _cached(store, key)
    if hit is not None:
        return hit
    rdir = reference_dir(cfg, store, ref)
    start_hash = checkpoint_hash(rdir)
    tok = load_tokenizer(rdir)
    examples, too_long = [], 0
    for t in read_trajectories(store, demos["key"], split="pivot"):
        try:
            examples.extend(build_sft_examples(t, tok, max_len=cfg.model.max_context, **prompt_kwargs(cfg))[0])
        except StateTooLongError:
            too_long += 1
    led, led_wall = CostLedger(name="sft"), CostLedger(name="sft_wall")
    summary: dict[str, Any] = {"budget": cp.sft_budget, "target_steps": target,
                               "examples": len(examples), "skipped_too_long": too_long, "start_hash": start_hash,
                               "reference_hash": ref["ref_hash"]}
    if by_wall:
        summary["budget_wall_s"] = round(pivotrl_ledger(cfg, store, probe, train, ref).total_wall_s, 1)

    def booked(ledger: CostLedger, m: dict[str, Any], step: int) -> None:
        """The ledger of the policy after ``step`` steps of the run ``m``."""
        if step:
            tokens = int(m["step_tokens"][step - 1])
            ledger.add(optimizer_steps=step, trainer_tokens=tokens, trainer_tokens_naive=tokens)
            ledger.add_wall("train", float(m["step_time_s"][step - 1]))
        ledger.note_memory()

    with tempfile.TemporaryDirectory(dir=cache_dir(cfg)) as tmp:
        steps_dir, wall_dir = Path(tmp) / "steps", Path(tmp) / "wall"
        common = dict(lr=cp.sft_lr or cfg.training.lr, batch_size=cp.sft_batch_size,
                      dtype=TRAINER_DTYPE[cfg.model.dtype], zero_stage=cfg.training.deepspeed.zero_stage,
                      seed=cfg.run.seed, retain_host_memory=cfg.training.retain_host_memory, cycle=True,
                      label="sft baseline")
        if not examples or (target == 0 and not by_wall):
            summary.update(steps=0, policy="reference", note="no PivotRL step or no example: SFT policy = reference")
            steps_dir = wall_dir = rdir
            if by_wall:
                summary.update(wall_steps=0, wall_s=0.0, wall_reached=False)
        elif by_wall:  # one run: the policy at PivotRL's step count and the one at its wall time
            m = run_sft(str(rdir), examples, str(wall_dir), max_steps=max(target, cp.sft_max_steps),
                        max_wall_s=summary["budget_wall_s"], snapshot_step=target or None,
                        snapshot_dir=str(steps_dir) if target else None, **common)
            if not target:
                steps_dir = rdir
                summary.update(policy="reference", note="no PivotRL step: the SFT policy at its step count = reference")
            booked(led, m, target)
            booked(led_wall, m, int(m["out_step"]))
            summary.update(steps=target, wall_steps=int(m["out_step"]), wall_s=round(led_wall.total_wall_s, 1),
                           wall_reached=m["wall_step"] is not None, first_loss=m["first_loss"],
                           final_loss=m["losses"][target - 1] if target else None,
                           wall_final_loss=m["losses"][int(m["out_step"]) - 1])
        else:
            m = run_sft(str(rdir), examples, str(steps_dir), max_steps=target, **common)
            booked(led, m, int(m["steps"]))
            summary.update(steps=int(m["steps"]), first_loss=m["first_loss"], final_loss=m["final_loss"])
        store.put_dir(str(steps_dir), f"{key}/policy")
        if by_wall:
            store.put_dir(str(wall_dir), f"{key}/policy_wall")
    out = {"key": key, "policy_key": f"{key}/policy", "summary": summary, "ledger": led.to_dict()}
    if by_wall:
        out.update(policy_wall_key=f"{key}/policy_wall", ledger_wall=led_wall.to_dict())
    _write(store, key, summary, led, "sft_baseline", demos, ref, train, cfg,
           more_ledgers={"ledger_wall.json": led_wall} if by_wall else None)
    return out


def stage_e2e_baseline(cfg: RunConfig, store: ArtifactStore, demos: dict[str, Any], ref: dict[str, Any],
                       probe: dict[str, Any], train: dict[str, Any]) -> dict[str, Any]:
    """End-to-end GRPO of π_ref on the pivot split's tasks, with PivotRL's generated tokens, rollout
    turns or wall time (probing and training) as its budget (``compare.e2e_budget``).

    Returns {"key", "policy_key", "summary" (budget, budget_tokens, budget_model_calls, budget_wall_s,
    steps, generated_tokens, model_calls, wall_s, budget_reached, reward per step, heldout_curve (the
    points of :func:`pivotrl.evaluation.learning_curve.learning_curve`, [] without one), start_hash,
    ...), "ledger"}. No task with an environment: the policy is π_ref (noted).
    """
    from pivotrl.bfcl.wheel import ensure_bfcl
    from pivotrl.evaluation.learning_curve import learning_curve
    from pivotrl.pipeline.common import close_quietly, make_verifier
    from pivotrl.pipeline.curve import heldout_curve_hook
    from pivotrl.pipeline.results import ProbeResult
    from pivotrl.runtime.models import checkpoint_hash, load_tokenizer
    from pivotrl.training.e2e import E2ESettings, run_e2e
    from pivotrl.training.pivotrl import PivotRLTrainer

    cp = cfg.compare
    pivot_led = pivotrl_ledger(cfg, store, probe, train, ref)
    spent = {"generated_tokens": pivot_led.generated_tokens, "rollout_turns": pivot_led.model_calls,
             "wall_time": round(pivot_led.total_wall_s, 1)}  # PivotRL's, per kind of budget
    budget: float = spent[cp.e2e_budget]
    key = e2e_baseline_key(cfg, demos, ref, probe, train)
    hit = _cached(store, key)
    if hit is not None:
        return hit
    rdir = reference_dir(cfg, store, ref)
    start_hash = checkpoint_hash(rdir)
    tasks = sorted((t for t in read_trajectories(store, demos["key"], split="pivot") if t.env is not None),
                   key=lambda t: t.id)
    led = CostLedger(name="e2e")
    summary: dict[str, Any] = {"budget": cp.e2e_budget, "budget_tokens": pivot_led.generated_tokens,
                               "budget_model_calls": pivot_led.model_calls,
                               "budget_wall_s": round(pivot_led.total_wall_s, 1), "tasks": len(tasks),
                               "reward": cp.e2e_reward, "start_hash": start_hash, "reference_hash": ref["ref_hash"],
                               "heldout_curve": []}
    if not tasks or budget == 0:
        summary.update(steps=0, policy="reference", note="no pivot-split task with an environment or no budget")
        with tempfile.TemporaryDirectory(dir=cache_dir(cfg)) as tmp:  # π_ref as it is, without its cache marker
            shutil.copytree(rdir, Path(tmp) / "policy", ignore=shutil.ignore_patterns(COMPLETE_MARKER))
            store.put_dir(str(Path(tmp) / "policy"), f"{key}/policy")
    else:
        by = cp.e2e_budget
        settings = E2ESettings(group_size=cp.e2e_group_size, tasks_per_batch=cp.e2e_tasks_per_batch,
                               max_steps=cp.e2e_max_steps,
                               max_generated_tokens=int(budget) if by == "generated_tokens" else None,
                               max_model_calls=int(budget) if by == "rollout_turns" else None,
                               max_wall_s=budget if by == "wall_time" else None,
                               eval_every=cfg.training.eval_every, reward=cp.e2e_reward,
                               temperature=1.0, max_tokens=cfg.rollout.max_tokens,
                               max_steps_per_turn=cp.e2e_max_steps_per_turn,
                               max_context=cfg.model.max_context - cfg.rollout.max_tokens, judge=cfg.quality.judge,
                               advantage_estimator=cfg.training.advantage_estimator, delta=cfg.training.delta,
                               seed=cfg.run.seed, weight_sync=cfg.rollout.weight_sync, dtype=cfg.model.dtype,
                               refresh_tolerance=cfg.training.refresh_tolerance if cfg.training.refresh_tolerance
                               is not None else (1e-4 if cfg.model.dtype == "fp32" else 0.3))
        trainer = PivotRLTrainer.for_run(cfg, str(rdir))
        tok = load_tokenizer(rdir)
        bfcl_root = ensure_bfcl(cache_dir(cfg))
        engine = make_rollout_engine(cfg, rdir)
        verifier = None
        try:
            # PivotRL's held-out curve, measured the same way on this engine (None when eval_every = 0).
            verifier = make_verifier(cfg, bfcl_root, tok) if cfg.training.eval_every else None
            curve = heldout_curve_hook(cfg, store, ProbeResult.of(probe), tok, engine, verifier, demos["key"])
            with tempfile.TemporaryDirectory(dir=cache_dir(cfg)) as tmp:
                history, led = run_e2e(trainer, engine, tok, tasks, settings, ledger=led, work_dir=tmp, evaluate=curve,
                                       bfcl_root=str(bfcl_root), **prompt_kwargs(cfg))
                trainer.export_hf(str(Path(tmp) / "policy"))
                store.put_dir(str(Path(tmp) / "policy"), f"{key}/policy")
        finally:
            engine.close()
            close_quietly(verifier)
        led.note_memory()
        wall = round(led.total_wall_s, 1)
        metrics_df = pd.DataFrame(history)
        spent_e2e = {"generated_tokens": led.generated_tokens, "rollout_turns": led.model_calls, "wall_time": wall}
        summary.update(steps=len(history), generated_tokens=led.generated_tokens, model_calls=led.model_calls,
                       wall_s=wall, reward_per_step=[h["reward_mean"] for h in history],
                       budget_reached=spent_e2e[cp.e2e_budget] >= budget,
                       heldout_curve=(learning_curve(metrics_df) or {}).get("heldout", []))
        if not math.isfinite(sum(summary["reward_per_step"])):
            log.warning("end-to-end RL rewards contain non-finite values")
        store.write_artifact(f"{key}/metrics.parquet", metrics_df, kind="training_metrics",
                             inputs={"trajectories": demos["trajectories"]},
                             config={"compare": cp.model_dump(mode="json")}, extra={"seed": cfg.run.seed})
    _write(store, key, summary, led, "e2e_baseline", demos, ref, train, cfg)
    return {"key": key, "policy_key": f"{key}/policy", "summary": summary, "ledger": led.to_dict()}
