"""Importance ratios π_θ / π_old of sampled actions (PivotRL §3, Stage 2).

PivotRL's ratio is that of the **whole action** (one assistant turn of ``T_i`` tokens)::

    r_i = π_θ(a_i|s) / π_old(a_i|s) = exp( Σ_t (logprobs[i,t] − old_logprobs[i,t]) · action_mask[i,t] )

The per-token log-ratios are *summed*: no T-th root, no length normalisation. The log-ratio is
clamped to ``±log_ratio_clamp`` before ``exp`` (so a single bad token cannot overflow the loss),
and the number of clamped values is returned so it can be reported.

Other ratio types are separate, named, non-default choices in :data:`RATIO_TYPES`:

- ``"sequence"`` (default): the whole-action ratio above, shape (B,).
- ``"geometric_mean"``: GSPO-style (2025) length-averaged ratio ``exp((1/T_i) Σ_t d_t)``, shape
  (B,). This is the T_i-th root of the whole-action ratio — a different objective.
- ``"token"``: per-token ratios ``exp(d_t)`` of shape (B, T) as in PPO/GRPO token-level losses;
  masked positions hold ratio 1 and must be ignored by the caller.

Shape legend: B = sampled actions in the batch (pivots × K), T = padded action tokens.
"""

from __future__ import annotations

import math
from typing import Callable

import torch
from torch import Tensor

from pivotrl.core.errors import ConfigError
from pivotrl.core.registry import Registry

LogRatioFn = Callable[[Tensor, Tensor, Tensor], Tensor]

RATIO_TYPES: Registry[LogRatioFn] = Registry("ratio type")
DEFAULT_RATIO_TYPE = "sequence"
DEFAULT_LOG_RATIO_CLAMP = 20.0


def masked_token_log_ratio(logprobs: Tensor, old_logprobs: Tensor, action_mask: Tensor) -> Tensor:
    """Per-token log-ratio ``d_t = logprobs − old_logprobs`` on action tokens, exactly 0 elsewhere.

    Args:
        logprobs: (B, T) log π_θ of the sampled tokens (float, may require grad).
        old_logprobs: (B, T) log π_old of the same tokens (no grad needed).
        action_mask: (B, T) bool or 0/1; True on the action's tokens.

    Returns:
        (B, T) tensor. Values at masked positions never reach the result (nor its gradient), even
        if they are NaN or infinite there.
    """
    mask = action_mask.bool()
    diff = torch.where(mask, logprobs, torch.zeros_like(logprobs)) - torch.where(
        mask, old_logprobs.to(logprobs.dtype), torch.zeros_like(logprobs)
    )
    return diff


@RATIO_TYPES.register("sequence")
def sequence_log_ratio(logprobs: Tensor, old_logprobs: Tensor, action_mask: Tensor) -> Tensor:
    """Whole-action log-ratio ``Σ_t d_t`` over action tokens (PivotRL §3). (B, T) → (B,)."""
    return masked_token_log_ratio(logprobs, old_logprobs, action_mask).sum(dim=-1)


@RATIO_TYPES.register("geometric_mean")
def geometric_mean_log_ratio(logprobs: Tensor, old_logprobs: Tensor, action_mask: Tensor) -> Tensor:
    """GSPO-style length-averaged log-ratio ``(1/T_i) Σ_t d_t``. (B, T) → (B,). Not PivotRL's ratio."""
    lengths = action_mask.bool().sum(dim=-1).clamp(min=1).to(logprobs.dtype)
    return sequence_log_ratio(logprobs, old_logprobs, action_mask) / lengths


@RATIO_TYPES.register("token")
def token_log_ratio(logprobs: Tensor, old_logprobs: Tensor, action_mask: Tensor) -> Tensor:
    """Per-token log-ratios ``d_t`` (PPO/GRPO token level). (B, T) → (B, T), 0 where masked."""
    return masked_token_log_ratio(logprobs, old_logprobs, action_mask)


def check_log_ratio_clamp(log_ratio_clamp: float) -> float:
    """Validate ``log_ratio_clamp`` (finite, > 0). Raises ConfigError."""
    value = float(log_ratio_clamp)
    if not (math.isfinite(value) and value > 0.0):
        raise ConfigError(f"log_ratio_clamp must be a finite number > 0 (e.g. 20.0), got {log_ratio_clamp!r}")
    return value


def clamp_log_ratio(log_ratio: Tensor, log_ratio_clamp: float = DEFAULT_LOG_RATIO_CLAMP) -> tuple[Tensor, int]:
    """Clamp log-ratios to ``[−log_ratio_clamp, +log_ratio_clamp]``; count the values it changed.

    The gradient through a clamped value is 0 (like ``torch.clamp``). NaN stays NaN and is not
    counted (the loss's finiteness check reports it).

    Returns:
        ``(clamped, num_clamped)``: same shape as ``log_ratio``; a Python int.
    """
    c = check_log_ratio_clamp(log_ratio_clamp)
    num_clamped = int((log_ratio.detach().abs() > c).sum().item())
    return log_ratio.clamp(min=-c, max=c), num_clamped


def action_ratios(
    logprobs: Tensor,
    old_logprobs: Tensor,
    action_mask: Tensor,
    *,
    ratio_type: str = DEFAULT_RATIO_TYPE,
    log_ratio_clamp: float = DEFAULT_LOG_RATIO_CLAMP,
) -> tuple[Tensor, int]:
    """Importance ratios of the sampled actions (PivotRL §3; ``r = exp(Σ d_t)``, not ``exp(mean d_t)``).

    Args:
        logprobs: (B, T) log π_θ of the sampled tokens, float, may require grad.
        old_logprobs: (B, T) log π_old of the same tokens.
        action_mask: (B, T) bool or 0/1, True on action tokens (never on state/tool-output tokens).
        ratio_type: name in :data:`RATIO_TYPES`; ``"sequence"`` (default) is PivotRL's whole-action ratio.
        log_ratio_clamp: the log-ratio is clamped to ± this value before ``exp`` (default 20.0).

    Returns:
        ``(ratio, num_clamped)``: ratio of shape (B,) for ``"sequence"``/``"geometric_mean"``, (B, T)
        for ``"token"`` (1 at masked positions), in ``logprobs``' dtype; ``num_clamped`` the number
        of log-ratios (actions, or action tokens for ``"token"``) the clamp changed.

    Raises:
        ConfigError: unknown ``ratio_type`` (lists valid names), bad ``log_ratio_clamp``.
    """
    fn = RATIO_TYPES.get(ratio_type)
    log_ratio = fn(logprobs, old_logprobs, action_mask)
    clamped, num_clamped = clamp_log_ratio(log_ratio, log_ratio_clamp)
    return torch.exp(clamped), num_clamped
