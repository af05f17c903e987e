"""The parts of the evaluate stage: policies on held-out tasks and states, and the report.

The stage (:func:`pivotrl.pipeline.evaluate_stage.stage_evaluate`, in one shard or many) and the
comparison's evaluation (:mod:`pivotrl.pipeline.compare_eval`, over more policies) are built from:

- :func:`policy_task_frames`: one policy's full multi-turn tasks from scratch, one table per seed;
- :func:`policy_state_results`: one policy's local accuracy on held-out states, stop decisions,
  out-of-domain states and the pivot set;
- :func:`reprobe_pivots`: the pivot set re-probed under the trained policy (pivot drift);
- :func:`write_report`: the report from those parts (full-task summaries are computed here, from
  the per-task tables, so a report merged from shards is the same as one computed in one piece).

The arithmetic over seeds and categories lives in :mod:`pivotrl.evaluation.aggregate`, the report
in :mod:`pivotrl.evaluation.report`.
"""

from __future__ import annotations

import json
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Mapping, Sequence

import pandas as pd

from pivotrl.provenance.code_digest import stage_code_digest
from pivotrl.config import RunConfig, config_hash
from pivotrl.core.hashing import content_hash
from pivotrl.pipeline.common import local_checkpoint, prompt_kwargs, sampling_for
from pivotrl.pipeline.demos import cache_dir, read_histories, read_trajectories
from pivotrl.pipeline.reference import base_model_dir, prompt_identity, reference_dir
from pivotrl.pipeline.results import EvalResult, ProbeResult, ReferenceResult, TrainResult
from pivotrl.provenance.rollouts import record_evaluation
from pivotrl.storage import ArtifactStore


def eval_key(cfg: RunConfig, demos: Mapping[str, Any], ref: ReferenceResult | Mapping[str, Any],
             train: TrainResult | Mapping[str, Any]) -> str:
    """``eval/<16 hex>``: content hash of the demonstrations, base and π_ref, the trained run, the
    evaluation, prompt, rollout and quality settings and the evaluate stage's code. ``cfg`` with
    its dtype resolved (``with_resolved_dtype``)."""
    ref, train = ReferenceResult.of(ref), TrainResult.of(train)
    return "eval/" + content_hash({"demos": demos["key"], "base": ref.base_hash, "ref": ref.ref_hash,
                                   "train": train.train_key, "evaluation": cfg.evaluation.model_dump(mode="json"),
                                   "prompt": prompt_identity(cfg, ref), "rollout": cfg.rollout.model_dump(mode="json"),
                                   "quality": cfg.quality.model_dump(mode="json"), "code": stage_code_digest("evaluate")})[:16]


#: Where one policy's part of an evaluation shard lives: ``<prefix>/<16 hex>`` (:func:`policy_part_key`).
PARTS_PREFIX = "eval/shards/by-policy"

#: Tokenizer files whose bytes :func:`tokenizer_hash` covers (whichever a checkpoint has).
_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "chat_template.jinja",
                    "vocab.json", "merges.txt", "tokenizer.model", "added_tokens.json")


def tokenizer_hash(model_dir: str | Path) -> str:
    """sha256 hex over the tokenizer files of ``model_dir`` (names and bytes, in name order): the
    evaluation renders every policy's prompts with π_ref's tokenizer."""
    import hashlib

    digest = hashlib.sha256()
    for name in _TOKENIZER_FILES:
        path = Path(model_dir) / name
        if path.is_file():
            digest.update(f"{name}\0{path.stat().st_size}\0".encode())
            digest.update(path.read_bytes())
    return digest.hexdigest()


def policy_weights(ref: ReferenceResult, train: TrainResult) -> dict[str, str]:
    """Policy name → the identity of its weights, in :data:`POLICIES` order: the base model's and
    π_ref's checkpoint hashes, the trained run's key (π_ref's hash when nothing was trained)."""
    return {"base": f"checkpoint:{ref.base_hash}", "reference": f"checkpoint:{ref.ref_hash}",
            "pivotrl": f"train:{train.train_key}" if train.policy_key else f"checkpoint:{ref.ref_hash}"}


