"""Rollout throughput and log-prob agreement: vLLM vs the transformers engine, interleaved.

Usage::

    python benchmarks/bench_rollout.py [--model SOURCE] [--prompts 4] [--n 8] [--max-tokens 64]
                                       [--order random|trajectory] [--engines vllm,transformers]
                                       [--dtype bf16] [--repeats 3] [--threads N]
                                       [--json OUT] [--quick]

The model comes from ``pivotrl.runtime.models.resolve_model`` (default: SmolLM2-135M-Instruct dequantised
from Q4_1). Prompts are real BFCL ``multi_turn_base`` turn states rendered with
``pivotrl.format.prompts.encode_state`` with ``--min-prompt``..``--max-prompt`` tokens (so P follows the
real distribution): with ``--order random`` drawn independently, so prompts share no prefix beyond
the system prompt; with ``--order trajectory`` whole trajectories in turn order, as the probe stage
batches its candidates (sorted by state id), so each state repeats the previous one as its prefix.
``--synthetic`` (or BFCL being unavailable) uses random token ids.

Engines: ``vllm``, ``transformers`` (KV of the prompt shared by the n samples) and
``transformers-noreuse`` (the prompt prefilled once per sample, the reference behaviour). All
engines are built first (construction time reported, not counted); then each repeat runs every
engine once on the same prompts and settings, in rotating order, and records generated tokens per
second of wall time with the 1-minute load average. vLLM's prefix cache is reset before each of
its runs, so no repeat reuses an earlier repeat's prompt KV (the n samples of one prompt share it,
as in the transformers engine). Speed-ups are medians of per-repeat ratios against the last engine
listed. With ``--agree-samples`` > 0 each engine's ``rollout_logprobs`` are compared with a plain
transformers forward over prompt + action in the same dtype and in fp32.

Both engines get the same CPUs: the transformers engine runs in this process with ``--threads``
torch threads; vLLM runs in its own engine process, its CPU worker bound to ``--threads`` CPUs
(``cpu_threads``), while this process waits.
"""

from __future__ import annotations

import argparse
import os
import random
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import (  # noqa: E402
    DEFAULT_CACHE_DIR, bfcl_multi_turn_states, distribution, header, load1, md_table, median, synthetic_ids,
    write_json,
)


def _prompts(tokenizer: Any, args: argparse.Namespace) -> tuple[list[list[int]], str, list[int]]:
    rng = random.Random(args.seed)
    if not args.synthetic:
        try:
            states = [(sid, p, a) for sid, p, a in bfcl_multi_turn_states(tokenizer, args.cache_dir, max_prompt=args.max_prompt,
                                                                records=args.bfcl_records)
                      if len(p) >= args.min_prompt]
            if len(states) >= args.prompts:
                pool = [len(p) for _, p, _ in states]
                if args.order == "trajectory":
                    return _trajectory_prompts(states, args.prompts, rng), (
                        f"BFCL multi_turn_base turn states ({len(states)} in range), whole trajectories in turn "
                        "order"), pool
                return [p for _, p, _ in rng.sample(states, args.prompts)], (
                    f"BFCL multi_turn_base turn states ({len(states)} in range), drawn at random"), pool
            print(f"only {len(states)} BFCL states in range; using synthetic ids", file=sys.stderr)
        except Exception as err:  # noqa: BLE001 - any failure → synthetic prompts, reported
            print(f"BFCL states unavailable ({type(err).__name__}: {err}); using synthetic ids", file=sys.stderr)
    vocab = len(tokenizer)
    out = [synthetic_ids(rng, vocab, rng.randint(max(1, args.min_prompt), args.max_prompt)) for _ in range(args.prompts)]
    return out, "synthetic token ids", [len(p) for p in out]


def _trajectory_prompts(states: list[tuple[str, list[int], Any]], count: int, rng: random.Random) -> list[list[int]]:
    """``count`` prompts made of whole trajectories' turn states in turn order (the last one cut),
    trajectories drawn at random: the order the probe stage sends states in (sorted by state id),
    where consecutive states of one trajectory share the earlier turns as a prompt prefix."""
    by_traj: dict[str, list[tuple[int, list[int]]]] = {}
    for sid, prompt, _ in states:
        traj, _, turn = sid.rpartition("#")
        by_traj.setdefault(traj, []).append((int(turn), prompt))
    names = sorted(by_traj)
    rng.shuffle(names)
    out: list[list[int]] = []
    for name in names:
        out += [p for _, p in sorted(by_traj[name], key=lambda tp: tp[0])]
        if len(out) >= count:
            break
    return out[:count]


