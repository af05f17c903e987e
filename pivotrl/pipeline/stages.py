"""The heavy pipeline stages: reference (warm start), probing + pivot filter, PivotRL training,
evaluation + report. Each is a plain function ``(cfg, store, inputs) -> outputs dict`` that reads
and writes artifacts only through the store, so it can run in its own process (see
``pivotrl.pipeline.entry``) launched by a Prefect task or by a cluster launcher.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import signal
import tempfile
import time
from pathlib import Path
from typing import Any

import pandas as pd

from pivotrl.config import RunConfig, config_hash
from pivotrl.code_digest import stage_code_digest
from pivotrl.data.schema import content_hash
from pivotrl.errors import StateTooLongError, TrainingError, VerifierError
from pivotrl.pipeline.common import (
    local_checkpoint, make_rollout_engine, make_verifier, prompt_format, prompt_kwargs, resolve_base_model, sampling_for,
)
from pivotrl.pipeline.demos import cache_dir, read_histories, read_trajectories
from pivotrl.fingerprints import capture_hashes
from pivotrl.rollouts import record_evaluation, record_train_step
from pivotrl.precision import with_resolved_dtype
from pivotrl.storage import ArtifactStore
from pivotrl.tracking.live import step_logger

log = logging.getLogger("pivotrl.pipeline")

#: config dtype names → the trainer's names
TRAINER_DTYPE = {"bf16": "bfloat16", "fp32": "float32"}


# --------------------------------------------------------------------------------------------
# Reference policy: resolve the base model, optional supervised warm start.
# --------------------------------------------------------------------------------------------
def stage_reference(cfg: RunConfig, store: ArtifactStore, demos: dict[str, Any]) -> dict[str, Any]:
    """Resolve the base model and, if enabled, fine-tune it on the warm-start split (π_ref).

    Returns {"base_dir", "base_hash", "ref_key" (None without warm start), "ref_hash", "sft"}.
    The warm start never sees the pivot-candidate split it will be probed on.
    """
    cfg = with_resolved_dtype(cfg)  # model.dtype: auto → bf16 | fp32 on this hardware
    from pivotrl.models import checkpoint_hash, load_tokenizer
    from pivotrl.prompts import build_sft_examples

    cache = cache_dir(cfg)
    base_dir = resolve_base_model(cfg, cache)
    base_hash = checkpoint_hash(base_dir)
    tok = load_tokenizer(base_dir)
    fmt = prompt_format(cfg, tok).to_dict()  # checked once here: format, parser, template hash, stability
    log.info("prompt format %s, tool parser %s, chat template %s (%s)", fmt["format"], fmt["tool_parser"],
             fmt["template_hash"], "prefix-stable" if fmt["prefix_stable"] else
             "not prefix-stable: per-turn examples")
    out: dict[str, Any] = {"base_dir": str(base_dir), "base_hash": base_hash, "ref_key": None,
                           "ref_hash": base_hash, "sft": None, "prompt_format": fmt}
    if not cfg.warm_start.enabled:
        return out
    ws = cfg.warm_start.model_dump(mode="json")
    key = "models/warm_start/" + content_hash(
        {"base": base_hash, "demos": demos["key"], "warm_start": ws, "prompt": cfg.prompt.model_dump(mode="json"),
         "template": fmt["template_hash"], "dtype": cfg.model.dtype, "seed": cfg.run.seed,
         "code": stage_code_digest("reference")})[:16]
    out["ref_key"] = key
    if store.exists(f"{key}/_COMPLETE") and store.exists(f"{key}.sft.json"):
        out["sft"] = store.read_json(f"{key}.sft.json")
        out["ref_hash"] = out["sft"]["checkpoint_hash"]
        return out

    from pivotrl.training.sft import run_sft

    trajs = read_trajectories(store, demos["key"], split="warm_start")
    examples, too_long, per_turn = [], 0, 0
    for t in trajs:
        try:
            got, split = build_sft_examples(t, tok, max_len=cfg.warm_start.max_len, **prompt_kwargs(cfg))
        except StateTooLongError:
            too_long += 1
            continue
        examples.extend(got)
        per_turn += int(split)
    if per_turn:
        log.warning("warm start: %d of %d trajectories trained as per-turn examples (the chat template re-renders "
                    "earlier turns)", per_turn, len(trajs))
    with tempfile.TemporaryDirectory(dir=cache) as tmp:
        ckpt = Path(tmp) / "ckpt"
        metrics = run_sft(
            str(base_dir), examples, str(ckpt), epochs=cfg.warm_start.epochs, lr=cfg.warm_start.lr,
            batch_size=cfg.warm_start.batch_size, dtype=TRAINER_DTYPE[cfg.model.dtype],
            zero_stage=cfg.training.deepspeed.zero_stage, seed=cfg.run.seed,
        )
        ref_hash = checkpoint_hash(ckpt)
        store.put_dir(str(ckpt), key)
    metrics = {k: v for k, v in _jsonable(metrics).items() if k != "out_dir"}  # a deleted temp dir
    sft = {"examples": len(examples), "skipped_too_long": too_long, "per_turn_trajectories": per_turn,
           "prompt_format": fmt, "checkpoint_hash": ref_hash, "metrics": metrics}
    store.write_artifact(f"{key}.sft.json", sft, kind="reference_checkpoint",
                         inputs={"trajectories": demos["trajectories"], "base_model": f"{cfg.model.source}#{base_hash}"},
                         config={"warm_start": ws, "model": cfg.model.model_dump(mode="json")},
                         extra={"seed": cfg.run.seed, "checkpoint": store.url(key), "checkpoint_hash": ref_hash,
                                "template_hash": fmt["template_hash"], "prompt_format": fmt})
    out["sft"], out["ref_hash"] = sft, ref_hash
    return out


def _prompt_identity(cfg: RunConfig, ref: dict[str, Any]) -> dict[str, Any]:
    """What a stage key needs of the prompt: the config section and the chat template's hash."""
    fmt = ref.get("prompt_format") or {}
    return {**cfg.prompt.model_dump(mode="json"), "template_hash": fmt.get("template_hash"),
            "resolved": [fmt.get("format"), fmt.get("tool_parser")]}