def policy_part_key(cfg: RunConfig, demos: Mapping[str, Any], ref: ReferenceResult, weights: str,
                    items: Mapping[str, Any], tokenizer: str) -> str:
    """``eval/shards/by-policy/<16 hex>``: the content key of one policy's results on one shard's
    items (:func:`policy_task_frames` or :func:`policy_state_results`), which depend on nothing
    else: the policy's weights (:func:`policy_weights`), the items (``items``: the part, the task or
    state ids and what else decides them, e.g. the pivot set), the demonstrations, the tokenizer
    that renders the prompts (:func:`tokenizer_hash`), the evaluation, prompt, rollout, model,
    verifier, quality and fault settings, the run's seed (engines, selection) and the evaluate
    stage's code. Not the training settings: a run that changes only those finds the base model's
    and π_ref's parts under the same keys and reuses them. ``cfg`` with its dtype resolved."""
    return f"{PARTS_PREFIX}/" + content_hash({
        "weights": weights, "items": dict(items), "demos": demos["key"], "tokenizer": tokenizer,
        "evaluation": cfg.evaluation.model_dump(mode="json"), "prompt": prompt_identity(cfg, ref),
        **{s: getattr(cfg, s).model_dump(mode="json") for s in ("rollout", "model", "verifier", "quality", "faults")},
        "seed": cfg.run.seed, "code": stage_code_digest("evaluate")})[:16]


def heldout_tasks(cfg: RunConfig, store: ArtifactStore, demos: Mapping[str, Any], limit: int | None = None) -> list[Any]:
    """The held-out tasks played from scratch: held-out trajectories with a tool environment,
    sorted by id, the first ``limit`` (default ``evaluation.num_tasks``)."""
    heldout = [t for t in read_trajectories(store, demos["key"], split="heldout") if t.env is not None]
    return sorted(heldout, key=lambda t: t.id)[: cfg.evaluation.num_tasks if limit is None else limit]


#: The policies evaluated, in the report's order.
POLICIES = ("base", "reference", "pivotrl")


def eval_policies(cfg: RunConfig, store: ArtifactStore, ref: ReferenceResult, train: TrainResult) -> dict[str, Path]:
    """Policy name → local checkpoint directory, in :data:`POLICIES` order."""
    return {"base": base_model_dir(cfg, ref), "reference": reference_dir(cfg, store, ref),
            "pivotrl": local_checkpoint(store, train.policy_key, cache_dir(cfg)) if train.policy_key
            else reference_dir(cfg, store, ref)}


@dataclass(frozen=True)
class EvalStates:
    """The turn states evaluated locally: held-out calls and text turns, stop decisions,
    out-of-domain BFCL categories and the pivot set."""

    local: list[Any]
    stop: list[Any]
    ood: list[Any]
    pivots: list[Any]

    @classmethod
    def select(cls, cfg: RunConfig, store: ArtifactStore, demos: Mapping[str, Any], probe: ProbeResult) -> "EvalStates":
        from pivotrl.data.states import frame_to_states
        from pivotrl.evaluation.trust import out_of_domain_states
        from pivotrl.pipeline.probe import select_candidates

        cand = store.read_parquet(f"{demos['key']}/candidates.parquet")
        n_local = cfg.evaluation.local_states or max(min(cfg.evaluation.num_tasks * 4, 40), 32)  # held-out states
        hist = read_histories(store, demos["key"], cand.loc[cand["split"] == "heldout", "trajectory_id"])
        local = frame_to_states(select_candidates(cand, "heldout", n_local, cfg.run.seed, kinds=("call", "text_rule")), hist)
        # Stop decisions (BFCL's closing "Done.") are scored apart; text turns without a rule never.
        stop = frame_to_states(select_candidates(cand, "heldout", n_local, cfg.run.seed, kinds=("stop",)), hist)
        ood = out_of_domain_states(cfg, cache_dir(cfg))  # BFCL categories never trained on
        pivots = frame_to_states(store.read_parquet(f"{probe.pivots_key}/pivots.parquet"))
        return cls(local, stop, ood, pivots)

    def counts(self) -> dict[str, int]:
        return {"local_states": len(self.local), "pivots": len(self.pivots), "stop_decision_states": len(self.stop),
                "out_of_domain_states": len(self.ood)}


@dataclass
class StateParts:
    """What the state-level evaluation of every policy produced (see :func:`policy_state_results`).

    ``results``: policy → its per-seed local summaries; ``local_frames`` / ``pivot_frames``: the
    per-state tables (columns of :func:`pivotrl.evaluation.local.evaluate_local` plus policy, seed
    and, for local frames, kind); ``reprobe``: the pivot set re-probed under the trained policy."""

    counts: dict[str, int]
    results: dict[str, dict[str, Any]] = field(default_factory=dict)
    local_frames: list[pd.DataFrame] = field(default_factory=list)
    pivot_frames: list[pd.DataFrame] = field(default_factory=list)
    reprobe: pd.DataFrame | None = None


