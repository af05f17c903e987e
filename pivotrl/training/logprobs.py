"""Per-token log-probabilities of a group of K actions that share one state.

Shape legend (as in the spec): K = group size, P = state (prefix) tokens, T = action tokens,
T_max = the longest action in the group, V = vocabulary size.

Three ways to compute the same numbers:

* **shared prefix, packed** (``prefix_method="packed"``, and ``"auto"``, the default), for the model
  types of :data:`PACKED_MODEL_TYPES`: one sequence ``state + a_1[:-1] + … + a_K[:-1]`` with position
  ids restarting at P for every action and a 4-D block mask (the state causal; each action sees the
  state and its own earlier tokens). Tokens processed: ``P + K·(T_max − 1)``; the state's keys and
  values are computed and differentiated once. On SmolLM2 this is the fastest path in bf16 on AVX-512
  and in fp32 on AVX2 (benchmarks/RESULTS.md §14): the cache path's backward spends much of its time
  on the K-fold repeated prefix (repeat, GQA expand, and summing the K gradient copies back). The
  trainer switches its models to :mod:`pivotrl.training.packed_attention`, which attends the state
  causally without the mask (SDPA cannot skip the masked blocks of an explicit mask).
* **shared prefix, cache** (``prefix_method="cache"``): the state is run once with ``use_cache=True``; the logits of its last
  position predict the first action token; the key/value cache is repeated K times along the batch
  dimension and the K right-padded actions (all but their last token) are run on top of it, with
  explicit ``position_ids`` starting at P and an attention mask covering prefix + action. Tokens
  processed: ``P + K·(T_max − 1)``. Gradients flow through the cached prefix keys/values, so the
  parameter gradients equal the naive computation's.
* **naive**: K full sequences ``state + action[:-1]``: ``K·(P + T_max − 1)`` tokens.

The shared path needs a model whose forward returns a ``transformers`` cache object with
``batch_repeat_interleave`` and accepts ``past_key_values``, ``position_ids`` and a 2-D
``attention_mask`` (Llama, Mistral, Qwen2 and other standard decoder-only models do). For any other
model (no cache object returned, or a forward that rejects these arguments) the computation falls
back to the naive path, once per model class, with a warning; the results are the same, only slower.
"""

from __future__ import annotations

import inspect
import logging
from dataclasses import dataclass
from typing import Any, Sequence

import torch

from pivotrl.core.errors import DataError
from pivotrl.training.packed_attention import PACKED_ATTENTION, PACKED_MODEL_TYPES, SEGMENTS_KWARG

__all__ = [
    "GroupLogprobs",
    "compute_group_logprobs",
    "compute_groups_logprobs",
    "group_logprobs",
    "processed_tokens",
    "work_counts",
]

log = logging.getLogger(__name__)

# Model classes (by qualified name) on which the shared-prefix path failed: they use the naive path.
_NAIVE_ONLY: set[str] = set()


@dataclass(frozen=True)
class GroupLogprobs:
    """Result of :func:`compute_group_logprobs` for one state and its K actions."""

    logprobs: torch.Tensor  # (K, T_max) float32 (float64 for a float64 model), log π(a_{i,t} | s, a_{i,<t}); 0 where action_mask == 0
    action_mask: torch.Tensor  # (K, T_max) float32, 1 on real action tokens, 0 on right padding
    entropy: torch.Tensor | None  # (K, T_max) float32, detached token entropy in nats; None unless asked
    tokens_processed: int  # tokens run through the model (see processed_tokens)
    shared_prefix: bool  # whether the shared-prefix path was used
    logit_positions: int = 0  # positions whose logits (vocabulary projection) were computed
    attention_pairs: int = 0  # causal (query, key) pairs attended (pivotrl.runtime.mfu)


def processed_tokens(prompt_len: int, action_lens: Sequence[int], *, shared_prefix: bool) -> int:
    """Tokens run through the model for one group: ``P + K·(T_max−1)`` shared, ``K·(P+T_max−1)`` naive.

    Padding tokens of shorter actions are counted (they are computed). Pure arithmetic.
    """
    k, t_max = len(action_lens), max(action_lens)
    if shared_prefix:
        return prompt_len + k * (t_max - 1)
    return k * (prompt_len + t_max - 1)


