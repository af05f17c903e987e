"""Does end-to-end RL have a learning signal on a run's tasks? π_ref's episodes, K per task, judged.

Usage::

    python benchmarks/bench_e2e_signal.py --config CONFIG [--set KEY=VALUE ...]
        [--group-sizes 4,16] [--tasks 24] [--json OUT]

End-to-end GRPO (``pivotrl.training.e2e``) updates the policy only through groups whose K episodes of
one task differ in reward: with equal rewards every advantage is 0 and the step is skipped. This
plays the pivot split's tasks (the baseline's training tasks, ``--tasks`` of them in a seeded
order) with the run's π_ref exactly as the baseline's rollout does
(:func:`pivotrl.training.e2e.collect_episodes`: temperature 1, the run's renderer, parser, judge and
step limit), K episodes per task for every K of ``--group-sizes``, and reports per K: the share of
groups with a reward variance under each reward of :data:`pivotrl.training.e2e.E2E_REWARDS`, how
many distinct texts a task's K episodes produced (first model call; whole episode), the turns
passed (the per-turn reward's numerator) as a histogram over the K·tasks episodes, and (in the JSON
and the log) which turns are passed: tasks whose first turn has no demonstrated call, tasks whose
first turn every episode passes, episodes that pass a turn with calls. No training.

The run's demonstrations and reference stages must be cached (``pivotrl probe`` or ``pivotrl run``
with the same config and overrides first); the script says so and stops otherwise.
"""

from __future__ import annotations

import argparse
import random
import sys
from collections import Counter
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import header, load1, md_table, write_json  # noqa: E402


def group_stats(groups: list[list], rewards: tuple[str, ...]) -> dict:
    """Signal statistics of K-episode groups (each a list of ``Episode``): per reward kind the share
    of groups whose rewards are not all equal, the mean number of distinct first-call and whole-episode
    texts per group (by generated token ids) and the histogram of turns passed; rewards as the
    baseline gives them (:func:`pivotrl.training.e2e.episode_reward`)."""
    from pivotrl.training.e2e import episode_reward

    out: dict = {"groups": len(groups), "episodes": sum(len(g) for g in groups)}
    for kind in rewards:
        rewards_by_group = [[episode_reward(e.success, e.turns_passed, e.n_turns, kind) for e in g] for g in groups]
        out[f"varied_{kind}"] = sum(len(set(r)) > 1 for r in rewards_by_group)
        out[f"mean_reward_{kind}"] = sum(map(sum, rewards_by_group)) / max(1, out["episodes"])
    first = [len({tuple(e.calls[0][1]) if e.calls else () for e in g}) for g in groups]
    whole = [len({tuple(tuple(a) for _, a in e.calls) for e in g}) for g in groups]
    out["distinct_first_call"] = sum(first) / max(1, len(groups))
    out["distinct_episode"] = sum(whole) / max(1, len(groups))
    out["model_calls"] = sum(len(e.calls) for g in groups for e in g)
    out["turns_passed"] = dict(sorted(Counter(e.turns_passed for g in groups for e in g).items()))
    return out


