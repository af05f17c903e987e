"""PivotRL's Stage-2 objective as free functions in pure torch (PivotRL §3).

- :mod:`~pivotrl.objective.advantages`: group-relative advantages (GRPO by default).
- :mod:`~pivotrl.objective.ratios`: whole-action importance ratios ``exp(Σ_t d_t)``, clamped.
- :mod:`~pivotrl.objective.surrogate`: PPO's clipped surrogate and where the clip binds.
- :mod:`~pivotrl.objective.kl`: KL estimators (default ``½ℓ²``: unbiased reverse-KL gradient).
- :mod:`~pivotrl.objective.loss`: :func:`pivotrl_loss`, the single loss entry point.
- :mod:`~pivotrl.objective.tis`: sampler–trainer mismatch and truncated importance sampling
  against the sampler's log-probs (``training.tis_cap``, off by default).

Every choice a config string makes is a :class:`~pivotrl.core.registry.Registry`:
``ADVANTAGE_ESTIMATORS``, ``RATIO_TYPES``, ``KL_ESTIMATORS``.
"""

from __future__ import annotations

from pivotrl.objective.advantages import (
    ADVANTAGE_ESTIMATORS,
    DEFAULT_ADVANTAGE_ESTIMATOR,
    DEFAULT_DELTA,
    compute_advantages,
)
from pivotrl.objective.kl import (
    DEFAULT_KL_ESTIMATOR,
    KL_ESTIMATORS,
    action_log_ratio_to_ref,
    k3_value,
    kl_terms,
)
from pivotrl.objective.loss import pivotrl_loss
from pivotrl.objective.ratios import (
    DEFAULT_LOG_RATIO_CLAMP,
    DEFAULT_RATIO_TYPE,
    RATIO_TYPES,
    action_ratios,
    clamp_log_ratio,
    sequence_log_ratio,
)
from pivotrl.objective.surrogate import DEFAULT_EPSILON, clipped_surrogate
from pivotrl.objective.tis import sampler_mismatch, truncated_is_weights

__all__ = [
    "ADVANTAGE_ESTIMATORS",
    "DEFAULT_ADVANTAGE_ESTIMATOR",
    "DEFAULT_DELTA",
    "DEFAULT_EPSILON",
    "DEFAULT_KL_ESTIMATOR",
    "DEFAULT_LOG_RATIO_CLAMP",
    "DEFAULT_RATIO_TYPE",
    "KL_ESTIMATORS",
    "RATIO_TYPES",
    "action_log_ratio_to_ref",
    "action_ratios",
    "clamp_log_ratio",
    "clipped_surrogate",
    "compute_advantages",
    "k3_value",
    "kl_terms",
    "pivotrl_loss",
    "sampler_mismatch",
    "sequence_log_ratio",
    "truncated_is_weights",
]
