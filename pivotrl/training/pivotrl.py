"""The PivotRL trainer core (PivotRL §3, Stage 2): local GRPO updates on pivot states with DeepSpeed.

The trainer is independent of how rollouts are produced: it receives, per batch, a list of
:class:`Group` (one pivot state, its K sampled actions as token ids and their verifier rewards) and
performs ``updates_per_batch`` optimiser updates of ``pivotrl_loss``.

Per batch (``train_step``):

1. advantages per group from its rewards (``compute_advantages``, GRPO by default);
2. π_ref log-probs of every action from the frozen reference copy (no grad), all of this rank's
   groups packed into shared forwards (:func:`~pivotrl.training.logprobs.compute_groups_logprobs`);
3. π_old log-probs: the weights before the first update of this batch. They are the detached
   log-probs of the first update's own forward passes (same weights, same numbers), so no extra
   forward pass is spent on them;
4. ``updates_per_batch`` updates, each over all micro-batches (``micro_batch_groups`` groups
   each, one forward per group) with gradient accumulation, so the whole batch is one optimiser
   update.

**Groups without task signal.** A group whose K rewards are all equal has Â = 0 for every action
under ``grpo``/``dr_grpo``/``rloo`` (spec, conformance case 3). Such groups *stay in the batch and
in the loss denominator* (the loss is the mean over all sampled pivots, as in J), so the task term
of the other groups is not re-weighted by how many groups happened to be uninformative. With
β > 0 they are trained (the KL term still has a gradient). With β = 0 and all advantages exactly
zero their loss and gradient are exactly zero, so they are skipped in the forward/backward passes
(a pure saving; the result is identical). They are skipped too while π_θ is still π_ref (no update taken
since the trainer was built on π_ref's weights): the KL term is at its minimum there and its exact
gradient is zero, so what a backward would give is rounding noise, which Adam would turn into a
full learning-rate step in a random direction. A batch with no task signal at all therefore makes no
update before the first one that had some (the rule is read once per batch: with
``updates_per_batch`` > 1 the first batch that updates keeps them out of all its updates). A
checkpoint keeps whether π_θ is still π_ref. ``zero_variance_frac`` reports their share.

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

import math
import os
import random
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, Sequence

import torch

from pivotrl.config import TrainingSection
from pivotrl.core.errors import TrainingError
from pivotrl.objective import compute_advantages, pivotrl_loss
from pivotrl.training.deepspeed_utils import (
    build_engine,
    data_parallel_loss_scale,
    export_hf_checkpoint,
    load_causal_lm,
    rank_and_world,
    resolve_dtype,
)
from pivotrl.training.groups import Group, check_groups
from pivotrl.training.logprobs import compute_group_logprobs, compute_groups_logprobs
from pivotrl.training.packed_attention import use_packed_attention
from pivotrl.runtime.mfu import ModelShape, calibrated_peak_gflops, forward_flops
from pivotrl.training.sampler_correction import sampler_terms
from pivotrl.training.settings import LOG_RATIO_CLAMP, run_trainer_inputs, training_section
from pivotrl.training.step_metrics import speed_metrics, step_metrics
from pivotrl.training.trainer_state import (
    MetricSums,
    load_trainer_checkpoint,
    pad_cat,
    save_trainer_checkpoint,
)

if TYPE_CHECKING:
    from pivotrl.config import RunConfig

__all__ = ["Group", "PivotRLTrainer"]


class PivotRLTrainer:
    """PivotRL Stage-2 trainer: π_θ in a DeepSpeed engine, π_ref a frozen copy (PivotRL §3).

    Args:
        model_dir: HF checkpoint of the policy to train (π_θ starts as this).
        ref_model_dir: HF checkpoint of π_ref (default: ``model_dir``; PivotRL starts π_θ = π_ref).
        tokenizer_dir: where tokenizer files are copied from on export (default: ``model_dir``).
        training: the validated ``training`` section of the run config (loss, optimiser, DeepSpeed
            settings; checked by the schema and not again here).
        dtype: ``"bfloat16"`` (bf16 compute, fp32 master weights) or ``"float32"``.
        seed: seeds Python's and torch's RNGs before the policy is loaded.

    Build from a run config with :meth:`for_run`, from keywords with :meth:`build`. Every rank of
    a data-parallel job constructs the trainer and calls every method with the same arguments (the
    process group is created here if no launcher did). π_ref is replicated on every rank, in the
    compute dtype. Raises ConfigError for an unknown dtype, ModelError for unreadable checkpoints.
    """

    def __init__(
        self,
        model_dir: str | os.PathLike[str],
        ref_model_dir: str | os.PathLike[str] | None = None,
        *,
        tokenizer_dir: str | os.PathLike[str] | None = None,
        training: TrainingSection,
        dtype: str = "bfloat16",
        seed: int = 0,
    ) -> None:
        self.settings = training
        self.dtype, self.seed = dtype, seed
        self.model_dir = Path(model_dir)
        self.ref_model_dir = Path(ref_model_dir) if ref_model_dir is not None else self.model_dir
        self.tokenizer_dir = Path(tokenizer_dir) if tokenizer_dir is not None else self.model_dir
        self.compute_dtype = resolve_dtype(dtype)

        random.seed(seed)
        torch.manual_seed(seed)
        policy = load_causal_lm(self.model_dir, torch.float32)
        self.engine = build_engine(
            policy,
            lr=training.lr,
            zero_stage=training.deepspeed.zero_stage,
            dtype=dtype,
            grad_clip=training.grad_clip or 0.0,
            weight_decay=0.0,
            extra_config=training.deepspeed.extra or None,
            retain_host_memory=training.retain_host_memory,
        )
        self.engine.eval()  # no dropout: log-probs must be deterministic functions of the weights
        self.ref_model = load_causal_lm(self.ref_model_dir, self.compute_dtype).eval()
        self.ref_model.requires_grad_(False)
        self.ref_model.to(self.engine.device)
        for model in (self.engine.module, self.ref_model):  # the packed state attended without a mask
            use_packed_attention(model)
        #: The model's shape for the FLOP count (pivotrl.runtime.mfu); π_ref has π_θ's architecture.
        self.shape = ModelShape.of_model(self.ref_model)
        #: Calibrated matmul peak of one thread in the compute dtype (GFLOP/s); None = no MFU column.
        self.peak_gflops_per_thread: float | None = None
        self.step = 0
        self.data_position = 0  # position in the caller's pivot order; saved with checkpoints
        self.extra_state: dict[str, Any] = {}
        #: Called with the number of groups after each micro-batch's backward pass (progress lines).
        self.on_groups: Callable[[int], Any] | None = None
        #: π_θ still has π_ref's weights (built on the same checkpoint, no update taken since; checkpointed).
        self.at_reference = self.model_dir.resolve() == self.ref_model_dir.resolve()

    @classmethod
    def for_run(cls, cfg: RunConfig, model_dir: str | os.PathLike[str]) -> PivotRLTrainer:
        """The trainer of a validated, dtype-resolved run config on π_ref = π_θ = ``model_dir``."""
        trainer = cls(model_dir, model_dir, tokenizer_dir=model_dir, **run_trainer_inputs(cfg))
        trainer.peak_gflops_per_thread = calibrated_peak_gflops(cfg.model.dtype, str(cfg.run.local_cache()))
        return trainer

    @classmethod
    def build(
        cls,
        model_dir: str | os.PathLike[str],
        ref_model_dir: str | os.PathLike[str] | None = None,
        *,
        tokenizer_dir: str | os.PathLike[str] | None = None,
        dtype: str = "bfloat16",
        seed: int = 0,
        **training: Any,
    ) -> PivotRLTrainer:
        """A trainer from keywords of the ``training`` section (``group_size=4, lr=1e-3, ...``),
        validated by the schema (:func:`pivotrl.training.settings.training_section`)."""
        return cls(model_dir, ref_model_dir, tokenizer_dir=tokenizer_dir, training=training_section(**training),
                   dtype=dtype, seed=seed)

    # ------------------------------------------------------------------ batch checks
    def _check_groups(self, groups: Sequence[Group]) -> None:
        check_groups(groups, self.settings.group_size)

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
            (policy forward+backward tokens, summed over updates), ``ref_tokens`` (π_ref forward-only
            tokens), ``step_time_s`` = ``trainer_s`` (this call's time); speed
            (:func:`~pivotrl.training.step_metrics.speed_metrics`):
            ``policy_tokens_per_s``, ``ref_tokens_per_s``, ``model_tflop``, ``threads``, and with a
            calibrated peak (``peak_gflops_per_thread``) ``peak_gflops`` and ``mfu``; when the groups
            carry the rollout engine's log-probs: ``sampler_mismatch_mean_abs`` (mean |log π_old − log
            π_sampler| per action token, nats; π_old is the trainer's), ``sampler_mismatch_max_abs``
            (its largest token), with several engines both per engine (``…_e{j}``, ``Group.engine``),
            and ``sampler_log_ratio_mean`` (mean whole-action Σ_t of that difference); with
            ``training.tis_cap``: ``tis_weight_mean``
            (:mod:`pivotrl.objective.tis`).
            All values are global (reduced over ranks).

        Raises:
            DataError: malformed groups. TrainingError: non-finite loss or gradient norm.
        """
        s = self.settings
        t_start = time.perf_counter()
        self._check_groups(groups)
        rank, world = rank_and_world()
        advantages = self._advantages(groups)  # G × (K_g,)
        kl_moves = s.beta > 0 and not self.at_reference  # the KL term's gradient is zero at π_θ = π_ref
        trainable = [i for i in range(len(groups)) if kl_moves or bool((advantages[i] != 0).any())]
        num_actions = sum(len(g.actions) for g in groups)  # global loss denominator: every sampled action
        local = trainable[rank::world]
        per_rank = math.ceil(len(trainable) / world)
        n_micro = math.ceil(per_rank / s.micro_batch_groups)
        micro = [local[j * s.micro_batch_groups : (j + 1) * s.micro_batch_groups] for j in range(n_micro)]
        loss_scale = data_parallel_loss_scale()
        sums = MetricSums(engines=max((g.engine for g in groups), default=0) + 1)

        # π_ref log-probs (no grad) of all this rank's groups, packed into shared forwards of at most
        # training.pack_tokens tokens (π_ref is a plain module on every rank: no collectives), then
        # per micro-batch: (B, T)
        with torch.no_grad():
            ref_parts = compute_groups_logprobs(self.ref_model, [(groups[i].prompt_ids, groups[i].actions) for i in local],
                                                shared_prefix=s.shared_prefix, prefix_method=s.prefix_method,
                                                pack_tokens=s.pack_tokens)
        by_group = dict(zip(local, ref_parts))
        ref_lp: list[torch.Tensor | None] = [pad_cat([by_group[i].logprobs for i in mb]) if mb else None for mb in micro]
        sums.add("ref_tokens", sum(p.tokens_processed for p in ref_parts))
        sums.add("ref_flop", sum(forward_flops(self.shape, p.tokens_processed, p.logit_positions, p.attention_pairs)
                                 for p in ref_parts))

        old_lp: list[torch.Tensor | None] = [None] * n_micro
        tis_w: list[torch.Tensor | None] = [None] * n_micro  # truncated IS weights (training.tis_cap), per micro-batch
        grad_norms: list[float] = []
        for update in range(s.updates_per_batch if micro else 0):
            first = update == 0
            last = update == s.updates_per_batch - 1
            for j, mb in enumerate(micro):
                if not mb:
                    self._dummy_backward()
                    continue
                # one forward per group: every rank runs the same number of π_θ forwards (a ZeRO-3
                # forward is a collective), and packing π_θ's groups measured slower (RESULTS.md §14k)
                parts = compute_groups_logprobs(
                    self.engine, [(groups[i].prompt_ids, groups[i].actions) for i in mb], shared_prefix=s.shared_prefix,
                    with_entropy=first, prefix_method=s.prefix_method, pack_tokens=1,
                )
                logprobs = pad_cat([p.logprobs for p in parts])  # (B, T)
                mask = pad_cat([p.action_mask for p in parts])  # (B, T)
                if first:
                    old_lp[j] = logprobs.detach().clone()  # π_old = the weights before this batch's first update
                    tis_w[j] = sampler_terms(self.settings, groups, mb, old_lp[j], mask, sums)
                ref, old = ref_lp[j], old_lp[j]
                if ref is None or old is None:
                    raise TrainingError(f"micro-batch {j} lost its π_ref/π_old log-probs (internal error)")
                t = logprobs.shape[1]
                ref = torch.nn.functional.pad(ref, (0, t - ref.shape[1])).to(logprobs.device, logprobs.dtype)
                adv = torch.cat([advantages[i] for i in mb]).to(logprobs.device, logprobs.dtype)  # (B,)
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
                    log_ratio_clamp=LOG_RATIO_CLAMP,
                    action_weights=tis_w[j],
                )
                self.engine.backward(loss * loss_scale, scale_wrt_gas=False)
                if self.on_groups is not None:
                    self.on_groups(len(mb))
                b = float(logprobs.shape[0])
                sums.add("tokens", sum(p.tokens_processed for p in parts))
                sums.add("policy_flop", 3.0 * sum(forward_flops(self.shape, p.tokens_processed, p.logit_positions,
                                                                p.attention_pairs) for p in parts))
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
            self.at_reference = False
            norm = self.engine.get_global_grad_norm()
            norm = float(norm) if norm is not None else math.nan
            if not math.isfinite(norm):
                raise TrainingError(f"non-finite gradient norm {norm} at step {self.step + 1}, update {update + 1}")
            grad_norms.append(norm)

        tot, ratio_min, ratio_max = sums.reduce()
        self.step += 1
        elapsed = time.perf_counter() - t_start
        return step_metrics(tot, ratio_min, ratio_max, groups, step=self.step, actions=num_actions,
                            groups_trained=len(trainable), beta=s.beta, grad_norms=grad_norms, elapsed=elapsed,
                            speed=speed_metrics(tot["tokens"], tot["ref_tokens"], tot["policy_flop"] + tot["ref_flop"],
                                                elapsed, world, self.peak_gflops_per_thread))

    # ------------------------------------------------------------------ inspection / export
    def old_policy_logprobs(self, prompt_ids: Sequence[int], action_ids: Sequence[int]) -> list[float]:
        """Per-token log π(a_t | s, a_<t) (T floats) under the current weights, which are π_old for
        the next batch: compare with a rollout engine's log-probs after a weight refresh.

        Under ZeRO-3 every rank must call this (parameters are gathered collectively).
        Raises DataError for empty inputs.
        """
        return self.group_logprobs(prompt_ids, [action_ids])[0]

    def group_logprobs(self, prompt_ids: Sequence[int], actions: Sequence[Sequence[int]]) -> list[list[float]]:
        """:meth:`old_policy_logprobs` of several actions after one prompt (A lists of T_i floats),
        in one pass (the shared-prefix path where ``training.shared_prefix`` allows it)."""
        with torch.no_grad():
            res = compute_group_logprobs(self.engine, prompt_ids, [list(a) for a in actions],
                                         shared_prefix=self.settings.shared_prefix,
                                         prefix_method=self.settings.prefix_method)
        return [res.logprobs[i, : len(a)].double().tolist() for i, a in enumerate(actions)]

    def export_hf(self, directory: str | os.PathLike[str], writers: Sequence[int] = (0,)) -> Path:
        """Write the current weights + tokenizer files as an HF checkpoint (atomic); every rank
        calls, the ranks in ``writers`` write (each to its own ``directory``)."""
        return export_hf_checkpoint(self.engine, directory, tokenizer_dir=self.tokenizer_dir, writers=writers)

    def shared_weights(self, writers: Sequence[int] = (0,)) -> tuple[str, list] | None:
        """Write the current weights (compute dtype, tied duplicates left out) into this trainer's
        shared-memory block (``pivotrl.rollout.weight_sync.SharedWeights``, reused every step) on
        the ranks in ``writers`` → ``(block name, tensor metadata)`` there, None on the other ranks.
        Every rank calls (ZeRO-3 gathers the partitions collectively)."""
        from pivotrl.training.deepspeed_utils import _full_state_dict
        from pivotrl.rollout.weight_sync import SharedWeights, module_weights

        rank, _ = rank_and_world()
        if self.engine.zero_optimization_stage() == 3:
            sd = _full_state_dict(self.engine, writers)
            items = list(sd.items()) if sd is not None else None
        else:
            items = module_weights(self.engine.module) if rank in writers else None
        if items is None:
            return None
        if getattr(self, "_shared", None) is None:
            self._shared = SharedWeights()
        return self._shared.write(items)

    # ------------------------------------------------------------------ checkpoints
    def save_checkpoint(self, directory: str | os.PathLike[str]) -> Path:
        """Save everything needed to resume into ``directory`` (atomically; every rank calls); see
        :func:`pivotrl.training.trainer_state.save_trainer_checkpoint` for the layout."""
        return save_trainer_checkpoint(self, directory)

    def load_checkpoint(self, directory: str | os.PathLike[str]) -> dict[str, Any]:
        """Restore a :meth:`save_checkpoint` directory: weights, optimizer, step, data position, RNG.

        Returns the trainer state dict. Raises TrainingError if the checkpoint is incomplete or was
        written with a different world size under ZeRO ≥ 1 (partitioned optimizer state).
        """
        return load_trainer_checkpoint(self, directory)
