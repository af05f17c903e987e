"""Attention for packed shared-prefix sequences, registered with transformers as ``"pivotrl_packed"``.

A packed segment of :mod:`pivotrl.training.logprobs` is ``state + a_1[:-1] + … + a_K[:-1]`` (length
P + K·s) under a block mask: the state causal, every action token sees the whole state and its own
earlier tokens. One forward may hold several segments (groups) one after the other, each seeing only
itself. PyTorch's SDPA kernels cannot skip any block of an explicit mask, so plain SDPA visits all L²
(query, key) pairs of the sequence, about twice the pairs the mask lets through for one group (P =
1,000, K = 8, s = 31: 1.56 M visited, 0.75 M attended) and more with every group added. This
function computes, per segment, with the same result:

* the state's P queries against the state's P keys with ``is_causal=True`` and no mask (the kernel
  skips the blocks above the diagonal);
* the K·s action queries against the segment's keys under the segment's action rows of the mask.

It runs only when the forward is given ``pivotrl_segments=((start, P, end), …)`` (``logprobs``
passes it) and the layout is the packed one (batch 1, queries = keys, a mask covering them); any other
call (generation, a plain forward, dropout) goes to transformers' own SDPA function unchanged.
Measured in benchmarks/RESULTS.md §14j. torch and transformers are imported inside the functions.
"""

from __future__ import annotations

from typing import Any

__all__ = ["PACKED_ATTENTION", "PACKED_MODEL_TYPES", "SEGMENTS_KWARG", "use_packed_attention"]

PACKED_ATTENTION = "pivotrl_packed"
#: ``config.model_type`` of the models whose forward honours a 4-D attention mask with explicit
#: ``position_ids`` (transformers' standard decoder layers; checked in tests/unit/test_logprobs.py):
#: the packed path serves them (:func:`pivotrl.training.logprobs.packs`).
PACKED_MODEL_TYPES = frozenset({"llama", "qwen2", "mistral", "qwen3"})
#: Keyword of the model's forward carrying the packed segments: ``((start, P, end), …)`` in order,
#: covering the sequence (``start`` of the first is 0, each ``end`` is the next ``start``).
SEGMENTS_KWARG = "pivotrl_segments"


def _packed_attention(
    module: Any,
    query: Any,
    key: Any,
    value: Any,
    attention_mask: Any,
    dropout: float = 0.0,
    scaling: float | None = None,
    **kwargs: Any,
) -> tuple[Any, None]:
    """Attention of packed segments, two SDPA calls per segment (see the module docstring).

    Shapes: query (1, H, L, D), key/value (1, H_kv, L, D), attention_mask (1, 1, L, L) bool
    (True = attend) or additive float; ``kwargs[SEGMENTS_KWARG]`` = ``((start, P, end), …)`` with
    0 ≤ start < start + P ≤ end, consecutive and ending at L. Returns (1, L, H, D), as transformers'
    attention functions do. Anything else: transformers' SDPA.
    """
    import torch
    from transformers.integrations.sdpa_attention import repeat_kv, sdpa_attention_forward

    segments = kwargs.get(SEGMENTS_KWARG)
    length = query.shape[2]
    if (not segments or dropout or attention_mask is None or query.shape[0] != 1 or key.shape[2] != length
            or segments[0][0] != 0 or segments[-1][2] != length
            or any(not (a < a + p <= b) for a, p, b in segments)
            or any(prev[2] != nxt[0] for prev, nxt in zip(segments, segments[1:]))):
        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout,
                                      scaling=scaling, **kwargs)
    groups = query.shape[1] // key.shape[1]

    def attend(q: Any, k: Any, v: Any, mask: Any) -> Any:
        extra: dict[str, Any] = {}
        if groups > 1:
            # grouped-query heads inside the kernel only without a mask (CUDA's fused kernels take no
            # mask with GQA; transformers' own sdpa path on CPU and CUDA follows the same rule)
            if mask is None and k.shape[-1] == v.shape[-1] <= 256:
                extra["enable_gqa"] = True
            else:
                k, v = repeat_kv(k, groups), repeat_kv(v, groups)
        return torch.nn.functional.scaled_dot_product_attention(
            q, k, v, attn_mask=mask, is_causal=mask is None, scale=scaling, **extra)

    parts = []
    for a, p, b in segments:
        c = a + p  # first action token of the segment
        parts.append(attend(query[:, :, a:c], key[:, :, a:c], value[:, :, a:c], None))  # (1, H, P, D)
        if c < b:  # (1, H, K·s, D): the action rows against the segment's keys
            parts.append(attend(query[:, :, c:b], key[:, :, a:b], value[:, :, a:b], attention_mask[:, :, c:b, a:b]))
    out = torch.cat(parts, dim=2) if len(parts) > 1 else parts[0]
    return out.transpose(1, 2).contiguous(), None


def use_packed_attention(model: Any) -> bool:
    """Switch ``model`` (an HF causal LM, or a DeepSpeed engine's ``.module``) from ``"sdpa"`` to
    :data:`PACKED_ATTENTION` when its type takes the packed path
    (:data:`PACKED_MODEL_TYPES`); registers the function with transformers
    once per process. Other forwards of the model compute exactly as under ``"sdpa"``. Returns
    whether the model now uses it (False for other attention implementations and model types)."""
    from transformers import AttentionInterface
    from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, sdpa_mask

    module = getattr(model, "module", model)
    config = getattr(module, "config", None)
    impl = getattr(config, "_attn_implementation", None)
    if impl == PACKED_ATTENTION:
        return True
    if getattr(config, "model_type", None) not in PACKED_MODEL_TYPES or impl != "sdpa":
        return False
    if PACKED_ATTENTION not in AttentionInterface._global_mapping:
        AttentionInterface.register(PACKED_ATTENTION, _packed_attention)
        ALL_MASK_ATTENTION_FUNCTIONS.register(PACKED_ATTENTION, sdpa_mask)
    module.set_attn_implementation(PACKED_ATTENTION)
    return True
