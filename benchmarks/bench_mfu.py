"""The PivotRL trainer's MFU: where one step's time goes, and variants timed interleaved.

Usage::

    python benchmarks/bench_mfu.py profile [--dtype bfloat16] [--groups 2] [--prompt 1000] [--prompt-min N] [--action 32]
    python benchmarks/bench_mfu.py compare [--variants before,after] [--repeats 3] [--json OUT]
    python benchmarks/bench_mfu.py ceiling [--dtype bfloat16] [--groups 1] [--repeats 3]

The model comes from ``pivotrl.runtime.models.resolve_model`` (default: SmolLM2-135M-Instruct dequantised
from Q4_1). The groups are synthetic token ids shaped like the default run's: a state of
``--prompt`` tokens (the median BFCL multi-turn state is ≈ 1,070 tokens with the compact tool
rendering), K = ``--group-size`` actions of ``--action`` tokens at most (lengths drawn between a
quarter of that and that), rewards 0/1 alternating; one micro-batch per group, as the default config.

**profile** runs one warm-up ``train_step`` and then one timed step with

* a split of its wall time: π_ref forward (no grad), π_θ forward, the log-prob gathering
  (``_token_stats``: upcast, log-softmax, gather, entropy), backward, optimizer step, and the rest
  (Python, padding, the loss);
* the process's CPU time over the wall time (cores busy) and the torch thread count;
* the step's MFU (``pivotrl.runtime.mfu``) against the calibrated peak × threads;
* a second step under ``torch.profiler``: the top operators by self CPU time.

**compare** times ``train_step`` for each variant (trainer settings below), interleaved in one
process (A, B, B, A, …), each with the 1-minute load average, and prints the per-variant MFU and the
median of the per-round ratios. Variants (:data:`VARIANTS`): ``before`` = the log-probs through the
repeated key/value cache (``training.prefix_method: cache``) and the for-loop AdamW, the code before
the change; ``after`` = the current defaults (``prefix_method: auto`` = packed, its attention in
two SDPA calls, :mod:`pivotrl.training.packed_attention`; fused AdamW); ``full_mask`` = packed under
one masked SDPA call per layer (transformers' ``"sdpa"``, the packed path before the split);
``cache``, ``packed`` and ``unfused`` force one choice; ``unpacked`` runs one forward per group
(``training.pack_tokens: 1``, π_ref's groups not packed together); ``mb2`` and ``mb4`` put 2 or 4
groups in a micro-batch (packed into one forward); ``compiled`` is ``after`` with both models' forwards
under ``torch.compile`` (inductor, dynamic shapes; the warm-up step pays the compilation).

**ceiling** times only the matrix products and the attention one step of those groups needs —
every linear layer's forward GEMM for π_ref and π_θ and its two backward GEMMs (input and weight
gradients) for π_θ, at the packed step's row counts, the output head only at the action positions,
and each layer's packed attention (π_ref forward, π_θ forward and backward) — with random tensors in
the dtype. It prints the GFLOP/s each GEMM shape and the attention reach against the calibrated peak
× threads, and the MFU a step would reach if everything else (element-wise work, copies, the
optimizer, Python) took no time.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import resource
import sys
import time
from pathlib import Path
from typing import Any, Callable

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import DEFAULT_CACHE_DIR, header, load1, md_table, median  # noqa: E402

#: Trainer keyword settings per variant (on top of the default config's training section).
#: ``env`` entries are set while that variant's trainer is built (``PIVOTRL_FUSED_ADAMW=0``: the
#: for-loop AdamW of before).
VARIANTS: dict[str, dict[str, Any]] = {
    "before": {"prefix_method": "cache", "env": {"PIVOTRL_FUSED_ADAMW": "0"}},
    "cache": {"prefix_method": "cache"},
    "unfused": {"env": {"PIVOTRL_FUSED_ADAMW": "0"}},
    "packed": {"prefix_method": "packed"},
    "full_mask": {"prefix_method": "packed", "attention": "sdpa"},
    "unpacked": {"pack_tokens": 1},
    "mb2": {"micro_batch_groups": 2},
    "mb4": {"micro_batch_groups": 4},
    "after": {},
    "compiled": {"compile": True},
}


def _groups(args: argparse.Namespace, seed: int) -> list[Any]:
    from pivotrl.training.groups import Group

    rng = random.Random(seed)
    out = []
    for g in range(args.groups):
        prompt = [rng.randrange(100, 40000) for _ in range(rng.randint(args.prompt_min or args.prompt, args.prompt))]
        acts = [[rng.randrange(100, 40000) for _ in range(rng.randint(max(1, args.action // 4), args.action))]
                for _ in range(args.group_size)]
        out.append(Group(f"g{g}", prompt, acts, [float(j % 2) for j in range(args.group_size)]))
    return out


def _trainer(model_dir: str, args: argparse.Namespace, **overrides: Any) -> Any:
    from pivotrl.config import load_config
    from pivotrl.runtime.mfu import calibrated_peak_gflops
    from pivotrl.training.pivotrl import PivotRLTrainer

    tr = load_config(str(Path(__file__).resolve().parents[1] / "configs" / "default.yaml")).training
    env = overrides.pop("env", {})
    attention = overrides.pop("attention", None)
    compiled = overrides.pop("compile", False)
    fields = {**tr.model_dump(), "group_size": args.group_size, "lr": 1e-7, **overrides}
    saved = {k: os.environ.get(k) for k in env}
    os.environ.update(env)
    try:
        trainer = PivotRLTrainer.build(model_dir, dtype=args.dtype, seed=0, **fields)
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
    if attention is not None:  # e.g. "sdpa": the packed sequence under one masked SDPA call per layer
        for model in (trainer.engine.module, trainer.ref_model):
            model.set_attn_implementation(attention)
    if compiled:  # torch.compile (inductor) of both models' forwards, shapes dynamic as in a run
        for model in (trainer.engine.module, trainer.ref_model):
            model.compile(dynamic=True)
    trainer.peak_gflops_per_thread = calibrated_peak_gflops(args.dtype, args.cache_dir)
    return trainer


class _Timer:
    """Wall seconds per label, from wrapped callables and module hooks (nested: inner labels are
    subtracted from the outer ones at the end)."""

    def __init__(self) -> None:
        self.s: dict[str, float] = {}

    def wrap(self, label: str, fn: Callable[..., Any]) -> Callable[..., Any]:
        def timed(*a: Any, **k: Any) -> Any:
            t0 = time.perf_counter()
            try:
                return fn(*a, **k)
            finally:
                self.s[label] = self.s.get(label, 0.0) + time.perf_counter() - t0
        return timed

    def hook(self, module: torch.nn.Module, label: str) -> None:
        start: list[float] = []
        module.register_forward_pre_hook(lambda *_: start.append(time.perf_counter()))

        def done(*_: Any) -> None:
            self.s[label] = self.s.get(label, 0.0) + time.perf_counter() - start.pop()
        module.register_forward_hook(done)


def profile(model_dir: str, args: argparse.Namespace) -> dict[str, Any]:
    import pivotrl.training.logprobs as lp

    trainer = _trainer(model_dir, args)
    groups = _groups(args, 0)
    trainer.train_step(groups)  # warm-up (allocations, one-time kernel choices)
    timer = _Timer()
    policy = trainer.engine.module
    timer.hook(trainer.ref_model, "π_ref forward")
    timer.hook(policy, "π_θ forward")
    orig_stats, orig_backward, orig_step = lp._token_stats, trainer.engine.backward, trainer.engine.step
    lp._token_stats = timer.wrap("log-prob gathering", orig_stats)
    trainer.engine.backward = timer.wrap("backward", orig_backward)
    trainer.engine.step = timer.wrap("optimizer step", orig_step)
    la = load1()
    r0, t0 = resource.getrusage(resource.RUSAGE_SELF), time.perf_counter()
    m = trainer.train_step(groups)
    wall = time.perf_counter() - t0
    r1 = resource.getrusage(resource.RUSAGE_SELF)
    lp._token_stats, trainer.engine.backward, trainer.engine.step = orig_stats, orig_backward, orig_step
    cpu = (r1.ru_utime - r0.ru_utime) + (r1.ru_stime - r0.ru_stime)
    parts = dict(timer.s)
    # the gathering runs inside the forward calls' callers, not inside the module forwards: no overlap
    parts["other (Python, padding, loss)"] = wall - sum(parts.values())
    rows = [[k, round(v, 2), f"{100 * v / wall:.1f} %"] for k, v in parts.items()]
    print(md_table(["part", "s", "share"], rows))
    print(f"\nstep {wall:.2f} s, load {la}, CPU time {cpu:.2f} s = {cpu / wall:.2f} cores busy "
          f"({torch.get_num_threads()} torch threads); policy tokens {m['tokens']:.0f}, reference tokens "
          f"{m['ref_tokens']:.0f}, model FLOPs {m['model_tflop']:.3f} T → {m['model_tflop'] * 1e3 / wall:.1f} GFLOP/s, "
          f"MFU {100 * m.get('mfu', float('nan')):.1f} % of {m.get('peak_gflops', float('nan')):.0f} GFLOP/s")
    from torch.profiler import ProfilerActivity, profile as tprofile

    with tprofile(activities=[ProfilerActivity.CPU]) as prof:
        trainer.train_step(groups)
    table = prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=int(args.top))
    print("\n" + table)
    return {"parts": parts, "wall_s": wall, "cpu_s": cpu, "load1": la, "metrics": m, "top_ops": table}


def compare(model_dir: str, args: argparse.Namespace) -> dict[str, Any]:
    names = [v.strip() for v in args.variants.split(",") if v.strip()]
    trainers = {n: _trainer(model_dir, args, **dict(VARIANTS[n])) for n in names}
    groups = _groups(args, 0)
    for n in names:  # warm-up
        trainers[n].train_step(groups)
    rows, by = [], {n: [] for n in names}
    for rep in range(args.repeats):
        order = names if rep % 2 == 0 else names[::-1]
        for n in order:
            la = load1()
            m = trainers[n].train_step(groups)
            by[n].append(m)
            rows.append([rep, n, round(m["trainer_s"], 2), round(m["policy_tokens_per_s"], 1),
                         round(m["ref_tokens_per_s"], 1), round(m["model_tflop"] * 1e3 / m["trainer_s"], 1),
                         f"{100 * m.get('mfu', float('nan')):.1f} %", la])
    print(md_table(["round", "variant", "trainer s", "policy tok/s", "ref tok/s", "model GFLOP/s", "MFU", "load"], rows))
    out: dict[str, Any] = {"rows": rows}
    for n in names:
        out[n] = {"mfu_median": median(m.get("mfu", float("nan")) for m in by[n]),
                  "trainer_s_median": median(m["trainer_s"] for m in by[n])}
        print(f"{n}: median MFU {100 * out[n]['mfu_median']:.1f} %, median step {out[n]['trainer_s_median']:.2f} s")
    if len(names) == 2:
        a, b = names
        ratios = [by[a][i]["trainer_s"] / by[b][i]["trainer_s"] for i in range(args.repeats)]
        out["speedup"] = median(ratios)
        print(f"{a} s / {b} s per round: median {out['speedup']:.2f}× (min {min(ratios):.2f}, max {max(ratios):.2f})")
    return out


def _gemm_seconds(m: int, k: int, n: int, dtype: torch.dtype, repeats: int) -> float:
    """Median seconds of one (m × k) · (k × n) product in ``dtype`` (after one warm-up)."""
    a, b = torch.randn(m, k, dtype=dtype), torch.randn(k, n, dtype=dtype)
    torch.mm(a, b)
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        torch.mm(a, b)
        times.append(time.perf_counter() - t0)
    return median(times)


def ceiling(model_dir: str, args: argparse.Namespace) -> dict[str, Any]:
    from transformers import AutoConfig

    from pivotrl.runtime import mfu as M
    from pivotrl.training.logprobs import processed_tokens, work_counts

    cfg = AutoConfig.from_pretrained(model_dir)
    dtype = {"bfloat16": torch.bfloat16, "float32": torch.float32}[args.dtype]
    h, inter, layers = cfg.hidden_size, cfg.intermediate_size, cfg.num_hidden_layers
    head_dim = getattr(cfg, "head_dim", None) or h // cfg.num_attention_heads
    q, kv = cfg.num_attention_heads * head_dim, cfg.num_key_value_heads * head_dim
    linears = {"q": (h, q), "k": (h, kv), "v": (h, kv), "o": (q, h), "gate": (h, inter), "up": (h, inter),
               "down": (inter, h)}
    groups = _groups(args, 0)
    # the packed step's rows (actions padded to the longest), its logit positions and attention pairs
    rows_body = sum(processed_tokens(len(g.prompt_ids), [len(a) for a in g.actions], shared_prefix=True)
                    for g in groups)
    counts = [work_counts(len(g.prompt_ids), [len(a) for a in g.actions], shared_prefix=True) for g in groups]
    rows_head, pairs = sum(c[0] for c in counts), sum(c[1] for c in counts)
    peak = M.calibrated_peak_gflops(args.dtype, args.cache_dir) or float("nan")
    total, table = 0.0, []
    # (label, m, k, n, times per step): forward for π_ref and π_θ (2×), backward dX and dW for π_θ
    shapes = []
    for name, (fin, fout) in linears.items():
        shapes += [(f"{name} fwd", rows_body, fin, fout, 2 * layers), (f"{name} bwd dX", rows_body, fout, fin, layers),
                   (f"{name} bwd dW", fout, rows_body, fin, layers)]
    shapes += [("head fwd", rows_head, h, cfg.vocab_size, 2), ("head bwd dX", rows_head, cfg.vocab_size, h, 1),
               ("head bwd dW", cfg.vocab_size, rows_head, h, 1)]
    for label, m, k, n, times in shapes:
        s = _gemm_seconds(m, k, n, dtype, args.repeats)
        total += s * times
        rate = 2 * m * k * n / s / 1e9
        table.append([label, f"{m}×{k}×{n}", times, round(s * 1e3, 2), round(rate, 1),
                      f"{100 * rate / (peak * args.threads):.0f} %"])
    print(md_table(["GEMM", "m×k×n", "per step", "ms", "GFLOP/s", "of peak"], table))
    shape = M.ModelShape.of_config(cfg, _n_params(cfg))
    flop = 4 * M.forward_flops(shape, rows_body, rows_head, pairs)  # π_θ 3× + π_ref 1×
    gemm_flop = flop - 4 * 4 * layers * shape.attn_dim * pairs
    attn = layers * sum(_attention_seconds(len(g.prompt_ids), len(g.actions), max(len(a) for a in g.actions) - 1,
                                           cfg.num_attention_heads, cfg.num_key_value_heads, head_dim, dtype,
                                           args.repeats) for g in groups)
    print(f"\nGEMMs: {gemm_flop / 1e12:.3f} TFLOP in {total:.2f} s = {gemm_flop / total / 1e9:.1f} GFLOP/s "
          f"({100 * (M.mfu(gemm_flop, total, peak, args.threads) or float('nan')):.1f} % of {args.threads} × {peak:.1f} GFLOP/s)")
    print(f"attention (the packed path's SDPA calls, π_ref forward + π_θ forward and backward): "
          f"{(flop - gemm_flop) / 1e12:.3f} TFLOP in {attn:.2f} s = {(flop - gemm_flop) / attn / 1e9:.1f} GFLOP/s")
    ceil = M.mfu(flop, total + attn, peak, args.threads)
    print(f"GEMMs + attention alone: {total + attn:.2f} s for the step's {flop / 1e12:.3f} model TFLOP → MFU ceiling "
          f"{100 * (ceil or float('nan')):.1f} % (everything else taking no time)")
    return {"gemm_s": total, "attention_s": attn, "model_tflop": flop / 1e12, "gemm_tflop": gemm_flop / 1e12,
            "mfu_ceiling": ceil, "rows": table}


def _attention_seconds(p: int, k: int, s: int, heads: int, kv_heads: int, head_dim: int, dtype: torch.dtype,
                       repeats: int) -> float:
    """Median seconds of one layer's attention for one packed group (state P, K actions of s inputs)
    through :func:`pivotrl.training.packed_attention._packed_attention`, laid out as the model lays it
    out: one forward without gradients (π_ref) plus one forward and backward (π_θ)."""
    from pivotrl.training.packed_attention import SEGMENTS_KWARG, _packed_attention

    n = p + k * s
    idx, block = torch.arange(n), torch.cat([torch.full((p,), -1), torch.arange(k).repeat_interleave(s)])
    attend = (idx[:, None] >= idx[None]) & ((block[None] == -1) | (block[:, None] == block[None]))
    mask = torch.zeros(n, n, dtype=dtype).masked_fill_(~attend, torch.finfo(dtype).min)[None, None]
    x = [torch.randn(1, n, h * head_dim, dtype=dtype, requires_grad=True) for h in (heads, kv_heads, kv_heads)]

    def once(grad: bool) -> None:
        with torch.set_grad_enabled(grad):
            q, kk, v = (t.view(1, n, -1, head_dim).transpose(1, 2) for t in x)
            out, _ = _packed_attention(None, q, kk, v, mask, scaling=head_dim ** -0.5, **{SEGMENTS_KWARG: ((0, p, n),)})
            if grad:
                out.sum().backward()

    def step() -> None:
        once(False)
        once(True)

    step()
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        step()
        times.append(time.perf_counter() - t0)
    return median(times)


def _n_params(cfg: Any) -> int:
    """Parameters of a Llama-type decoder from its config (tied head counted once)."""
    h, inter, layers = cfg.hidden_size, cfg.intermediate_size, cfg.num_hidden_layers
    head_dim = getattr(cfg, "head_dim", None) or h // cfg.num_attention_heads
    q, kv = cfg.num_attention_heads * head_dim, cfg.num_key_value_heads * head_dim
    block = h * q + 2 * h * kv + q * h + 3 * h * inter + 2 * h
    embed = cfg.vocab_size * h
    return layers * block + h + embed * (1 if getattr(cfg, "tie_word_embeddings", False) else 2)


def main(argv: list[str] | None = None) -> int:
    from pivotrl.runtime.models import DEFAULT_MODEL_SOURCE, resolve_model

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("what", choices=["profile", "compare", "ceiling"])
    ap.add_argument("--model", default=DEFAULT_MODEL_SOURCE)
    ap.add_argument("--cache-dir", default=DEFAULT_CACHE_DIR)
    ap.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    ap.add_argument("--groups", type=int, default=2)
    ap.add_argument("--group-size", type=int, default=8)
    ap.add_argument("--prompt", type=int, default=1000)
    ap.add_argument("--prompt-min", type=int, default=None,
                    help="draw each state's length between this and --prompt (default: all --prompt)")
    ap.add_argument("--action", type=int, default=32)
    ap.add_argument("--threads", type=int, default=int(os.environ.get("OMP_NUM_THREADS", "2") or 2))
    ap.add_argument("--variants", default="before,after")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--top", type=int, default=15)
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    os.environ["OMP_NUM_THREADS"] = str(args.threads)
    print(header(f"bench_mfu {args.what}"))
    model_dir = str(resolve_model(args.model, args.cache_dir))
    out = {"profile": profile, "compare": compare, "ceiling": ceiling}[args.what](model_dir, args)
    if args.json:
        Path(args.json).write_text(json.dumps(out, indent=1, default=str))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
