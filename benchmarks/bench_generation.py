"""Generation MFU of the vLLM engine (pivotrl.runtime.generation) on the default model: the stage's
shapes vs a roofline batch.

Usage::

    python benchmarks/bench_generation.py [--prompts 16] [--prompt-len 512] [--n 4] [--max-tokens 32]
        [--threads 2] [--kv-gib 1] [--dtype fp32|bf16] [--roofline-seqs N] [--json OUT]

"stage shapes": ``--prompts`` synthetic prompts of ``--prompt-len`` tokens, ``n`` samples each at
temperature 1 (probing's shape, eos allowed), one ``generate`` call, fresh prefix cache.
"roofline": every sequence of equal length (eos ignored, 128-token prompts, ``--max-tokens`` × 2
tokens), as many at once as the KV cache holds (``kv_cache_gib`` / KV bytes per token / sequence
length, capped by vLLM's ``max_num_seqs``, or ``--roofline-seqs``: the ceiling at a phase's own
concurrency, e.g. 32 for the default run's training rollouts), so the gap between the two rows is scheduling (ragged
batches, a draining tail), not kernels. Both count FLOPs and MFU with the engine's meter against
the calibrated peak of ``--dtype`` (fp32 by default; bf16 where the CPU has ``avx512_bf16``, as
``model.dtype: auto`` chooses there) × the engine's threads.
"""

from __future__ import annotations

import argparse
import random
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import DEFAULT_CACHE_DIR, header, load1, md_table, synthetic_ids, write_json  # noqa: E402


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=None)
    ap.add_argument("--cache-dir", default=DEFAULT_CACHE_DIR)
    ap.add_argument("--prompts", type=int, default=16)
    ap.add_argument("--prompt-len", type=int, default=512)
    ap.add_argument("--n", type=int, default=4)
    ap.add_argument("--max-tokens", type=int, default=32)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--kv-gib", type=int, default=1)
    ap.add_argument("--dtype", default="fp32", choices=["fp32", "bf16"])
    ap.add_argument("--roofline-seqs", type=int, default=None,
                    help="sequences at once in the roofline (default: as many as the KV cache holds)")
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)

    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    from pivotrl.rollout import SamplingConfig, make_engine
    from pivotrl.runtime.generation import generation_peak
    from pivotrl.runtime.models import DEFAULT_MODEL_SOURCE, resolve_model

    print(header("Generation MFU: stage shapes vs roofline (vLLM CPU)", sys.argv))
    model_dir = str(resolve_model(args.model or DEFAULT_MODEL_SOURCE, args.cache_dir))
    eng = make_engine("vllm", model_dir, dtype=args.dtype, max_model_len=2048, kv_cache_gib=args.kv_gib,
                      cpu_threads=args.threads)
    rng, rows, out = random.Random(0), [], {}

    def run(name: str, fn) -> None:
        eng.llm.reset_prefix_cache()
        before = eng.meter.totals()
        t0 = time.perf_counter()
        fn()
        wall = time.perf_counter() - t0
        gen = eng.meter.totals().minus(before)
        peak = generation_peak(gen, args.cache_dir)
        m = gen.metrics(peak)
        out[name] = {**m, "wall_s": wall, "requests": gen.requests, "load1": load1()}
        rows.append((name, gen.requests, gen.samples, gen.prefill_tokens, gen.generated_tokens, f"{wall:.1f}",
                     f"{m['gen_tokens_per_s']:.1f}", f"{m['gen_tflop']:.3f}",
                     "n/a" if "gen_mfu" not in m else f"{100 * m['gen_mfu']:.2f} %", f"{load1():.2f}"))
        print(gen.line(name, peak), flush=True)

    vocab = eng.vocab_size
    stage = [synthetic_ids(rng, vocab, args.prompt_len) for _ in range(args.prompts)]
    run("stage shapes", lambda: eng.generate(stage, SamplingConfig(n=args.n, temperature=1.0,
                                                                   max_tokens=args.max_tokens, seed=0)))
    cfg = eng.llm.llm_engine.model_config.hf_config
    kv_heads = getattr(cfg, "num_key_value_heads", cfg.num_attention_heads)
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    per_token = 2 * cfg.num_hidden_layers * kv_heads * head_dim * (4 if args.dtype == "fp32" else 2)  # K and V
    seq = 128 + 2 * args.max_tokens
    max_seqs = int(eng.llm.llm_engine.vllm_config.scheduler_config.max_num_seqs)
    batch = max(1, min(args.kv_gib * 2**30 // per_token // seq, max_seqs, args.roofline_seqs or max_seqs))
    print(f"roofline: {per_token} KV bytes per token, {seq}-token sequences, {batch} at once "
          f"(KV cache {args.kv_gib} GiB, max_num_seqs {max_seqs})", flush=True)
    roof = [TokensPrompt(prompt_token_ids=synthetic_ids(rng, vocab, 128)) for _ in range(batch)]
    params = SamplingParams(n=1, temperature=1.0, max_tokens=2 * args.max_tokens, ignore_eos=True, logprobs=0, seed=1)

    def roofline() -> None:
        with eng.meter.timed():
            eng._collect(eng.llm.generate(roof, params, use_tqdm=False), None)

    run("roofline", roofline)
    eng.close()
    print(md_table(["run", "requests", "samples", "prefilled tok", "generated tok", "wall s", "gen tok/s",
                    "TFLOP", "MFU", "load"], rows))
    if args.json:
        write_json(args.json, out)


if __name__ == "__main__":
    main()