def probe_table_key(cfg: RunConfig, candidates_hash: str, ref: dict[str, Any]) -> str:
    """The content key of a probe table over the candidates with content hash ``candidates_hash``
    (the whole pivot split, or one shard of it): :func:`pivotrl.pipeline.probe.probe_key` with the
    run's probing, verifier, prompt and engine settings (the resolved dtype)."""
    from pivotrl.pipeline.probe import probe_key

    cfg = with_resolved_dtype(cfg)
    return probe_key(candidates_hash, ref["ref_hash"], cfg.probing.model_dump(mode="json"),
                     cfg.verifier.model_dump(mode="json"), _prompt_identity(cfg, ref),
                     {"engine": cfg.rollout.engine, "max_tokens": cfg.rollout.max_tokens,
                      "dtype": cfg.model.dtype, "max_context": cfg.model.max_context,
                      "include_stop_decisions": cfg.quality.include_stop_decisions})


def reference_dir(cfg: RunConfig, store: ArtifactStore, ref: dict[str, Any]) -> Path:
    if ref["ref_key"] is None:
        return Path(ref["base_dir"])
    return local_checkpoint(store, ref["ref_key"], cache_dir(cfg))


# --------------------------------------------------------------------------------------------
# Probing + pivot filter.
# --------------------------------------------------------------------------------------------
def stage_probe(cfg: RunConfig, store: ArtifactStore, demos: dict[str, Any], ref: dict[str, Any]) -> dict[str, Any]:
    """Probe π_ref on the pivot-candidate split, then apply the pivot rule (λ_diff)."""
    cfg = with_resolved_dtype(cfg)  # model.dtype: auto → bf16 | fp32 on this hardware
    from pivotrl.data.bfcl import ensure_bfcl
    from pivotrl.data.states import candidate_kinds_for_pivots, expand_candidates, frame_to_states
    from pivotrl.models import load_tokenizer
    from pivotrl.pipeline.probe import (
        apply_pivot_filter, pivot_stats, probe_states, select_candidates, stats_markdown,
    )

    cand_manifest = store.read_manifest(f"{demos['key']}/candidates.parquet")
    pkey = probe_table_key(cfg, cand_manifest.sha256, ref)
    probes_uri = store.url(f"{pkey}/probes.parquet")
    if not store.exists(f"{pkey}/probes.parquet"):
        cand = select_candidates(store.read_parquet(f"{demos['key']}/candidates.parquet"), "pivot",
                                 cfg.probing.max_states, cfg.probing.seed,
                                 kinds=candidate_kinds_for_pivots(cfg.quality.include_stop_decisions))
        states = frame_to_states(cand, read_histories(store, demos["key"], cand["trajectory_id"]))
        rdir = reference_dir(cfg, store, ref)
        tok = load_tokenizer(rdir)
        verifier = make_verifier(cfg, ensure_bfcl(cache_dir(cfg)), tokenizer=tok)
        engine = make_rollout_engine(cfg, rdir)
        t0 = time.time()
        try:
            df = probe_states(
                engine, tok, states, verifier, num_probes=cfg.probing.num_probes,
                sampling=sampling_for(cfg, n=cfg.probing.num_probes, temperature=cfg.probing.temperature,
                                      seed=cfg.probing.seed, top_p=cfg.probing.top_p, top_k=cfg.probing.top_k),
                max_context=cfg.model.max_context, max_tokens=cfg.rollout.max_tokens, prompt_kwargs=prompt_kwargs(cfg),
            )
        finally:
            engine.close()
            _close(verifier)
        store.write_artifact(
            f"{pkey}/probes.parquet", df, kind="probes",
            inputs={"candidates": store.url(f"{demos['key']}/candidates.parquet"),
                    "reference": store.url(ref["ref_key"]) if ref["ref_key"] else f"{cfg.model.source}#{ref['base_hash']}"},
            # λ_diff is not part of the probe table's identity (changing it only re-filters).
            config={**{k: getattr(cfg, k).model_dump(mode="json") for k in ("verifier", "prompt", "rollout", "model")},
                    "probing": cfg.probing.model_dump(mode="json", exclude={"lambda_diff"})},
            extra={"seed": cfg.probing.seed, "reference_hash": ref["ref_hash"], "verifier": cfg.verifier.name,
                   "prompt_format": ref.get("prompt_format"),
                   "wall_s": round(time.time() - t0, 2), **capture_hashes(cfg, tok)},
        )
    lam = cfg.probing.lambda_diff
    vkey = pkey.replace("probes/", "pivots/") + "-" + content_hash({"lambda_diff": lam})[:8]
    if not store.exists(f"{vkey}/pivots.parquet"):
        df = apply_pivot_filter(store.read_parquet(f"{pkey}/probes.parquet"), lam)
        stats = pivot_stats(df, lam)
        cand = store.read_parquet(f"{demos['key']}/candidates.parquet")
        kept = df[df["decision"] == "kept"][["state_id", "mu", "var"]]
        pivots = cand.merge(kept, on="state_id", how="inner").sort_values("state_id").reset_index(drop=True)
        pivots = expand_candidates(pivots, read_histories(store, demos["key"], pivots["trajectory_id"]))
        store.write_json(f"{vkey}/stats.json", stats)
        store.write_text(f"{vkey}/summary.md", stats_markdown(stats))
        store.write_artifact(
            f"{vkey}/pivots.parquet", pivots, kind="pivots",
            inputs={"probes": probes_uri, "candidates": store.url(f"{demos['key']}/candidates.parquet")},
            config={"lambda_diff": lam, "probing": cfg.probing.model_dump(mode="json")},
            extra={"reference_hash": ref["ref_hash"], "verifier": cfg.verifier.name, "num_pivots": len(pivots),
                   "prompt_format": ref.get("prompt_format")},
        )
    stats = store.read_json(f"{vkey}/stats.json")
    return {"probes_key": pkey, "probes": probes_uri, "pivots_key": vkey,
            "pivots": store.url(f"{vkey}/pivots.parquet"), "stats": stats,
            "summary_md": store.read_text(f"{vkey}/summary.md")}


