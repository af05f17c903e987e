"""Generation MFU: the model FLOPs a rollout engine spends generating, over its wall time, against
the calibrated peak (the trainer's rule, :mod:`pivotrl.runtime.mfu`, forward only).

One :class:`GenerationMeter` per engine, fed by the engine from its own outputs
(:meth:`GenerationMeter.record`, one call per request) and timed around each engine call
(:meth:`GenerationMeter.timed`). A stage takes :func:`snapshot` of its engine before it generates
and :func:`since` after: the :class:`GenerationTotals` of its own calls, which
:meth:`GenerationTotals.metrics` turns into the ``gen_*`` columns (metrics.parquet, summaries,
MLflow), :meth:`GenerationTotals.counters` into progress-line counters and
:meth:`GenerationTotals.line` into one log line.

**Counting, per request** of a prompt of P tokens with n samples of T_1..T_n generated tokens,
prefilled in one or more passes, pass j finding c_j prompt tokens in the engine's prefix cache:

* prefill: each pass runs P − c_j tokens through the body, attending Σ_{t=c_j+1..P} t (query, key)
  pairs (the tokens it computes are the prompt's tail from c_j + 1, each attending every key up to
  its own position: exact for causal attention, no approximation);
* decode: each sample feeds back its tokens but the last, T_i − 1 tokens, the one at context
  position P + t attending P + t keys;
* output head: one logits row per generated token, Σ T_i.

Forward FLOPs = :func:`pivotrl.runtime.mfu.forward_flops` of those totals. The passes are the
engine's: the transformers engine counts one pass per prompt, c = 0 (with
``reuse_prompt_cache=False`` it computes the prompt once per sample, still counted once); vLLM runs an
n-sample request as n child requests, each prefilling the prompt after its own prefix-cache hit
(the first computes the prompt, its siblings hit its full KV blocks and recompute the partial last
block), and :class:`pivotrl.rollout.vllm.VLLMEngine` reads every child's hit from the engine's own
per-request statistics, so prefill_tokens is what the engine computed: the scheduler's
prefix-cache queries − hits over the call (``vllm:prefix_cache_queries`` −
``vllm:prefix_cache_hits``). Where those statistics are not available (a vLLM built without them,
an engine started with ``disable_log_stats=True``) it falls back to the one ``num_cached_tokens``
vLLM reports per request, that of the child finishing last, as one pass: the prompt counted once
from that child's hit, which under-counts the prefill of n > 1 requests (benchmarks/RESULTS.md §23).
Work the engine does that no counted token needs (a padded batch, a request recomputed after a
preemption) is not model FLOPs: it shows as lower MFU.

The wall time is the engine call's (scheduling, sampling, detokenizing included), so MFU here is
what a stage gets from the engine, not what its kernels reach (``benchmarks/bench_generation.py``
separates the two). Pure: no torch import.
"""

from __future__ import annotations

import json
import struct
import threading
import time
from contextlib import contextmanager
from dataclasses import dataclass, fields, replace
from pathlib import Path
from typing import Any, Iterable, Iterator, Sequence

from pivotrl.runtime.mfu import ModelShape, forward_flops, mfu

__all__ = ["GenerationMeter", "GenerationTotals", "generation_peak", "prefill_passes", "request_flops",
           "safetensors_params", "shape_of_checkpoint", "side_by_side", "since", "snapshot"]


def prefill_passes(prompt_len: int, cached: int | Sequence[int] | None) -> list[int]:
    """The prompt tokens found cached by each prefill pass of a request, each clipped to [0, P]:
    ``cached`` is one number (None: 0) for a prompt prefilled once, or one number per pass."""
    p = int(prompt_len)
    if cached is None or isinstance(cached, (int, float)):
        cached = [int(cached or 0)]
    return [max(0, min(int(c), p)) for c in cached]


def request_flops(shape: ModelShape, prompt_len: int, cached: int | Sequence[int] | None,
                  sample_lengths: Sequence[int]) -> float:
    """Forward model FLOPs of one request (see the module docstring); ``cached`` as
    :func:`prefill_passes` takes it."""
    p = int(prompt_len)
    fed, pairs = 0, 0
    for c in prefill_passes(p, cached):
        fed += p - c
        pairs += p * (p + 1) // 2 - c * (c + 1) // 2
    logits = 0
    for n in sample_lengths:
        steps = max(int(n) - 1, 0)
        fed += steps
        pairs += steps * p + steps * (steps + 1) // 2
        logits += int(n)
    return forward_flops(shape, fed, logits, pairs)


