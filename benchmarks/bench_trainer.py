"""Trainer throughput: forward+backward of K actions per state, shared prefix vs naive.

Usage::

    python benchmarks/bench_trainer.py [--model SOURCE] [--groups 3] [--group-size 8] [--threads 2]

The model comes from ``pivotrl.models.resolve_model`` (default: the project's default source,
SmolLM2-135M-Instruct dequantised from Q4_1). States are real BFCL multi-turn states rendered
with ``pivotrl.prompts.encode_state`` whose prompt has ``--min-prompt``..``--max-prompt`` tokens;
actions are K windows of ``--min-action``..``--max-action`` tokens cut from the demonstration
action and the history (compute depends on lengths only). ``--synthetic`` (or BFCL being
unavailable) uses random token ids of the same lengths instead.

For each mode the script times ``compute_group_logprobs`` + backward of the summed log-probs in
plain PyTorch (no DeepSpeed; the optimiser step is not included; the naive mode runs one
sequence per backward to bound memory, with the same FLOPs) and prints a markdown table:
tokens actually run through the model per second, the naive-equivalent ``K·(P+T)`` tokens per
second, and seconds per group. With ``--trainer-step`` it also times one full
``PivotRLTrainer.train_step`` (DeepSpeed, ZeRO 0) on the same groups.
"""

from __future__ import annotations

import argparse
import os
import random
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import torch


def _states(tokenizer: Any, args: argparse.Namespace, rng: random.Random) -> tuple[list[tuple[list[int], list[list[int]]]], str]:
    """``--groups`` (prompt_ids, K actions) pairs and a description of where they came from."""
    lens = lambda: rng.randint(args.min_action, args.max_action)  # noqa: E731
    if not args.synthetic:
        try:
            from pivotrl.actions import format_action
            from pivotrl.data.bfcl import load_bfcl
            from pivotrl.data.states import extract_turn_states
            from pivotrl.errors import StateTooLongError
            from pivotrl.prompts import encode_action, encode_state

            trajs = load_bfcl(["multi_turn_base"], args.cache_dir, limit_per_category=args.bfcl_records)
            out = []
            for traj in trajs:
                for st in extract_turn_states(traj):
                    try:
                        prompt = encode_state(st, tokenizer, max_len=args.max_prompt)
                    except StateTooLongError:
                        continue
                    if len(prompt) < args.min_prompt:
                        continue
                    demo = encode_action(format_action(st.demo_action), tokenizer)
                    pool = demo + prompt[-400:]
                    actions = []
                    for _ in range(args.group_size):
                        t = lens()
                        start = rng.randrange(0, max(1, len(pool) - t))
                        actions.append(pool[start : start + t])
                    out.append((prompt, actions))
                    if len(out) == args.groups:
                        return out, f"BFCL multi_turn_base states ({len(trajs)} records scanned)"
            print(f"only {len(out)} BFCL states in range; topping up with synthetic ones", file=sys.stderr)
        except Exception as err:  # noqa: BLE001 - any failure → synthetic states, reported
            print(f"BFCL states unavailable ({type(err).__name__}: {err}); using synthetic ids", file=sys.stderr)
            out = []
    else:
        out = []
    vocab = len(tokenizer)
    while len(out) < args.groups:
        p = rng.randint(args.min_prompt, args.max_prompt)
        out.append(([rng.randrange(vocab) for _ in range(p)], [[rng.randrange(vocab) for _ in range(lens())] for _ in range(args.group_size)]))
    return out, "synthetic token ids"


def _time_mode(model: Any, groups: list[tuple[list[int], list[list[int]]]], shared: bool, repeats: int) -> dict[str, float]:
    from pivotrl.training.logprobs import compute_group_logprobs, processed_tokens

    run_tokens = 0
    naive_tokens = 0
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        for prompt, actions in groups:
            # naive: one sequence per backward (same FLOPs as all K at once, 1/K of the activations)
            chunks = [actions] if shared else [[a] for a in actions]
            for chunk in chunks:
                res = compute_group_logprobs(model, prompt, chunk, shared_prefix=shared)
                res.logprobs.sum().backward()
                run_tokens += res.tokens_processed
            naive_tokens += processed_tokens(len(prompt), [len(a) for a in actions], shared_prefix=False)
        times.append(time.perf_counter() - t0)
        model.zero_grad(set_to_none=True)
    total = sum(times)
    return {
        "tokens_per_s": run_tokens / total,
        "naive_equiv_tokens_per_s": naive_tokens / total,
        "s_per_group": total / (repeats * len(groups)),
        "s_per_group_stdev": statistics.pstdev(times) / len(groups) if len(times) > 1 else 0.0,
    }