# --------------------------------------------------------------------------------------------
# PivotRL training (world size 1 in-process; see pivotrl.training.launch for process groups).
# --------------------------------------------------------------------------------------------
def pivot_schedule(num_pivots: int, batch: int, epochs: int, seed: int, max_steps: int | None) -> list[list[int]]:
    """The pivot order of the whole run: one seeded permutation per epoch, cut into batches.

    Deterministic in its arguments, so a resumed run consumes exactly the same sequence.
    """
    import random

    steps: list[list[int]] = []
    for e in range(epochs):
        order = list(range(num_pivots))
        random.Random(seed * 1_000_003 + e).shuffle(order)
        steps += [order[i : i + batch] for i in range(0, num_pivots, batch)]
    return steps[:max_steps] if max_steps else steps


def stage_train(cfg: RunConfig, store: ArtifactStore, probe: dict[str, Any], ref: dict[str, Any]) -> dict[str, Any]:
    """Local GRPO on the pivot set (PivotRL §3 stage 2), with π_old refreshed in the rollout engine
    after every batch and the refresh verified against the trainer's log-probs.

    Resumes from the latest complete checkpoint under ``train/<key>/checkpoints`` and consumes the
    same pivot order as an uninterrupted run. Returns {"train_key", "policy_key", "metrics", ...}.
    """
    cfg = with_resolved_dtype(cfg)  # model.dtype: auto → bf16 | fp32 on this hardware
    from pivotrl.data.bfcl import ensure_bfcl
    from pivotrl.data.states import frame_to_states
    from pivotrl.models import load_tokenizer
    from pivotrl.prompts import encode_state
    from pivotrl.training.pivotrl import Group, PivotRLTrainer

    tr = cfg.training
    tkey = "train/" + content_hash({"pivots": store.read_manifest(f"{probe['pivots_key']}/pivots.parquet").sha256,
                                    "reference": ref["ref_hash"], "training": tr.model_dump(mode="json"),
                                    "rollout": cfg.rollout.model_dump(mode="json"), "verifier": cfg.verifier.model_dump(mode="json"),
                                    "prompt": _prompt_identity(cfg, ref), "dtype": cfg.model.dtype,
                                    "seed": cfg.run.seed, "code": stage_code_digest("train")})[:16]
    final_key = f"{tkey}/policy"
    if store.exists(f"{tkey}/summary.json") and store.exists(f"{tkey}/metrics.parquet"):
        summary = store.read_json(f"{tkey}/summary.json")
        return {"train_key": tkey, "policy_key": final_key if summary["steps"] else None, "metrics": store.url(f"{tkey}/metrics.parquet"),
                "summary": summary}

    cache = cache_dir(cfg)
    pivots = frame_to_states(store.read_parquet(f"{probe['pivots_key']}/pivots.parquet"))
    rdir = reference_dir(cfg, store, ref)
    if not pivots:
        # Nothing to train on tonight: the policy stays π_ref, and the report says so.
        log.warning("the pivot set %s is empty: no PivotRL update; the policy is the reference. Probe more "
                    "states (probing.max_states), raise probing.lambda_diff, or warm-start the reference.", probe["pivots"])
        empty = pd.DataFrame({"step": pd.Series([], dtype="int64"), "reward_mean": pd.Series([], dtype="float64")})
        summary = {"steps": 0, "pivots": 0, "final_reward_mean": None, "policy": "reference",
                   "note": "empty pivot set: policy = reference"}
        inputs = {"pivots": probe["pivots"]}
        store.write_artifact(f"{tkey}/metrics.parquet", empty, kind="training_metrics", inputs=inputs,
                             config={"training": tr.model_dump(mode="json")})
        store.write_artifact(f"{tkey}/summary.json", summary, kind="policy_checkpoint", inputs=inputs,
                             config={"training": tr.model_dump(mode="json")})
        return {"train_key": tkey, "policy_key": None, "metrics": store.url(f"{tkey}/metrics.parquet"),
                "summary": summary}
    tok = load_tokenizer(rdir)
    prompts = [encode_state(s, tok, max_len=cfg.model.max_context - cfg.rollout.max_tokens, **prompt_kwargs(cfg))
               for s in pivots]
    schedule = pivot_schedule(len(pivots), tr.pivots_per_batch, tr.epochs, cfg.run.seed, tr.max_steps)
    work = Path(tempfile.mkdtemp(prefix="pivotrl-train-", dir=cache))
    trainer = PivotRLTrainer(
        str(rdir), str(rdir), tokenizer_dir=str(rdir), group_size=tr.group_size, epsilon=tr.epsilon, beta=tr.beta, delta=tr.delta,
        kl_estimator=tr.kl_estimator, advantage_estimator=tr.advantage_estimator, ratio_type=tr.ratio_type,
        lr=tr.lr, updates_per_batch=tr.updates_per_batch, micro_batch_groups=tr.micro_batch_groups,
        shared_prefix=tr.shared_prefix, dtype=TRAINER_DTYPE[cfg.model.dtype], zero_stage=tr.deepspeed.zero_stage,
        grad_clip=tr.grad_clip, seed=cfg.run.seed, deepspeed_extra=tr.deepspeed.extra or None,
    )
    # Data parallel: every rank trains; rank 0 alone owns the rollout engine and the verifier,
    # and broadcasts each batch's groups, so all ranks step on the same global batch.
    rank, world = _rank_and_world()
    lead = rank == 0
    start, rows = 0, []
    latest = _latest_checkpoint(store, f"{tkey}/checkpoints")
    policy_dir = rdir
    if latest is not None:
        step_dir = _fetch_checkpoint(store, latest, cache, rank)
        state = trainer.load_checkpoint(str(step_dir))
        start = int(state["step"])
        rows = pd.read_parquet(step_dir / "metrics.parquet").to_dict("records")
        policy_dir = step_dir / "hf"
        log.info("resuming PivotRL training from %s (step %d)", latest, start)
    verifier = make_verifier(cfg, ensure_bfcl(cache), tokenizer=tok) if lead else None
    engine = make_rollout_engine(cfg, policy_dir) if lead else None
    tol_max = tr.refresh_tolerance if tr.refresh_tolerance is not None else (1e-4 if cfg.model.dtype == "fp32" else 0.3)
    log_step = step_logger(cfg, store, tkey)
    from pivotrl.progress import Progress

    # Progress by group updates (pivots × updates per batch), counted inside each step.
    bar = Progress("training", (len(schedule) - start) * tr.pivots_per_batch * tr.updates_per_batch,
                   "group updates", enabled=lead).__enter__()
    trainer.on_groups = lambda n: bar.update(n * world)
    try:
        for step in range(start, len(schedule)):
            t0 = time.time()
            if lead:
                _maybe_kill(cfg, store, tkey, step)
            idx = schedule[step]
            groups, dropped, retries, scored = [], 0, 0, []
            if lead:
                retries0 = _retries(verifier)
                gens = engine.generate([prompts[i] for i in idx],
                                       sampling_for(cfg, n=tr.group_size, temperature=1.0, seed=cfg.run.seed * 100_003 + step))
                for i, samples in zip(idx, gens):
                    try:
                        res = verifier.score(pivots[i], [g.text for g in samples])
                    except VerifierError as e:
                        # The whole group is dropped and counted: never advantages from a partial group.
                        dropped += 1
                        log.warning("dropping pivot %s at step %d: %s", pivots[i].state_id, step, e)
                        continue
                    groups.append(Group(state_id=pivots[i].state_id, prompt_ids=prompts[i],
                                        actions=[list(g.token_ids) for g in samples], rewards=[r.reward for r in res]))
                    scored.append((pivots[i].state_id, samples, res))
                retries = _retries(verifier) - retries0
            groups, dropped, retries = _broadcast((groups, dropped, retries), world)
            t_roll = time.time() - t0
            metrics = trainer.train_step(groups) if groups else {}
            if lead:  # every sampled action of the step, kept (pivotrl.rollouts)
                record_train_step(store, tkey, step + 1, scored, trainer, groups, world, tr.advantage_estimator, tr.delta)
            # Refresh π_old inside the running engine (no restart), then check that it took: the
            # engine's log-probs of a fixed action must match the trainer's.
            export = work / f"policy-{step}"
            trainer.export_hf(str(export))
            probe_prompt = groups[0].prompt_ids if groups else None
            action = groups[0].actions[0] if groups else None
            trainer_lp = trainer.old_policy_logprobs(probe_prompt, action) if action else []
            d_max = d_mean = 0.0
            if lead:
                engine.load_weights(str(export))
                d_max, d_mean = _refresh_delta(engine, probe_prompt, action, trainer_lp)
            d_max, d_mean = _broadcast((d_max, d_mean), world)
            shutil.rmtree(work / f"policy-{step - 1}", ignore_errors=True)
            row = {"step": step + 1, "pivots": len(idx), "groups": len(groups), "dropped_groups": dropped,
                   "verifier_retries": retries,
                   **{k: float(v) for k, v in metrics.items() if isinstance(v, (int, float))},
                   "rollout_s": round(t_roll, 3), "step_time_s": round(time.time() - t0, 3),
                   "refresh_max_abs_delta": d_max, "refresh_mean_abs_delta": d_mean}
            rows.append(row)
            if lead:
                log_step(row)  # to the experiment tracker, live (a no-op unless tracking is on)
            # Groups not trained (dropped, zero advantage, a short last batch) still count as done.
            bar.update((step + 1 - start) * tr.pivots_per_batch * tr.updates_per_batch - bar.done, steps=1)
            _check_refresh(step + 1, d_max, d_mean, tol_max, cfg.model.dtype)
            if (step + 1) % tr.checkpoint_every == 0 or step + 1 == len(schedule):
                _save_checkpoint(store, trainer, f"{tkey}/checkpoints/step-{step + 1:06d}", rows, work, rank, world)
        bar.__exit__(None, None, None)
    finally:
        bar.close()
        if engine is not None:
            engine.close()
        _close(verifier)
    if not lead:
        shutil.rmtree(work, ignore_errors=True)
        return {"train_key": tkey, "policy_key": final_key, "metrics": store.url(f"{tkey}/metrics.parquet"),
                "summary": None}
    metrics_df = pd.DataFrame(rows)
    last = _latest_checkpoint(store, f"{tkey}/checkpoints")
    final = _fetch_checkpoint(store, last, cache, 0) / "hf"
    store.put_dir(str(final), final_key)
    inputs = {"pivots": probe["pivots"], "reference": store.url(ref["ref_key"]) if ref["ref_key"] else ref["base_dir"]}
    store.write_artifact(f"{tkey}/metrics.parquet", metrics_df, kind="training_metrics", inputs=inputs,
                         config={"training": tr.model_dump(mode="json")}, extra={"seed": cfg.run.seed})
    summary = {"steps": len(rows), "pivots": len(pivots), "final_reward_mean": float(metrics_df["reward_mean"].iloc[-1])
               if "reward_mean" in metrics_df and len(metrics_df) else None,
               "policy": store.url(final_key)}
    store.write_artifact(f"{tkey}/summary.json", summary, kind="policy_checkpoint", inputs=inputs,
                         config={"training": tr.model_dump(mode="json")}, extra={"checkpoint": store.url(final_key),
                                                                         "prompt_format": ref.get("prompt_format")})
    shutil.rmtree(work, ignore_errors=True)
    return {"train_key": tkey, "policy_key": final_key, "metrics": store.url(f"{tkey}/metrics.parquet"), "summary": summary}


