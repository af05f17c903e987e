"""The metrics of one PivotRL training step, from the step's summed counters.

:func:`step_metrics` turns the counters a :meth:`~pivotrl.training.pivotrl.PivotRLTrainer.train_step`
summed over its micro-batches and updates (:class:`~pivotrl.training.trainer_state.MetricSums`,
already reduced over ranks) into the step's metrics: batch (groups, actions, reward mean/std,
zero-variance share), loss terms per action (nats), ratio and clipping statistics, gradient norms,
token counts and times (seconds); :func:`speed_metrics` adds the speed: tokens per second, model
TFLOP and, with a calibrated peak, the model FLOPs utilization (:mod:`pivotrl.runtime.mfu`). Every
value is a float.
"""

from __future__ import annotations

import math
from typing import Mapping, Sequence

import torch

from pivotrl.runtime.mfu import mfu
from pivotrl.training.groups import Group

__all__ = ["speed_metrics", "step_metrics"]


def step_metrics(tot: Mapping[str, float], ratio_min: float, ratio_max: float, groups: Sequence[Group], *, step: int,
                 actions: int, groups_trained: int, beta: float, grad_norms: Sequence[float], elapsed: float,
                 speed: Mapping[str, float]) -> dict[str, float]:
    """The metrics of step ``step`` (see :meth:`~pivotrl.training.pivotrl.PivotRLTrainer.train_step`
    for each key). ``tot``: the reduced counters; ``ratio_min``/``ratio_max``: the extreme ratios
    (inf/-inf when no action was trained); ``actions``: every sampled action of the batch (the loss
    denominator); ``grad_norms``: one per update; ``elapsed``: the step's seconds; ``speed``: the
    :func:`speed_metrics` of the step."""
    n = max(tot["actions"], 1.0)
    nr = max(tot["ratio_actions"], 1.0)
    flat_rewards = torch.tensor([r for g in groups for r in g.rewards], dtype=torch.float64)
    metrics = {
        "step": float(step),
        "groups": float(len(groups)),
        "actions": float(actions),
        "groups_trained": float(groups_trained),
        "reward_mean": float(flat_rewards.mean()),
        "reward_std": float(flat_rewards.std(correction=0)),
        "zero_variance_frac": sum(max(g.rewards) == min(g.rewards) for g in groups) / len(groups),
        "loss": tot["loss_first"],
        "loss_last": tot["loss_last"],
        "surrogate": tot["surrogate"] / n,
        "kl": tot["kl"] / n,
        "kl_term": tot["kl_term"] / n,
        "kl_penalty": beta * tot["kl_term"] / n,
        "entropy": tot["entropy_sum"] / max(tot["action_tokens"], 1.0),
        "ratio_mean": tot["ratio_sum"] / nr if tot["ratio_actions"] else 1.0,
        "ratio_min": ratio_min if math.isfinite(ratio_min) else 1.0,
        "ratio_max": ratio_max if math.isfinite(ratio_max) else 1.0,
        "clip_frac_high": tot["clip_high"] / nr,
        "clip_frac_low": tot["clip_low"] / nr,
        "clip_frac": (tot["clip_high"] + tot["clip_low"]) / nr,
        "log_ratio_clamped": tot["log_ratio_clamped"],
        "grad_norm": sum(grad_norms) / len(grad_norms) if grad_norms else 0.0,
        "grad_norm_max": max(grad_norms) if grad_norms else 0.0,
        "updates": float(len(grad_norms)),
        "action_tokens": tot["action_tokens"],
        "tokens": tot["tokens"],
        "ref_tokens": tot["ref_tokens"],
        "step_time_s": elapsed,
        "trainer_s": elapsed,
        **speed,
    }
    if tot["mismatch_tokens"]:  # sampler (engine) vs trainer π_old on the sampled tokens
        metrics["sampler_mismatch_mean_abs"] = tot["mismatch_abs"] / tot["mismatch_tokens"]
        metrics["sampler_log_ratio_mean"] = tot["mismatch_log_ratio"] / max(tot["mismatch_actions"], 1.0)
        engines = sorted(int(k.rsplit("_e", 1)[1]) for k in tot if k.startswith("mismatch_max_e"))
        if engines:
            metrics["sampler_mismatch_max_abs"] = max(tot[f"mismatch_max_e{j}"] for j in engines)
        if len(engines) > 1:
            for j in engines:
                if tot[f"mismatch_tokens_e{j}"]:
                    metrics[f"sampler_mismatch_mean_abs_e{j}"] = tot[f"mismatch_abs_e{j}"] / tot[f"mismatch_tokens_e{j}"]
                    metrics[f"sampler_mismatch_max_abs_e{j}"] = tot[f"mismatch_max_e{j}"]
    if tot["tis_actions"]:
        metrics["tis_weight_mean"] = tot["tis_weight_sum"] / tot["tis_actions"]
    return metrics


def speed_metrics(tokens: float, ref_tokens: float, flop: float, elapsed: float, world: int,
                  peak_gflops_per_thread: float | None) -> dict[str, float]:
    """The step's speed: ``policy_tokens_per_s`` (forward+backward), ``ref_tokens_per_s`` (π_ref,
    forward only), ``model_tflop`` (model FLOPs of both, pivotrl.runtime.mfu), ``threads`` (torch
    threads × ranks) and, with a calibrated peak, ``peak_gflops`` (per-thread peak × threads)
    and ``mfu`` (model FLOP/s over that peak). ``elapsed`` in seconds; ``peak_gflops_per_thread``:
    the calibrated matmul peak of one thread in GFLOP/s, None = no MFU."""
    threads = torch.get_num_threads() * world
    out = {"policy_tokens_per_s": tokens / elapsed if elapsed > 0 else 0.0,
           "ref_tokens_per_s": ref_tokens / elapsed if elapsed > 0 else 0.0,
           "model_tflop": flop / 1e12, "threads": float(threads)}
    util = mfu(flop, elapsed, peak_gflops_per_thread, threads)
    if util is not None and peak_gflops_per_thread:
        out["peak_gflops"] = peak_gflops_per_thread * threads
        out["mfu"] = util
    return out

