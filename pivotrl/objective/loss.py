"""The PivotRL loss: clipped whole-action surrogate minus a reverse-KL penalty (PivotRL §3, Stage 2).

For a pivot ``s`` with K sampled actions::

    J_s(θ) = (1/K) Σ_i min( r_i Â_i , clip(r_i, 1−ε, 1+ε) Â_i )  −  β · KL( π_θ(·|s) ‖ π_ref(·|s) )

and the loss is ``−J`` averaged over the sampled pivots. Reduction (turn level): with ``N`` the
number of actions the loss is averaged over (``num_actions``; B for a whole batch),

    loss = −(1/N) Σ_i surrogate_i  +  β · (1/N) Σ_i kl_term_i

With K actions per pivot this is the mean over pivots of ``−J_s``, where the KL of each pivot is
estimated by the mean of its K actions' terms. Every action weighs the same whatever its length.
Because each action contributes ``term_i / N`` independently, splitting a batch across
data-parallel ranks and passing the *global* ``num_actions`` to every rank makes the sum of the
ranks' losses (and gradients) equal to the full-batch loss: sharding-invariant.

Shape legend: B = actions on this rank (pivots × K), T = padded action tokens.
"""

from __future__ import annotations

import operator

import torch
from torch import Tensor

from pivotrl.core.errors import ConfigError, TrainingError
from pivotrl.objective.kl import DEFAULT_KL_ESTIMATOR, k3_value, kl_terms
from pivotrl.objective.ratios import DEFAULT_LOG_RATIO_CLAMP, DEFAULT_RATIO_TYPE, action_ratios
from pivotrl.objective.surrogate import clipped_surrogate


def _check_inputs(
    logprobs: Tensor, old_logprobs: Tensor, ref_logprobs: Tensor, advantages: Tensor, action_mask: Tensor
) -> None:
    if logprobs.dim() != 2:
        raise ValueError(f"logprobs must have shape (B, T), got {tuple(logprobs.shape)}")
    if not logprobs.is_floating_point():
        raise ValueError(f"logprobs must be a floating-point tensor, got {logprobs.dtype}")
    for name, t in (("old_logprobs", old_logprobs), ("ref_logprobs", ref_logprobs), ("action_mask", action_mask)):
        if t.shape != logprobs.shape:
            raise ValueError(f"{name} must have the shape of logprobs {tuple(logprobs.shape)}, got {tuple(t.shape)}")
    if advantages.shape != logprobs.shape[:1]:
        raise ValueError(f"advantages must have shape (B,) = ({logprobs.shape[0]},), got {tuple(advantages.shape)}")
    if logprobs.shape[0] == 0:
        raise ValueError("the batch is empty (B = 0): pivotrl_loss needs at least one action")
    mask = action_mask.detach()
    if mask.dtype != torch.bool and not bool(((mask == 0) | (mask == 1)).all()):
        raise ValueError("action_mask must be bool or contain only 0 and 1")
    empty = (~mask.bool().any(dim=-1)).nonzero().flatten().tolist()
    if empty:
        raise ValueError(f"action_mask has no action token in row(s) {empty[:10]}: every action needs >= 1 token")
    if not bool(torch.isfinite(advantages.detach()).all()):
        raise ValueError("advantages contain NaN or infinite values")


