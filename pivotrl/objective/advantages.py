"""Group-relative advantage estimators (PivotRL §3, Stage 2; GRPO as in DeepSeekMath 2024).

For one pivot state the current policy samples a group of ``K = group_size`` whole actions and the
verifier scores them: ``rewards`` of shape (G, K) for G states. Every estimator maps (G, K) rewards
to (G, K) advantages, one value per *action* (the whole assistant turn), and is chosen by name from
:data:`ADVANTAGE_ESTIMATORS`:

=============  ==========================================  ==============================
name           Â_i                                          source
=============  ==========================================  ==============================
``grpo``       (R_i − R̄) / (σ_R + δ)                         GRPO; PivotRL's choice (default)
``dr_grpo``    R_i − R̄                                       Dr. GRPO (no std normalisation)
``rloo``       R_i − mean_{j≠i} R_j = K/(K−1) · (R_i − R̄)    REINFORCE leave-one-out
``reinforce``  R_i                                           plain REINFORCE (no baseline)
=============  ==========================================  ==============================

``R̄`` is the group mean and ``σ_R`` the **population** standard deviation (divide by K, not K−1).
``δ > 0`` (``delta``) only guards the division when all rewards of a group are equal; such a
group then gets Â = 0 exactly under ``grpo``, ``dr_grpo`` and ``rloo``.

Shape legend: G = groups (pivot states), K = group size.
"""

from __future__ import annotations

import math
from typing import Callable

import torch
from torch import Tensor

from pivotrl.core.errors import ConfigError
from pivotrl.core.registry import Registry

AdvantageEstimator = Callable[[Tensor, float], Tensor]

ADVANTAGE_ESTIMATORS: Registry[AdvantageEstimator] = Registry("advantage estimator")
DEFAULT_ADVANTAGE_ESTIMATOR = "grpo"
DEFAULT_DELTA = 1e-6


def _group_mean(rewards: Tensor) -> Tensor:
    return rewards.mean(dim=-1, keepdim=True)  # (G, 1)


@ADVANTAGE_ESTIMATORS.register("grpo")
def grpo_advantages(rewards: Tensor, delta: float) -> Tensor:
    """GRPO: ``(R − R̄) / (σ_R + δ)`` per group, σ_R the population std. (G, K) → (G, K)."""
    mean = _group_mean(rewards)
    std = rewards.std(dim=-1, keepdim=True, correction=0)  # (G, 1) population std
    return (rewards - mean) / (std + delta)


@ADVANTAGE_ESTIMATORS.register("dr_grpo")
def dr_grpo_advantages(rewards: Tensor, delta: float) -> Tensor:
    """Dr. GRPO: ``R − R̄`` (no std normalisation; ``delta`` unused). (G, K) → (G, K)."""
    return rewards - _group_mean(rewards)


@ADVANTAGE_ESTIMATORS.register("rloo")
def rloo_advantages(rewards: Tensor, delta: float) -> Tensor:
    """RLOO: ``R_i − mean_{j≠i} R_j`` (leave-one-out baseline; ``delta`` unused). (G, K) → (G, K)."""
    k = rewards.shape[-1]
    others_mean = (rewards.sum(dim=-1, keepdim=True) - rewards) / (k - 1)
    return rewards - others_mean


@ADVANTAGE_ESTIMATORS.register("reinforce")
def reinforce_advantages(rewards: Tensor, delta: float) -> Tensor:
    """REINFORCE: the raw reward (no baseline; ``delta`` unused). (G, K) → (G, K).

    Not centred: an all-success group gets Â = 1 everywhere, unlike the other estimators.
    """
    return rewards.clone()


def compute_advantages(
    rewards: Tensor, estimator: str = DEFAULT_ADVANTAGE_ESTIMATOR, delta: float = DEFAULT_DELTA
) -> Tensor:
    """Advantages of whole actions from their group's rewards (PivotRL §3, Stage 2).

    Args:
        rewards: (G, K) verifier rewards, one row per pivot state, K = ``group_size`` ≥ 2 actions
            sampled from π_old at that state. A (K,) tensor is treated as one group. Integer or
            bool dtypes are converted to the default float dtype; no gradient is needed or kept.
        estimator: a name in :data:`ADVANTAGE_ESTIMATORS` (default ``"grpo"``, PivotRL's choice).
        delta: δ > 0 added to σ_R in ``grpo`` (default 1e-6); only guards division by zero.

    Returns:
        (G, K) advantages in the dtype of ``rewards`` (shape (K,) for a (K,) input), detached.

    Raises:
        ConfigError (a ValueError): unknown ``estimator`` (lists the valid names), ``delta`` ≤ 0 or
            not finite, or ``group_size`` K < 2.
        ValueError: ``rewards`` of rank other than 1 or 2, or NaN/infinite rewards.
    """
    fn = ADVANTAGE_ESTIMATORS.get(estimator)
    delta_f = float(delta)
    if not (math.isfinite(delta_f) and delta_f > 0.0):
        raise ConfigError(f"delta must be a finite number > 0 (it guards σ_R + δ against 0), got {delta!r}")
    if not isinstance(rewards, Tensor):
        rewards = torch.as_tensor(rewards)
    squeeze = rewards.dim() == 1
    if rewards.dim() not in (1, 2):
        raise ValueError(f"rewards must have shape (G, K) (groups × group_size), got {tuple(rewards.shape)}")
    r = rewards.detach()
    if not r.is_floating_point():
        r = r.to(torch.get_default_dtype())
    if squeeze:
        r = r.unsqueeze(0)
    k = r.shape[-1]
    if k < 2:
        raise ConfigError(f"group_size must be at least 2 for group-relative advantages, got K={k}")
    if not bool(torch.isfinite(r).all()):
        raise ValueError("rewards contain NaN or infinite values")
    adv = fn(r, delta_f)
    return adv.squeeze(0) if squeeze else adv