def _trainer_logprobs(model: Any, prompt: list[int], action: list[int]) -> list[float]:
    """Plain forward over prompt + action; log_softmax (fp32 math) at the action positions."""
    import torch

    with torch.inference_mode():
        logits = model(torch.tensor([prompt + action])).logits[0, len(prompt) - 1 : -1].float()
    return torch.log_softmax(logits, dim=-1).gather(-1, torch.tensor(action)[:, None])[:, 0].tolist()


def _agreement(results: list[list[Any]], prompts: list[list[int]], trainer: Any, per_prompt: int) -> tuple[float, float]:
    diffs: list[float] = []
    for prompt, row in zip(prompts, results):
        for gen in row[:per_prompt]:
            if gen.token_ids:
                ref = _trainer_logprobs(trainer, prompt, gen.token_ids)
                diffs += [abs(a - b) for a, b in zip(gen.rollout_logprobs, ref)]
    return (max(diffs), sum(diffs) / len(diffs)) if diffs else (float("nan"), float("nan"))


def _build(name: str, model_dir: str, args: argparse.Namespace, max_model_len: int) -> Any:
    from pivotrl.rollout import make_engine

    if name == "vllm":
        return make_engine("vllm", model_dir, dtype=args.dtype, max_model_len=max_model_len, kv_cache_gib=args.kv_cache_gib,
                           cpu_threads=args.threads)
    if name == "transformers":
        return make_engine("transformers", model_dir, dtype=args.dtype, max_model_len=max_model_len)
    if name == "transformers-noreuse":
        return make_engine("transformers", model_dir, dtype=args.dtype, max_model_len=max_model_len,
                           reuse_prompt_cache=False)
    raise SystemExit(f"unknown engine {name!r}; valid: vllm, transformers, transformers-noreuse")


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=None, help="model source (default: the project default)")
    ap.add_argument("--cache-dir", default=DEFAULT_CACHE_DIR)
    ap.add_argument("--prompts", type=int, default=4)
    ap.add_argument("--n", type=int, default=8)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--temperature", type=float, default=1.0)
    ap.add_argument("--min-prompt", type=int, default=0)
    ap.add_argument("--max-prompt", type=int, default=8096)
    ap.add_argument("--bfcl-records", type=int, default=None)
    ap.add_argument("--synthetic", action="store_true")
    ap.add_argument("--order", default="random", choices=["random", "trajectory"],
                    help="random: states drawn independently (no prefix shared across prompts); trajectory: "
                         "whole trajectories' states in turn order, as the probe stage batches them")
    ap.add_argument("--engines", default="vllm,transformers", help="comma-separated; speed-ups are against the last")
    ap.add_argument("--dtype", default="bf16", choices=["bf16", "fp32"])
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--agree-samples", type=int, default=0, help="samples per prompt compared with a trainer forward")
    ap.add_argument("--threads", type=int, default=len(os.sched_getaffinity(0)),
                    help="CPU threads of every engine: torch threads of this process (transformers) and "
                         "the vLLM CPU worker's bound threads (default: every CPU this process may use)")
    ap.add_argument("--kv-cache-gib", type=float, default=1.0)
    ap.add_argument("--json", default=None, help="also write the raw numbers here")
    ap.add_argument("--quick", action="store_true",
                    help="transformers vs transformers-noreuse, 2 synthetic prompts, n=4, 8 tokens, fp32 (for tests)")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args(argv)
    if args.quick:
        args.synthetic, args.prompts, args.n, args.max_tokens, args.repeats = True, 2, 4, 8, 2
        args.min_prompt, args.max_prompt, args.dtype = 64, 128, "fp32"
        if args.engines == ap.get_default("engines"):
            args.engines = "transformers,transformers-noreuse"

    import torch

    from pivotrl.runtime.models import DEFAULT_MODEL_SOURCE, load_tokenizer, resolve_model
    from pivotrl.rollout import SamplingConfig

    print(header("Rollout: generated tokens per second by engine"))
    torch.set_num_threads(args.threads)
    model_dir = str(resolve_model(args.model or DEFAULT_MODEL_SOURCE, args.cache_dir))
    tokenizer = load_tokenizer(model_dir)
    prompts, source, pool = _prompts(tokenizer, args)
    max_model_len = max(len(p) for p in prompts) + args.max_tokens + 8
    names = [e for e in args.engines.split(",") if e]
    if "vllm" not in names:
        print(f"vLLM not run (engines: {', '.join(names)}); the vLLM comparison needs --engines vllm,transformers\n")
    engines, start_s = {}, {}
    for name in names:
        t0 = time.perf_counter()
        engines[name] = _build(name, model_dir, args, max_model_len)
        engines[name].generate(prompts[:1], SamplingConfig(n=1, max_tokens=2, seed=1))  # warm-up
        start_s[name] = time.perf_counter() - t0
    runs: dict[str, list[tuple[int, float, float]]] = {n: [] for n in names}
    last: dict[str, Any] = {}
    for rep in range(args.repeats):
        order = names[rep % len(names):] + names[: rep % len(names)]
        for name in order:
            eng = engines[name]
            if hasattr(eng, "llm"):
                eng.llm.reset_prefix_cache()
            sampling = SamplingConfig(n=args.n, temperature=args.temperature, max_tokens=args.max_tokens,
                                      seed=args.seed + rep)
            la = load1()
            t0 = time.perf_counter()
            results = eng.generate(prompts, sampling)
            wall = time.perf_counter() - t0
            tokens = sum(len(g.token_ids) for row in results for g in row)
            runs[name].append((tokens, wall, la))
            last[name] = results
            print(f"repeat {rep} {name}: {tokens / wall:.1f} tok/s (load {la:.2f})", file=sys.stderr, flush=True)
    for eng in engines.values():
        eng.close()

    base = names[-1]
    agree: dict[str, tuple[tuple[float, float], tuple[float, float]]] = {}
    if args.agree_samples > 0:
        from transformers import AutoModelForCausalLM

        trainers = {d: AutoModelForCausalLM.from_pretrained(model_dir, dtype=getattr(torch, t)).eval()
                    for d, t in (("fp32", "float32"), (args.dtype, "bfloat16" if args.dtype == "bf16" else "float32"))}
        for name in names:
            same = _agreement(last[name], prompts, trainers[args.dtype], args.agree_samples)
            agree[name] = (same, _agreement(last[name], prompts, trainers["fp32"], args.agree_samples)
                           if args.dtype != "fp32" else same)

    lengths = [len(p) for p in prompts]
    print(f"model: {model_dir}  \nprompts: {len(prompts)} from {source}; P of the pool {distribution(pool)}; "
          f"P used {distribution(lengths)}  \nn={args.n}, max_tokens={args.max_tokens}, T={args.temperature}, "
          f"dtype {args.dtype}; torch threads here: {args.threads}; {args.repeats} repeats, engines rotated\n")
    rows, raw = [], {}
    for name in names:
        tps = [t / w for t, w, _ in runs[name]]
        ratio = median(a[0] / a[1] / (b[0] / b[1]) for a, b in zip(runs[name], runs[base]))
        row = [name, args.dtype, start_s[name], median(t for t, _, _ in runs[name]), median(w for _, w, _ in runs[name]),
               median(tps), min(tps), max(tps), ratio, median(la for _, _, la in runs[name])]
        if agree:
            (sm, sa), (fm, fa) = agree[name]
            row += [f"{sm:.2e}", f"{sa:.2e}", f"{fm:.2e}", f"{fa:.2e}"]
        rows.append(row)
        raw[name] = {"start_s": start_s[name], "runs": runs[name], "speedup_vs_" + base: ratio}
    cols = ["engine", "dtype", "start s", "gen tokens", "wall s", "gen tok/s", "min tok/s", "max tok/s",
            f"speed-up vs {base}", "load"]
    if agree:
        cols += ["max abs Δ (same dtype)", "mean abs Δ (same dtype)", "max abs Δ vs fp32", "mean abs Δ vs fp32"]
    print(md_table(cols, rows))
    print(f"\n(medians over {args.repeats} repeats; speed-up = median of per-repeat tok/s ratios)")
    if args.json:
        write_json(args.json, {"engines": raw, "prompts": lengths, "source": source, "model_dir": model_dir,
                               "n": args.n, "max_tokens": args.max_tokens, "dtype": args.dtype})


if __name__ == "__main__":
    main()
