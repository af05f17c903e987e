"""The vLLM CPU engine's KV block size against the prefill of n-sample requests.

Usage::

    python benchmarks/bench_block_size.py [--blocks 128,32] [--pairs 2] [--dtype bf16] [--threads 2] [--json OUT]

An n-sample request runs as n child requests: the first prefills the prompt, the others reuse its
*full* KV blocks from the prefix cache and prefill the rest again (benchmarks/RESULTS.md §23). vLLM's
CPU build uses 128-token blocks unless told otherwise, so a prompt of 200 tokens is prefilled
1 + 7 × (72/200) ≈ 3.5 times with n = 8, and a prompt under 128 tokens n times. The CPU attention
kernel takes any multiple of 32.

Each block size runs in its own process (the block size is an engine setting), alternating
(A, B, B, A, …), on the same synthetic prompts and seeds in two shapes:

* ``short``: 48 prompts of 150–370 tokens, n = 8, 48 new tokens (the single-turn showcase's probe,
  rollouts and sampled evaluation: BFCL single-turn states are 194 tokens on average);
* ``long``: 8 prompts of 900–1,200 tokens, n = 8, 32 new tokens (multi-turn turn states).

End of sequence is ignored so every run decodes the same number of tokens. Per run it prints the
wall seconds, the prefilled tokens (the generation meter: the scheduler's queries − hits), the
forward TFLOP and the generation MFU against the calibrated peak, and whether the sampled token ids
equal those of the first block size's run (same seeds). Results: benchmarks/RESULTS.md §28e.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import random
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import DEFAULT_CACHE_DIR, header, load1, md_table, median, synthetic_ids, write_json  # noqa: E402

SHAPES = {"short": (48, 150, 370, 48), "long": (8, 900, 1200, 32)}  # prompts, min len, max len, new tokens


def child(block: int, dtype: str, threads: int, cache_dir: str) -> dict:
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    from pivotrl.rollout import make_engine
    from pivotrl.runtime.generation import generation_peak
    from pivotrl.runtime.models import DEFAULT_MODEL_SOURCE, resolve_model

    model_dir = str(resolve_model(DEFAULT_MODEL_SOURCE, cache_dir))
    eng = make_engine("vllm", model_dir, dtype=dtype, max_model_len=2048, kv_cache_gib=2, cpu_threads=threads,
                      block_size=block)
    out = {}
    for name, (count, lo, hi, new) in SHAPES.items():
        rng = random.Random(0)
        prompts = [TokensPrompt(prompt_token_ids=synthetic_ids(rng, eng.vocab_size, rng.randint(lo, hi)))
                   for _ in range(count)]
        params = SamplingParams(n=8, temperature=1.0, max_tokens=new, ignore_eos=True, logprobs=0, seed=1)
        eng.llm.reset_prefix_cache()
        before = eng.meter.totals()
        t0 = time.perf_counter()
        with eng.meter.timed():
            outs = eng.llm.generate(prompts, params, use_tqdm=False)
            eng._collect(outs, None)
        wall = time.perf_counter() - t0
        gen = eng.meter.totals().minus(before)
        metrics = gen.metrics(generation_peak(gen, cache_dir))
        ids = hashlib.sha256(json.dumps([[list(c.token_ids) for c in o.outputs] for o in outs]).encode()).hexdigest()
        out[name] = {"wall_s": wall, "prompt_tokens": sum(len(p["prompt_token_ids"]) for p in prompts),
                     "prefill_tokens": gen.prefill_tokens, "generated_tokens": gen.generated_tokens,
                     "tflop": metrics["gen_tflop"], "mfu": metrics.get("gen_mfu"), "tokens_sha": ids[:12],
                     "load1": load1()}
    eng.close()
    return out


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--blocks", default="128,32")
    ap.add_argument("--pairs", type=int, default=2)
    ap.add_argument("--dtype", default="bf16", choices=["fp32", "bf16"])
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--cache-dir", default=DEFAULT_CACHE_DIR)
    ap.add_argument("--child", type=int, default=None, help=argparse.SUPPRESS)
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)
    if args.child is not None:
        print("RESULT " + json.dumps(child(args.child, args.dtype, args.threads, args.cache_dir)), flush=True)
        return

    print(header("vLLM CPU KV block size vs the prefill of n-sample requests", sys.argv))
    blocks = [int(b) for b in args.blocks.split(",")]
    order = []
    for p in range(args.pairs):
        order += blocks if p % 2 == 0 else blocks[::-1]
    runs: list[tuple[int, dict]] = []
    for block in order:
        cmd = [sys.executable, __file__, "--child", str(block), "--dtype", args.dtype, "--threads", str(args.threads),
               "--cache-dir", args.cache_dir]
        proc = subprocess.run(cmd, capture_output=True, text=True, env=os.environ.copy())
        line = next((ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")), None)
        if proc.returncode or line is None:
            sys.exit(f"block {block}: the child failed (rc {proc.returncode}):\n{proc.stderr[-3000:]}")
        res = json.loads(line[len("RESULT "):])
        runs.append((block, res))
        for shape, r in res.items():
            print(f"block {block:>4} {shape:>5}: {r['wall_s']:.1f} s, prefilled {r['prefill_tokens']} "
                  f"(prompt {r['prompt_tokens']}), generated {r['generated_tokens']}, {r['tflop']:.3f} TFLOP, "
                  f"MFU {100 * (r['mfu'] or 0):.1f} %, tokens {r['tokens_sha']}, load {r['load1']:.2f}", flush=True)
    rows = []
    first = {shape: r["tokens_sha"] for shape, r in runs[0][1].items()}
    for shape in SHAPES:
        for block in blocks:
            rs = [r[shape] for b, r in runs if b == block]
            rows.append((shape, block, len(rs), rs[0]["prompt_tokens"], rs[0]["prefill_tokens"],
                         rs[0]["generated_tokens"], f"{median(r['wall_s'] for r in rs):.1f}",
                         f"{rs[0]['tflop']:.2f}", f"{100 * median(r['mfu'] or 0 for r in rs):.1f} %",
                         "yes" if all(r["tokens_sha"] == first[shape] for r in rs) else "no"))
    print(md_table(["shape", "block", "runs", "prompt tok", "prefilled tok", "generated tok", "median wall s",
                    "TFLOP", "median MFU", f"tokens = block {blocks[0]}'s"], rows))
    for shape in SHAPES:
        ratios = []
        for p in range(args.pairs):
            pair = runs[p * len(blocks):(p + 1) * len(blocks)]
            walls = {b: r[shape]["wall_s"] for b, r in pair}
            ratios.append(walls[blocks[0]] / walls[blocks[-1]])
        print(f"{shape}: block {blocks[0]} / block {blocks[-1]} wall, per pair: "
              + ", ".join(f"{x:.2f}" for x in ratios) + f"; median {median(ratios):.2f}")
    if args.json:
        write_json(args.json, [{"block": b, **r} for b, r in runs])


if __name__ == "__main__":
    main()
