"""The PivotRL trainer core (PivotRL §3, Stage 2): local GRPO updates on pivot states with DeepSpeed.

The trainer is independent of how rollouts are produced: it receives, per batch, a list of
:class:`Group` (one pivot state, its K sampled actions as token ids and their verifier rewards) and
performs ``updates_per_batch`` optimiser updates of ``pivotrl_loss``.

Per batch (``train_step``):

1. advantages per group from its rewards (``compute_advantages``, GRPO by default);
2. π_ref log-probs of every action from the frozen reference copy (no grad);
3. π_old log-probs: the weights before the first update of this batch. They are the detached
   log-probs of the first update's own forward passes (same weights, same numbers), so no extra
   forward pass is spent on them;
4. ``updates_per_batch`` updates, each over all micro-batches (``micro_batch_groups`` groups
   each) with gradient accumulation, so the whole batch is one optimiser update.

**Groups without task signal.** A group whose K rewards are all equal has Â = 0 for every action
under ``grpo``/``dr_grpo``/``rloo`` (spec, conformance case 3). Such groups *stay in the batch and
in the loss denominator* (the loss is the mean over all sampled pivots, as in J), so the task term
of the other groups is not re-weighted by how many groups happened to be uninformative. With
β > 0 they are trained (the KL term still has a gradient). With β = 0 and all advantages exactly
zero their loss and gradient are exactly zero, so they are skipped in the forward/backward passes
(a pure saving; the result is identical). ``zero_variance_frac`` reports their share.

**Data parallelism.** Every rank receives the same global list of groups. The trainable groups
are dealt round-robin to the ranks; every rank runs the same number of micro-batches
(``ceil(ceil(n / world) / micro_batch_groups)``; a rank with nothing left runs a zero-loss dummy
backward so collective calls stay matched). The loss is divided by the *global* number of actions
(all groups of the batch) and multiplied by the world size before ``engine.backward`` (DeepSpeed
averages gradients over ranks), so 2 ranks × half the batch give the same update as 1 rank × all.

Shape legend: G = groups in the batch, K = group size, B = actions in a micro-batch,
T = action tokens (padded), P = state tokens.
"""

from __future__ import annotations

import json
import math
import os
import random
import shutil
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Callable, Mapping, Sequence

import torch

from pivotrl.errors import ConfigError, DataError, TrainingError
from pivotrl.objective import ADVANTAGE_ESTIMATORS, compute_advantages, pivotrl_loss, validate_loss_settings
from pivotrl.training.deepspeed_utils import (
    build_engine,
    data_parallel_loss_scale,
    deepspeed_config,
    export_hf_checkpoint,
    load_causal_lm,
    rank_and_world,
    replace_directory,
    resolve_dtype,
)
from pivotrl.training.logprobs import compute_group_logprobs

__all__ = ["Group", "PivotRLSettings", "PivotRLTrainer", "main"]

TRAINER_STATE_FILE = "trainer_state.json"


@dataclass(frozen=True)
class Group:
    """One pivot state and the K actions sampled from π_old there, with their verifier rewards."""

    state_id: str
    prompt_ids: list[int]  # (P,) the rendered state, ending with the assistant generation header
    actions: list[list[int]]  # K × (T_i,) action token ids, each ending with the end-of-turn token
    rewards: list[float]  # (K,) R(s, a_i) from the verifier
    # (K,) precomputed Â_i, or None (computed from ``rewards`` with the advantage estimator). Set by
    # callers whose advantage is not a group statistic of this state, e.g. end-to-end RL, where every
    # model call of an episode carries the episode's group-normalised advantage (pivotrl.training.e2e);
    # such a group may hold any number ≥ 1 of actions.
    advantages: list[float] | None = None

    def to_dict(self) -> dict[str, Any]:
        """JSON-able dict with the fields (the record format of a batches file)."""
        d = asdict(self)
        if d["advantages"] is None:
            del d["advantages"]
        return d

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> Group:
        """Build from a JSON-like mapping; DataError naming the missing key."""
        try:
            return cls(
                state_id=str(d["state_id"]),
                prompt_ids=[int(x) for x in d["prompt_ids"]],
                actions=[[int(x) for x in a] for a in d["actions"]],
                rewards=[float(x) for x in d["rewards"]],
                advantages=None if d.get("advantages") is None else [float(x) for x in d["advantages"]],
            )
        except KeyError as err:
            raise DataError(f"group record {d.get('state_id', '?')!r} lacks key {err}") from None