def _lkw(cfg: RunConfig) -> dict[str, Any]:
    return {"max_context": cfg.model.max_context - cfg.rollout.max_tokens, **prompt_kwargs(cfg),
            "cache_dir": str(cfg.run.local_cache())}  # the generation MFU's calibrated peak


def policy_task_frames(cfg: RunConfig, engine: Any, tok: Any, tasks: Sequence[Any], bfcl_root: Path,
                       policy: str) -> list[pd.DataFrame]:
    """The held-out ``tasks`` played from scratch by the policy loaded in ``engine``: one per-task
    table (:func:`pivotrl.evaluation.full_task.evaluate_full_tasks` plus policy, seed) per seed."""
    from pivotrl.evaluation.full_task import evaluate_full_tasks

    ev, frames = cfg.evaluation, []
    for seed in ev.seeds:
        df, _ = evaluate_full_tasks(engine, tok, tasks, bfcl_root=str(bfcl_root), max_steps_per_turn=ev.max_steps_per_turn,
                                    sampling=sampling_for(cfg, n=1, temperature=ev.temperature, seed=seed), seed=seed,
                                    max_context=cfg.model.max_context - cfg.rollout.max_tokens,
                                    judge=cfg.quality.judge, **prompt_kwargs(cfg))
        df["policy"], df["seed"] = policy, seed
        frames.append(df)
    return frames


def full_task_runs(cfg: RunConfig, frames: Sequence[pd.DataFrame]) -> list[dict[str, Any]]:
    """The per-seed full-task summaries of one policy's per-task tables (one per seed)."""
    from pivotrl.evaluation.aggregate import task_summary

    ev = cfg.evaluation
    return [task_summary(df.drop(columns=["policy", "seed"]), max_steps_per_turn=ev.max_steps_per_turn,
                         sampling=sampling_for(cfg, n=1, temperature=ev.temperature, seed=seed), seed=seed,
                         max_context=cfg.model.max_context - cfg.rollout.max_tokens, judge=cfg.quality.judge)
            for seed, df in zip(ev.seeds, frames)]


#: The state-level measures of :func:`policy_state_results`, in the order they run.
STATE_MEASURES = ("heldout_greedy", "heldout_sampled", "stop_decisions_greedy", "out_of_domain_greedy", "pivots")


def policy_state_results(cfg: RunConfig, engine: Any, tok: Any, states: EvalStates, verifier: Any, policy: str,
                         parts: StateParts, measures: Sequence[str] = STATE_MEASURES) -> None:
    """Local accuracy of the policy loaded in ``engine`` on ``states``, every seed, added to
    ``parts``. ``measures`` (a subset of :data:`STATE_MEASURES`): held-out states greedy and with m
    samples at the probe temperature, stop decisions, out-of-domain states (greedy) and the pivot set
    (``evaluation.local_pivots``); ``pivotrl compare`` asks for the greedy ones only.
    With ``quality.judge: bfcl`` the greedy held-out and out-of-domain
    measures (:data:`BFCL_JUDGED`) take BFCL's ``ast_checker`` verdict on BFCL single-turn states,
    pivotrl's verifier's kept beside (:func:`pivotrl.bfcl.single_tables.rejudge_local`)."""
    from pivotrl.evaluation.aggregate import accuracy_by_category
    from pivotrl.evaluation.local import evaluate_local_groups

    unknown = sorted(set(measures) - set(STATE_MEASURES))
    if unknown:
        raise ValueError(f"unknown evaluation measures {unknown}; valid: {', '.join(STATE_MEASURES)}")
    ev, lkw, res = cfg.evaluation, _lkw(cfg), {}
    judge: list[Any] = []  # BFCL's single-turn judge, made when first needed
    text_turn = {st.state_id: not st.demo_action.tool_calls for st in states.local}
    for seed in ev.seeds:
        greedy = sampling_for(cfg, n=1, temperature=ev.temperature, seed=seed)
        # Sampled success as in probing (m samples at the probe temperature), beside greedy.
        sampled = sampling_for(cfg, n=cfg.probing.num_probes, temperature=cfg.probing.temperature, seed=seed)
        plan = {"heldout_greedy": (states.local, greedy, "local_heldout_runs"),
                "heldout_sampled": (states.local, sampled, "local_sampled_runs"),
                "stop_decisions_greedy": (states.stop, greedy, "local_stop_runs"),
                "out_of_domain_greedy": (states.ood, greedy, "out_of_domain_runs")}
        # Every measure of this policy and seed in one engine pass (a measure sampled alone leaves
        # the engine's batch emptying while its slowest samples finish).
        run = [k for k, (chosen, _, _) in plan.items()
               if k in measures and (chosen or k in ("heldout_greedy", "heldout_sampled"))]
        pivots = bool(ev.local_pivots and "pivots" in measures)
        jobs = [(plan[k][0], plan[k][1]) for k in run] + ([(states.pivots, greedy)] if pivots else [])
        done = dict(zip(run + ["pivots"] * pivots, evaluate_local_groups(
            engine, tok, jobs, verifier, **lkw, label=f"{policy}: local measures, seed {seed}")))
        frames: dict[str, pd.DataFrame] = {}
        for kind, (chosen, _, runs) in plan.items():
            if kind not in measures:
                continue
            if kind in done:
                frame, summary = done[kind]
            else:  # no stop decision or out-of-domain state: an empty table, no summary
                some = next(iter(frames.values()), None)
                frame, summary = (some.iloc[:0] if some is not None else pd.DataFrame()), None
            if summary is not None and kind in BFCL_JUDGED and cfg.quality.judge == "bfcl":
                frame, summary = _bfcl_rejudge(cfg, tok, frame, summary, chosen, judge)
            frames[kind] = frame
            res.setdefault(runs, []).append(summary)
            parts.local_frames.append(frame.assign(policy=policy, seed=seed, kind=kind))
        # Per category, tool calls apart from text turns with an answer rule (stop decisions: above).
        by_category = {name: accuracy_by_category(frames[kind], text_turn)
                       for name, kind in (("greedy", "heldout_greedy"), ("sampled", "heldout_sampled")) if kind in frames}
        if by_category:
            res["local_by_category"] = by_category
        if pivots:
            pdf, psum = done["pivots"]
            parts.pivot_frames.append(pdf.assign(policy=policy, seed=seed))
            res.setdefault("local_pivot_runs", []).append(psum)
    parts.results[policy] = res


