"""Stage 1 of PivotRL: choose pivot states from reference probes (PivotRL §3, appendix A.2).

For each candidate turn state ``s`` the frozen reference policy ``π_ref`` samples ``m`` actions
(``num_probes``), a verifier scores them, and::

    μ̂(s)  = (1/m) Σ_i R_i
    σ̂²(s) = (1/m) Σ_i (R_i − μ̂)²        (population variance, not the unbiased m−1 form)

``s`` is kept iff ``σ̂²(s) > 0`` and ``μ̂(s) < λ_diff``. "σ̂² > 0" is decided with a stated tolerance:
rewards equal within ``REWARD_TOLERANCE = 1e-9`` count as equal (``[0.3, 0.1+0.2, 0.3, 0.3]`` has
σ̂² = 0, not the 2.3e-33 of float noise); see :func:`probe_stats` and :func:`pivot_decision`. The first condition removes states whose
probes all fail or all pass: a group of equal rewards has zero group-relative advantage, so it
would give no task signal in Stage 2. For binary rewards ``σ̂² = μ̂(1 − μ̂)``, which is symmetric
around 0.5, so the variance condition alone keeps easy and hard states alike; the threshold keeps
the states the reference finds hard. It is not "pick the largest variance".

Why ``lambda_diff = 0.5`` by default: it is the worked example of the method's description (m = 4,
λ_diff = 0.5: probes ``[1,0,0,0]`` are kept, ``[1,1,0,0]`` are not). With binary rewards it keeps
exactly the states where the reference fails more often than it succeeds (with m = 8: 1–3
successes of 8). A public reproduction used the looser ``μ̂ ≤ 0.6``; raise ``lambda_diff`` to keep
more, easier states. ``lambda_diff = 1`` keeps every state with mixed outcomes.

What is kept is the *state* (the history); the probes only select states and are never used as
supervision labels.

Shape legend: m = probes per state (``num_probes``), N = candidate states.
"""

from __future__ import annotations

import math
from typing import Sequence

import torch
from torch import Tensor

PIVOT_DECISIONS: tuple[str, ...] = ("kept", "all_fail", "all_pass", "above_threshold")
DEFAULT_LAMBDA_DIFF = 0.5
#: Rewards of one state whose range (max − min) is at most this count as equal (σ̂² = 0): float noise
#: such as 0.1 + 0.2 ≠ 0.3 is no mixed outcome. Verifier rewards are 0/1 or graded in steps ≫ 1e-9.
REWARD_TOLERANCE = 1e-9
#: The largest σ̂² that rewards equal within REWARD_TOLERANCE can have (range r gives σ̂² ≤ r²/4):
#: :func:`pivot_decision` reads a σ̂² at or below it as 0.
VARIANCE_TOLERANCE = REWARD_TOLERANCE**2 / 4


def _as_reward_tensor(rewards: Sequence[float] | Tensor) -> Tensor:
    if isinstance(rewards, Tensor):
        t = rewards.detach().to(dtype=torch.float64, device="cpu")
    else:
        try:
            t = torch.as_tensor(rewards, dtype=torch.float64)
        except (TypeError, ValueError, RuntimeError) as exc:
            raise ValueError(f"rewards must be numbers of shape (m,) or (N, m): {exc}") from None
    if t.dim() not in (1, 2):
        raise ValueError(f"rewards must have shape (m,) or (N, m), got shape {tuple(t.shape)}")
    if not bool(torch.isfinite(t).all()):
        raise ValueError("rewards contain NaN or infinite values")
    return t


