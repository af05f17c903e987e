"""The comparison's evaluation and report: π_ref, PivotRL, SFT and E2E RL side by side.

All four policies are evaluated by one engine (weights swapped), with the same seeds, the same
judge (``quality.judge``), on the same held-out tasks (full task from scratch), the same held-out
states (local accuracy, greedy), the held-out split's stop decisions where it has any (SFT imitates
every demonstrated turn, stop turns included; PivotRL trains on pivots) and the same out-of-domain
states (``quality.out_of_domain``). The
report (``compare/eval/<key>/report.json`` + ``report.md``) holds:

* per method: local accuracy, per-turn pass rate (turns passed / turns) and full-task success,
  each with n and a 95% interval, and paired tests between every two methods
  (:func:`pivotrl.evaluation.comparison.compare_policies`);
* the cost ledger of each method's training, and of its evaluation, summed;
* cost per point of gain over π_ref: generated tokens, model calls and trainer tokens per
  percentage point of full-task success (and of local accuracy) gained; "n/a" without a gain;
* one sentence per claim of the paper, decided by the paired tests at this scale;
* claim 3 read from the held-out curves too (:func:`~pivotrl.evaluation.turn_curves.turns_to_target`): PivotRL's and E2E RL's
  greedy accuracy on the same held-out states against the rollout turns each had sampled (model
  calls: PivotRL's probe and training samples, E2E RL's model calls in episodes), the turns each
  needed to reach π_ref + the smaller of their final gains, and their ratio, with both curves in
  one plot (``turn_curves.png``, :func:`pivotrl.evaluation.plots.plot_turn_curves`);
* with ``compare.sft_budget = wall_time`` a fifth policy, ``sft_wall`` (SFT at PivotRL's wall
  time; ``sft`` stays SFT at PivotRL's optimiser steps), evaluated the same way; claims 1 and 2
  give PivotRL − SFT at both.

A policy whose tensors equal an earlier one's (:func:`same_weights`; E2E RL that never updated is
π_ref) is not sampled again: it takes its twin's per-item results, and ``meta.same_weights`` and
the report say so.
"""

from __future__ import annotations

import tempfile
from pathlib import Path
from typing import Any, Mapping

import pandas as pd

from pivotrl.config import RunConfig
from pivotrl.core.hashing import content_hash
from pivotrl.evaluation.comparison import difference_ci, oriented_pair, signed
from pivotrl.runtime.ledger import CostLedger
from pivotrl.bfcl.wheel import ensure_bfcl
from pivotrl.evaluation.comparison import compare_policies
from pivotrl.evaluation.turn_curves import NAMES as _NAMES, turns_markdown as _turns_md, turns_to_target
from pivotrl.runtime.models import load_tokenizer
from pivotrl.pipeline.common import close_quietly, local_checkpoint, make_rollout_engine, make_verifier
from pivotrl.pipeline.compare import compare_code_digest, pivotrl_ledger
from pivotrl.pipeline.demos import cache_dir
from pivotrl.pipeline.evaluate import EvalStates, StateParts, heldout_tasks, policy_state_results, policy_task_frames
from pivotrl.pipeline.reference import reference_dir
from pivotrl.pipeline.results import ProbeResult
from pivotrl.storage import ArtifactStore

__all__ = ["cached_compare_evaluate", "claims", "compare_eval_key", "cost_per_point", "same_weights",
           "stage_compare_evaluate"]

METHODS = ("reference", "pivotrl", "sft", "e2e")
#: The SFT policy at PivotRL's wall time (``compare.sft_budget = wall_time``), evaluated after METHODS.
SFT_WALL = "sft_wall"
#: The plot of both held-out curves against rollout turns, beside report.md.
TURNS_PLOT = "turn_curves.png"
#: A curve point reaches the target when its accuracy is at least the target less this (float noise).
#: The state-level measures of the comparison (:data:`pivotrl.pipeline.evaluate.STATE_MEASURES`).
COMPARE_MEASURES = ("heldout_greedy", "stop_decisions_greedy", "out_of_domain_greedy")


def _rate(stats: Mapping[str, Any], *path: str) -> float | None:
    node: Any = stats
    for p in path:
        node = (node or {}).get(p)
    return None if node is None else node.get("rate")


