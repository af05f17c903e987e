"""Rollout throughput and log-prob agreement: vLLM vs the transformers engine.

Usage::

    python benchmarks/bench_rollout.py [--model SOURCE] [--prompts 4] [--n 8] [--max-tokens 64]
                                       [--engines vllm,transformers] [--dtypes bf16,fp32]

The model comes from ``pivotrl.models.resolve_model`` (default: SmolLM2-135M-Instruct dequantised
from Q4_1). Prompts are real BFCL multi-turn states rendered with ``pivotrl.prompts.encode_state``
whose length lies in ``--min-prompt``..``--max-prompt`` tokens; ``--synthetic`` (or BFCL being
unavailable) uses random token ids of such lengths instead.

For every (engine, dtype) the script samples ``--n`` actions per prompt (temperature
``--temperature``, ``--max-tokens``), reports generated tokens per second of wall time (engine
construction excluded), and compares each sampled token's ``rollout_logprobs`` with a plain
transformers forward over prompt + action (the trainer's computation) in fp32 and in bf16:
max and mean |Δ| per token, over the first ``--agree-samples`` samples of each prompt. Results
are printed as a markdown table.

The transformers engine runs in this process with ``--threads`` torch threads; vLLM runs its
engine in its own process (its CPU worker picks its threads) while this process waits.
"""

from __future__ import annotations

import argparse
import os
import random
import sys
import time
from pathlib import Path
from typing import Any


def _prompts(tokenizer: Any, args: argparse.Namespace) -> tuple[list[list[int]], str]:
    rng = random.Random(args.seed)
    out: list[list[int]] = []
    if not args.synthetic:
        try:
            from pivotrl.data.bfcl import load_bfcl
            from pivotrl.data.states import extract_turn_states
            from pivotrl.errors import StateTooLongError
            from pivotrl.prompts import encode_state

            trajs = load_bfcl(["multi_turn_base"], args.cache_dir, limit_per_category=args.bfcl_records)
            for traj in trajs:
                for state in extract_turn_states(traj):
                    try:
                        ids = encode_state(state, tokenizer, max_len=args.max_prompt)
                    except StateTooLongError:
                        continue
                    if len(ids) >= args.min_prompt:
                        out.append(ids)
                        break  # one state per trajectory: different tasks
                if len(out) == args.prompts:
                    return out, f"BFCL multi_turn_base states ({len(trajs)} records scanned)"
            print(f"only {len(out)} BFCL states in range; topping up with synthetic ones", file=sys.stderr)
        except Exception as err:  # noqa: BLE001 - any failure → synthetic prompts, reported
            print(f"BFCL states unavailable ({type(err).__name__}: {err}); using synthetic ids", file=sys.stderr)
            out = []
    vocab = len(tokenizer)
    while len(out) < args.prompts:
        out.append([rng.randrange(vocab) for _ in range(rng.randint(args.min_prompt, args.max_prompt))])
    return out, "synthetic token ids"


def _trainer_logprobs(model: Any, prompt: list[int], action: list[int]) -> list[float]:
    """Plain forward over prompt + action; log_softmax (fp32 math) at the action positions."""
    import torch

    with torch.inference_mode():
        logits = model(torch.tensor([prompt + action])).logits[0, len(prompt) - 1 : -1].float()
    return torch.log_softmax(logits, dim=-1).gather(-1, torch.tensor(action)[:, None])[:, 0].tolist()