@dataclass(frozen=True)
class GenerationTotals:
    """Sums over an engine's requests.

    Attributes:
        requests: prompts served; samples: sequences generated (requests × n).
        prompt_tokens: prompt tokens of the requests; prefill_tokens: those computed (after
            prefix-cache hits, in every prefill pass: more than prompt_tokens where an engine
            computes a prompt once per sample); generated_tokens: tokens sampled.
        flops: forward model FLOPs of both (module docstring); seconds: wall time of the engine calls.
        threads: threads the engine computes with; dtype: its compute dtype ("fp32" | "bf16").
    """

    requests: int = 0
    samples: int = 0
    prompt_tokens: int = 0
    prefill_tokens: int = 0
    generated_tokens: int = 0
    flops: float = 0.0
    seconds: float = 0.0
    threads: int = 1
    dtype: str = "fp32"

    def minus(self, before: "GenerationTotals") -> "GenerationTotals":
        """What was added since ``before`` (an earlier snapshot of the same meter)."""
        return replace(self, **{f.name: getattr(self, f.name) - getattr(before, f.name) for f in fields(self)
                                if f.name not in ("threads", "dtype")})

    def plus(self, other: "GenerationTotals") -> "GenerationTotals":
        """Two engines' totals together (threads add up: they run side by side)."""
        return replace(self, threads=self.threads + other.threads,
                       **{f.name: getattr(self, f.name) + getattr(other, f.name) for f in fields(self)
                          if f.name not in ("threads", "dtype")})

    def mfu(self, peak_gflops_per_thread: float | None) -> float | None:
        """FLOPs / seconds against ``peak_gflops_per_thread`` × :attr:`threads`; None without a peak or time."""
        return mfu(self.flops, self.seconds, peak_gflops_per_thread, self.threads)

    def metrics(self, peak_gflops_per_thread: float | None, prefix: str = "gen_") -> dict[str, float]:
        """The ``{prefix}*`` numbers: prompt_tokens, prefill_tokens, tokens (generated), tflop,
        s (wall seconds), tokens_per_s (generated), threads and, with a peak, peak_gflops and mfu
        (a fraction). {} when nothing was generated."""
        if not self.requests:
            return {}
        out = {"prompt_tokens": float(self.prompt_tokens), "prefill_tokens": float(self.prefill_tokens),
               "tokens": float(self.generated_tokens), "tflop": self.flops / 1e12, "s": self.seconds,
               "tokens_per_s": self.generated_tokens / self.seconds if self.seconds > 0 else 0.0,
               "threads": float(self.threads)}
        util = self.mfu(peak_gflops_per_thread)
        if util is not None and peak_gflops_per_thread:
            out["peak_gflops"] = peak_gflops_per_thread * self.threads
            out["mfu"] = util
        return {prefix + k: v for k, v in out.items()}

    def counters(self, peak_gflops_per_thread: float | None) -> dict[str, float]:
        """Counters for a progress line (:class:`pivotrl.core.progress.Progress`): prefilled and
        generated tokens, generated tokens/s and generation MFU in %."""
        out = {"prefilled tok": float(self.prefill_tokens), "generated tok": float(self.generated_tokens),
               "gen tok/s": round(self.generated_tokens / self.seconds, 1) if self.seconds > 0 else 0.0}
        util = self.mfu(peak_gflops_per_thread)
        if util is not None:
            out["gen MFU %"] = round(100 * util, 2)
        return out

    def line(self, label: str, peak_gflops_per_thread: float | None) -> str:
        """``label: generation 12.3k prompt tokens (9.1k prefilled), 4.5k generated in 45.0 s, 1.23 TFLOP, MFU 3.1 %
        (bf16, 2 threads)``."""
        util = self.mfu(peak_gflops_per_thread)
        rate = self.generated_tokens / self.seconds if self.seconds > 0 else 0.0
        return (f"{label}: generation {self.prompt_tokens} prompt tokens ({self.prefill_tokens} prefilled), "
                f"{self.generated_tokens} generated in {self.seconds:.1f} s ({rate:.1f} tok/s), "
                f"{self.flops / 1e12:.3f} TFLOP, MFU " + ("n/a" if util is None else f"{100 * util:.2f} %")
                + f" ({self.dtype}, {self.threads} threads)")