def main(argv: list[str] | None = None) -> int:
    from pivotrl.models import DEFAULT_MODEL_SOURCE

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default=DEFAULT_MODEL_SOURCE, help="model source for pivotrl.models.resolve_model")
    ap.add_argument("--cache-dir", default=os.environ.get("PIVOTRL_CACHE_DIR", str(Path.home() / ".cache" / "pivotrl")))
    ap.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    ap.add_argument("--groups", type=int, default=3)
    ap.add_argument("--group-size", type=int, default=8)
    ap.add_argument("--min-prompt", type=int, default=1000)
    ap.add_argument("--max-prompt", type=int, default=2048)
    ap.add_argument("--min-action", type=int, default=20)
    ap.add_argument("--max-action", type=int, default=40)
    ap.add_argument("--bfcl-records", type=int, default=30)
    ap.add_argument("--repeats", type=int, default=1)
    ap.add_argument("--threads", type=int, default=int(os.environ.get("OMP_NUM_THREADS", "1")))
    ap.add_argument("--synthetic", action="store_true")
    ap.add_argument("--modes", default="shared,naive", help="comma-separated subset of shared,naive")
    ap.add_argument("--trainer-step", action="store_true", help="also time one PivotRLTrainer.train_step")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args(argv)

    from pivotrl.models import load_tokenizer, resolve_model
    from pivotrl.training.deepspeed_utils import load_causal_lm

    torch.set_num_threads(args.threads)
    rng = random.Random(args.seed)
    model_dir = resolve_model(args.model, args.cache_dir)
    tokenizer = load_tokenizer(model_dir)
    groups, origin = _states(tokenizer, args, rng)
    dtype = torch.bfloat16 if args.dtype == "bfloat16" else torch.float32
    model = load_causal_lm(model_dir, dtype).eval()

    # warm-up (allocations, kernel selection) on a short group
    from pivotrl.training.logprobs import compute_group_logprobs

    compute_group_logprobs(model, groups[0][0][:64], groups[0][1][:2]).logprobs.sum().backward()
    model.zero_grad(set_to_none=True)

    modes = [m for m in args.modes.split(",") if m]
    if not modes or set(modes) - {"shared", "naive"}:
        ap.error(f"--modes must list shared and/or naive, got {args.modes!r}")
    results = {mode: _time_mode(model, groups, mode == "shared", args.repeats) for mode in modes}
    p_lens = [len(p) for p, _ in groups]
    t_lens = [len(a) for _, acts in groups for a in acts]
    print(f"model: {args.model} ({model_dir}), dtype {args.dtype}, threads {args.threads}, "
          f"load average {os.getloadavg()[0]:.2f}")
    print(f"states: {origin}; {len(groups)} groups, K={args.group_size}, P {min(p_lens)}–{max(p_lens)}, "
          f"T {min(t_lens)}–{max(t_lens)}\n")
    print("| mode | tokens run / s | naive-equivalent tokens / s | s per group (fwd+bwd) |")
    print("|---|---:|---:|---:|")
    for mode, r in results.items():
        print(f"| {mode} | {r['tokens_per_s']:.0f} | {r['naive_equiv_tokens_per_s']:.0f} | {r['s_per_group']:.2f} |")
    if len(results) == 2:
        speedup = results["naive"]["s_per_group"] / results["shared"]["s_per_group"]
        print(f"\nshared-prefix speed-up per group: {speedup:.2f}x")

    if args.trainer_step:
        from pivotrl.training.pivotrl import Group, PivotRLTrainer

        trainer = PivotRLTrainer(model_dir, group_size=args.group_size, dtype=args.dtype, lr=1e-6, beta=0.01, seed=args.seed)
        batch = [Group(f"g{i}", p, acts, [float(j % 2) for j in range(len(acts))]) for i, (p, acts) in enumerate(groups)]
        m = trainer.train_step(batch)
        print(f"\nPivotRLTrainer.train_step ({len(batch)} groups, ZeRO 0, {args.dtype}): "
              f"{m['step_time_s']:.1f} s, {m['tokens_per_s']:.0f} tokens/s (policy + reference passes)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
