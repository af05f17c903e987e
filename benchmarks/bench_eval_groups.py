"""Local evaluation's measures sampled one engine call each vs all in one pass (vLLM), interleaved.

Usage::

    python benchmarks/bench_eval_groups.py [--pairs 2] [--max-tokens 96] [--threads 2] [--json OUT]

The default run's state measures of one policy, in the evaluate stage's shapes: 40 held-out states
greedy and with m = 8 samples at temperature 1, 38 stop decisions, 25 out-of-domain states and 21
pivots greedy (``evaluation`` and ``probing`` defaults, the AVX2 sizing's halved out-of-domain
count), on real BFCL ``multi_turn_base`` turn states (disjoint sets where the stage's are).
"separate" samples each measure in batches of 64 prompts, one ``engine.generate`` call per batch
(the stage before :func:`pivotrl.evaluation.local.evaluate_local_groups`); "together" passes the
same batches to :func:`pivotrl.rollout.base.generate_groups` (one scheduler pass). Both get the same
prompts, seeds and sampling, so they generate the same tokens (checked); the prefix cache is reset
before each run. Reports wall seconds per run, generated tokens/s and the median per-pair speed-up.
Generation only: the verifier's time is the same in both.
"""

from __future__ import annotations

import argparse
import random
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import DEFAULT_CACHE_DIR, bfcl_multi_turn_states, header, load1, md_table, median, write_json  # noqa: E402


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=None, help="model source (default: the project default)")
    ap.add_argument("--cache-dir", default=DEFAULT_CACHE_DIR)
    ap.add_argument("--pairs", type=int, default=2)
    ap.add_argument("--max-tokens", type=int, default=96)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)

    from pivotrl.runtime.models import DEFAULT_MODEL_SOURCE, resolve_model
    from pivotrl.rollout import SamplingConfig, make_engine
    from pivotrl.rollout.base import generate_groups

    print(header("Local evaluation: measures one call each vs one pass", sys.argv))
    model_dir = str(resolve_model(args.model or DEFAULT_MODEL_SOURCE, args.cache_dir))
    eng = make_engine("vllm", model_dir, dtype="fp32", max_model_len=8192, kv_cache_gib=4, cpu_threads=args.threads)
    states = [p for _, p, _ in bfcl_multi_turn_states(eng.tokenizer, args.cache_dir, max_prompt=8000)]
    random.Random(0).shuffle(states)
    greedy = SamplingConfig(n=1, temperature=0.0, max_tokens=args.max_tokens, seed=0)
    sampled = SamplingConfig(n=8, temperature=1.0, max_tokens=args.max_tokens, seed=0)
    measures = [(states[:40], greedy), (states[:40], sampled), (states[40:78], greedy), (states[78:103], greedy),
                (states[103:124], greedy)]
    batches = [(ps[a : a + 64], s) for ps, s in measures for a in range(0, len(ps), 64)]

    def separate() -> list[Any]:
        return [eng.generate(p, s) for p, s in batches]

    def together() -> list[Any]:
        return generate_groups(eng, batches)

    rows, runs, tokens = [], {"separate": [], "together": []}, {}
    for pair in range(args.pairs):
        order = [("separate", separate), ("together", together)]
        for name, fn in order if pair % 2 == 0 else order[::-1]:
            eng.llm.reset_prefix_cache()
            t0 = time.perf_counter()
            out = fn()
            dt = time.perf_counter() - t0
            ids = [[[g.token_ids for g in row] for row in batch] for batch in out]
            tokens.setdefault(name, ids)
            n = sum(len(t) for batch in ids for row in batch for t in row)
            runs[name].append(dt)
            rows.append((pair, name, dt, n, n / dt, load1()))
            print(f"pair {pair} {name}: {dt:.1f} s, {n} tokens, {n / dt:.1f} tok/s, load {load1():.2f}", flush=True)
    eng.close()
    same = tokens["separate"] == tokens["together"]
    ratio = median(a / b for a, b in zip(runs["separate"], runs["together"]))
    print(md_table(["pair", "variant", "wall s", "gen tokens", "gen tok/s", "load"], rows))
    print(f"\nspeed-up of one pass (median of {args.pairs} per-pair ratios): {ratio:.2f}x; same tokens: {same}")
    if args.json:
        write_json(args.json, {"rows": rows, "speedup": ratio, "same_tokens": same})


if __name__ == "__main__":
    main()