def _success(stats: Mapping[str, Any], p: str) -> float | None:
    return _rate(((stats.get("full_task") or {}).get("per_policy") or {}).get(p) or {}, "task_success")


def _local_acc(stats: Mapping[str, Any], p: str) -> float | None:
    block = ((stats.get("local") or {}).get("heldout_greedy") or {}).get("per_policy") or {}
    return (block.get(p) or {}).get("rate")


def cost_per_point(ledgers: Mapping[str, CostLedger], stats: Mapping[str, Any]) -> dict[str, Any]:
    """Per method: cost per percentage point gained over π_ref in full-task success and local
    accuracy (generated tokens, model calls, trainer tokens, wall seconds); None without a gain."""
    out: dict[str, Any] = {}
    for m, led in ledgers.items():
        row: dict[str, Any] = {}
        for name, get in (("full_task_success", _success), ("local_accuracy", _local_acc)):
            ref, mine = get(stats, "reference"), get(stats, m)
            gain = None if ref is None or mine is None else 100.0 * (mine - ref)
            ok = gain is not None and gain > 0
            row[name] = {"gain_points": gain,
                         **{f"{c}_per_point": (getattr(led, c) / gain if ok else None)
                            for c in ("generated_tokens", "model_calls", "trainer_tokens")},
                         "wall_s_per_point": led.total_wall_s / gain if ok else None}
        out[m] = row
    return out


def _verdict(d: dict[str, Any] | None, label: str) -> str:
    if d is None:
        return f"{label}: not evaluated"
    return (f"{label} {signed(d['difference'])} (n = {d['n']}, {difference_ci(d)}, {d['test']}, p = {d['p_value']:.3g}, "
            f"{d['verdict']})")


def claims(stats: Mapping[str, Any], ledgers: Mapping[str, CostLedger], turns: Mapping[str, Any] | None = None,
           sft: Mapping[str, Any] | None = None) -> list[str]:
    """One sentence per claim of the paper, decided at this run's scale by the paired tests.

    ``turns``: :func:`~pivotrl.evaluation.turn_curves.turns_to_target`'s reading, added to claim 3. ``sft``: the SFT baseline's
    summary; when ``stats`` hold the ``sft_wall`` policy, claims 1 and 2 add PivotRL − SFT at
    matched wall time (SFT's steps and seconds from it) to the matched optimiser steps."""
    local = stats.get("local") or {}
    full = stats.get("full_task")
    ind = oriented_pair(local.get("heldout_greedy"), "pivotrl", "sft")
    ood = oriented_pair(local.get("out_of_domain_greedy"), "pivotrl", "sft")
    e2e = oriented_pair(full, "pivotrl", "e2e", "task_success")

    def holds(d: dict[str, Any] | None) -> str:
        if d is None:
            return "cannot be checked"
        return "holds" if d["difference"] > 0 and d["p_value"] < 0.05 else "is not shown"

    def at_wall(kind: str, label: str) -> str:
        d = oriented_pair(local.get(kind), "pivotrl", SFT_WALL)
        if d is None:
            return ""
        s = sft or {}
        return (f"; at matched wall time (SFT {s.get('wall_steps', '?')} steps in {s.get('wall_s', 0):.0f} s against "
                f"PivotRL's {s.get('budget_wall_s', 0):.0f} s) it {holds(d)}: " + _verdict(d, label))

    calls_p, calls_e = ledgers["pivotrl"].model_calls, ledgers["e2e"].model_calls
    tok_p, tok_e = ledgers["pivotrl"].generated_tokens, ledgers["e2e"].generated_tokens
    spent = (f"E2E RL made {calls_e} model calls ({tok_e} generated tokens), PivotRL {calls_p} "
             f"({tok_p}) in probing and training")
    if e2e is None:
        third = "cannot be checked"
    elif e2e["difference"] < 0 and e2e["p_value"] < 0.05:
        third = "does not hold (E2E RL is significantly better)"
    elif calls_p >= calls_e:
        third = (f"is not shown: PivotRL used {calls_p / calls_e:.1f}× E2E RL's model calls, not fewer"
                 if calls_e else "cannot be checked (E2E RL made no model call)")
    else:
        fewer = f"{calls_e / calls_p:.1f}× fewer model calls"
        third = (f"holds ({fewer}, significantly higher success)" if e2e["difference"] > 0 and e2e["p_value"] < 0.05
                 else f"is not contradicted ({fewer}, no significant difference in success)")
    steps = " at matched optimiser steps" if oriented_pair(local.get("heldout_greedy"), "pivotrl", SFT_WALL) else ""
    curve = f"; {turns['sentence']}" if turns else ""
    return [
        f"1. PivotRL beats SFT in-domain (the paper: +4.17 points): {holds(ind)} here{steps}; "
        + _verdict(ind, "PivotRL − SFT, held-out local accuracy")
        + at_wall("heldout_greedy", "PivotRL − SFT (wall), held-out local accuracy") + ".",
        f"2. PivotRL retains out-of-domain accuracy better than SFT (the paper: +10.04 points): {holds(ood)} here"
        f"{steps}; " + _verdict(ood, "PivotRL − SFT, out-of-domain local accuracy")
        + at_wall("out_of_domain_greedy", "PivotRL − SFT (wall), out-of-domain local accuracy") + ".",
        f"3. PivotRL reaches end-to-end RL's full-task success with fewer rollout turns (the paper: 4× fewer): "
        f"{third}; {spent}; " + _verdict(e2e, "PivotRL − E2E RL, full-task success") + curve + ".",
    ]