def _rank_and_world() -> tuple[int, int]:
    from pivotrl.training.deepspeed_utils import rank_and_world

    return rank_and_world()


def _broadcast(obj: Any, world: int) -> Any:
    """Rank 0's ``obj`` on every rank (pickled by torch.distributed; small Python objects only)."""
    if world == 1:
        return obj
    import torch.distributed as dist

    box = [obj]
    dist.broadcast_object_list(box, src=0)
    return box[0]


#: Mean |Δ| per token allowed between engine and trainer log-probs after a refresh (spec tolerances).
REFRESH_MEAN_TOLERANCE = {"fp32": 1e-4, "bf16": 0.05}


def _check_refresh(step: int, d_max: float, d_mean: float, tol_max: float, dtype: str) -> None:
    """Fail loudly if the rollout engine is not serving the trainer's weights after a refresh.

    fp32: both the max and the mean per-token |Δ| must be within tolerance (engines agree to ~1e-5).
    bf16: the mean must be ≤ 0.05; a max above ``refresh_tolerance`` alone is logged, not fatal —
    single bf16 tokens differ by up to ~0.3–0.5 between kernels (measured), while a refresh that did
    not take shows on the mean. Raises TrainingError naming the step and the numbers."""
    mean_tol = REFRESH_MEAN_TOLERANCE.get(dtype, 0.05)
    if d_mean > mean_tol or (dtype == "fp32" and d_max > tol_max):
        raise TrainingError(
            f"policy refresh check failed at step {step}: engine vs trainer log-probs differ by {d_max:.3g} "
            f"(max) / {d_mean:.3g} (mean) per token (tolerances {tol_max:g} / {mean_tol:g}); the rollout "
            "engine is not sampling from π_old")
    if d_max > tol_max:
        log.warning("refresh check at step %d: max per-token |Δ| %.3g exceeds %.3g (mean %.3g is within %.3g); "
                    "bf16 kernel noise", step, d_max, tol_max, d_mean, mean_tol)