def call_turns_passed(groups: list[list], tasks: list) -> dict:
    """Which turns the episodes pass: per task (in ``tasks``' order, one group each) whether its first
    user turn has demonstrated calls, and how many of its episodes passed a turn that has them (the
    turns passed from the start, counted against the demonstration's turns). → counts over tasks."""
    from pivotrl.evaluation.task_env import split_user_turns

    out = {"tasks_first_turn_without_calls": 0, "tasks_first_turn_passed_by_all": 0, "of_those_without_calls": 0,
           "episodes_passing_a_call_turn": 0, "episodes": 0}
    for task, group in zip(tasks, groups):
        _, turns = split_user_turns(task)
        no_call = not turns[0].demo_calls
        everyone = all(e.turns_passed >= 1 for e in group)
        out["tasks_first_turn_without_calls"] += no_call
        out["tasks_first_turn_passed_by_all"] += everyone
        out["of_those_without_calls"] += everyone and no_call
        out["episodes"] += len(group)
        out["episodes_passing_a_call_turn"] += sum(any(t.demo_calls for t in turns[: e.turns_passed]) for e in group)
    return out


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--config", required=True)
    ap.add_argument("--set", action="append", default=[], dest="overrides")
    ap.add_argument("--group-sizes", default="4,16", help="comma-separated K values")
    ap.add_argument("--tasks", type=int, default=24, help="pivot-split tasks played (seeded order)")
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)
    sizes = [int(k) for k in args.group_sizes.split(",") if k]
    if not sizes or min(sizes) < 2:
        ap.error("--group-sizes: K values of at least 2")

    import time

    from pivotrl.bfcl.wheel import ensure_bfcl
    from pivotrl.config import load_config
    from pivotrl.pipeline.common import make_rollout_engine, make_store, prompt_kwargs
    from pivotrl.pipeline.demos import cache_dir, cached_demonstrations, read_trajectories
    from pivotrl.pipeline.reference import cached_reference, reference_dir
    from pivotrl.runtime.models import load_tokenizer
    from pivotrl.runtime.precision import with_resolved_dtype
    from pivotrl.training.e2e import E2E_REWARDS, E2ESettings, collect_episodes

    print(header("End-to-end RL's signal on a run's pivot-split tasks (π_ref, no training)", sys.argv))
    cfg = with_resolved_dtype(load_config(args.config, args.overrides))
    store = make_store(cfg)
    demos = cached_demonstrations(cfg, store)
    ref = cached_reference(cfg, store, demos) if demos is not None else None
    if demos is None or ref is None:
        sys.exit("the run's demonstrations and reference are not cached: run `pivotrl probe` with this config first")
    tasks = sorted((t for t in read_trajectories(store, demos["key"], split="pivot") if t.env is not None),
                   key=lambda t: t.id)
    random.Random(cfg.run.seed).shuffle(tasks)
    tasks = tasks[: args.tasks]
    rdir = reference_dir(cfg, store, ref)
    tok = load_tokenizer(rdir)
    bfcl_root = ensure_bfcl(cache_dir(cfg))
    cp = cfg.compare
    engine = make_rollout_engine(cfg, rdir)
    rows, report = [], {"config": args.config, "overrides": args.overrides, "tasks": len(tasks), "by_k": {}}
    try:
        for k in sizes:
            settings = E2ESettings(group_size=k, temperature=1.0, max_tokens=cfg.rollout.max_tokens,
                                   max_steps_per_turn=cp.e2e_max_steps_per_turn,
                                   max_context=cfg.model.max_context - cfg.rollout.max_tokens,
                                   judge=cfg.quality.judge, seed=cfg.run.seed)
            t0, l0 = time.perf_counter(), load1()
            groups = collect_episodes(engine, tok, tasks, settings, step_seed=cfg.run.seed * 100_003 + k,
                                      bfcl_root=str(bfcl_root), **prompt_kwargs(cfg))
            stats = group_stats(groups, E2E_REWARDS)
            stats["call_turns"] = call_turns_passed(groups, tasks)
            stats.update(wall_s=round(time.perf_counter() - t0, 1), load=round(max(l0, load1()), 2))
            report["by_k"][k] = stats
            rows.append([k, stats["groups"], stats["episodes"], stats["model_calls"],
                         f"{stats['varied_full_task']}/{stats['groups']}", f"{stats['varied_per_turn']}/{stats['groups']}",
                         stats["mean_reward_per_turn"], stats["distinct_first_call"], stats["distinct_episode"],
                         " ".join(f"{t}:{n}" for t, n in stats["turns_passed"].items()), stats["wall_s"], stats["load"]])
            print(f"K = {k}: {stats}", file=sys.stderr, flush=True)
    finally:
        engine.close()
    print(md_table(["K", "tasks", "episodes", "model calls", "groups with variance (full_task)",
                    "groups with variance (per_turn)", "mean per-turn reward", "distinct first calls per task",
                    "distinct episodes per task", "turns passed: episodes", "wall s", "load"], rows))
    if args.json:
        write_json(args.json, report)


if __name__ == "__main__":
    main()