def _e2e_budget(e2e: dict[str, Any]) -> str:
    """One phrase: what the E2E RL baseline matched with PivotRL, and what it spent."""
    capped = "" if e2e.get("budget_reached", True) else ", stopped by compare.e2e_max_steps"
    if e2e.get("budget") == "wall_time":
        return (f"same wall time as PivotRL's probing and training ({e2e.get('budget_wall_s', 0):.0f} s; E2E RL "
                f"spent {e2e.get('wall_s', 0):.0f} s in {e2e.get('steps', 0)} steps)")
    if e2e.get("budget") == "rollout_turns":
        return (f"same rollout turns as PivotRL's probing and training ({e2e.get('budget_model_calls', 0)} model "
                f"calls; E2E RL made {e2e.get('model_calls', 0)} in {e2e.get('steps', 0)} steps{capped})")
    return (f"same generated tokens as PivotRL's probing and training ({e2e.get('budget_tokens', 0)}; E2E RL "
            f"generated {e2e.get('generated_tokens', 0)} in {e2e.get('steps', 0)} steps{capped})")


def _sft_budget(sft: dict[str, Any]) -> str:
    """One phrase: what the SFT baseline matched with PivotRL (its two policies with wall_time)."""
    steps = f"same optimiser steps as PivotRL ({sft.get('target_steps', 0)})"
    if sft.get("budget") != "wall_time":
        return steps
    return (f"{steps} for `sft`, and PivotRL's probing and training wall time for `{SFT_WALL}` "
            f"({sft.get('budget_wall_s', 0):.0f} s; SFT spent {sft.get('wall_s', 0):.0f} s in its optimiser steps, "
            f"{sft.get('wall_steps', 0)} steps" + ("" if sft.get("wall_reached", True)
                                                   else ", stopped by compare.sft_max_steps") + ")")


