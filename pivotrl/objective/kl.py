"""KL penalty toward the frozen reference policy (PivotRL §3, Stage 2).

The divergence is the reverse KL of whole actions::

    KL(π_θ(·|s) ‖ π_ref(·|s)) = E_{a∼π_θ}[ log π_θ(a|s) − log π_ref(a|s) ]

The loss only sees a few sampled actions per state, so it uses an *estimator*: a per-action term
whose **gradient** must, in expectation over on-policy samples, equal ``∇_θ KL``. Let
``ℓ(a) = Σ_t (log π_θ(a_t|…) − log π_ref(a_t|…))`` over the action's tokens (``ℓ = log π_θ(a|s) −
log π_ref(a|s)``). Then, because the sampling distribution itself depends on θ,

    ∇_θ KL = Σ_a ∇π_θ(a) · ℓ(a) + Σ_a π_θ(a) ∇ℓ(a)
           = E_{a∼π_θ}[ ℓ(a) ∇ log π_θ(a|s) ] + E_{a∼π_θ}[ ∇ log π_θ(a|s) ]
           = E_{a∼π_θ}[ ℓ(a) ∇ log π_θ(a|s) ]            (the score has mean zero)

Estimators, chosen by name from :data:`KL_ESTIMATORS` (each maps (B, T) tensors to a (B,) term):

- ``"squared_log_ratio"`` (default): ``½ ℓ²``. Its gradient is ``ℓ · ∇ℓ = ℓ · ∇ log π_θ(a|s)``
  (π_ref is fixed), whose expectation is exactly ``∇ KL`` above — the one required property. The
  log-ratio is that of the whole action (a sum over tokens), so the term couples an action's
  tokens: a per-token ``Σ_t ½ d_t²`` would drop the cross terms ``d_{t'} ∇ log π_θ(a_t|…)`` with
  ``t' > t`` (a later token's log-ratio times an earlier token's score), which do not vanish in
  expectation when later tokens depend on earlier ones.
  (Its *value* estimates ``E[½ℓ²]``, not KL; the reported KL metric is :func:`k3_value`.)
- ``"k1"``: ``ℓ``. An unbiased estimate of the KL *value*, but a trap as a loss term: its gradient
  is ``∇ log π_θ(a|s)``, whose expectation under on-policy sampling is **zero**, so it does not
  pull π_θ toward π_ref at all (only noise).
- ``"k3_per_token"``: ``Σ_t (e^{−d_t} + d_t − 1)`` with ``d_t = log π_θ − log π_ref`` per token (as in
  GRPO). A good non-negative estimate of the KL *value*, but a trap as a loss term: its gradient
  per token is ``(1 − π_ref/π_θ) ∇ log π_θ``, whose on-policy expectation is
  ``−Σ_x π_ref(x) ∇ log π_θ(x) = ∇ KL(π_ref ‖ π_θ)`` — the gradient of the **forward** KL (per
  token), not of the reverse KL PivotRL specifies.

All estimators assume on-policy actions (sampled from π_old ≈ π_θ). Putting the penalty into the
reward instead of the loss would change the gradient path; this module has no such variant.

Shape legend: B = sampled actions, T = padded action tokens.
"""

from __future__ import annotations

from typing import Callable

import torch
from torch import Tensor

from pivotrl.core.registry import Registry

KLEstimator = Callable[[Tensor, Tensor, Tensor], Tensor]

KL_ESTIMATORS: Registry[KLEstimator] = Registry("KL estimator")
DEFAULT_KL_ESTIMATOR = "squared_log_ratio"


def _masked_ref_diff(logprobs: Tensor, ref_logprobs: Tensor, action_mask: Tensor) -> Tensor:
    """(B, T) per-token ``log π_θ − log π_ref`` on action tokens, exactly 0 (no grad) elsewhere."""
    mask = action_mask.bool()
    zeros = torch.zeros_like(logprobs)
    return torch.where(mask, logprobs, zeros) - torch.where(mask, ref_logprobs.to(logprobs.dtype), zeros)


def action_log_ratio_to_ref(logprobs: Tensor, ref_logprobs: Tensor, action_mask: Tensor) -> Tensor:
    """``ℓ_i = Σ_t (logprobs − ref_logprobs) · action_mask``: log π_θ(a_i|s) − log π_ref(a_i|s). (B, T) → (B,)."""
    return _masked_ref_diff(logprobs, ref_logprobs, action_mask).sum(dim=-1)


@KL_ESTIMATORS.register("squared_log_ratio")
def squared_log_ratio_kl(logprobs: Tensor, ref_logprobs: Tensor, action_mask: Tensor) -> Tensor:
    """Default KL loss term ``½ ℓ²`` per action; expected gradient = ∇ reverse KL. (B, T) → (B,)."""
    ell = action_log_ratio_to_ref(logprobs, ref_logprobs, action_mask)
    return 0.5 * ell * ell


@KL_ESTIMATORS.register("k1")
def k1_kl(logprobs: Tensor, ref_logprobs: Tensor, action_mask: Tensor) -> Tensor:
    """``ℓ`` per action. Unbiased KL value, but zero expected gradient as a loss term. (B, T) → (B,)."""
    return action_log_ratio_to_ref(logprobs, ref_logprobs, action_mask)


def _k3_per_token(logprobs: Tensor, ref_logprobs: Tensor, action_mask: Tensor) -> Tensor:
    d = _masked_ref_diff(logprobs, ref_logprobs, action_mask)  # (B, T), 0 where masked → k3 = 0
    return torch.exp(-d) + d - 1.0


@KL_ESTIMATORS.register("k3_per_token")
def k3_per_token_kl(logprobs: Tensor, ref_logprobs: Tensor, action_mask: Tensor) -> Tensor:
    """``Σ_t (e^{−d_t} + d_t − 1)`` per action. Its gradient follows the *forward* KL. (B, T) → (B,)."""
    return _k3_per_token(logprobs, ref_logprobs, action_mask).sum(dim=-1)


def kl_terms(
    logprobs: Tensor, ref_logprobs: Tensor, action_mask: Tensor, kl_estimator: str = DEFAULT_KL_ESTIMATOR
) -> Tensor:
    """Per-action KL loss terms of the named estimator (the thing β multiplies). (B, T) → (B,).

    Raises:
        ConfigError: unknown ``kl_estimator`` (lists the valid names).
    """
    return KL_ESTIMATORS.get(kl_estimator)(logprobs, ref_logprobs, action_mask)


@torch.no_grad()
def k3_value(logprobs: Tensor, ref_logprobs: Tensor, action_mask: Tensor) -> Tensor:
    """The reported KL metric: per-action sum of per-token k3 (≥ 0), without gradient.

    Args:
        logprobs: (B, T) log π_θ of the sampled tokens.
        ref_logprobs: (B, T) log π_ref of the same tokens.
        action_mask: (B, T) bool or 0/1, True on action tokens.

    Returns:
        (B,) detached tensor, in nats: ``Σ_t (π_ref/π_θ − log(π_ref/π_θ) − 1)`` over action tokens.
        Each token's term is a non-negative, unbiased estimate of that token's KL(π_θ ‖ π_ref).
    """
    return _k3_per_token(logprobs.detach(), ref_logprobs.detach(), action_mask).sum(dim=-1)
