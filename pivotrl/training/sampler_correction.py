"""The sampler's log-probs against the trainer's π_old: their mismatch and the truncated IS weights.

A rollout engine samples with its own numerics (vLLM in bf16, another kernel), so the log-probs it
reports for its actions (``Group.sampler_logprobs``, one list of per-token log-probs per action)
differ from the trainer's π_old on the same tokens. :func:`sampler_terms` adds, for one micro-batch,
the mismatch sums (mean |log π_old − log π_sampler| per token, whole-action log-ratio; nats), in
all and per rollout engine (``Group.engine``: sums and the largest per-token |Δ|), to the step's
counters and, with ``training.tis_cap``, returns the truncated importance-sampling weights
of its actions, shape (B,) (:mod:`pivotrl.objective.tis`). DataError when ``tis_cap`` is set and a
group lacks the sampler's log-probs.
"""

from __future__ import annotations

from typing import Any, Sequence

import torch

from pivotrl.core.errors import DataError
from pivotrl.objective import sampler_mismatch, truncated_is_weights
from pivotrl.training.groups import Group
from pivotrl.training.settings import LOG_RATIO_CLAMP
from pivotrl.training.trainer_state import MetricSums

__all__ = ["sampler_terms"]


def sampler_terms(settings: Any, groups: Sequence[Group], mb: Sequence[int], old: torch.Tensor, mask: torch.Tensor,
                  sums: MetricSums) -> torch.Tensor | None:
    """Mismatch sums of one micro-batch between the engine's sampled log-probs and the trainer's
    π_old (when every group of it carries them), and its TIS weights (B,) when ``tis_cap`` is set.
    Raises DataError when ``tis_cap`` is set and a group lacks the sampler's log-probs."""
    cap = getattr(settings, "tis_cap", None)
    missing = [groups[i].state_id for i in mb if groups[i].sampler_logprobs is None]
    if missing:
        if cap is not None:
            raise DataError(f"training.tis_cap is set but group {missing[0]!r} has no sampler log-probs "
                            "(the rollout engine's per-token log-probs of its actions)")
        return None
    rows = [torch.tensor(lp, dtype=torch.float64) for i in mb for lp in groups[i].sampler_logprobs]
    sampler = torch.zeros(old.shape, dtype=torch.float64)
    for r, lp in enumerate(rows):
        sampler[r, : min(len(lp), old.shape[1])] = lp[: old.shape[1]]
    sampler = sampler.to(old.device)
    m = sampler_mismatch(old, sampler, mask)
    sums.add("mismatch_abs", m["abs_sum"])
    sums.add("mismatch_tokens", m["tokens"])
    sums.add("mismatch_log_ratio", m["log_ratio_sum"])
    sums.add("mismatch_actions", m["actions"])
    engine_of_row = [groups[i].engine for i in mb for _ in groups[i].sampler_logprobs]
    for j in sorted(set(engine_of_row)):
        rows_j = torch.tensor([e == j for e in engine_of_row], device=old.device)
        mj = sampler_mismatch(old[rows_j], sampler[rows_j], mask[rows_j])
        sums.add(f"mismatch_abs_e{j}", mj["abs_sum"])
        sums.add(f"mismatch_tokens_e{j}", mj["tokens"])
        sums.engine_max[j] = max(sums.engine_max[j], mj["max_abs"])
    if cap is None:
        return None
    w = truncated_is_weights(old, sampler, mask, cap, log_ratio_clamp=LOG_RATIO_CLAMP)
    sums.add("tis_weight_sum", float(w.sum()))
    sums.add("tis_actions", float(w.numel()))
    return w