def _retries(verifier: Any) -> int:
    stats = getattr(verifier, "stats", None)
    return int(getattr(stats, "retries", 0) or 0)


def _refresh_delta(engine: Any, prompt: list[int], action: list[int] | None,
                   trainer_lp: list[float]) -> tuple[float, float]:
    """Max and mean |Δ| per token between the engine's and the trainer's log-probs of ``action``."""
    if not action:
        return 0.0, 0.0
    eng = engine.score([prompt], [action])[0]
    deltas = [abs(a - float(b)) for a, b in zip(eng, trainer_lp)]
    return (max(deltas), sum(deltas) / len(deltas)) if deltas else (0.0, 0.0)


def _save_checkpoint(store: ArtifactStore, trainer: Any, key: str, rows: list[dict], work: Path,
                     rank: int, world: int) -> None:
    """Publish a resumable checkpoint under ``key``: every rank uploads its own files to
    ``key/rank-<r>`` (DeepSpeed state incl. its optimizer partition; rank 0 adds the HF export and
    the metrics so far), then rank 0 writes ``key/ranks.json`` last. Storage is the only medium
    shared between ranks, so this works across machines without a shared filesystem."""
    d = work / f"ckpt-{Path(key).name}-rank{rank}"
    out = trainer.save_checkpoint(str(d))
    src = Path(out) if Path(out).exists() else d.with_name(d.name + ".partial")
    if rank == 0:
        pd.DataFrame(rows).to_parquet(src / "metrics.parquet")
    store.put_dir(str(src), f"{key}/rank-{rank}")
    shutil.rmtree(src, ignore_errors=True)
    _broadcast(None, world)  # barrier: every rank has published
    if rank == 0:
        store.write_json(f"{key}/ranks.json", {"world_size": world})


