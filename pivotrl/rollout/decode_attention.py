"""A matmul attention for decode steps, registered with transformers as ``"pivotrl_decode"``.

On CPU, PyTorch's SDPA kernel is ~17x slower for one bf16 query token, which made it most of a
decode step of :class:`pivotrl.rollout.hf.TransformersEngine`; prefill (longer queries) still
uses SDPA. torch and transformers are imported inside the functions.
"""

from __future__ import annotations

from typing import Any

__all__ = ["DECODE_ATTENTION", "register_decode_attention"]

DECODE_ATTENTION = "pivotrl_decode"
_DECODE_MAX_QUERY = 8  # query lengths up to this use the matmul path; longer ones use SDPA


def _decode_attention(
    module: Any,
    query: Any,
    key: Any,
    value: Any,
    attention_mask: Any,
    dropout: float = 0.0,
    scaling: float | None = None,
    **kwargs: Any,
) -> tuple[Any, None]:
    """Attention for short queries (decode steps) as two matmuls with an fp32 softmax.

    On CPU, PyTorch's SDPA kernel takes ≈ 8 ms per layer for one bf16 query token against 1k keys
    (8 rows, 9 heads), ~17x slower than this path; the results agree to rounding. Shapes:
    query (B, H, q, D), key/value (B, H_kv, S, D), mask (B, 1, q, S) bool (True = attend) or
    additive float, or None; returns (B, q, H, D). Longer queries (prefill) go to SDPA.
    """
    import torch
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    b, h, q, d = query.shape
    if q > _DECODE_MAX_QUERY or dropout or key.shape[-1] != value.shape[-1]:
        return sdpa_attention_forward(
            module, query, key, value, attention_mask, dropout=dropout, scaling=scaling, **kwargs
        )
    h_kv, s = key.shape[1], key.shape[2]
    groups = h // h_kv
    scale = scaling if scaling is not None else d**-0.5
    # grouped-query attention without repeating keys/values: (B·H_kv, G·q, S) scores
    q_flat = query.reshape(b * h_kv, groups * q, d)
    scores = torch.bmm(q_flat, key.flatten(0, 1).transpose(1, 2)).float()
    scores = scores.view(b, h_kv, groups, q, s) * scale
    if attention_mask is not None:
        mask = attention_mask[:, :, -q:, -s:].unsqueeze(2)  # (B, 1, 1, q, S)
        if mask.dtype == torch.bool:
            scores = scores.masked_fill(~mask, float("-inf"))
        else:
            scores = scores + mask.float()
    elif q > 1 and kwargs.get("is_causal", getattr(module, "is_causal", True)):
        # no mask given (SDPA would use is_causal): query i sits at position S - q + i
        causal = torch.ones(q, s, dtype=torch.bool, device=scores.device).tril(diagonal=s - q)
        scores = scores.masked_fill(~causal, float("-inf"))
    probs = torch.softmax(scores, dim=-1).to(value.dtype).view(b * h_kv, groups * q, s)
    out = torch.bmm(probs, value.flatten(0, 1)).view(b, h, q, d)  # heads ordered kv-major, as repeat_kv
    return out.transpose(1, 2).contiguous(), None


def register_decode_attention() -> None:
    """Register :data:`DECODE_ATTENTION` with transformers (once per process)."""
    from transformers import AttentionInterface
    from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, sdpa_mask

    if DECODE_ATTENTION not in AttentionInterface._global_mapping:
        AttentionInterface.register(DECODE_ATTENTION, _decode_attention)
        ALL_MASK_ATTENTION_FUNCTIONS.register(DECODE_ATTENTION, sdpa_mask)
