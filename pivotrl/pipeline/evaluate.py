"""The evaluate stage: base, π_ref and the PivotRL policy on held-out tasks and states, and the report.

``stage_evaluate(cfg, store, demos, ref, probe, train) -> EvalResult``. The arithmetic over seeds
and categories lives in :mod:`pivotrl.evaluation.aggregate`, the report in
:mod:`pivotrl.evaluation.report`.
"""

from __future__ import annotations

import json
import tempfile
from pathlib import Path
from typing import Any, Mapping

import pandas as pd

from pivotrl.code_digest import stage_code_digest
from pivotrl.config import RunConfig, config_hash
from pivotrl.data.schema import content_hash
from pivotrl.pipeline.common import close_quietly, local_checkpoint, make_rollout_engine, make_verifier, prompt_kwargs, sampling_for
from pivotrl.pipeline.demos import cache_dir, read_histories, read_trajectories
from pivotrl.pipeline.reference import prompt_identity, reference_dir
from pivotrl.pipeline.results import EvalResult, ProbeResult, ReferenceResult, TrainResult
from pivotrl.precision import with_resolved_dtype
from pivotrl.rollouts import record_evaluation
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


def stage_evaluate(cfg: RunConfig, store: ArtifactStore, demos: Mapping[str, Any],
                   ref: ReferenceResult | Mapping[str, Any], probe: ProbeResult | Mapping[str, Any],
                   train: TrainResult | Mapping[str, Any]) -> EvalResult:
    """Evaluate base, π_ref and the PivotRL policy with the same seeds: full multi-turn tasks from
    scratch on held-out tasks, and local accuracy on held-out states and on the pivot set."""
    cfg = with_resolved_dtype(cfg)  # model.dtype: auto → bf16 | fp32 on this hardware
    ref, probe, train = ReferenceResult.of(ref), ProbeResult.of(probe), TrainResult.of(train)
    from pivotrl.data.bfcl import ensure_bfcl
    from pivotrl.data.states import frame_to_states
    from pivotrl.evaluation.full_task import evaluate_full_tasks
    from pivotrl.evaluation.local import evaluate_local
    from pivotrl.evaluation.comparison import compare_policies
    from pivotrl.evaluation.report import build_report
    from pivotrl.evaluation.trust import full_task_metric, out_of_domain_states, trust_sections
    from pivotrl.models import load_tokenizer
    from pivotrl.evaluation.drift import drift_markdown, drift_table, zero_variance_summary
    from pivotrl.evaluation.aggregate import accuracy_by_category, summarize_runs
    from pivotrl.pipeline.probe import probe_states, select_candidates

    ev = cfg.evaluation
    ekey = eval_key(cfg, demos, ref, train)
    if store.exists(f"{ekey}/report.json"):
        return _result(store, ekey)
    cache = cache_dir(cfg)
    bfcl_root = ensure_bfcl(cache)
    heldout = [t for t in read_trajectories(store, demos["key"], split="heldout") if t.env is not None]
    heldout = sorted(heldout, key=lambda t: t.id)[: ev.num_tasks]
    cand = store.read_parquet(f"{demos['key']}/candidates.parquet")
    n_local = max(min(ev.num_tasks * 4, 40), 32)  # held-out states for local accuracy (m samples each)
    hist = read_histories(store, demos["key"], cand.loc[cand["split"] == "heldout", "trajectory_id"])
    local_states = frame_to_states(select_candidates(cand, "heldout", n_local, cfg.run.seed, kinds=("call", "text_rule")),
                                   hist)
    # Stop decisions (BFCL's closing "Done.") are scored apart; text turns without a rule never.
    stop_states = frame_to_states(select_candidates(cand, "heldout", n_local, cfg.run.seed, kinds=("stop",)), hist)
    ood_states = out_of_domain_states(cfg, cache)  # BFCL categories never trained on
    pivots = frame_to_states(store.read_parquet(f"{probe.pivots_key}/pivots.parquet"))
    text_turn = {st.state_id: not st.demo_action.tool_calls for st in local_states}
    policies = {"base": Path(ref.base_dir),
                "reference": reference_dir(cfg, store, ref),
                "pivotrl": local_checkpoint(store, train.policy_key, cache) if train.policy_key
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
                res["local_by_category"] = {kind: accuracy_by_category(frame, text_turn)
                                            for kind, frame in (("greedy", ldf), ("sampled", sdf))}
                if ev.local_pivots:
                    pdf, psum = evaluate_local(engine, tok, pivots, verifier, sampling=samp, **lkw)
                    pivot_frames.append(pdf.assign(policy=name, seed=seed))
                    res.setdefault("local_pivot_runs", []).append(psum)
            summarize_runs(res, has_stop=bool(stop_states), has_ood=bool(ood_states), pivots=ev.local_pivots)
            results[name] = res
        # Pivot drift: the pivot set re-probed under the trained policy (last in `policies`), same m.
        reprobe = probe_states(engine, tok, pivots, verifier, num_probes=cfg.probing.num_probes,
                               sampling=sampling_for(cfg, n=cfg.probing.num_probes, temperature=cfg.probing.temperature,
                                                     seed=cfg.probing.seed, top_p=cfg.probing.top_p, top_k=cfg.probing.top_k),
                               max_context=cfg.model.max_context, max_tokens=cfg.rollout.max_tokens,
                               prompt_kwargs=prompt_kwargs(cfg), progress=False) if pivots else None
    finally:
        engine.close()
        close_quietly(verifier)
    metrics_df = store.read_parquet(f"{train.train_key}/metrics.parquet")
    probe_df = store.read_parquet(f"{probe.probes_key}/probes.parquet")
    meta = {"run": cfg.run.name, "config_hash": config_hash(cfg), "model_source": cfg.model.source,
            "note": "SmolLM2-135M-Instruct here is dequantised from a Q4_1 GGUF, not the original bf16 weights"
            if "smollm2" in cfg.model.source.lower() else "",
            "heldout_tasks": [t.id for t in heldout], "local_states": len(local_states), "pivots": len(pivots),
            "stop_decision_states": len(stop_states), "out_of_domain": list(cfg.quality.out_of_domain),
            "out_of_domain_states": len(ood_states),
            "sft": ref.sft, "training": train.summary}
    per_task_df, local_df = pd.concat(per_task), pd.concat(local_frames)
    statistics = compare_policies(per_task_df, local_df, list(policies), seed=cfg.run.seed)
    sections = trust_sections(cfg, demos.get("counts") or {}, heldout, bfcl_total=200)
    drift = None if reprobe is None else drift_table(reprobe, cfg.probing.lambda_diff)
    pivot_mus = [float(x) for x in store.read_parquet(f"{probe.pivots_key}/pivots.parquet").get("mu", [])]
    zero_var = zero_variance_summary(metrics_df, cfg.training.group_size, pivot_mus)
    sections += drift_markdown(drift, zero_var, cfg.probing.num_probes)
    statistics["pivot_drift"], statistics["zero_variance"] = drift, zero_var
    meta["full_task_metric"], meta["full_task_metric_differs_from_bfcl"] = full_task_metric(
        cfg.quality.judge, ev.max_steps_per_turn, len(heldout))
    with tempfile.TemporaryDirectory(dir=cache) as tmp:
        rj, rm = build_report(results, metrics_df=metrics_df, probe_df=probe_df, pivot_stats=probe.stats,
                              meta=meta, out_dir=tmp, statistics=statistics, sections=sections)
        record_evaluation(store, ekey, pivot_frames, probes_key=probe.probes_key, train_key=train.train_key,
                          train_steps=int((train.summary or {}).get("steps") or 0), report_md=rm, reprobe=reprobe)
        per_task_df.to_parquet(Path(tmp) / "full_task.parquet")
        local_df.to_parquet(Path(tmp) / "local.parquet")
        for f in sorted(Path(tmp).iterdir()):
            if f.name != "report.json":
                store.write_bytes(f"{ekey}/{f.name}", f.read_bytes())
        store.write_artifact(f"{ekey}/report.json", json.loads(Path(rj).read_text()), kind="report",
                             inputs={"policy": store.url(train.policy_key) if train.policy_key else "reference", "pivots": probe.pivots,
                                     "metrics": train.metrics, "trajectories": demos["trajectories"]},
                             config={"evaluation": ev.model_dump(mode="json")}, extra={"seeds": ev.seeds, "prompt_format": ref.prompt_format})
    return _result(store, ekey)


def _result(store: ArtifactStore, ekey: str) -> EvalResult:
    return EvalResult(ekey, store.url(f"{ekey}/report.json"), store.url(f"{ekey}/report.md"),
                      store.read_json(f"{ekey}/report.json"))

