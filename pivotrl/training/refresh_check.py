"""The refresh check: is every rollout engine sampling from the trainer's π_old?

After each optimiser step the trainer's weights are written into the engines
(:func:`pivotrl.training.rank_engines.refresh_step`). The next batch checks that refresh for free:
the engines sample it with the refreshed weights and report each sampled token's log-prob, and the
trainer's ``train_step`` computes π_old on the same tokens for the loss; their per-token |Δ| per
engine (``sampler_mismatch_*``, :mod:`pivotrl.training.sampler_correction`) is :func:`batch_check`.
The refresh no batch samples (after the last step) is checked by scoring
(:func:`pivotrl.rollout.pool.refresh_delta`). :func:`check_refresh` holds the rule for both.

Tolerances (per token, nats): fp32 max ≤ ``training.refresh_tolerance`` and mean ≤ 1e-4; bf16
mean ≤ 0.05 (a larger max is bf16 kernel noise, logged). Pure: no engine, no torch.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Any, Sequence

from pivotrl.core.errors import TrainingError
from pivotrl.training.checkpoints import broadcast

if TYPE_CHECKING:
    from pivotrl.config import RunConfig

log = logging.getLogger("pivotrl.training")

__all__ = ["BATCH_SOURCE", "REFRESH_MEAN_TOLERANCE", "batch_check", "check_refresh", "engines_row", "num_engines",
           "refresh_ok"]

#: Mean |Δ| per token allowed between engine and trainer log-probs after a refresh (spec tolerances).
REFRESH_MEAN_TOLERANCE = {"fp32": 1e-4, "bf16": 0.05}

#: What a check read from a step's batch compares (the failure message names it).
BATCH_SOURCE = "the engine's sampling log-probs of this step's batch vs the trainer's π_old"


def num_engines(engine: Any, hosts: Sequence[int], world: int) -> int:
    """The rollout engines serving a batch: the host ranks' engines, else rank 0's pool or engine
    (the same count on every rank)."""
    if len(hosts) > 1:
        return len(hosts)
    return int(broadcast(len(getattr(engine, "engines", ())) or 1, world))


def batch_check(metrics: dict[str, Any], engines: int) -> list[tuple[float, float] | None] | None:
    """Per engine, (max, mean) per-token |Δ| between the engine's sampling log-probs of the batch
    and the trainer's π_old (``sampler_mismatch_*`` of ``train_step``); None for an engine whose
    actions were not trained; None in all when the batch carried no sampling log-probs (the engine
    does not report them, or no group was trained)."""
    if "sampler_mismatch_mean_abs" not in metrics or "sampler_mismatch_max_abs" not in metrics:
        return None
    overall = (float(metrics["sampler_mismatch_max_abs"]), float(metrics["sampler_mismatch_mean_abs"]))
    if engines == 1 or not any(f"sampler_mismatch_mean_abs_e{j}" in metrics for j in range(engines)):
        # one engine, or a batch whose groups all came from engine 0 (no per-engine columns)
        return [overall] + [None] * (engines - 1)
    out = [(float(metrics[f"sampler_mismatch_max_abs_e{j}"]), float(metrics[f"sampler_mismatch_mean_abs_e{j}"]))
           if f"sampler_mismatch_mean_abs_e{j}" in metrics else None for j in range(engines)]
    return out if any(out) else None


def engines_row(per_engine: Sequence[tuple[float, float] | None], served: Sequence[int],
                 cfg: "RunConfig") -> dict[str, Any]:
    """The per-engine columns of a metrics row (several engines only; see the module docstring)."""
    row: dict[str, Any] = {"engines": len(per_engine), "refresh_verified_engines": sum(
        1 for d in per_engine if d is not None
        and refresh_ok(d[0], d[1], cfg.training.refresh_tolerance, cfg.model.dtype))}
    for j, d in enumerate(per_engine):
        row[f"refresh_max_abs_delta_e{j}"] = d[0] if d is not None else 0.0
    for j, n in enumerate(served):
        row[f"rollout_states_e{j}"] = n
    return row


def refresh_ok(d_max: float, d_mean: float, tol_max: float, dtype: str) -> bool:
    """Whether a refresh check passes (:func:`check_refresh`'s rule, without raising)."""
    return not (d_mean > REFRESH_MEAN_TOLERANCE.get(dtype, 0.05) or (dtype == "fp32" and d_max > tol_max))


def check_refresh(step: int, d_max: float, d_mean: float, tol_max: float, dtype: str, *,
                  engine: int | None = None, source: str = "engine vs trainer log-probs") -> None:
    """Fail loudly if the rollout engine is not serving the trainer's weights after a refresh.

    ``d_max`` / ``d_mean``: over every trained token of the step's batch (``source`` says so), or of
    the first trained group's K actions scored after the refresh
    (:func:`~pivotrl.rollout.pool.refresh_delta`).
    fp32: both the max and the mean per-token |Δ| must be within tolerance (engines agree to ~1e-5).
    bf16: the mean must be ≤ 0.05; a max above ``refresh_tolerance`` alone is logged, not fatal —
    single bf16 tokens differ by up to ~0.3–0.5 between kernels (measured), while a refresh that did
    not take shows on the mean. One action's mean is not enough in bf16: on the multi-turn
    showcase's ≈1,400-token states single actions' means under the same weights reached 0.035, and
    after a refresh 0.054 and 0.113 (benchmarks/RESULTS.md §29), so the mean pools the group. Raises TrainingError naming the step, the engine (``engine``: its
    index in a pool of several) and the numbers."""
    mean_tol = REFRESH_MEAN_TOLERANCE.get(dtype, 0.05)
    which = "" if engine is None else f" (rollout engine {engine})"
    if not refresh_ok(d_max, d_mean, tol_max, dtype):
        raise TrainingError(
            f"policy refresh check failed at step {step}{which}: {source} differ by {d_max:.3g} "
            f"(max) / {d_mean:.3g} (mean) per token (tolerances {tol_max:g} / {mean_tol:g}); the rollout "
            "engine is not sampling from π_old")
    if d_max > tol_max:
        log.warning("refresh check at step %d: max per-token |Δ| %.3g exceeds %.3g (mean %.3g is within %.3g); "
                    "bf16 kernel noise", step, d_max, tol_max, d_mean, mean_tol)
