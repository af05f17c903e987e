"""Sampler–trainer mismatch and truncated importance sampling (TIS) against the sampler.

π_old is the trainer's: PivotRL's ratio ``r = exp(Σ_t log π_θ − log π_old)`` uses log-probs the
trainer computes for the sampled tokens under the weights that sampled them (the detached log-probs
of the batch's first update), never the rollout engine's. The engine (vLLM, bf16 kernels) samples
from a slightly different distribution π_sampler: 0.04 nats per token on average, up to 0.4, were
measured between the two in bf16. :func:`sampler_mismatch` measures that gap per step;
:func:`truncated_is_weights` corrects for it when asked (``training.tis_cap``), by weighting each
action's surrogate with the truncated whole-action ratio ``w = min(π_old(a|s) / π_sampler(a|s), C)``
(the "truncated importance sampling" of Yao et al., 2025, "Your efficient RL framework secretly
brings you off-policy RL training", at the action level as PivotRL's ratio is), detached.

Shapes: B = actions, T = padded action tokens. Log-probs are natural-log, per token.
"""

from __future__ import annotations

import torch
from torch import Tensor

from pivotrl.core.errors import ConfigError
from pivotrl.objective.ratios import DEFAULT_LOG_RATIO_CLAMP

__all__ = ["sampler_mismatch", "truncated_is_weights"]


def _check(old: Tensor, sampler: Tensor, mask: Tensor) -> Tensor:
    if old.shape != sampler.shape or old.shape != mask.shape or old.dim() != 2:
        raise ValueError(f"old_logprobs, sampler_logprobs and action_mask must share one (B, T) shape, got "
                         f"{tuple(old.shape)}, {tuple(sampler.shape)}, {tuple(mask.shape)}")
    return mask.detach().bool()


def sampler_mismatch(old_logprobs: Tensor, sampler_logprobs: Tensor, action_mask: Tensor) -> dict[str, float]:
    """How far the sampler's log-probs are from the trainer's π_old on the sampled action tokens.

    Returns floats: ``abs_sum`` (Σ over action tokens of |log π_old − log π_sampler|, nats),
    ``tokens`` (action tokens), ``max_abs`` (largest per-token |Δ|), ``log_ratio_sum`` (Σ over
    actions of the whole-action log-ratio Σ_t (log π_old − log π_sampler)), ``actions`` (B). Sums, so
    micro-batches and ranks add up; mean per token = abs_sum / tokens.
    """
    mask = _check(old_logprobs, sampler_logprobs, action_mask)
    d = old_logprobs.detach().double() - sampler_logprobs.detach().double()
    d = torch.where(mask, d, torch.zeros((), dtype=torch.float64))
    return {"abs_sum": float(d.abs().sum()), "tokens": float(mask.sum()), "max_abs": float(d.abs().max()),
            "log_ratio_sum": float(d.sum()), "actions": float(mask.shape[0])}


def truncated_is_weights(old_logprobs: Tensor, sampler_logprobs: Tensor, action_mask: Tensor, cap: float, *,
                         log_ratio_clamp: float = DEFAULT_LOG_RATIO_CLAMP) -> Tensor:
    """Per-action TIS weights ``min(exp(Σ_t m_t (log π_old − log π_sampler)), cap)``, shape (B,), detached.

    Args:
        old_logprobs: (B, T) the trainer's log π_old of the sampled tokens.
        sampler_logprobs: (B, T) the rollout engine's log-probs of the same tokens (temperature 1).
        action_mask: (B, T) True on action tokens; other positions are ignored.
        cap: C > 0, the truncation (``training.tis_cap``).
        log_ratio_clamp: the summed log-ratio is clamped to ± this before ``exp``.

    Raises ConfigError for cap ≤ 0, ValueError for mismatched shapes.
    """
    if not cap > 0:
        raise ConfigError(f"training.tis_cap = {cap!r}: must be > 0")
    mask = _check(old_logprobs, sampler_logprobs, action_mask)
    d = old_logprobs.detach().double() - sampler_logprobs.detach().double()
    d = torch.where(mask, d, torch.zeros((), dtype=torch.float64))
    log_w = d.sum(dim=-1).clamp(-log_ratio_clamp, log_ratio_clamp)
    return torch.exp(log_w).clamp(max=float(cap))