def _latest_checkpoint(store: ArtifactStore, prefix: str) -> str | None:
    """Key of the newest checkpoint whose every rank published (``ranks.json`` exists), or None
    when there is none. A storage failure is not "no checkpoint" (that would silently restart
    training from step 0): the store retries transient failures, then its StorageError propagates."""
    keys = store.list(prefix)
    steps = sorted({k.split("/step-")[1].split("/")[0] for k in keys if "/step-" in k and k.endswith("/ranks.json")})
    return f"{prefix}/step-{steps[-1]}" if steps else None


def _fetch_checkpoint(store: ArtifactStore, key: str, cache: Path, rank: int) -> Path:
    """A local directory with rank 0's files (model states, HF export, metrics) and, for rank > 0,
    this rank's own files (its optimizer partition) merged in."""
    base = local_checkpoint(store, f"{key}/rank-0", cache)
    if rank == 0:
        return base
    own = local_checkpoint(store, f"{key}/rank-{rank}", cache)
    merged = cache / "checkpoints" / f"{key.replace('/', '_')}-merged-rank{rank}"
    if not merged.exists():
        shutil.copytree(base, merged)
        shutil.copytree(own, merged, dirs_exist_ok=True)
    return merged


def _maybe_kill(cfg: RunConfig, store: ArtifactStore, tkey: str, step: int) -> None:
    """Fault injection: SIGKILL this process once at ``faults.kill_trainer_at_step``."""
    at = cfg.faults.kill_trainer_at_step
    marker = f"{tkey}/faults/killed-at-{at}"
    if at is not None and step == at and not store.exists(marker):
        store.write_text(marker, "killed\n")
        os.kill(os.getpid(), signal.SIGKILL)


def _close(obj: Any) -> None:
    close = getattr(obj, "close", None)
    if callable(close):
        close()


def _jsonable(x: Any) -> Any:
    return json.loads(json.dumps(x, default=lambda o: o.item() if hasattr(o, "item") else str(o)))