def work_counts(prompt_len: int, action_lens: Sequence[int], *, shared_prefix: bool) -> tuple[int, int]:
    """``(logit_positions, attention_pairs)`` of one group: the positions whose logits are computed
    (shared: the state's last + K·(T_max−1); naive: K·T_max) and the causal (query, key) pairs
    attended (:mod:`pivotrl.runtime.mfu`), padding included. Pure arithmetic."""
    from pivotrl.runtime.mfu import attention_pairs_causal, attention_pairs_shared

    k, t_max = len(action_lens), max(action_lens)
    if shared_prefix:
        return 1 + k * (t_max - 1), attention_pairs_shared(prompt_len, k, t_max - 1)
    return k * t_max, attention_pairs_causal([prompt_len + t_max - 1] * k)


def _underlying(model: Any) -> Any:
    """The ``nn.Module`` behind a DeepSpeed engine (``.module``) or the model itself."""
    return getattr(model, "module", model)


def _accepts(model: Any, name: str) -> bool:
    try:
        params = inspect.signature(_underlying(model).forward).parameters
    except (TypeError, ValueError):
        return False
    return name in params or any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values())


def _model_device(model: Any) -> torch.device:
    for p in _underlying(model).parameters():
        return p.device
    return torch.device("cpu")


def _model_dtype(model: Any) -> torch.dtype:
    for p in _underlying(model).parameters():
        return p.dtype
    return torch.float32


def _check_inputs(prompt_ids: Sequence[int], actions: Sequence[Sequence[int]]) -> None:
    if len(prompt_ids) == 0:
        raise DataError("group_logprobs: prompt_ids is empty; a state needs at least one token")
    if len(actions) == 0:
        raise DataError("group_logprobs: actions is empty; a group needs at least one action (K ≥ 1)")
    for i, a in enumerate(actions):
        if len(a) == 0:
            raise DataError(f"group_logprobs: action {i} has no tokens; every action needs T ≥ 1")


def _pad_actions(
    actions: Sequence[Sequence[int]], device: torch.device, dtype: torch.dtype
) -> tuple[torch.Tensor, torch.Tensor]:
    """Right-pad to (K, T_max) token ids (pad id 0, never attended to) and a (K, T_max) 0/1 mask."""
    t_max = max(len(a) for a in actions)
    ids = torch.zeros(len(actions), t_max, dtype=torch.long, device=device)
    mask = torch.zeros(len(actions), t_max, dtype=dtype, device=device)
    for i, a in enumerate(actions):
        ids[i, : len(a)] = torch.as_tensor(list(a), dtype=torch.long, device=device)
        mask[i, : len(a)] = 1.0
    return ids, mask