def pivotrl_loss(
    logprobs: Tensor,
    old_logprobs: Tensor,
    ref_logprobs: Tensor,
    advantages: Tensor,
    action_mask: Tensor,
    *,
    epsilon: float,
    beta: float,
    kl_estimator: str = DEFAULT_KL_ESTIMATOR,
    ratio_type: str = DEFAULT_RATIO_TYPE,
    num_actions: int | None = None,
    log_ratio_clamp: float = DEFAULT_LOG_RATIO_CLAMP,
    action_weights: Tensor | None = None,
) -> tuple[Tensor, dict[str, float]]:
    """PivotRL's turn-level loss ``−J`` for a batch of sampled actions (PivotRL §3, Stage 2).

    Args:
        logprobs: (B, T) log π_θ(a_t | s, a_<t) of the sampled action tokens; carries the gradient.
            bf16/fp16 inputs are computed in float32.
        old_logprobs: (B, T) log π_old of the same tokens (the policy that sampled them; no grad).
        ref_logprobs: (B, T) log π_ref of the same tokens (frozen reference; no grad).
        advantages: (B,) advantage of each whole action (see :func:`compute_advantages`); no grad.
        action_mask: (B, T) bool or 0/1: True on the action's own tokens (incl. its end-of-turn
            token), False on padding. Every row needs at least one action token. Values of the
            other tensors at masked positions are ignored (they may be NaN/inf).
        epsilon: clip range, 0 < ε < 1 (default in configs: 0.2).
        beta: KL coefficient β ≥ 0. With β = 0 the KL term is not added (it is still reported).
            Their bounds are the config schema's (``training.epsilon``/``training.beta``, checked
            once when a config is loaded); they are not checked again here, on every step.
        kl_estimator: name in :data:`KL_ESTIMATORS`; default ``"squared_log_ratio"`` (½ℓ², whose
            expected gradient is the gradient of the reverse KL; see :mod:`pivotrl.objective.kl`).
        ratio_type: name in :data:`RATIO_TYPES`; default ``"sequence"`` (whole-action ratio
            ``exp(Σ_t d_t)``). ``"geometric_mean"`` (GSPO-style) and ``"token"`` (per-token ratios;
            each action's surrogate is the mean over its tokens) are different objectives.
        num_actions: N, the global number of actions the loss is averaged over (all ranks
            together, for sharding invariance); default B.
        log_ratio_clamp: log-ratios are clamped to ± this before ``exp`` (default 20.0).
        action_weights: (B,) optional non-negative weight of each action's surrogate (no grad), e.g.
            the truncated importance weights against the sampler
            (:func:`pivotrl.objective.tis.truncated_is_weights`, ``training.tis_cap``); None = 1.
            The KL term is not weighted.

    Returns:
        ``(loss, metrics)``: a scalar tensor (float32 or wider) to minimise, and Python floats
        (statistics over this rank's B actions; ratio and clip statistics are over action tokens
        for ``"token"``): ``loss`` (the returned value), ``surrogate`` (mean surrogate per action),
        ``kl`` (mean k3 KL per action, nats), ``kl_term`` (mean estimator term per action),
        ``kl_penalty`` (β · kl_term), ``ratio_mean``, ``ratio_max``, ``ratio_min``,
        ``clip_frac_high``, ``clip_frac_low``, ``log_ratio_clamped`` (count), ``advantage_mean``,
        ``num_actions`` (B on this rank).

    Raises:
        ConfigError: an unknown ``kl_estimator`` or ``ratio_type`` (listing the valid names), a bad
            ``log_ratio_clamp`` or ``num_actions`` (the message names it).
        ValueError: shapes disagree, an action has no token, or advantages are not finite.
        TrainingError: the loss is NaN or infinite (e.g. a NaN log-prob on an action token).
    """
    _check_inputs(logprobs, old_logprobs, ref_logprobs, advantages, action_mask)
    b = logprobs.shape[0]
    if num_actions is None:
        n = b
    else:
        try:
            n = operator.index(num_actions) if not isinstance(num_actions, bool) else -1
        except TypeError:
            n = -1
        if n < b:
            raise ConfigError(
                f"num_actions must be an int >= the local batch size B={b} "
                f"(the global number of actions, all ranks together), got {num_actions!r}"
            )

    compute_dtype = torch.promote_types(logprobs.dtype, torch.float32)
    lp = logprobs.to(compute_dtype)
    old = old_logprobs.detach().to(compute_dtype)
    ref = ref_logprobs.detach().to(compute_dtype)
    adv = advantages.detach().to(compute_dtype)
    mask = action_mask.detach().bool()

    ratio, num_clamped = action_ratios(lp, old, mask, ratio_type=ratio_type, log_ratio_clamp=log_ratio_clamp)
    surr, clip_high, clip_low = clipped_surrogate(ratio, adv, epsilon)
    if ratio.dim() == 2:  # "token": mean over each action's tokens → one value per action
        lengths = mask.sum(dim=-1).to(compute_dtype)
        surr_action = torch.where(mask, surr, torch.zeros_like(surr)).sum(dim=-1) / lengths
        stat_ratio = ratio.detach()[mask]
        stat_high, stat_low = clip_high[mask], clip_low[mask]
    else:
        surr_action = surr
        stat_ratio = ratio.detach()
        stat_high, stat_low = clip_high, clip_low

    if action_weights is not None:
        if action_weights.shape != (b,):
            raise ValueError(f"action_weights must have shape (B,) = ({b},), got {tuple(action_weights.shape)}")
        surr_action = surr_action * action_weights.detach().to(compute_dtype)
    task_loss = -surr_action.sum() / n
    kl_term = kl_terms(lp, ref, mask, kl_estimator)  # (B,)
    beta_f = float(beta)
    loss = task_loss + (beta_f * kl_term.sum() / n) if beta_f > 0.0 else task_loss

    if not bool(torch.isfinite(loss.detach())):
        raise TrainingError(
            "non-finite PivotRL loss: "
            f"surrogate finite={bool(torch.isfinite(surr_action.detach()).all())}, "
            f"kl_term finite={bool(torch.isfinite(kl_term.detach()).all())}, "
            f"logprobs finite on action tokens={bool(torch.isfinite(lp.detach()[mask]).all())}"
        )

    kl_mean = float(k3_value(lp, ref, mask).mean())
    kl_term_mean = float(kl_term.detach().mean())
    metrics = {
        "loss": float(loss.detach()),
        "surrogate": float(surr_action.detach().mean()),
        "kl": kl_mean,
        "kl_term": kl_term_mean,
        "kl_penalty": beta_f * kl_term_mean,
        "ratio_mean": float(stat_ratio.mean()),
        "ratio_max": float(stat_ratio.max()),
        "ratio_min": float(stat_ratio.min()),
        "clip_frac_high": float(stat_high.float().mean()),
        "clip_frac_low": float(stat_low.float().mean()),
        "log_ratio_clamped": float(num_clamped),
        "advantage_mean": float(adv.mean()),
        "num_actions": float(b),
    }
    return loss, metrics