def probe_stats(rewards: Sequence[float] | Tensor) -> tuple[float, float] | tuple[Tensor, Tensor]:
    """Mean μ̂ and population variance σ̂² of the probe rewards of one or many states (PivotRL §3).

    Args:
        rewards: shape (m,) — the ``m = num_probes`` rewards of one state — as a sequence of numbers
            or a tensor; or a tensor of shape (N, m), one row per candidate state. Any real dtype;
            computed in float64.

    Returns:
        ``(mu, var)``: Python floats for a (m,) input; float64 tensors of shape (N,) for (N, m).
        ``var`` is exactly 0.0 when all rewards of a state are equal within ``REWARD_TOLERANCE``
        (max − min ≤ 1e-9: no rounding residue), so ``var > 0`` is a safe test for "mixed outcomes".

    ``m`` ≥ 2 (``probing.num_probes``) and ``0 < λ_diff ≤ 1`` are the config schema's bounds
    (:class:`pivotrl.config.sections.ProbingSection`), checked once when the config is validated;
    a single probe here simply has σ̂² = 0.

    Raises:
        ValueError: wrong rank, or NaN/infinite rewards.
    """
    t = _as_reward_tensor(rewards)
    mu = t.mean(dim=-1)
    var = ((t - mu.unsqueeze(-1)) ** 2).mean(dim=-1)
    all_equal = (t.amax(dim=-1) - t.amin(dim=-1)) <= REWARD_TOLERANCE
    var = torch.where(all_equal, torch.zeros_like(var), var)
    if t.dim() == 1:
        return float(mu), float(var)
    return mu, var


def pivot_decision(mu: float | Tensor, var: float | Tensor, lambda_diff: float = DEFAULT_LAMBDA_DIFF) -> str:
    """Decide whether one candidate state is a pivot (PivotRL §3, Stage 1).

    Args:
        mu: μ̂, the mean probe reward (float or 0-d tensor).
        var: σ̂², the population variance of the probe rewards (float or 0-d tensor, ≥ 0).
        lambda_diff: success-rate threshold, ``0 < lambda_diff ≤ 1`` (default 0.5, see module doc;
            the bound is ``probing.lambda_diff``'s in the config schema, not checked again here).

    Returns:
        ``"kept"`` if σ̂² > 0 and μ̂ < λ_diff; otherwise the reason it is dropped:
        ``"all_fail"`` / ``"all_pass"`` when σ̂² = 0 (σ̂² ≤ ``VARIANCE_TOLERANCE`` = 2.5e-19, the
        most that rewards equal within ``REWARD_TOLERANCE`` can give, counts as 0) (every probe scored the same; for binary
        rewards all 0 or all 1 — with graded rewards, "all_fail" if μ̂ < λ_diff else "all_pass"),
        ``"above_threshold"`` when σ̂² > 0 but μ̂ ≥ λ_diff.

    Raises:
        ValueError: ``mu`` or ``var`` not finite, ``var < 0``, or a tensor with more than one element.
    """
    lam = float(lambda_diff)
    mu_f = _scalar(mu, "mu")
    var_f = _scalar(var, "var")
    if var_f < 0.0:
        raise ValueError(f"var (σ̂²) must be >= 0, got {var_f}")
    if var_f <= VARIANCE_TOLERANCE:
        return "all_fail" if mu_f < lam else "all_pass"
    if mu_f >= lam:
        return "above_threshold"
    return "kept"


def pivot_decisions(mu: Tensor, var: Tensor, lambda_diff: float = DEFAULT_LAMBDA_DIFF) -> list[str]:
    """:func:`pivot_decision` for every state: ``mu``, ``var`` of shape (N,) → N decisions."""
    if mu.shape != var.shape or mu.dim() != 1:
        raise ValueError(f"mu and var must both have shape (N,), got {tuple(mu.shape)} and {tuple(var.shape)}")
    return [pivot_decision(float(a), float(b), lambda_diff) for a, b in zip(mu.tolist(), var.tolist())]


def is_pivot(mu: float | Tensor, var: float | Tensor, lambda_diff: float = DEFAULT_LAMBDA_DIFF) -> bool:
    """True iff :func:`pivot_decision` returns ``"kept"`` (σ̂² > 0 and μ̂ < λ_diff)."""
    return pivot_decision(mu, var, lambda_diff) == "kept"


def _scalar(x: float | Tensor, name: str) -> float:
    if isinstance(x, Tensor):
        if x.numel() != 1:
            raise ValueError(f"{name} must be a single value, got a tensor of shape {tuple(x.shape)}")
        x = x.item()
    try:
        value = float(x)
    except (TypeError, ValueError):
        raise ValueError(f"{name} must be a number, got {x!r}") from None
    if not math.isfinite(value):
        raise ValueError(f"{name} must be finite, got {value}")
    return value
