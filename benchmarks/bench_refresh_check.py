"""The refresh check's statistic on real states: the rollout engine's and the trainer's log-probs of
sampled actions under the same weights, per action and pooled over a group's actions.

Usage::

    python benchmarks/bench_refresh_check.py --config CONFIG --model DIR --pivots PIVOTS.parquet
        [--set KEY=VALUE ...] [--states 8] [--samples 4] [--json OUT]

``--model``: a policy checkpoint directory (e.g. a run's warm start, ``<root>/models/warm_start/<key>``);
``--pivots``: a pivot table of the same run (``<root>/pivots/<key>/pivots.parquet``). The first
``--states`` pivot states are rendered as the run renders them, ``--samples`` actions are sampled
per state at temperature 1 on the configured engine and dtype, and each action is scored by the
engine (:func:`pivotrl.rollout.pool.refresh_delta`) and by the trainer built as the train stage
builds it. Nothing is trained, so every difference is the two kernels' own (no refresh is
involved): the floor the check's tolerance (``pivotrl.training.refresh_check.check_refresh``) must clear.
Reported: per action the prompt and action lengths, max and mean |Δ| per token; over the actions
the distribution of the one-action mean (the check before it pooled), per state the mean pooled
over that state's actions (the scored check: a group's actions after one prompt), and the engine's
own sampling log-probs of the same actions against the trainer's, pooled over every action of every
state (the check read from a batch, ``pivotrl.training.refresh_check.batch_check``).
"""

from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import header, load1, md_table, write_json  # noqa: E402


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--config", required=True)
    ap.add_argument("--model", required=True)
    ap.add_argument("--pivots", required=True)
    ap.add_argument("--set", action="append", default=[], dest="overrides")
    ap.add_argument("--states", type=int, default=8)
    ap.add_argument("--samples", type=int, default=4)
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)

    import pandas as pd

    from pivotrl.config import load_config
    from pivotrl.data.states import frame_to_states
    from pivotrl.format.prompts import encode_state
    from pivotrl.pipeline.common import make_rollout_engine, prompt_kwargs
    from pivotrl.rollout import SamplingConfig
    from pivotrl.rollout.pool import refresh_delta
    from pivotrl.runtime.models import load_tokenizer
    from pivotrl.runtime.precision import with_resolved_dtype
    from pivotrl.training.pivotrl import PivotRLTrainer

    print(header("The refresh check's statistic on real states, same weights", sys.argv))
    cfg = with_resolved_dtype(load_config(args.config, args.overrides))
    states = frame_to_states(pd.read_parquet(args.pivots))[: args.states]
    tok = load_tokenizer(args.model)
    prompts = [encode_state(s, tok, max_len=cfg.model.max_context - cfg.rollout.max_tokens, **prompt_kwargs(cfg))
               for s in states]
    engine = make_rollout_engine(cfg, args.model)
    try:
        gens = engine.generate(prompts, SamplingConfig(n=args.samples, temperature=1.0,
                                                       max_tokens=cfg.rollout.max_tokens, seed=cfg.run.seed))
        trainer = PivotRLTrainer.for_run(cfg, args.model)
        rows, pooled, sampled = [], [], []
        for s, p, group in zip(states, prompts, gens):
            actions = [g.token_ids for g in group if g.token_ids]
            lps = trainer.group_logprobs(p, actions)
            sampled += [abs(float(e) - float(t)) for g, lp in zip([g for g in group if g.token_ids], lps)
                        for e, t in zip(g.rollout_logprobs, lp)]
            for a, lp in zip(actions, lps):
                d_max, d_mean = refresh_delta(engine, p, [a], [lp])
                rows.append({"state": s.state_id, "prompt_len": len(p), "action_len": len(a),
                             "max_abs_delta": d_max, "mean_abs_delta": d_mean})
            pooled.append({"state": s.state_id, **dict(zip(("max_abs_delta", "mean_abs_delta"),
                                                            refresh_delta(engine, p, actions, lps)))})
    finally:
        engine.close()
    means = [r["mean_abs_delta"] for r in rows]
    group_means = [r["mean_abs_delta"] for r in pooled]
    summary = {"dtype": cfg.model.dtype, "actions": len(rows), "states": len(pooled),
               "one_action_mean": {"median": statistics.median(means), "max": max(means)},
               "group_mean": {"median": statistics.median(group_means), "max": max(group_means)},
               "max_abs_delta": max(r["max_abs_delta"] for r in rows),
               "batch_sampled": {"tokens": len(sampled), "mean": sum(sampled) / max(len(sampled), 1),
                                 "max": max(sampled, default=0.0)},
               "load1": load1()}
    print(md_table(["state", "prompt tok", "action tok", "max |Δ|", "mean |Δ|"],
                   [(r["state"], r["prompt_len"], r["action_len"], f"{r['max_abs_delta']:.4f}",
                     f"{r['mean_abs_delta']:.4f}") for r in rows]))
    print(md_table(["state", "group max |Δ|", "group mean |Δ| (pooled)"],
                   [(r["state"], f"{r['max_abs_delta']:.4f}", f"{r['mean_abs_delta']:.4f}") for r in pooled]))
    print(summary)
    if args.json:
        write_json(args.json, {"summary": summary, "actions": rows, "groups": pooled})


if __name__ == "__main__":
    main()