class GenerationMeter:
    """An engine's running :class:`GenerationTotals` (thread-safe).

    Args:
        shape: the model's :class:`~pivotrl.runtime.mfu.ModelShape`; None: tokens and time only
            (FLOPs stay 0, no MFU).
        threads: threads the engine computes with; dtype: "fp32" | "bf16".
    """

    def __init__(self, shape: ModelShape | None, threads: int, dtype: str) -> None:
        self.shape = shape
        self._lock = threading.Lock()
        name = {"float32": "fp32", "bfloat16": "bf16"}.get(str(dtype), str(dtype))
        self._totals = GenerationTotals(threads=max(int(threads), 1), dtype=name)

    def record(self, prompt_len: int, cached: int | Sequence[int] | None, sample_lengths: Sequence[int]) -> None:
        """Add one finished request: its prompt length, the prompt tokens found cached (one number,
        None: 0, for a prompt prefilled once; one per prefill pass where the engine prefills it
        several times, e.g. vLLM's child requests) and its samples' generated lengths."""
        passes = prefill_passes(prompt_len, cached)
        prefill = sum(int(prompt_len) - c for c in passes)
        flops = request_flops(self.shape, prompt_len, passes, sample_lengths) if self.shape is not None else 0.0
        with self._lock:
            t = self._totals
            self._totals = replace(t, requests=t.requests + 1, samples=t.samples + len(sample_lengths),
                                   prompt_tokens=t.prompt_tokens + int(prompt_len),
                                   prefill_tokens=t.prefill_tokens + prefill,
                                   generated_tokens=t.generated_tokens + sum(int(n) for n in sample_lengths),
                                   flops=t.flops + flops)

    def add_seconds(self, seconds: float) -> None:
        with self._lock:
            self._totals = replace(self._totals, seconds=self._totals.seconds + float(seconds))

    @contextmanager
    def timed(self) -> Iterator[None]:
        """Add the wall time of the ``with`` block (one engine call)."""
        t0 = time.perf_counter()
        try:
            yield
        finally:
            self.add_seconds(time.perf_counter() - t0)

    def totals(self) -> GenerationTotals:
        with self._lock:
            return self._totals


def snapshot(engine: Any) -> GenerationTotals | None:
    """The totals of ``engine``'s meter (``engine.meter``); for a pool (``engine.engines``) its engines'
    counts, FLOPs and threads summed over the pool's own wall time (``engine.generation_seconds``:
    its engines generate at the same time, so their seconds are not added; the longest engine's when
    the pool keeps no time; a pool of one engine gives that engine's own totals). None when no engine keeps a meter (e.g. a test double)."""
    meter = getattr(engine, "meter", None)
    if isinstance(meter, GenerationMeter):
        return meter.totals()
    out = side_by_side(snapshot(e) for e in getattr(engine, "engines", None) or [])
    wall = getattr(engine, "generation_seconds", None)
    if out is not None and isinstance(wall, (int, float)) and len(engine.engines) > 1:
        out = replace(out, seconds=float(wall))
    return out


def since(engine: Any, before: GenerationTotals | None) -> GenerationTotals | None:
    """What ``engine`` generated since :func:`snapshot` returned ``before`` (None without a meter)."""
    now = snapshot(engine)
    if now is None or before is None:
        return now
    return now.minus(before)


def side_by_side(parts: Iterable[GenerationTotals | None]) -> GenerationTotals | None:
    """The totals of engines that generated at the same time, e.g. one engine on each host rank in
    one training step: counts, FLOPs and threads summed, seconds those of the longest (the wall
    time they shared: generated tokens/s and MFU are of all their threads over that time); None
    parts (a rank without an engine or a meter) left out; None when no part is left."""
    use = [p for p in parts if p is not None]
    if not use:
        return None
    out = use[0]
    for p in use[1:]:
        out = out.plus(p)
    return replace(out, seconds=max(p.seconds for p in use))


def safetensors_params(model_dir: str | Path) -> tuple[int, set[str]]:
    """Parameter count and tensor names of an HF checkpoint's ``*.safetensors`` files (their JSON
    headers only). ValueError when there is none."""
    files = sorted(Path(model_dir).glob("*.safetensors"))
    if not files:
        raise ValueError(f"{model_dir} has no *.safetensors file")
    total, names = 0, set()
    for f in files:
        with open(f, "rb") as fh:
            (size,) = struct.unpack("<Q", fh.read(8))
            header = json.loads(fh.read(size))
        for name, meta in header.items():
            if name == "__metadata__":
                continue
            n = 1
            for d in meta["shape"]:
                n *= int(d)
            total += n
            names.add(name)
    return total, names


def shape_of_checkpoint(model_dir: str | Path, config: Any) -> ModelShape | None:
    """The :class:`ModelShape` of a checkpoint directory and its ``transformers`` config (a head
    stored beside a tied embedding counted once); None when it cannot be read."""
    try:
        n, names = safetensors_params(model_dir)
        if getattr(config, "tie_word_embeddings", False) and "lm_head.weight" in names:
            n -= int(config.vocab_size) * int(config.hidden_size)
        return ModelShape.of_config(config, n)
    except (OSError, ValueError, KeyError, TypeError):
        return None


def generation_peak(totals: GenerationTotals | None, cache_dir: str | Path | None) -> float | None:
    """The calibrated per-thread peak (GFLOP/s) of ``totals.dtype`` from ``<cache_dir>/calibration.json``
    (:func:`pivotrl.runtime.mfu.calibrated_peak_gflops`); None without totals, a cache folder or a calibration."""
    from pivotrl.runtime.mfu import calibrated_peak_gflops

    if totals is None or not cache_dir:
        return None
    return calibrated_peak_gflops(totals.dtype, str(cache_dir))
