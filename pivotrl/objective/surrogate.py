"""The clipped surrogate of PPO (2017), applied to whole-action ratios (PivotRL §3, Stage 2).

Per action (or per token for the ``"token"`` ratio type)::

    surrogate = min( r · Â , clip(r, 1 − ε, 1 + ε) · Â )

The clip *binds* when the clipped branch is the minimum and differs from the unclipped one:
``Â > 0 and r > 1 + ε`` (counted as "high") or ``Â < 0 and r < 1 − ε`` ("low"). Where it binds
the surrogate is constant in θ, so its gradient is exactly 0; elsewhere the gradient with respect
to the action's whole log-probability is ``r · Â``.
"""

from __future__ import annotations

import torch
from torch import Tensor

DEFAULT_EPSILON = 0.2


def clipped_surrogate(ratio: Tensor, advantages: Tensor, epsilon: float) -> tuple[Tensor, Tensor, Tensor]:
    """``min(r·Â, clip(r, 1−ε, 1+ε)·Â)`` elementwise, with where the clip binds.

    Args:
        ratio: (B,) whole-action ratios, or (B, T) per-token ratios; may require grad.
        advantages: (B,) advantages of the actions (broadcast over T for a (B, T) ratio); no grad.
        epsilon: clip range, 0 < ε < 1 (PivotRL default 0.2; the config schema checks the bound).

    Returns:
        ``(surrogate, clipped_high, clipped_low)``: surrogate of ``ratio``'s shape; two bool tensors
        of the same shape, True where the clipped branch is the strict minimum with r > 1+ε (high)
        or r < 1−ε (low). Where either is True the surrogate's gradient is exactly 0.

    Raises:
        ValueError: ``advantages`` does not have shape (B,).
    """
    eps = float(epsilon)  # its bound (0, 1) is the config schema's (training.epsilon)
    if advantages.dim() != 1 or advantages.shape[0] != ratio.shape[0]:
        raise ValueError(
            f"advantages must have shape (B,) = ({ratio.shape[0]},), got {tuple(advantages.shape)}"
        )
    adv = advantages.detach().to(ratio.dtype)
    if ratio.dim() == 2:
        adv = adv.unsqueeze(-1)  # (B, 1)
    unclipped = ratio * adv
    clipped = ratio.clamp(min=1.0 - eps, max=1.0 + eps) * adv
    binds = clipped.detach() < unclipped.detach()
    # torch.where (not torch.minimum) so a bound clip gives a gradient of exactly 0, with no tie-splitting.
    surrogate = torch.where(binds, clipped, unclipped)
    rd = ratio.detach()
    clipped_high = binds & (rd > 1.0 + eps)
    clipped_low = binds & (rd < 1.0 - eps)
    return surrogate, clipped_high, clipped_low