@dataclass(frozen=True)
class PivotRLSettings:
    """Trainer settings (the RL section of a run config); validated on construction.

    Loss (PivotRL §3): ``group_size`` K ≥ 2 actions per pivot; ``epsilon`` clip range (0, 1);
    ``beta`` ≥ 0 KL coefficient; ``delta`` > 0 guards σ_R + δ; ``kl_estimator``,
    ``advantage_estimator`` and ``ratio_type`` are registry names from ``pivotrl.objective``;
    ``log_ratio_clamp`` bounds whole-turn log-ratios before ``exp``.
    Optimisation: ``lr`` (AdamW), ``weight_decay``, ``updates_per_batch`` ≥ 1 optimiser updates
    per rollout batch, ``micro_batch_groups`` ≥ 1 groups per backward pass, ``grad_clip`` ≥ 0.
    ``grad_clip`` None means 0 (no clipping).
    Execution: ``shared_prefix`` (one state pass per group), ``dtype`` (``"bfloat16"`` = bf16
    compute with fp32 master weights, or ``"float32"``), ``zero_stage`` 0–3, ``seed``,
    ``deepspeed_extra`` (merged over the generated DeepSpeed config).
    """

    group_size: int = 8
    epsilon: float = 0.2
    beta: float = 0.01
    delta: float = 1e-6
    kl_estimator: str = "squared_log_ratio"
    advantage_estimator: str = "grpo"
    ratio_type: str = "sequence"
    log_ratio_clamp: float = 20.0
    lr: float = 1e-5
    weight_decay: float = 0.0
    updates_per_batch: int = 1
    micro_batch_groups: int = 1
    grad_clip: float | None = 1.0
    shared_prefix: bool = True
    dtype: str = "bfloat16"
    zero_stage: int = 0
    seed: int = 0
    deepspeed_extra: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.grad_clip is None:
            object.__setattr__(self, "grad_clip", 0.0)
        def _int(name: str, lo: int) -> None:
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v < lo:
                raise ConfigError(f"{name} must be an integer >= {lo}, got {v!r}")

        _int("group_size", 2)
        _int("updates_per_batch", 1)
        _int("micro_batch_groups", 1)
        _int("seed", 0)
        validate_loss_settings(
            epsilon=self.epsilon,
            beta=self.beta,
            kl_estimator=self.kl_estimator,
            ratio_type=self.ratio_type,
            log_ratio_clamp=self.log_ratio_clamp,
        )
        ADVANTAGE_ESTIMATORS.get(self.advantage_estimator)
        if not (isinstance(self.delta, (int, float)) and math.isfinite(self.delta) and self.delta > 0):
            raise ConfigError(f"delta must be a finite number > 0, got {self.delta!r}")
        if not (isinstance(self.lr, (int, float)) and math.isfinite(self.lr) and self.lr > 0):
            raise ConfigError(f"lr must be a finite number > 0, got {self.lr!r}")
        if not self.weight_decay >= 0:
            raise ConfigError(f"weight_decay must be >= 0, got {self.weight_decay!r}")
        resolve_dtype(self.dtype)
        deepspeed_config(
            zero_stage=self.zero_stage, dtype=self.dtype, grad_clip=self.grad_clip, extra=self.deepspeed_extra
        )


def _pad_cat(tensors: Sequence[torch.Tensor]) -> torch.Tensor:
    """Concatenate (K_j, T_j) tensors along dim 0, right-padding T with zeros → (Σ K_j, max T_j)."""
    t_max = max(t.shape[1] for t in tensors)
    return torch.cat([torch.nn.functional.pad(t, (0, t_max - t.shape[1])) for t in tensors], dim=0)