def _agreement(
    results: list[list[Any]], prompts: list[list[int]], trainer: Any, per_prompt: int
) -> tuple[float, float]:
    diffs: list[float] = []
    for prompt, row in zip(prompts, results):
        for gen in row[:per_prompt]:
            if gen.token_ids:
                ref = _trainer_logprobs(trainer, prompt, gen.token_ids)
                diffs += [abs(a - b) for a, b in zip(gen.rollout_logprobs, ref)]
    return max(diffs), sum(diffs) / len(diffs)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=None, help="model source (default: the project default)")
    ap.add_argument("--cache-dir", default=os.environ.get("PIVOTRL_CACHE_DIR", str(Path.home() / ".cache" / "pivotrl")))
    ap.add_argument("--prompts", type=int, default=4)
    ap.add_argument("--n", type=int, default=8)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--temperature", type=float, default=1.0)
    ap.add_argument("--min-prompt", type=int, default=1000)
    ap.add_argument("--max-prompt", type=int, default=2000)
    ap.add_argument("--bfcl-records", type=int, default=60)
    ap.add_argument("--synthetic", action="store_true")
    ap.add_argument("--engines", default="vllm,transformers")
    ap.add_argument("--dtypes", default="bf16,fp32")
    ap.add_argument("--agree-samples", type=int, default=2, help="samples per prompt compared with the trainer")
    ap.add_argument("--threads", type=int, default=1, help="torch threads of this process")
    ap.add_argument("--kv-cache-gib", type=float, default=1.0)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args(argv)

    import torch
    from transformers import AutoModelForCausalLM

    from pivotrl.models import DEFAULT_MODEL_SOURCE, load_tokenizer, resolve_model
    from pivotrl.rollout import SamplingConfig, make_engine

    torch.set_num_threads(args.threads)
    model_dir = resolve_model(args.model or DEFAULT_MODEL_SOURCE, args.cache_dir)
    tokenizer = load_tokenizer(model_dir)
    prompts, source = _prompts(tokenizer, args)
    sampling = SamplingConfig(n=args.n, temperature=args.temperature, max_tokens=args.max_tokens, seed=args.seed)
    max_model_len = max(len(p) for p in prompts) + args.max_tokens + 8
    trainers = {
        d: AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=getattr(torch, t)).eval()
        for d, t in (("fp32", "float32"), ("bf16", "bfloat16"))
    }
    rows = []
    for engine_name in args.engines.split(","):
        for dtype in args.dtypes.split(","):
            t0 = time.perf_counter()
            extra = {"kv_cache_gib": args.kv_cache_gib} if engine_name == "vllm" else {}
            engine = make_engine(engine_name, str(model_dir), dtype=dtype, max_model_len=max_model_len, **extra)
            start_s = time.perf_counter() - t0
            engine.generate(prompts[:1], SamplingConfig(n=1, max_tokens=2, seed=1))  # warm-up
            t0 = time.perf_counter()
            results = engine.generate(prompts, sampling)
            wall = time.perf_counter() - t0
            engine.close()
            del engine
            tokens = sum(len(g.token_ids) for row in results for g in row)
            same = _agreement(results, prompts, trainers[dtype], args.agree_samples)
            vs32 = _agreement(results, prompts, trainers["fp32"], args.agree_samples) if dtype != "fp32" else same
            rows.append((engine_name, dtype, start_s, tokens, wall, tokens / wall, same, vs32))
            print(f"done {engine_name} {dtype}: {tokens / wall:.1f} tok/s", file=sys.stderr, flush=True)

    lengths = [len(p) for p in prompts]
    print(f"\nmodel: {model_dir}  |  prompts: {len(prompts)} from {source}, {min(lengths)}–{max(lengths)} tokens "
          f"(mean {sum(lengths) / len(lengths):.0f})  |  n={args.n}, max_tokens={args.max_tokens}, "
          f"T={args.temperature}  |  torch threads here: {args.threads}  |  log-prob Δ over "
          f"{args.agree_samples} samples per prompt\n")
    print("| engine | dtype | start s | gen tokens | wall s | gen tok/s | max abs Δ vs trainer (same dtype) "
          "| mean abs Δ (same dtype) | max abs Δ vs fp32 trainer | mean abs Δ vs fp32 trainer |")
    print("|---|---|---:|---:|---:|---:|---:|---:|---:|---:|")
    for name, dtype, start_s, tokens, wall, tps, same, vs32 in rows:
        print(f"| {name} | {dtype} | {start_s:.1f} | {tokens} | {wall:.1f} | {tps:.1f} | {same[0]:.2e} | {same[1]:.2e} "
              f"| {vs32[0]:.2e} | {vs32[1]:.2e} |")


if __name__ == "__main__":
    main()