def _md(stats: dict[str, Any], ledgers: dict[str, dict[str, Any]], cpp: dict[str, Any], sentences: list[str],
        meta: dict[str, Any], turns: Mapping[str, Any] | None = None, turns_plot: str | None = None) -> str:
    from pivotrl.evaluation.comparison import comparison_markdown

    lines = ["# PivotRL vs SFT vs end-to-end RL", "",
             f"Same π_ref (hash {meta['reference_hash'][:12]}), seeds {meta['seeds']}, judge {meta['judge']}; "
             f"{len(meta['heldout_tasks'])} held-out tasks, {meta['local_states']} held-out states, "
             f"{meta['ood_states']} out-of-domain states. SFT budget: {_sft_budget(meta.get('sft') or {})}; "
             f"E2E RL budget: {_e2e_budget(meta.get('e2e') or {})}.", ""]
    twins = meta.get("same_weights") or {}
    if twins:
        lines += ["Same weights, so the same policy (its measures are the other's draws, not sampled again): "
                  + ", ".join(f"`{a}` = `{b}`" for a, b in twins.items()) + ".", ""]
    lines += ["## The paper's claims at this scale", "", *sentences, ""]
    lines += _turns_md(turns, turns_plot)
    lines += comparison_markdown(stats)
    cols = ["model_calls", "generated_tokens", "tool_executions", "tool_retries", "verifier_executions",
            "trainer_tokens", "trainer_tokens_naive", "reference_tokens", "optimizer_steps"]
    lines += ["## Cost ledger (training; evaluation apart)", "",
              "| method | " + " | ".join(cols) + " | wall s | peak MiB |", "|---" * (len(cols) + 3) + "|"]
    for m, d in ledgers.items():
        led = CostLedger.from_dict(d)
        lines.append(f"| {m} | " + " | ".join(str(getattr(led, c)) for c in cols)
                     + f" | {led.total_wall_s:.1f} | "
                     + (f"{led.peak_memory_bytes / 2**20:.0f} |" if led.peak_memory_bytes else "not measured |"))
    lines += ["", "## Cost per point of gain over π_ref", "",
              "| method | measure | gain (points) | generated tokens / point | model calls / point | trainer tokens / point |",
              "|---|---|---|---|---|---|"]

    def f(x: Any) -> str:
        return "n/a" if x is None else f"{x:.1f}" if isinstance(x, float) else str(x)

    for m, row in cpp.items():
        for measure, r in row.items():
            lines.append(f"| {m} | {measure} | {f(r['gain_points'])} | {f(r['generated_tokens_per_point'])} | "
                         f"{f(r['model_calls_per_point'])} | {f(r['trainer_tokens_per_point'])} |")
    return "\n".join(lines) + "\n"


def _pivotrl_curve(store: ArtifactStore, train: dict[str, Any]) -> list[dict[str, Any]]:
    """PivotRL's held-out curve points (with their rollout turns) from its training metrics; []
    without metrics or a curve."""
    from pivotrl.evaluation.learning_curve import learning_curve

    key = f"{train['train_key']}/metrics.parquet"
    if not store.exists(key):
        return []
    return (learning_curve(store.read_parquet(key)) or {}).get("heldout", [])


def same_weights(policies: Mapping[str, str | Path]) -> dict[str, str]:
    """Policy → the earlier policy (in ``policies``' order) whose checkpoint holds the same tensors
    (:func:`~pivotrl.runtime.models.weights_hash`); policies without such a twin are absent.

    One engine serves every policy of the comparison by swapping tensors in, so a twin is the same
    policy: its measures are its twin's draws (same items, seeds and engine), not sampled again.
    End-to-end RL whose groups all had Â = 0 never updates and exports π_ref's tensors; so does a
    run that trained nothing."""
    from pivotrl.runtime.models import weights_hash

    first: dict[str, str] = {}
    twins: dict[str, str] = {}
    for name, mdir in policies.items():
        twin = first.setdefault(weights_hash(mdir), name)
        if twin != name:
            twins[name] = twin
    return twins


def compare_eval_key(cfg: RunConfig, demos: dict[str, Any], ref: dict[str, Any], train: dict[str, Any],
                     sft: dict[str, Any], e2e: dict[str, Any]) -> str:
    """``compare/eval/<16 hex>``: the demonstrations' key, π_ref's hash, the PivotRL, SFT and E2E
    runs' keys, ``evaluation``, ``compare.num_tasks``, ``quality``, ``rollout`` and the code. Reads
    nothing (the task computes it before a stage process starts)."""
    return "compare/eval/" + content_hash({"demos": demos["key"], "ref": ref["ref_hash"], "train": train["train_key"],
                                           "sft": sft["key"], "e2e": e2e["key"],
                                           "evaluation": cfg.evaluation.model_dump(mode="json"),
                                           "num_tasks": cfg.compare.num_tasks,
                                           "quality": cfg.quality.model_dump(mode="json"),
                                           "rollout": cfg.rollout.model_dump(mode="json"), "code": compare_code_digest("pivotrl.pipeline.compare_eval")})[:16]


def cached_compare_evaluate(cfg: RunConfig, store: ArtifactStore, demos: dict[str, Any], ref: dict[str, Any],
                            train: dict[str, Any], sft: dict[str, Any], e2e: dict[str, Any]) -> dict[str, Any] | None:
    """The result of :func:`stage_compare_evaluate` if its report exists under its key, else None."""
    key = compare_eval_key(cfg, demos, ref, train, sft, e2e)
    if not store.exists(f"{key}/report.json"):
        return None
    return {"key": key, "report_json": store.url(f"{key}/report.json"), "report_md": store.url(f"{key}/report.md"),
            "report": store.read_json(f"{key}/report.json")}


