"""Model FLOPs utilization (MFU): the model FLOPs a computation needs, over its time, against the
machine's calibrated peak.

**Counting (the standard rule, Kaplan et al. 2020 §2.1, PaLM appendix B).** A forward pass costs
2 FLOPs per parameter per token (one multiply-add), a forward+backward pass 3× that (6·N). Counted
per part of a decoder-only transformer:

* the **body** (every weight matrix of the transformer blocks: attention projections, MLP, norms;
  ``n_body`` = all parameters minus the input embedding and the output head): 2·``n_body`` per
  token run through the model;
* the **output head** (``n_head`` = V·d, the projection to the vocabulary; tied or not): 2·``n_head``
  per position whose logits are computed. The trainer computes logits only where a log-probability
  is needed (the action tokens, ``logits_to_keep``); a warm start computes them everywhere. The
  input embedding is a table lookup: no FLOPs;
* **attention** (the score and value products, no parameters): 4·``n_layers``·``attn_dim`` per
  (query, key) pair a causal model attends to: 2·``attn_dim`` for q·k and 2·``attn_dim`` for the
  weighted sum of values, per layer. One sequence of L tokens attends L(L+1)/2 pairs; K actions of
  T tokens on a cached prefix of P tokens attend K·Σ_{t=1..T}(P + t).

Training FLOPs = 3 × the forward FLOPs of the same tokens (backward = 2 × forward); forward-only
work (the frozen reference, scoring) counts 1×. Recomputation, padding a kernel computes but the
model does not need, and the optimizer are not model FLOPs (they show as lower MFU).

So for SmolLM2-135M (n_body 106.2 M, n_head 28.3 M, 30 layers, attn_dim 576) a warm-start token of
a 1,000-token sequence costs 6·(106.2 + 28.3) M + 12·30·576·500.5 ≈ 911 MFLOP; a policy action
token of the RL trainer on a 1,000-token state ≈ 6·134.5 M + 12·30·576·1,000 ≈ 1,014 MFLOP.

**Peak.** The peak is the machine's calibration (:mod:`pivotrl.runtime.sizing`, ``calibration.json``): a
timed 1024² matmul in the compute dtype on one torch thread, per core; the peak of a process is
that × the threads it uses (all ranks together). MFU = model FLOPs / seconds / peak.

Pure: no torch import (:meth:`ModelShape.of_model` reads a model's parameters duck-typed).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Iterable, Sequence

__all__ = ["ModelShape", "attention_pairs_causal", "attention_pairs_shared", "calibrated_peak_gflops",
           "forward_flops", "mfu", "train_flops"]


@dataclass(frozen=True)
class ModelShape:
    """What the FLOP count needs of a decoder-only model.

    Attributes:
        n_body: parameters of the transformer blocks and final norm (all parameters minus the input
            embedding and the output head; a tied head is counted once, as the head).
        n_head: parameters of the output projection (vocabulary × hidden).
        n_layers: transformer blocks.
        attn_dim: width of the attention products (query heads × head dim).
    """

    n_body: int
    n_head: int
    n_layers: int
    attn_dim: int

    @classmethod
    def of_config(cls, config: Any, n_params: int) -> "ModelShape":
        """From a ``transformers`` config (``vocab_size``, ``hidden_size``, ``num_hidden_layers``,
        ``num_attention_heads``, optional ``head_dim``) and the model's parameter count
        ``n_params`` (tied weights counted once). The input embedding is V·d; an untied head
        another V·d. ValueError when the config lacks a field."""
        try:
            v, d = int(config.vocab_size), int(config.hidden_size)
            layers, heads = int(config.num_hidden_layers), int(config.num_attention_heads)
        except (AttributeError, TypeError) as err:
            raise ValueError(f"model config lacks a field the FLOP count needs ({err})") from None
        head_dim = int(getattr(config, "head_dim", None) or d // heads)
        tied = bool(getattr(config, "tie_word_embeddings", False))
        embed = v * d
        n_body = int(n_params) - embed - (0 if tied else embed)
        if n_body <= 0:
            raise ValueError(f"{n_params} parameters leave no transformer body beside a {v}×{d} embedding")
        return cls(n_body=n_body, n_head=embed, n_layers=layers, attn_dim=heads * head_dim)

    @classmethod
    def of_model(cls, model: Any) -> "ModelShape":
        """From a ``transformers`` model (or a DeepSpeed engine around one): its config and its
        distinct parameters' sizes (under ZeRO-3 the partitioned parameters' ``ds_numel``)."""
        module = getattr(model, "module", model)
        seen: set[int] = set()
        total = 0
        for p in module.parameters():
            if id(p) in seen:
                continue
            seen.add(id(p))
            total += int(getattr(p, "ds_numel", 0) or p.numel())
        return cls.of_config(module.config, total)


def attention_pairs_causal(lengths: Iterable[int]) -> int:
    """(query, key) pairs of causal sequences of these lengths run from scratch: Σ L(L+1)/2."""
    return sum(int(n) * (int(n) + 1) // 2 for n in lengths)


def attention_pairs_shared(prompt_len: int, k: int, steps: int) -> int:
    """Pairs of one state of ``prompt_len`` tokens run once, then ``k`` continuations of ``steps``
    tokens each on its cache (padding included): P(P+1)/2 + k·Σ_{t=1..steps}(P + t)."""
    p, s = int(prompt_len), int(steps)
    return p * (p + 1) // 2 + int(k) * (s * p + s * (s + 1) // 2)


def forward_flops(shape: ModelShape, tokens: int, logit_positions: int, attention_pairs: int) -> float:
    """Model FLOPs of one forward pass over ``tokens`` tokens, ``logit_positions`` of them with
    logits, attending ``attention_pairs`` (query, key) pairs (see the module docstring)."""
    return float(2 * shape.n_body * tokens + 2 * shape.n_head * logit_positions
                 + 4 * shape.n_layers * shape.attn_dim * attention_pairs)


def train_flops(shape: ModelShape, tokens: int, logit_positions: int, attention_pairs: int) -> float:
    """Model FLOPs of forward + backward over the same work: 3 × :func:`forward_flops`."""
    return 3.0 * forward_flops(shape, tokens, logit_positions, attention_pairs)


def mfu(flops: float, seconds: float, peak_gflops_per_thread: float | None, threads: int) -> float | None:
    """``flops / seconds`` as a fraction of ``peak_gflops_per_thread × threads`` (GFLOP/s); None
    when there is no peak or no time."""
    if not peak_gflops_per_thread or seconds <= 0 or threads <= 0:
        return None
    return flops / seconds / (peak_gflops_per_thread * 1e9 * threads)


def calibrated_peak_gflops(dtype: str, cache_dir: str, measure: Any = None) -> float | None:
    """The machine's per-thread matmul peak (GFLOP/s) in ``dtype`` ("bf16" | "fp32" | "bfloat16" |
    "float32") from ``<cache_dir>/calibration.json`` (:mod:`pivotrl.runtime.sizing`; measured, about three seconds,
    and kept when absent). None on CUDA (no CPU calibration applies) or when it cannot be measured."""
    from pivotrl.runtime.precision import detect_hardware
    from pivotrl.runtime.sizing import _cached_gflops, measure_gflops

    name = {"bfloat16": "bf16", "float32": "fp32"}.get(dtype, dtype)
    if detect_hardware().device == "cuda":
        return None
    try:
        gflops, _ = _cached_gflops(cache_dir, name, 1, measure or measure_gflops)
    except (OSError, RuntimeError, ValueError):
        return None
    return float(gflops) if gflops > 0 else None


def summarize(rows: Sequence[dict[str, Any]]) -> dict[str, float]:
    """A stage's totals from its per-step metrics rows: ``model_tflop`` (Σ), ``trainer_s`` (Σ),
    ``mfu`` (Σ FLOPs over Σ time against the steps' peak), ``policy_tokens_per_s`` and
    ``ref_tokens_per_s`` over the trainer's time. Rows without the columns are skipped; {} when none has them."""
    use = [r for r in rows if isinstance(r.get("model_tflop"), (int, float)) and r.get("trainer_s")]
    if not use:
        return {}
    flop = sum(float(r["model_tflop"]) for r in use)
    secs = sum(float(r["trainer_s"]) for r in use)
    out = {"model_tflop": flop, "trainer_s": secs,
           "policy_tokens_per_s": sum(float(r.get("tokens", 0.0)) for r in use) / secs,
           "ref_tokens_per_s": sum(float(r.get("ref_tokens", 0.0)) for r in use) / secs}
    peaks = [float(r["peak_gflops"]) for r in use if isinstance(r.get("peak_gflops"), (int, float)) and r["peak_gflops"] > 0]
    if len(peaks) == len(use):
        out["mfu"] = flop * 1e3 / secs / (sum(peaks) / len(peaks))
    return out
