"""Attention for the packed shared-prefix sequence, registered with transformers as ``"pivotrl_packed"``.

The packed sequence of :func:`pivotrl.training.logprobs.compute_group_logprobs` is ``state + a_1[:-1]
+ … + a_K[:-1]`` (length L = P + K·s) under a 4-D block mask: the state causal, every action token
sees the whole state and its own earlier tokens. PyTorch's SDPA kernels cannot skip any block of an
explicit mask, so plain SDPA visits all L² (query, key) pairs, about twice the pairs the mask lets
through (P = 1,000, K = 8, s = 31: 1.56 M visited, 0.75 M attended). This function splits the
queries in two calls with the same result:

* the state's P queries against the state's P keys with ``is_causal=True`` and no mask (the kernel
  skips the blocks above the diagonal);
* the K·s action queries against all L keys under the action rows of the mask (K·s × L pairs).

It runs only when the forward is given ``pivotrl_prefix_len=P`` (``_packed_logits`` passes it) and
the layout is the packed one (batch 1, queries = keys, a mask); any other call (generation, a plain
forward, dropout) goes to transformers' own SDPA function unchanged. Measured per layer and step in
benchmarks/RESULTS.md §14j. torch and transformers are imported inside the functions.
"""

from __future__ import annotations

from typing import Any

__all__ = ["PACKED_ATTENTION", "PREFIX_KWARG", "use_packed_attention"]

PACKED_ATTENTION = "pivotrl_packed"
#: Keyword of the model's forward carrying the state length P of a packed sequence.
PREFIX_KWARG = "pivotrl_prefix_len"


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
    """Attention of one packed sequence as two SDPA calls (see the module docstring).

    Shapes: query (1, H, L, D), key/value (1, H_kv, L, D), attention_mask (1, 1, L, L) bool
    (True = attend) or additive float; ``kwargs[PREFIX_KWARG]`` = P with 0 < P ≤ L. Returns
    (1, L, H, D), as transformers' attention functions do. Anything else: transformers' SDPA.
    """
    import torch
    from transformers.integrations.sdpa_attention import repeat_kv, sdpa_attention_forward, use_gqa_in_sdpa

    p = kwargs.get(PREFIX_KWARG)
    length = query.shape[2]
    if (p is None or dropout or attention_mask is None or query.shape[0] != 1 or key.shape[2] != length
            or not 0 < int(p) <= length):
        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout,
                                      scaling=scaling, **kwargs)
    p = int(p)
    groups = query.shape[1] // key.shape[1]

    def attend(q: Any, k: Any, v: Any, mask: Any) -> Any:
        extra: dict[str, Any] = {}
        if groups > 1:
            if use_gqa_in_sdpa(mask, k, v):
                extra["enable_gqa"] = True
            else:
                k, v = repeat_kv(k, groups), repeat_kv(v, groups)
        return torch.nn.functional.scaled_dot_product_attention(
            q, k, v, attn_mask=mask, is_causal=mask is None, scale=scaling, **extra)

    state = attend(query[:, :, :p], key[:, :, :p], value[:, :, :p], None)  # (1, H, P, D)
    if p == length:
        out = state
    else:
        actions = attend(query[:, :, p:], key, value, attention_mask[:, :, p:, :])  # (1, H, L − P, D)
        out = torch.cat([state, actions], dim=2)
    return out.transpose(1, 2).contiguous(), None


def use_packed_attention(model: Any) -> bool:
    """Switch ``model`` (an HF causal LM, or a DeepSpeed engine's ``.module``) from ``"sdpa"`` to
    :data:`PACKED_ATTENTION` when its type takes the packed path
    (:data:`pivotrl.training.logprobs.PACKED_MODEL_TYPES`); registers the function with transformers
    once per process. Other forwards of the model compute exactly as under ``"sdpa"``. Returns
    whether the model now uses it (False for other attention implementations and model types)."""
    from transformers import AttentionInterface
    from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, sdpa_mask

    from pivotrl.training.logprobs import PACKED_MODEL_TYPES

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