#: The measures whose BFCL single-turn states BFCL's AST checker judges with ``quality.judge: bfcl``.
BFCL_JUDGED = ("heldout_greedy", "out_of_domain_greedy")


def _bfcl_rejudge(cfg: RunConfig, tok: Any, frame: pd.DataFrame, summary: dict[str, Any], states: Sequence[Any],
                  judge: list[Any]) -> tuple[pd.DataFrame, dict[str, Any]]:
    """``frame``/``summary`` with BFCL's AST checker as the judge of record on their BFCL
    single-turn states (:func:`pivotrl.bfcl.single_tables.rejudge_local`); ``judge`` caches
    the judge across calls (a one-element list once made). Without a state of a BFCL single-turn
    category nothing changes (and the wheel is not needed)."""
    from pivotrl.bfcl.data import SINGLE_TURN_CATEGORIES
    from pivotrl.bfcl.wheel import ensure_bfcl
    from pivotrl.bfcl.single import BFCLSingleTurnJudge
    from pivotrl.bfcl.single_tables import rejudge_local
    from pivotrl.pipeline.common import prompt_format

    if not any(s.category in SINGLE_TURN_CATEGORIES for s in states):
        return frame, summary
    if not judge:
        judge.append(BFCLSingleTurnJudge(ensure_bfcl(cache_dir(cfg)), prompt_format(cfg, tok).tool_parser))
    return rejudge_local(frame, summary, states, judge[0])


def reprobe_pivots(cfg: RunConfig, engine: Any, tok: Any, pivots: Sequence[Any], verifier: Any) -> pd.DataFrame | None:
    """Pivot drift: the pivot set re-probed (same m, temperature and seed as probing) under the
    policy loaded in ``engine``; None without pivots."""
    from pivotrl.pipeline.probe import probe_states

    if not pivots:
        return None
    p = cfg.probing
    return probe_states(engine, tok, pivots, verifier, num_probes=p.num_probes,
                        sampling=sampling_for(cfg, n=p.num_probes, temperature=p.temperature, seed=p.seed,
                                              top_p=p.top_p, top_k=p.top_k),
                        max_context=cfg.model.max_context, max_tokens=cfg.rollout.max_tokens,
                        prompt_kwargs=prompt_kwargs(cfg), progress=False)


