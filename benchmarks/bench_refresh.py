"""Per-step weight refresh of the rollout engine: through disk (HF export + ``load_weights``) vs in
memory (shared-memory block + ``update_weights``), interleaved, with the refresh check's deltas.

Usage::

    python benchmarks/bench_refresh.py [--model SOURCE] [--dtype bf16] [--repeats 4] [--engine vllm]

Builds the trainer (``PivotRLTrainer``, default config's training section) and one rollout engine
on the model, then repeats: perturb the trainer's weights slightly (as a training step would),
refresh the engine by one path, run the refresh check (engine vs trainer log-probs of a fixed
200-token state and 20-token action, as the loop does); the two paths alternate (disk, memory,
memory, disk, …). Reported per refresh: seconds to write (export / shared block), seconds for the
engine to load, the check's max and mean |Δ| per token, and the 1-minute load average.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import DEFAULT_CACHE_DIR, header, load1, md_table, median  # noqa: E402


def main(argv: list[str] | None = None) -> int:
    from pivotrl.config import load_config
    from pivotrl.runtime.models import DEFAULT_MODEL_SOURCE, resolve_model
    from pivotrl.rollout import make_engine
    from pivotrl.training.pivotrl import PivotRLTrainer
    from pivotrl.training.rank_engines import refresh_delta, reload

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=DEFAULT_MODEL_SOURCE)
    ap.add_argument("--cache-dir", default=DEFAULT_CACHE_DIR)
    ap.add_argument("--dtype", default="bf16", choices=["bf16", "fp32"])
    ap.add_argument("--engine", default="vllm", choices=["vllm", "transformers"])
    ap.add_argument("--repeats", type=int, default=4)
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)
    print(header("bench_refresh"))
    model_dir = str(resolve_model(args.model, args.cache_dir))
    tr = load_config(str(Path(__file__).resolve().parents[1] / "configs" / "default.yaml")).training
    trainer = PivotRLTrainer.build(model_dir, dtype={"bf16": "bfloat16", "fp32": "float32"}[args.dtype], seed=0,
                                   **{**tr.model_dump(), "lr": 1e-7})
    engine = make_engine(args.engine, model_dir, dtype=args.dtype, max_model_len=1024, kv_cache_gib=1,
                         **({"cpu_threads": 1} if args.engine == "vllm" else {}))
    rng = random.Random(0)
    prompt = [rng.randrange(100, 40000) for _ in range(200)]
    action = [rng.randrange(100, 40000) for _ in range(20)]
    rows, by = [], {"disk": [], "memory": []}
    work = Path(tempfile.mkdtemp(prefix="bench-refresh-", dir=os.path.expanduser(args.cache_dir)))
    try:
        for rep in range(2 * args.repeats):
            mode = ("disk", "memory", "memory", "disk")[rep % 4]
            with torch.no_grad():  # what a training step does to the weights, roughly
                for p in trainer.engine.module.parameters():
                    p.add_(torch.randn_like(p) * 1e-3 * p.float().std().to(p.dtype))
            la = load1()
            t0 = time.perf_counter()
            if mode == "disk":
                source = str(trainer.export_hf(str(work / f"policy-{rep}")))
            else:
                source = trainer.shared_weights()
            t_write = time.perf_counter() - t0
            t1 = time.perf_counter()
            reload(engine, source)
            t_load = time.perf_counter() - t1
            d_max, d_mean = refresh_delta(engine, prompt, [action], [trainer.old_policy_logprobs(prompt, action)])
            by[mode].append(t_write + t_load)
            rows.append([rep, mode, round(t_write, 3), round(t_load, 3), round(t_write + t_load, 3),
                         f"{d_max:.3g}", f"{d_mean:.3g}", la])
    finally:
        engine.close()
        import shutil

        shutil.rmtree(work, ignore_errors=True)
    print(md_table(["round", "path", "write s", "engine load s", "refresh s", "check max |Δ|", "check mean |Δ|",
                    "load"], rows))
    ratio = median(by["disk"]) / median(by["memory"])
    print(f"\nmedian refresh: disk {median(by['disk']):.3f} s, memory {median(by['memory']):.3f} s ({ratio:.2f}x)")
    if args.json:
        Path(args.json).write_text(json.dumps({"rows": rows, "disk_s": by["disk"], "memory_s": by["memory"]}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