def _rng_state() -> dict[str, Any]:
    state: dict[str, Any] = {"python": random.getstate(), "torch": torch.get_rng_state()}
    try:
        import numpy as np

        state["numpy"] = np.random.get_state()
    except ImportError:  # pragma: no cover - numpy ships with torch installs
        pass
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def _set_rng_state(state: Mapping[str, Any]) -> None:
    random.setstate(state["python"])
    torch.set_rng_state(state["torch"])
    if "numpy" in state:
        import numpy as np

        np.random.set_state(state["numpy"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


class _MetricSums:
    """Accumulates per-micro-batch statistics as sums, reduced over ranks once per step."""

    SUM_KEYS = (
        "actions",
        "surrogate",
        "kl",
        "kl_term",
        "ratio_sum",
        "clip_high",
        "clip_low",
        "log_ratio_clamped",
        "loss_first",
        "loss_last",
        "ratio_actions",
        "entropy_sum",
        "action_tokens",
        "tokens",
        "ref_tokens",
    )

    def __init__(self) -> None:
        self.sums = dict.fromkeys(self.SUM_KEYS, 0.0)
        self.ratio_min = math.inf
        self.ratio_max = -math.inf

    def add(self, key: str, value: float) -> None:
        self.sums[key] += value

    def reduce(self) -> tuple[dict[str, float], float, float]:
        rank, world = rank_and_world()
        vec = torch.tensor([self.sums[k] for k in self.SUM_KEYS], dtype=torch.float64)
        lo = torch.tensor([self.ratio_min], dtype=torch.float64)
        hi = torch.tensor([self.ratio_max], dtype=torch.float64)
        if world > 1:
            dist = torch.distributed
            dist.all_reduce(vec, op=dist.ReduceOp.SUM)
            dist.all_reduce(lo, op=dist.ReduceOp.MIN)
            dist.all_reduce(hi, op=dist.ReduceOp.MAX)
        return dict(zip(self.SUM_KEYS, vec.tolist())), float(lo), float(hi)


class PivotRLTrainer:
    """PivotRL Stage-2 trainer: π_θ in a DeepSpeed engine, π_ref a frozen copy (PivotRL §3).

    Args:
        model_dir: HF checkpoint of the policy to train (π_θ starts as this).
        ref_model_dir: HF checkpoint of π_ref (default: ``model_dir``; PivotRL starts π_θ = π_ref).
        tokenizer_dir: where tokenizer files are copied from on export (default: ``model_dir``).
        **settings: fields of :class:`PivotRLSettings` (group_size, epsilon, beta, delta,
            kl_estimator, advantage_estimator, ratio_type, log_ratio_clamp, lr, weight_decay,
            updates_per_batch, micro_batch_groups, grad_clip, shared_prefix, dtype, zero_stage, seed,
            deepspeed_extra).

    Every rank of a data-parallel job constructs the trainer and calls every method with the same
    arguments (the process group is created here if no launcher did). π_ref is replicated on every
    rank, in the compute dtype. Raises ConfigError for bad settings, ModelError for unreadable
    checkpoints.
    """

    def __init__(
        self,
        model_dir: str | os.PathLike[str],
        ref_model_dir: str | os.PathLike[str] | None = None,
        *,
        tokenizer_dir: str | os.PathLike[str] | None = None,
        **settings: Any,
    ) -> None:
        unknown = sorted(set(settings) - set(PivotRLSettings.__dataclass_fields__))
        if unknown:
            valid = ", ".join(sorted(PivotRLSettings.__dataclass_fields__))
            raise ConfigError(f"unknown trainer setting(s) {unknown}; valid: {valid}")
        self.settings = PivotRLSettings(**settings)
        s = self.settings
        self.model_dir = Path(model_dir)
        self.ref_model_dir = Path(ref_model_dir) if ref_model_dir is not None else self.model_dir
        self.tokenizer_dir = Path(tokenizer_dir) if tokenizer_dir is not None else self.model_dir
        self.compute_dtype = resolve_dtype(s.dtype)

        random.seed(s.seed)
        torch.manual_seed(s.seed)
        policy = load_causal_lm(self.model_dir, torch.float32)
        self.engine = build_engine(
            policy,
            lr=s.lr,
            zero_stage=s.zero_stage,
            dtype=s.dtype,
            grad_clip=s.grad_clip,
            weight_decay=s.weight_decay,
            extra_config=s.deepspeed_extra,
        )
        self.engine.eval()  # no dropout: log-probs must be deterministic functions of the weights
        self.ref_model = load_causal_lm(self.ref_model_dir, self.compute_dtype).eval()
        self.ref_model.requires_grad_(False)
        self.ref_model.to(self.engine.device)
        self.step = 0
        self.data_position = 0  # position in the caller's pivot order; saved with checkpoints
        self.extra_state: dict[str, Any] = {}
        #: Called with the number of groups after each micro-batch's backward pass (progress lines).
        self.on_groups: Callable[[int], Any] | None = None

    # ------------------------------------------------------------------ batch checks
    def _check_groups(self, groups: Sequence[Group]) -> None:
        k = self.settings.group_size
        if len(groups) == 0:
            raise DataError("train_step needs at least one group")
        for g in groups:
            if g.advantages is not None:
                if not (len(g.actions) == len(g.rewards) == len(g.advantages) >= 1):
                    raise DataError(
                        f"group {g.state_id!r}: {len(g.actions)} actions, {len(g.rewards)} rewards and "
                        f"{len(g.advantages)} advantages; with precomputed advantages all three must match (>= 1)"
                    )
                if not all(math.isfinite(a) for a in g.advantages):
                    raise DataError(f"group {g.state_id!r}: advantages must be finite, got {g.advantages}")
            elif len(g.actions) != k or len(g.rewards) != k:
                raise DataError(
                    f"group {g.state_id!r}: {len(g.actions)} actions and {len(g.rewards)} rewards, "
                    f"expected group_size={k} of each"
                )
            if len(g.prompt_ids) == 0:
                raise DataError(f"group {g.state_id!r}: prompt_ids is empty")
            for i, a in enumerate(g.actions):
                if len(a) == 0:
                    raise DataError(f"group {g.state_id!r}: action {i} has no tokens")
            if not all(math.isfinite(r) for r in g.rewards):
                raise DataError(f"group {g.state_id!r}: rewards must be finite, got {g.rewards}")

    def _advantages(self, groups: Sequence[Group]) -> list[torch.Tensor]:
        """Â per group, (K_g,) float64: precomputed where given, else the estimator over the
        groups without them (one (G', K) call, so estimators see whole groups as before)."""
        s = self.settings
        plain = [i for i, g in enumerate(groups) if g.advantages is None]
        out: list[torch.Tensor] = [torch.tensor(g.advantages or [], dtype=torch.float64) for g in groups]
        if plain:
            rewards = torch.tensor([groups[i].rewards for i in plain], dtype=torch.float64)  # (G', K)
            computed = compute_advantages(rewards, s.advantage_estimator, s.delta)
            for row, i in enumerate(plain):
                out[i] = computed[row]
        return out

    def _dummy_backward(self) -> None:
        """A zero-loss backward through the model, keeping collectives matched across ranks."""
        out = self.engine(input_ids=torch.zeros(1, 1, dtype=torch.long, device=self.engine.device), use_cache=False)
        self.engine.backward(out.logits.float().sum() * 0.0, scale_wrt_gas=False)

    # ------------------------------------------------------------------ training
    def train_step(self, groups: Sequence[Group]) -> dict[str, float]:
        """One rollout batch: advantages, π_ref/π_old log-probs, ``updates_per_batch`` updates.

        Args:
            groups: the global batch (the same list on every rank), each with K = group_size actions.

        Returns:
            metrics (floats): ``step``; batch: ``groups``, ``actions``, ``reward_mean``,
            ``reward_std`` (over all actions), ``zero_variance_frac`` (groups with equal rewards),
            ``groups_trained``; loss at π_old (first update): ``loss``, ``surrogate``, ``kl`` (k3
            value, nats per action), ``kl_term``, ``kl_penalty``, ``entropy`` (mean token entropy of
            the action tokens, nats); over all updates: ``ratio_mean``, ``ratio_min``,
            ``ratio_max``, ``clip_frac_high``, ``clip_frac_low``, ``clip_frac``,
            ``log_ratio_clamped`` (count); ``loss_last`` (last update); ``grad_norm`` (mean over
            updates, before clipping), ``grad_norm_max``; work: ``action_tokens``, ``tokens``
            (policy forward+backward tokens), ``ref_tokens``, ``step_time_s``, ``tokens_per_s``.
            All values are global (reduced over ranks).

        Raises:
            DataError: malformed groups. TrainingError: non-finite loss or gradient norm.
        """
        s = self.settings
        t_start = time.perf_counter()
        self._check_groups(groups)
        rank, world = rank_and_world()
        advantages = self._advantages(groups)  # G × (K_g,)
        zero_var = [max(g.rewards) == min(g.rewards) for g in groups]
        trainable = [i for i in range(len(groups)) if s.beta > 0 or bool((advantages[i] != 0).any())]
        num_actions = sum(len(g.actions) for g in groups)  # global loss denominator: every sampled action
        local = trainable[rank::world]
        per_rank = math.ceil(len(trainable) / world)
        n_micro = math.ceil(per_rank / s.micro_batch_groups)
        micro = [local[j * s.micro_batch_groups : (j + 1) * s.micro_batch_groups] for j in range(n_micro)]
        loss_scale = data_parallel_loss_scale()
        sums = _MetricSums()

        # π_ref log-probs (no grad), per micro-batch: (B, T)
        ref_lp: list[torch.Tensor | None] = []
        with torch.no_grad():
            for mb in micro:
                if not mb:
                    ref_lp.append(None)
                    continue
                parts = [
                    compute_group_logprobs(self.ref_model, groups[i].prompt_ids, groups[i].actions, shared_prefix=s.shared_prefix)
                    for i in mb
                ]
                ref_lp.append(_pad_cat([p.logprobs for p in parts]))
                sums.add("ref_tokens", sum(p.tokens_processed for p in parts))

        old_lp: list[torch.Tensor | None] = [None] * n_micro
        grad_norms: list[float] = []
        for update in range(s.updates_per_batch if micro else 0):
            first = update == 0
            last = update == s.updates_per_batch - 1
            for j, mb in enumerate(micro):
                if not mb:
                    self._dummy_backward()
                    continue
                parts = [
                    compute_group_logprobs(
                        self.engine, groups[i].prompt_ids, groups[i].actions, shared_prefix=s.shared_prefix, with_entropy=first
                    )
                    for i in mb
                ]
                logprobs = _pad_cat([p.logprobs for p in parts])  # (B, T)
                mask = _pad_cat([p.action_mask for p in parts])  # (B, T)
                if first:
                    old_lp[j] = logprobs.detach().clone()  # π_old = the weights before this batch's first update
                ref, old = ref_lp[j], old_lp[j]
                if ref is None or old is None:
                    raise TrainingError(f"micro-batch {j} lost its π_ref/π_old log-probs (internal error)")
                t = logprobs.shape[1]
                ref = torch.nn.functional.pad(ref, (0, t - ref.shape[1])).to(logprobs.dtype)
                adv = torch.cat([advantages[i] for i in mb]).to(logprobs.dtype)  # (B,)
                loss, m = pivotrl_loss(
                    logprobs,
                    old,
                    ref,
                    adv,
                    mask,
                    epsilon=s.epsilon,
                    beta=s.beta,
                    kl_estimator=s.kl_estimator,
                    ratio_type=s.ratio_type,
                    num_actions=num_actions,
                    log_ratio_clamp=s.log_ratio_clamp,
                )
                self.engine.backward(loss * loss_scale, scale_wrt_gas=False)
                if self.on_groups is not None:
                    self.on_groups(len(mb))
                b = float(logprobs.shape[0])
                sums.add("tokens", sum(p.tokens_processed for p in parts))
                sums.add("ratio_actions", b)
                sums.add("ratio_sum", m["ratio_mean"] * b)
                sums.add("clip_high", m["clip_frac_high"] * b)
                sums.add("clip_low", m["clip_frac_low"] * b)
                sums.add("log_ratio_clamped", m["log_ratio_clamped"])
                sums.ratio_min = min(sums.ratio_min, m["ratio_min"])
                sums.ratio_max = max(sums.ratio_max, m["ratio_max"])
                if first:
                    sums.add("actions", b)
                    sums.add("loss_first", m["loss"])
                    sums.add("surrogate", m["surrogate"] * b)
                    sums.add("kl", m["kl"] * b)
                    sums.add("kl_term", m["kl_term"] * b)
                    sums.add("action_tokens", float(mask.sum()))
                    sums.add("entropy_sum", float(sum(p.entropy.sum() for p in parts if p.entropy is not None)))
                if last:
                    sums.add("loss_last", m["loss"])
            self.engine.step()
            norm = self.engine.get_global_grad_norm()
            norm = float(norm) if norm is not None else math.nan
            if not math.isfinite(norm):
                raise TrainingError(f"non-finite gradient norm {norm} at step {self.step + 1}, update {update + 1}")
            grad_norms.append(norm)

        tot, ratio_min, ratio_max = sums.reduce()
        self.step += 1
        elapsed = time.perf_counter() - t_start
        n = max(tot["actions"], 1.0)
        nr = max(tot["ratio_actions"], 1.0)
        flat_rewards = torch.tensor([r for g in groups for r in g.rewards], dtype=torch.float64)
        metrics = {
            "step": float(self.step),
            "groups": float(len(groups)),
            "actions": float(num_actions),
            "groups_trained": float(len(trainable)),
            "reward_mean": float(flat_rewards.mean()),
            "reward_std": float(flat_rewards.std(correction=0)),
            "zero_variance_frac": sum(zero_var) / len(groups),
            "loss": tot["loss_first"],
            "loss_last": tot["loss_last"],
            "surrogate": tot["surrogate"] / n,
            "kl": tot["kl"] / n,
            "kl_term": tot["kl_term"] / n,
            "kl_penalty": s.beta * tot["kl_term"] / n,
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
            "tokens_per_s": (tot["tokens"] + tot["ref_tokens"]) / elapsed if elapsed > 0 else 0.0,
        }
        return metrics

    # ------------------------------------------------------------------ inspection / export
    def old_policy_logprobs(self, prompt_ids: Sequence[int], action_ids: Sequence[int]) -> list[float]:
        """Per-token log π(a_t | s, a_<t) (T floats) under the current weights, which are π_old for
        the next batch: compare with a rollout engine's log-probs after a weight refresh.

        Under ZeRO-3 every rank must call this (parameters are gathered collectively).
        Raises DataError for empty inputs.
        """
        with torch.no_grad():
            res = compute_group_logprobs(self.engine, prompt_ids, [list(action_ids)], shared_prefix=self.settings.shared_prefix)
        return res.logprobs[0, : len(action_ids)].double().tolist()

    def export_hf(self, directory: str | os.PathLike[str]) -> Path:
        """Write the current weights + tokenizer files as an HF checkpoint (atomic); every rank calls."""
        return export_hf_checkpoint(self.engine, directory, tokenizer_dir=self.tokenizer_dir)

    # ------------------------------------------------------------------ checkpoints
    def save_checkpoint(self, directory: str | os.PathLike[str]) -> Path:
        """Save everything needed to resume into ``directory`` (atomically; every rank calls).

        Layout: ``deepspeed/`` (engine checkpoint: weights, fp32 master weights, optimizer
        state, tag ``step<N>``), ``hf/`` (HF export of the current weights), ``rng_rank<r>.pt``
        (each rank's Python/NumPy/torch RNG states), ``trainer_state.json`` (step,
        ``data_position``, ``extra_state``, settings, world size). Written into
        ``<directory>.partial`` and renamed when complete. π_ref is not saved (it is frozen and
        re-read from ``ref_model_dir``).
        """
        target = Path(directory)
        partial = target.with_name(target.name + ".partial")
        rank, world = rank_and_world()
        if rank == 0:
            shutil.rmtree(partial, ignore_errors=True)
            partial.mkdir(parents=True)
        if world > 1:
            torch.distributed.barrier()
        tag = f"step{self.step}"
        self.engine.save_checkpoint(str(partial / "deepspeed"), tag=tag)
        export_hf_checkpoint(self.engine, partial / "hf", tokenizer_dir=self.tokenizer_dir)
        torch.save(_rng_state(), partial / f"rng_rank{rank}.pt")
        if rank == 0:
            state = {
                "step": self.step,
                "tag": tag,
                "data_position": self.data_position,
                "extra_state": self.extra_state,
                "world_size": world,
                "settings": asdict(self.settings),
            }
            (partial / TRAINER_STATE_FILE).write_text(json.dumps(state, indent=2, sort_keys=True))
        if world > 1:
            torch.distributed.barrier()
        if rank == 0:
            replace_directory(partial, target)
        if world > 1:
            torch.distributed.barrier()
        return target

    def load_checkpoint(self, directory: str | os.PathLike[str]) -> dict[str, Any]:
        """Restore a :meth:`save_checkpoint` directory: weights, optimizer, step, data position, RNG.

        Returns the trainer state dict. Raises TrainingError if the checkpoint is incomplete or was
        written with a different world size under ZeRO ≥ 1 (partitioned optimizer state).
        """
        root = Path(directory)
        state_path = root / TRAINER_STATE_FILE
        if not state_path.is_file():
            raise TrainingError(f"no trainer checkpoint at {root} ({TRAINER_STATE_FILE} missing)")
        state = json.loads(state_path.read_text())
        _, world = rank_and_world()
        if state["world_size"] != world and self.settings.zero_stage > 0:
            raise TrainingError(
                f"checkpoint {root} was written by {state['world_size']} ranks with ZeRO stage "
                f"{self.settings.zero_stage}; resume it with the same world size (now {world})"
            )
        load_path, _ = self.engine.load_checkpoint(str(root / "deepspeed"), tag=state["tag"])
        if load_path is None:
            raise TrainingError(f"DeepSpeed could not load {root / 'deepspeed'} tag {state['tag']}")
        self.step = int(state["step"])
        self.data_position = int(state["data_position"])
        self.extra_state = dict(state.get("extra_state") or {})
        rank, _ = rank_and_world()
        rng_path = root / f"rng_rank{rank}.pt"
        if rng_path.is_file():
            _set_rng_state(torch.load(rng_path, weights_only=False))
        return state


# ---------------------------------------------------------------------- entry point
@dataclass(frozen=True)
class OfflineSpec:
    """``python -m pivotrl.training.pivotrl --spec spec.json``: train on pre-collected batches.

    ``batches_path``: JSON Lines, one batch per line: ``{"groups": [Group dicts]}``.
    ``metrics_path`` receives one JSON line of metrics per step (rank 0). ``out_dir`` receives
    the final HF export; ``checkpoint_dir`` (optional) a resumable checkpoint at the end.
    """

    model_dir: str
    batches_path: str
    out_dir: str
    ref_model_dir: str | None = None
    metrics_path: str | None = None
    checkpoint_dir: str | None = None
    resume_from: str | None = None
    trainer: dict[str, Any] = field(default_factory=dict)


def read_batches(path: str | os.PathLike[str]) -> list[list[Group]]:
    """Read a JSON Lines file of ``{"groups": [...]}`` batches; DataError naming the line."""
    batches = []
    for n, line in enumerate(Path(path).read_text().splitlines(), start=1):
        if not line.strip():
            continue
        try:
            rec = json.loads(line)
            batches.append([Group.from_dict(g) for g in rec["groups"]])
        except (json.JSONDecodeError, KeyError, TypeError) as err:
            raise DataError(f"{path}:{n}: not a batch record ({err})") from None
    return batches


def run_offline(spec: OfflineSpec) -> list[dict[str, float]]:
    """Train on the batches of ``spec`` (see :class:`OfflineSpec`); returns the per-step metrics."""
    trainer = PivotRLTrainer(spec.model_dir, spec.ref_model_dir, **spec.trainer)
    if spec.resume_from:
        trainer.load_checkpoint(spec.resume_from)
    batches = read_batches(spec.batches_path)
    rank, _ = rank_and_world()
    history = []
    for batch in batches[trainer.data_position :]:
        metrics = trainer.train_step(batch)
        trainer.data_position += 1
        history.append(metrics)
        if rank == 0 and spec.metrics_path:
            with open(spec.metrics_path, "a") as f:
                f.write(json.dumps(metrics, sort_keys=True) + "\n")
    trainer.export_hf(spec.out_dir)
    if spec.checkpoint_dir:
        trainer.save_checkpoint(spec.checkpoint_dir)
    return history


def main(argv: Sequence[str] | None = None) -> int:
    """Command-line entry: ``--spec <json file>`` with the fields of :class:`OfflineSpec`."""
    from pivotrl.training.launch import read_spec

    spec = read_spec(argv, OfflineSpec)
    run_offline(spec)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