def write_report(cfg: RunConfig, store: ArtifactStore, ekey: str, demos: Mapping[str, Any], ref: ReferenceResult,
                 probe: ProbeResult, train: TrainResult, heldout: Sequence[Any],
                 task_frames: Mapping[str, list[pd.DataFrame]], parts: StateParts) -> EvalResult:
    """Build and write the report (``<ekey>/report.json``, ``report.md``, plots, ``full_task.parquet``,
    ``local.parquet``, ``rollouts.parquet``) from the per-policy task tables (policy order = the
    report's) and the state-level parts. ``report.json`` is written last."""
    from pivotrl.evaluation.aggregate import summarize_runs
    from pivotrl.bfcl.single_tables import single_turn_judge_markdown
    from pivotrl.evaluation.comparison import compare_policies
    from pivotrl.evaluation.drift import drift_markdown, drift_table, zero_variance_summary
    from pivotrl.evaluation.report import build_report
    from pivotrl.evaluation.trust import full_task_metric, trust_sections

    ev, counts = cfg.evaluation, parts.counts
    results: dict[str, Any] = {}
    for name, frames in task_frames.items():
        res = {"full_task_runs": full_task_runs(cfg, frames), **parts.results[name]}
        summarize_runs(res, has_stop=counts["stop_decision_states"] > 0, has_ood=counts["out_of_domain_states"] > 0,
                       pivots=ev.local_pivots)
        results[name] = res
    metrics_df = store.read_parquet(f"{train.train_key}/metrics.parquet")
    probe_df = store.read_parquet(f"{probe.probes_key}/probes.parquet")
    meta = {"run": cfg.run.name, "config_hash": config_hash(cfg), "model_source": cfg.model.source,
            "note": "SmolLM2-135M-Instruct here is dequantised from a Q4_1 GGUF, not the original bf16 weights"
            if "smollm2" in cfg.model.source.lower() else "",
            "heldout_tasks": [t.id for t in heldout], "local_states": counts["local_states"], "pivots": counts["pivots"],
            "stop_decision_states": counts["stop_decision_states"], "out_of_domain": list(cfg.quality.out_of_domain),
            "out_of_domain_states": counts["out_of_domain_states"], "sft": ref.sft, "training": train.summary}
    per_task_df = pd.concat([f for frames in task_frames.values() for f in frames])
    local_df = pd.concat(parts.local_frames)
    # PivotRL first: every pair in the report reads pivotrl − reference, as its verdict does.
    statistics = compare_policies(per_task_df, local_df, sorted(task_frames, key=lambda p: p != "pivotrl"),
                                  seed=cfg.run.seed)
    sections = trust_sections(cfg, demos.get("counts") or {}, heldout, bfcl_total=200)
    drift = None if parts.reprobe is None else drift_table(parts.reprobe, cfg.probing.lambda_diff)
    pivot_mus = [float(x) for x in store.read_parquet(f"{probe.pivots_key}/pivots.parquet").get("mu", [])]
    zero_var = zero_variance_summary(metrics_df, cfg.training.group_size, pivot_mus)
    sections += single_turn_judge_markdown(results)
    sections += drift_markdown(drift, zero_var, cfg.probing.num_probes)
    statistics["pivot_drift"], statistics["zero_variance"] = drift, zero_var
    meta["full_task_metric"], meta["full_task_metric_differs_from_bfcl"] = full_task_metric(
        cfg.quality.judge, ev.max_steps_per_turn, len(heldout))
    with tempfile.TemporaryDirectory(dir=cache_dir(cfg)) as tmp:
        rj, rm = build_report(results, metrics_df=metrics_df, probe_df=probe_df, pivot_stats=probe.stats,
                              meta=meta, out_dir=tmp, statistics=statistics, sections=sections)
        record_evaluation(store, ekey, parts.pivot_frames, probes_key=probe.probes_key, train_key=train.train_key,
                          train_steps=int((train.summary or {}).get("steps") or 0), report_md=rm, reprobe=parts.reprobe)
        per_task_df.to_parquet(Path(tmp) / "full_task.parquet")
        local_df.to_parquet(Path(tmp) / "local.parquet")
        for f in sorted(Path(tmp).iterdir()):
            if f.name != "report.json":
                store.write_bytes(f"{ekey}/{f.name}", f.read_bytes())
        store.write_artifact(f"{ekey}/report.json", json.loads(Path(rj).read_text()), kind="report",
                             inputs={"policy": store.url(train.policy_key) if train.policy_key else "reference", "pivots": probe.pivots,
                                     "metrics": train.metrics, "trajectories": demos["trajectories"]},
                             config={"evaluation": ev.model_dump(mode="json")}, extra={"seeds": ev.seeds, "prompt_format": ref.prompt_format})
    return eval_result(store, ekey)


def eval_result(store: ArtifactStore, ekey: str) -> EvalResult:
    """The EvalResult of the report written under ``ekey``."""
    return EvalResult(ekey, store.url(f"{ekey}/report.json"), store.url(f"{ekey}/report.md"),
                      store.read_json(f"{ekey}/report.json"))