def _token_stats(
    logits: torch.Tensor, targets: torch.Tensor, mask: torch.Tensor, with_entropy: bool
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """logits (K, T_max, V) → log-probs (K, T_max) fp32 (fp64 for fp64 logits), masked to 0; entropy or None."""
    if logits.dtype != torch.float64:
        logits = logits.float()  # bf16/fp16 logits are normalised in fp32
    logp_all = torch.log_softmax(logits, dim=-1)  # (K, T_max, V)
    logprobs = logp_all.gather(-1, targets.unsqueeze(-1)).squeeze(-1) * mask  # (K, T_max)
    entropy = None
    if with_entropy:
        with torch.no_grad():
            entropy = -(logp_all.exp() * logp_all).sum(-1) * mask  # (K, T_max)
    return logprobs, entropy


def _naive_logits(model: Any, prompt: torch.Tensor, ids: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """K sequences ``state + action[:-1]`` → logits (K, T_max, V) predicting each action token."""
    k, t_max = ids.shape
    p = prompt.shape[0]
    inputs = torch.cat([prompt.unsqueeze(0).expand(k, p), ids[:, :-1]], dim=1)  # (K, P + T_max − 1)
    attn = torch.cat(
        [torch.ones(k, p, dtype=torch.long, device=ids.device), mask[:, :-1].long()], dim=1
    )  # (K, P + T_max − 1)
    kwargs: dict[str, Any] = {"input_ids": inputs, "attention_mask": attn, "use_cache": False}
    if _accepts(model, "logits_to_keep"):
        kwargs["logits_to_keep"] = t_max
    logits = model(**kwargs).logits  # (K, ≥T_max, V)
    return logits[:, -t_max:]


def _shared_logits(model: Any, prompt: torch.Tensor, ids: torch.Tensor, mask: torch.Tensor) -> torch.Tensor | None:
    """Shared-prefix logits (K, T_max, V); None when the model cannot expand its cache."""
    k, t_max = ids.shape
    p = prompt.shape[0]
    kwargs: dict[str, Any] = {"input_ids": prompt.unsqueeze(0), "use_cache": True}
    if _accepts(model, "logits_to_keep"):
        kwargs["logits_to_keep"] = 1
    out = model(**kwargs)
    first = out.logits[:, -1:]  # (1, 1, V): predicts every action's first token
    cache = getattr(out, "past_key_values", None)
    if cache is None or not hasattr(cache, "batch_repeat_interleave"):
        return None
    if t_max == 1:
        return first.expand(k, 1, first.shape[-1])
    cache.batch_repeat_interleave(k)
    steps = t_max - 1
    attn = torch.cat(
        [torch.ones(k, p, dtype=torch.long, device=ids.device), mask[:, :-1].long()], dim=1
    )  # (K, P + T_max − 1)
    positions = torch.arange(p, p + steps, device=ids.device).unsqueeze(0).expand(k, steps)  # (K, T_max − 1)
    rest = model(
        input_ids=ids[:, :-1],
        past_key_values=cache,
        position_ids=positions,
        attention_mask=attn,
        use_cache=True,
    ).logits  # (K, T_max − 1, V)
    return torch.cat([first.expand(k, 1, first.shape[-1]), rest], dim=1)




def packs(model: Any) -> bool:
    """Whether the packed shared-prefix path serves ``model`` (its model type is in
    :data:`PACKED_MODEL_TYPES` and its attention is sdpa, eager or
    :data:`~pivotrl.training.packed_attention.PACKED_ATTENTION`); decided from the config alone,
    so every rank of a data-parallel job takes the same path."""
    config = getattr(_underlying(model), "config", None)
    impl = getattr(config, "_attn_implementation", None) or "sdpa"
    return getattr(config, "model_type", None) in PACKED_MODEL_TYPES and impl in ("sdpa", "eager", PACKED_ATTENTION)


#: Most tokens one packed forward holds when several groups share it (:func:`compute_groups_logprobs`;
#: the trainer passes ``training.pack_tokens`` for π_ref); a group longer than this runs alone (with
#: its own (L, L) mask). At 4,096 a shared forward's mask is at most 64 MB in fp32.
PACK_TOKENS = 4096


def _packed_logits(model: Any, segments: Sequence[tuple[torch.Tensor, torch.Tensor]]) -> list[torch.Tensor]:
    """Packed shared-prefix logits of one or more groups in ONE forward: per group ``(prompt (P,),
    ids (K, T_max))`` a segment ``state + a_1[:-1] + … + a_K[:-1]`` (each action right-padded to T_max;
    ``P + K·(T_max−1)`` tokens) with ``position_ids`` restarting at P for every action, the segments
    one after the other under a 4-D additive mask: each segment sees only itself, its state causal,
    every action token the whole state and its own earlier tokens. Nothing is repeated K times, so the
    backward pass differentiates each state's keys/values once (the cache path sums K copies of them).
    A model switched to :mod:`pivotrl.training.packed_attention` attends each state without the mask
    (its kernel then skips the blocks above the diagonal) and each segment apart from the others; the
    numbers are the same. Returns each group's logits (K, T_max, V), in order."""
    device = segments[0][0].device
    inputs, positions, seg_of, block_of, keep, spans = [], [], [], [], [], []
    offset = 0
    for g, (prompt, ids) in enumerate(segments):
        k, t_max = ids.shape
        p, s = prompt.shape[0], t_max - 1
        n = p + k * s
        inputs.append(torch.cat([prompt, ids[:, :-1].reshape(-1)]))
        positions.append(torch.cat([torch.arange(p, device=device), (p + torch.arange(s, device=device)).repeat(k)]))
        seg_of.append(torch.full((n,), g, device=device))
        block_of.append(torch.cat([torch.full((p,), -1, device=device),
                                   torch.arange(k, device=device).repeat_interleave(s)]))  # -1 on the state
        keep.append(torch.arange(offset + p - 1, offset + n, device=device))  # the state's last + K·s
        spans.append((offset, p, offset + n))
        offset += n
    seg, block, idx = torch.cat(seg_of), torch.cat(block_of), torch.arange(offset, device=device)
    attend = ((seg.unsqueeze(1) == seg.unsqueeze(0)) & (idx.unsqueeze(1) >= idx.unsqueeze(0))
              & ((block.unsqueeze(0) == -1) | (block.unsqueeze(1) == block.unsqueeze(0))))  # (L, L): key j visible from query i
    dtype = _model_dtype(model)
    # additive (0 / most negative) in the compute dtype: SDPA's CPU kernel would convert a boolean
    # mask in every layer, and eager attention adds the mask to the scores
    mask = torch.zeros(offset, offset, dtype=dtype, device=device).masked_fill_(~attend, torch.finfo(dtype).min)
    extra: dict[str, Any] = {}
    if getattr(getattr(_underlying(model), "config", None), "_attn_implementation", None) == PACKED_ATTENTION:
        extra[SEGMENTS_KWARG] = tuple(spans)  # each state causal without a mask (packed_attention)
    to_keep: Any = keep[0].numel() if len(segments) == 1 else torch.cat(keep)
    logits = model(input_ids=torch.cat(inputs).unsqueeze(0), position_ids=torch.cat(positions).unsqueeze(0),
                   attention_mask=mask[None, None], logits_to_keep=to_keep, use_cache=False,
                   **extra).logits[0]  # (Σ (K·s + 1), V)
    out = []
    for (_, ids), part in zip(segments, logits.split([len(kp) for kp in keep])):
        k, s = ids.shape[0], ids.shape[1] - 1
        first = part[:1].expand(k, -1).unsqueeze(1)  # (K, 1, V): the state's last position predicts each first token
        out.append(first if s == 0 else torch.cat([first, part[1:].view(k, s, -1)], dim=1))  # (K, T_max, V)
    return out


def compute_groups_logprobs(
    model: Any,
    groups: Sequence[tuple[Sequence[int], Sequence[Sequence[int]]]],
    *,
    shared_prefix: bool = True,
    with_entropy: bool = False,
    prefix_method: str = "auto",
    pack_tokens: int = PACK_TOKENS,
) -> list[GroupLogprobs]:
    """Per-token log-probs of several groups ``(prompt_ids, actions)``, one :class:`GroupLogprobs` each,
    in order. On the packed path the groups share forwards: consecutive groups are packed into one
    sequence of at most ``pack_tokens`` tokens (a longer group runs alone), so the matrix products
    see more rows per call; each chunk's logits are reduced to log-probs before the next forward, so
    at most one chunk's logits are held. Each group's numbers are those of
    :func:`compute_group_logprobs` on it alone, up to rounding (a matmul's result can depend on its
    row count in bf16). Other paths run the groups one by one.

    The number of forwards depends on the groups' lengths: do not use ``pack_tokens`` > 1 on a model
    whose forward is a collective (DeepSpeed ZeRO-3) unless every rank packs the same way.

    Args and errors: as :func:`compute_group_logprobs`, per group; ``pack_tokens`` ≥ 1.
    """
    for prompt_ids, actions in groups:
        _check_inputs(prompt_ids, actions)
    if prefix_method not in ("auto", "packed", "cache"):
        raise ValueError(f"prefix_method must be 'auto', 'packed' or 'cache', got {prefix_method!r}")
    if prefix_method == "auto":  # measured faster in bf16 on AVX-512 and in fp32 on AVX2 (benchmarks/RESULTS.md §14)
        prefix_method = "packed"
    device = _model_device(model)
    dtype = torch.float64 if _model_dtype(model) == torch.float64 else torch.float32
    key = type(_underlying(model)).__qualname__
    out: list[GroupLogprobs | None] = [None] * len(groups)

    def finish(i: int, lg: torch.Tensor, ids: torch.Tensor, mask: torch.Tensor, shared: bool) -> None:
        prompt_ids, actions = groups[i]
        logprobs, entropy = _token_stats(lg, ids, mask, with_entropy)
        lens = [len(a) for a in actions]
        logit_positions, pairs = work_counts(len(prompt_ids), lens, shared_prefix=shared)
        out[i] = GroupLogprobs(logprobs=logprobs, action_mask=mask, entropy=entropy,
                               tokens_processed=processed_tokens(len(prompt_ids), lens, shared_prefix=shared),
                               shared_prefix=shared, logit_positions=logit_positions, attention_pairs=pairs)

    def prepared(i: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        prompt_ids, actions = groups[i]
        prompt = torch.as_tensor(list(prompt_ids), dtype=torch.long, device=device)  # (P,)
        return (prompt, *_pad_actions(actions, device, dtype))  # (K, T_max) ids and mask

    if shared_prefix and prefix_method == "packed" and packs(model):
        chunks: list[list[int]] = [[]]
        size = 0
        for i, (p, a) in enumerate(groups):
            n = processed_tokens(len(p), [len(x) for x in a], shared_prefix=True)
            if chunks[-1] and size + n > pack_tokens:
                chunks.append([])
                size = 0
            chunks[-1].append(i)
            size += n
        for chunk in chunks:
            if not chunk:
                continue
            inputs = [prepared(i) for i in chunk]
            for i, (_, ids, mask), lg in zip(chunk, inputs, _packed_logits(model, [(p, ids) for p, ids, _ in inputs])):
                finish(i, lg, ids, mask, True)
        return [r for r in out if r is not None]
    for i in range(len(groups)):
        prompt, ids, mask = prepared(i)
        lg = None
        if shared_prefix and key not in _NAIVE_ONLY:
            try:
                lg = _shared_logits(model, prompt, ids, mask)
            except (TypeError, NotImplementedError, AttributeError) as err:
                log.warning("shared-prefix log-probs unsupported by %s (%s); using the naive path", key, err)
                lg = None
            if lg is None:
                _NAIVE_ONLY.add(key)
        finish(i, lg if lg is not None else _naive_logits(model, prompt, ids, mask), ids, mask, lg is not None)
    return [r for r in out if r is not None]


def compute_group_logprobs(
    model: Any,
    prompt_ids: Sequence[int],
    actions: Sequence[Sequence[int]],
    *,
    shared_prefix: bool = True,
    with_entropy: bool = False,
    prefix_method: str = "auto",
) -> GroupLogprobs:
    """Per-token log-probs of K actions given one state, plus bookkeeping (see :class:`GroupLogprobs`).

    Args:
        model: a causal LM (``transformers`` model or a DeepSpeed engine wrapping one), any dtype.
            Called as is: gradients flow unless the caller wraps this in ``torch.no_grad()``.
        prompt_ids: the state's P token ids (the rendered history ending with the generation header).
        actions: K lists of action token ids (lengths T_i ≥ 1, may differ).
        shared_prefix: run the state once for all K actions (falls back to the naive path for
            models that cannot; see the module docstring).
        prefix_method: how, with ``shared_prefix``: ``"packed"`` (one sequence with a block mask,
            :func:`_packed_logits`; for the model types of :data:`PACKED_MODEL_TYPES`, others take the
            cache), ``"cache"`` (the state's key/value cache repeated K times) or ``"auto"`` (packed,
            which measured faster in bf16 and in fp32, RESULTS.md §14; the cache for other model types).
        with_entropy: also return the detached token entropy (K, T_max) in nats.

    Returns:
        :class:`GroupLogprobs` whose ``logprobs`` (K, T_max) are float32 log π(a_{i,t} | s, a_{i,<t})
        with 0 on padding, and ``action_mask`` (K, T_max) float32 (both float64 for a float64 model).

    Raises:
        DataError: empty state, empty group, or an empty action.
    """
    return compute_groups_logprobs(model, [(prompt_ids, actions)], shared_prefix=shared_prefix,
                                   with_entropy=with_entropy, prefix_method=prefix_method)[0]


def group_logprobs(
    model: Any,
    prompt_ids: Sequence[int],
    actions: Sequence[Sequence[int]],
    *,
    shared_prefix: bool = True,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-token log-probs (K, T_max) float32 and action_mask (K, T_max) float32 of K actions at one state.

    ``logprobs[i, t] = log π(a_{i,t} | s, a_{i,<t})`` for ``t < T_i``, 0 on right padding. The
    whole-action log-probability of action i is ``logprobs[i].sum()`` (PivotRL §3, sequence ratio).
    See :func:`compute_group_logprobs` for arguments, errors and the shared-prefix computation.
    """
    res = compute_group_logprobs(model, prompt_ids, actions, shared_prefix=shared_prefix)
    return res.logprobs, res.action_mask