# --------------------------------------------------------------------------------------------
# Evaluation + report.
# --------------------------------------------------------------------------------------------
def stage_evaluate(cfg: RunConfig, store: ArtifactStore, demos: dict[str, Any], ref: dict[str, Any],
                   probe: dict[str, Any], train: dict[str, Any]) -> dict[str, Any]:
    """Evaluate base, π_ref and the PivotRL policy with the same seeds: full multi-turn tasks from
    scratch on held-out tasks, and local accuracy on held-out states and on the pivot set."""
    cfg = with_resolved_dtype(cfg)  # model.dtype: auto → bf16 | fp32 on this hardware
    from pivotrl.data.bfcl import ensure_bfcl
    from pivotrl.data.states import frame_to_states
    from pivotrl.evaluation.full_task import evaluate_full_tasks
    from pivotrl.evaluation.local import evaluate_local
    from pivotrl.evaluation.comparison import compare_policies
    from pivotrl.evaluation.report import build_report
    from pivotrl.evaluation.trust import full_task_metric, out_of_domain_states, trust_sections
    from pivotrl.models import load_tokenizer
    from pivotrl.evaluation.drift import drift_markdown, drift_table, zero_variance_summary
    from pivotrl.pipeline.probe import probe_states, select_candidates

    ev = cfg.evaluation
    ekey = "eval/" + content_hash({"demos": demos["key"], "base": ref["base_hash"], "ref": ref["ref_hash"],
                                   "train": train["train_key"], "evaluation": ev.model_dump(mode="json"),
                                   "prompt": _prompt_identity(cfg, ref), "rollout": cfg.rollout.model_dump(mode="json"),
                                   "quality": cfg.quality.model_dump(mode="json"), "code": stage_code_digest("evaluate")})[:16]
    if store.exists(f"{ekey}/report.json"):
        return {"eval_key": ekey, "report_json": store.url(f"{ekey}/report.json"),
                "report_md": store.url(f"{ekey}/report.md"), "report": store.read_json(f"{ekey}/report.json")}
    cache = cache_dir(cfg)
    bfcl_root = ensure_bfcl(cache)
    heldout = [t for t in read_trajectories(store, demos["key"], split="heldout") if t.env is not None]
    heldout = sorted(heldout, key=lambda t: t.id)[: ev.num_tasks]
    cand = store.read_parquet(f"{demos['key']}/candidates.parquet")
    n_local = max(min(ev.num_tasks * 4, 40), 32)  # held-out states for local accuracy (m samples each)
    hist = read_histories(store, demos["key"], cand.loc[cand["split"] == "heldout", "trajectory_id"])
    local_states = frame_to_states(select_candidates(cand, "heldout", n_local, cfg.run.seed, kinds=("call", "text_rule")), hist)
    # Stop decisions (BFCL's closing "Done.") are scored apart; text turns without a rule never.
    stop_states = frame_to_states(select_candidates(cand, "heldout", n_local, cfg.run.seed, kinds=("stop",)), hist)
    ood_states = out_of_domain_states(cfg, cache)  # BFCL categories never trained on
    pivots = frame_to_states(store.read_parquet(f"{probe['pivots_key']}/pivots.parquet"))
    text_turn = {st.state_id: not st.demo_action.tool_calls for st in local_states}
    policies = {"base": Path(ref["base_dir"]),
                "reference": reference_dir(cfg, store, ref),
                "pivotrl": local_checkpoint(store, train["policy_key"], cache) if train["policy_key"]
                else reference_dir(cfg, store, ref)}
    tok = load_tokenizer(policies["reference"])
    verifier = make_verifier(cfg, bfcl_root, tokenizer=tok)
    engine = make_rollout_engine(cfg, policies["base"])
    results: dict[str, Any] = {}
    per_task: list[pd.DataFrame] = []
    local_frames: list[pd.DataFrame] = []
    pivot_frames: list[pd.DataFrame] = []
    try:
        for name, mdir in policies.items():
            if name != "base":
                engine.load_weights(str(mdir))  # same architecture: swap weights, keep the engine
            res: dict[str, Any] = {}
            for seed in ev.seeds:
                samp = sampling_for(cfg, n=1, temperature=ev.temperature, seed=seed)
                df, summ = evaluate_full_tasks(engine, tok, heldout, bfcl_root=str(bfcl_root),
                                               max_steps_per_turn=ev.max_steps_per_turn, sampling=samp, seed=seed,
                                               max_context=cfg.model.max_context - cfg.rollout.max_tokens,
                                               judge=cfg.quality.judge, **prompt_kwargs(cfg))
                df["policy"], df["seed"] = name, seed
                per_task.append(df)
                res.setdefault("full_task_runs", []).append(summ)
                lkw = {"max_context": cfg.model.max_context - cfg.rollout.max_tokens, **prompt_kwargs(cfg)}
                ldf, lsum = evaluate_local(engine, tok, local_states, verifier, sampling=samp, **lkw)
                res.setdefault("local_heldout_runs", []).append(lsum)
                # Sampled success as in probing (m samples at the probe temperature), beside greedy.
                sampled = sampling_for(cfg, n=cfg.probing.num_probes, temperature=cfg.probing.temperature, seed=seed)
                sdf, ssum = evaluate_local(engine, tok, local_states, verifier, sampling=sampled, **lkw)
                res.setdefault("local_sampled_runs", []).append(ssum)
                stdf, stsum = (evaluate_local(engine, tok, stop_states, verifier, sampling=samp, **lkw) if stop_states
                               else (ldf.iloc[:0], None))
                res.setdefault("local_stop_runs", []).append(stsum)
                odf, osum = (evaluate_local(engine, tok, ood_states, verifier, sampling=samp, **lkw) if ood_states
                             else (ldf.iloc[:0], None))
                res.setdefault("out_of_domain_runs", []).append(osum)
                for kind, frame in (("heldout_greedy", ldf), ("heldout_sampled", sdf), ("stop_decisions_greedy", stdf),
                                    ("out_of_domain_greedy", odf)):
                    local_frames.append(frame.assign(policy=name, seed=seed, kind=kind))
                # Per category, tool calls apart from text turns with an answer rule (stop decisions: above).
                res["local_by_category"] = {
                    kind: {c: float(g["n_accepted"].sum() / max(1, g["n_samples"].sum()))
                           for c, g in frame[frame["status"] == "ok"].assign(
                               group=lambda f: [f"{c}/{'text' if text_turn[sid] else 'call'}"
                                                for c, sid in zip(f["category"], f["state_id"])]).groupby("group")}
                    for kind, frame in (("greedy", ldf), ("sampled", sdf))}
                if ev.local_pivots:
                    pdf, psum = evaluate_local(engine, tok, pivots, verifier, sampling=samp, **lkw)
                    pivot_frames.append(pdf.assign(policy=name, seed=seed))
                    res.setdefault("local_pivot_runs", []).append(psum)
            res["full_task"] = res["full_task_runs"][0] if len(ev.seeds) == 1 else _mean_summ(res["full_task_runs"])
            res["local"] = res["local_heldout_runs"][0] if len(ev.seeds) == 1 else _mean_summ(res["local_heldout_runs"])
            res["local_sampled"] = (res["local_sampled_runs"][0] if len(ev.seeds) == 1
                                    else _mean_summ(res["local_sampled_runs"]))
            res["local_stop"] = (None if not stop_states else res["local_stop_runs"][0] if len(ev.seeds) == 1
                                 else _mean_summ(res["local_stop_runs"]))
            res["out_of_domain"] = (None if not ood_states else res["out_of_domain_runs"][0] if len(ev.seeds) == 1
                                    else _mean_summ(res["out_of_domain_runs"]))
            if ev.local_pivots:
                res["local_pivots"] = res["local_pivot_runs"][0] if len(ev.seeds) == 1 else _mean_summ(res["local_pivot_runs"])
            results[name] = res
        # Pivot drift: the pivot set re-probed under the trained policy (last in `policies`), same m.
        reprobe = probe_states(engine, tok, pivots, verifier, num_probes=cfg.probing.num_probes,
                               sampling=sampling_for(cfg, n=cfg.probing.num_probes, temperature=cfg.probing.temperature,
                                                     seed=cfg.probing.seed, top_p=cfg.probing.top_p, top_k=cfg.probing.top_k),
                               max_context=cfg.model.max_context, max_tokens=cfg.rollout.max_tokens,
                               prompt_kwargs=prompt_kwargs(cfg), progress=False) if pivots else None
    finally:
        engine.close()
        _close(verifier)
    metrics_df = store.read_parquet(f"{train['train_key']}/metrics.parquet")
    probe_df = store.read_parquet(f"{probe['probes_key']}/probes.parquet")
    meta = {"run": cfg.run.name, "config_hash": config_hash(cfg), "model_source": cfg.model.source,
            "note": "SmolLM2-135M-Instruct here is dequantised from a Q4_1 GGUF, not the original bf16 weights"
            if "smollm2" in cfg.model.source.lower() else "",
            "heldout_tasks": [t.id for t in heldout], "local_states": len(local_states), "pivots": len(pivots),
            "stop_decision_states": len(stop_states), "out_of_domain": list(cfg.quality.out_of_domain),
            "out_of_domain_states": len(ood_states),
            "sft": ref.get("sft"), "training": train.get("summary")}
    per_task_df, local_df = pd.concat(per_task), pd.concat(local_frames)
    statistics = compare_policies(per_task_df, local_df, list(policies), seed=cfg.run.seed)
    sections = trust_sections(cfg, demos.get("counts") or {}, heldout, bfcl_total=200)
    drift = None if reprobe is None else drift_table(reprobe, cfg.probing.lambda_diff)
    pivot_mus = [float(x) for x in store.read_parquet(f"{probe['pivots_key']}/pivots.parquet").get("mu", [])]
    zero_var = zero_variance_summary(metrics_df, cfg.training.group_size, pivot_mus)
    sections += drift_markdown(drift, zero_var, cfg.probing.num_probes)
    statistics["pivot_drift"], statistics["zero_variance"] = drift, zero_var
    meta["full_task_metric"], meta["full_task_metric_differs_from_bfcl"] = full_task_metric(
        cfg.quality.judge, ev.max_steps_per_turn, len(heldout))
    with tempfile.TemporaryDirectory(dir=cache) as tmp:
        rj, rm = build_report(results, metrics_df=metrics_df, probe_df=probe_df, pivot_stats=probe["stats"],
                              meta=meta, out_dir=tmp, statistics=statistics, sections=sections)
        record_evaluation(store, ekey, pivot_frames, probes_key=probe["probes_key"], train_key=train["train_key"],
                          train_steps=int((train.get("summary") or {}).get("steps") or 0), report_md=rm)
        per_task_df.to_parquet(Path(tmp) / "full_task.parquet")
        local_df.to_parquet(Path(tmp) / "local.parquet")
        for f in sorted(Path(tmp).iterdir()):
            if f.name != "report.json":
                store.write_bytes(f"{ekey}/{f.name}", f.read_bytes())
        store.write_artifact(f"{ekey}/report.json", json.loads(Path(rj).read_text()), kind="report",
                             inputs={"policy": store.url(train["policy_key"]) if train["policy_key"] else "reference", "pivots": probe["pivots"],
                                     "metrics": train["metrics"], "trajectories": demos["trajectories"]},
                             config={"evaluation": ev.model_dump(mode="json")}, extra={"seeds": ev.seeds, "prompt_format": ref.get("prompt_format")})
    return {"eval_key": ekey, "report_json": store.url(f"{ekey}/report.json"),
            "report_md": store.url(f"{ekey}/report.md"), "report": store.read_json(f"{ekey}/report.json")}


def _mean_summ(runs: list[dict[str, Any]]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for k in runs[0]:
        vals = [r[k] for r in runs if isinstance(r.get(k), (int, float))]
        out[k] = sum(vals) / len(vals) if len(vals) == len(runs) else runs[0][k]
    return out
