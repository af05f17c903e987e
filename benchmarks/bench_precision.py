"""Matmul peak per dtype and the warm start's forward+backward throughput on this CPU.

    OMP_NUM_THREADS=2 .venv/bin/python benchmarks/bench_precision.py [--seq 2048] [--loss-frac 0.1]
    ATEN_CPU_CAPABILITY=avx2 ONEDNN_MAX_CPU_ISA=AVX2 .venv/bin/python benchmarks/bench_precision.py

Prints, as JSON: the CPU (model, flags relevant to bf16, torch capability), the dtype
``model.dtype: auto`` resolves to, the 1024x1024 matmul GFLOP/s in fp32 and bf16 (best of 5, all
threads), and the SmolLM2-135M-shaped warm-start step (random weights built from SmolLM2's
architecture: same FLOPs, no download) on one ``--seq``-token sequence with a loss on the last
``--loss-frac`` of it: seconds and tokens/s for the output layer over every position (the former
loss) and over the loss positions only (the current one), in the resolved dtype, and that
throughput as a fraction of the matmul peak by the 6·N·T rule.
"""

from __future__ import annotations

import argparse
import json
import os
import time

import torch


def matmul_gflops(dtype: torch.dtype, n: int = 1024, reps: int = 5) -> float:
    a, b = torch.randn(n, n).to(dtype), torch.randn(n, n).to(dtype)
    for _ in range(2):
        a @ b
    best = float("inf")
    for _ in range(reps):
        t0 = time.perf_counter()
        a @ b
        best = min(best, time.perf_counter() - t0)
    return 2 * n**3 / best / 1e9


def smollm2_shaped(dtype: torch.dtype):
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(vocab_size=49152, hidden_size=576, intermediate_size=1536, num_hidden_layers=30,
                      num_attention_heads=9, num_key_value_heads=3, max_position_embeddings=8192,
                      tie_word_embeddings=True, rms_norm_eps=1e-5)
    torch.manual_seed(0)
    model = LlamaForCausalLM(cfg).to(dtype).eval()
    return model, sum(p.numel() for p in model.parameters())


def full_loss(model, ids, mask):
    logits = model(input_ids=ids, use_cache=False).logits[:, :-1]
    lp = torch.log_softmax(logits.float(), -1).gather(-1, ids[:, 1:].unsqueeze(-1)).squeeze(-1)
    return -(lp * mask[:, 1:]).sum()


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--seq", type=int, default=2048)
    ap.add_argument("--loss-frac", type=float, default=0.1)
    ap.add_argument("--reps", type=int, default=2)
    a = ap.parse_args()
    from pivotrl.runtime.precision import describe, detect_hardware, resolve_precision
    from pivotrl.training.sft import sft_batch_loss

    hw = detect_hardware()
    prec = resolve_precision("auto", hw)
    dtype = torch.bfloat16 if prec.dtype == "bf16" else torch.float32
    out = {"hardware": describe(hw), "threads": torch.get_num_threads(), "resolved": prec.record(),
           "load_avg": os.getloadavg(),
           "matmul_gflops": {"fp32": matmul_gflops(torch.float32), "bf16": matmul_gflops(torch.bfloat16)}}
    model, n_params = smollm2_shaped(dtype)
    ids = torch.randint(0, 49152, (1, a.seq))
    mask = torch.zeros(1, a.seq)
    mask[0, int(a.seq * (1 - a.loss_frac)):] = 1
    example = [(ids[0].tolist(), mask[0].long().tolist())]
    times = {"all_positions": [], "loss_positions": []}
    for _ in range(a.reps):  # interleaved
        for name in times:
            t0 = time.perf_counter()
            loss = full_loss(model, ids, mask) if name == "all_positions" else sft_batch_loss(model, example, 1)[0]
            loss.backward()
            times[name].append(time.perf_counter() - t0)
            model.zero_grad(set_to_none=True)
    peak = out["matmul_gflops"][prec.dtype] * 1e9
    out["warm_start_step"] = {
        name: {"seconds": min(t), "tokens_per_s": a.seq / min(t),
               "fraction_of_matmul_peak": 6 * n_params * a.seq / min(t) / peak}
        for name, t in times.items()}
    out["seq"], out["loss_frac"], out["params"] = a.seq, a.loss_frac, n_params
    out["load_avg_end"] = os.getloadavg()
    print(json.dumps(out, indent=2))


if __name__ == "__main__":
    main()