def stage_compare_evaluate(cfg: RunConfig, store: ArtifactStore, demos: dict[str, Any], ref: dict[str, Any],
                           probe: dict[str, Any], train: dict[str, Any], sft: dict[str, Any],
                           e2e: dict[str, Any]) -> dict[str, Any]:
    """Evaluate the four policies (five with SFT's wall-time policy; see the module docstring);
    returns {"key", "report_json", "report_md", "report"}. The report's ``items`` lists the task and
    state ids each policy saw; ``turns_to_target`` holds claim 3's reading of the held-out curves."""
    ev = cfg.evaluation
    key = compare_eval_key(cfg, demos, ref, train, sft, e2e)
    hit = cached_compare_evaluate(cfg, store, demos, ref, train, sft, e2e)
    if hit is not None:
        return hit
    cache = cache_dir(cfg)
    bfcl_root = ensure_bfcl(cache)
    # The evaluate stage's selection and per-policy measures, over the four methods.
    heldout = heldout_tasks(cfg, store, demos, limit=cfg.compare.num_tasks or ev.num_tasks)
    states = EvalStates.select(cfg, store, demos, ProbeResult.of(probe))
    rdir = reference_dir(cfg, store, ref)
    policies = {"reference": rdir,
                "pivotrl": local_checkpoint(store, train["policy_key"], cache) if train["policy_key"] else rdir,
                "sft": local_checkpoint(store, sft["policy_key"], cache),
                "e2e": local_checkpoint(store, e2e["policy_key"], cache)}
    if sft.get("policy_wall_key"):  # compare.sft_budget = wall_time: SFT at PivotRL's wall time too
        policies[SFT_WALL] = local_checkpoint(store, sft["policy_wall_key"], cache)
    methods = tuple(policies)
    twins = same_weights(policies)
    tok = load_tokenizer(rdir)
    verifier = make_verifier(cfg, bfcl_root, tok)
    engine = make_rollout_engine(cfg, rdir)
    per_task, eval_ledgers = [], {}
    parts = StateParts(states.counts())
    task_frames: dict[str, list[pd.DataFrame]] = {}
    state_frames: dict[str, list[pd.DataFrame]] = {}
    try:
        for name, mdir in policies.items():
            led = CostLedger(name=f"{name}-eval")
            if name in twins:  # the same weights as a policy already measured: its draws, relabelled
                twin = twins[name]
                task_frames[name] = [df.assign(policy=name) for df in task_frames[twin]]
                state_frames[name] = [df.assign(policy=name) for df in state_frames[twin]]
                per_task += task_frames[name]
                parts.local_frames += state_frames[name]
                parts.results[name] = parts.results[twin]
                eval_ledgers[name] = led
                continue
            engine.load_weights(str(mdir))
            with led.stage("full_task"):
                frames = policy_task_frames(cfg, engine, tok, heldout, bfcl_root, name)
            for df in frames:
                led.add(model_calls=int(df["model_calls"].sum()), generated_tokens=int(df["tokens_generated"].sum()),
                        tool_executions=int(df["tool_calls"].sum()))
            per_task += frames
            task_frames[name] = frames
            seen = len(parts.local_frames)
            with led.stage("local"):
                policy_state_results(cfg, engine, tok, states, verifier, name, parts, measures=COMPARE_MEASURES)
            state_frames[name] = parts.local_frames[seen:]
            for ldf in state_frames[name]:
                calls = int(ldf["n_samples"].fillna(0).sum()) if len(ldf) else 0
                led.add(model_calls=calls, verifier_executions=calls,
                        generated_tokens=int(ldf["tokens_generated"].fillna(0).sum()) if len(ldf) else 0)
            eval_ledgers[name] = led
    finally:
        engine.close()
        close_quietly(verifier)
    local_states, ood_states = states.local, states.ood
    local_frames = [f for f in parts.local_frames if len(f)]
    per_task_df, local_df = pd.concat(per_task), pd.concat(local_frames) if local_frames else None
    stats = compare_policies(per_task_df, local_df, list(methods), seed=cfg.run.seed)
    train_ledgers = {"reference": CostLedger(name="reference"),
                     "pivotrl": pivotrl_ledger(cfg, store, probe, train, ref),
                     "sft": CostLedger.from_dict(sft["ledger"]), "e2e": CostLedger.from_dict(e2e["ledger"])}
    if SFT_WALL in policies:
        train_ledgers[SFT_WALL] = CostLedger.from_dict(sft["ledger_wall"])
    turns = turns_to_target(_pivotrl_curve(store, train), e2e["summary"].get("heldout_curve") or [],
                            budget_turns=e2e["summary"].get("budget_model_calls")
                            if e2e["summary"].get("budget") == "rollout_turns" else None)
    sentences = claims(stats, train_ledgers, turns, sft["summary"])
    cpp = cost_per_point({m: train_ledgers[m] for m in methods if m != "reference"}, stats)
    items = {name: {"tasks": sorted(set(per_task_df.loc[per_task_df["policy"] == name, "task_id"])),
                    "states": sorted(set(local_df.loc[local_df["policy"] == name, "state_id"])) if local_df is not None else []}
             for name in methods}
    meta = {"reference_hash": ref["ref_hash"], "seeds": list(ev.seeds), "judge": cfg.quality.judge,
            "heldout_tasks": [t.id for t in heldout], "local_states": len(local_states), "ood_states": len(ood_states),
            "start_hashes": {"sft": sft["summary"]["start_hash"], "e2e": e2e["summary"]["start_hash"]},
            "same_weights": twins,
            "sft": sft["summary"], "e2e": e2e["summary"]}
    ledgers = {m: train_ledgers[m].to_dict() for m in methods}
    totals = {m: (train_ledgers[m] + eval_ledgers[m]).to_dict() for m in methods}
    plots: dict[str, str] = {}
    if any(turns["curves"].values()):  # the plot of whatever curve has rollout turns
        from pivotrl.evaluation.plots import plot_turn_curves, png_bytes

        store.write_bytes(f"{key}/{TURNS_PLOT}", png_bytes(lambda fig: plot_turn_curves(
            fig, {_NAMES[m]: c for m, c in turns["curves"].items()}, target=turns["target"],
            budget=turns["budget_turns"]), size=(8, 4.5)))
        plots["turn_curves"] = TURNS_PLOT
    report = {"meta": meta, "statistics": stats, "ledgers": ledgers, "evaluation_ledgers":
              {m: led.to_dict() for m, led in eval_ledgers.items()}, "ledger_totals": totals,
              "ledger_sum": CostLedger.total([CostLedger.from_dict(d) for d in totals.values()]).to_dict(),
              "cost_per_point": cpp, "claims": sentences, "turns_to_target": turns, "plots": plots,
              "items": items}
    with tempfile.TemporaryDirectory(dir=cache) as tmp:
        per_task_df.to_parquet(Path(tmp) / "full_task.parquet")
        store.write_bytes(f"{key}/full_task.parquet", (Path(tmp) / "full_task.parquet").read_bytes())
        if local_df is not None:
            local_df.to_parquet(Path(tmp) / "local.parquet")
            store.write_bytes(f"{key}/local.parquet", (Path(tmp) / "local.parquet").read_bytes())
    for m in methods:  # each method's ledger (training + this evaluation) beside the report, with a manifest
        store.write_artifact(f"{key}/ledgers/{m}.json", {"training": ledgers[m], "evaluation": eval_ledgers[m].to_dict(),
                                                        "total": totals[m]}, kind="cost_ledger",
                             inputs={"trajectories": demos["trajectories"]}, config={"compare": cfg.compare.model_dump(mode="json")})
    store.write_text(f"{key}/report.md", _md(stats, ledgers, cpp, sentences, meta, turns, plots.get("turn_curves")))
    store.write_artifact(f"{key}/report.json", report, kind="comparison_report",
                         inputs={"sft": store.url(sft["policy_key"]), "e2e": store.url(e2e["policy_key"]),
                                 "pivotrl": store.url(train["policy_key"]) if train.get("policy_key")
                                 else store.url(f"{train['train_key']}/summary.json"),
                                 "trajectories": demos["trajectories"]},
                         config={"evaluation": ev.model_dump(mode="json"), "compare": cfg.compare.model_dump(mode="json")})
    return {"key": key, "report_json": store.url(f"{key}/report.json"), "report_md": store.url(f"{key}/report.md"),
            "report": store.read_json(f"{key}/report.json")}
