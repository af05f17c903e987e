"""Config sections of training, evaluation and operations: DeepSpeed, training, evaluation, quality,
compare, faults, scale-out, tracking."""

from __future__ import annotations

import re
from typing import Any, Literal

from pydantic import Field, model_validator

from pivotrl.config.base import Float, Int, Section, bound_error


#: ``training.refresh_tolerance`` when null: the max per-token |Δ| a refresh may leave, by compute dtype.
DEFAULT_REFRESH_TOLERANCE = {"fp32": 1e-4, "bf16": 0.3}


class DeepSpeedSection(Section):
    zero_stage: Int = Field(0, ge=0, le=3, description="ZeRO stage (0 = plain data parallel, 3 = shard parameters).")
    extra: dict[str, Any] = Field(
        default_factory=dict,
        description="Extra DeepSpeed JSON config merged over the generated one (e.g. zero_optimization overrides).",
    )


class TrainingSection(Section):
    group_size: Int = Field(
        8,
        ge=2,
        description="K: actions sampled from π_old per pivot for one GRPO group (PivotRL §3.3).",
        json_schema_extra={"why": "group-relative advantages need two actions"},
    )
    epsilon: Float = Field(
        0.2, gt=0, lt=1, description="PPO clip range of the whole-action ratio: clip(r, 1-ε, 1+ε).",
        json_schema_extra={"why": "the spec requires 0 < ε < 1"},
    )
    beta: Float = Field(
        0.01,
        ge=0,
        description=(
            "Weight of the reverse KL(π_θ ‖ π_ref) penalty; small and > 0 keeps valid alternatives (spec π*)."
        ),
    )
    delta: Float = Field(
        1e-6, gt=0, description="δ in Â = (R − R̄)/(σ_R + δ); only guards the division by zero.",
        json_schema_extra={"why": "it guards a division by σ_R = 0"},
    )
    kl_estimator: Literal["squared_log_ratio", "k1", "k3_per_token"] = Field(
        "squared_log_ratio",
        description=(
            "KL penalty estimator: squared_log_ratio = ½(Σ_t log π_θ − log π_ref)², whose gradient "
            "estimates ∇ of the reverse KL (default); k1 = the plain log-ratio (zero expected gradient); k3_per_token = GRPO's "
            "per-token k3 (follows the forward KL). The last two exist for comparison only."
        ),
    )
    advantage_estimator: Literal["grpo", "dr_grpo", "rloo", "reinforce"] = Field(
        "grpo", description="Advantage estimator (PivotRL uses grpo; the others are spec case 4 variants)."
    )
    ratio_type: Literal["sequence", "geometric_mean", "token"] = Field(
        "sequence",
        description=(
            "sequence = exp(Σ_t log-ratio), the true whole-action ratio (PivotRL); geometric_mean = GSPO's "
            "exp(mean_t); token = per-token PPO surrogate."
        ),
    )
    lr: Float = Field(1e-5, gt=0, description="AdamW learning rate (1e-5 for 135M, 1e-6 for ≥ 1B models).")
    epochs: Int = Field(1, ge=1, description="Passes over the pivot set.")
    pivots_per_batch: Int = Field(
        4, ge=1, description="Pivots per rollout batch (each gives one group of group_size actions)."
    )
    updates_per_batch: Int = Field(
        1, ge=1, description="Optimiser updates per rollout batch; with 1 the ratio is 1 and clipping never binds."
    )
    micro_batch_groups: Int = Field(
        1, ge=1, description="Groups per micro-batch on one rank (gradient accumulation covers the rest)."
    )
    max_steps: Int | None = Field(
        10, ge=1, description="Stop after this many rollout batches (null = epochs decide)."
    )
    grad_clip: Float | None = Field(1.0, gt=0, description="Clip the global gradient norm to this value (null = off).")
    shared_prefix: bool = Field(
        True, description="Run the state once and its K actions on the cached prefix (same gradients, less compute)."
    )
    prefix_method: Literal["auto", "packed", "cache"] = Field(
        "auto",
        description=(
            "How a shared state is run with its K actions: packed = one sequence (state + every action) with a "
            "block attention mask, the state's keys/values computed and differentiated once; cache = the state's "
            "key/value cache repeated K times (every model with a cache object; the fallback for model types "
            "without packed support); auto = packed (measured faster in bf16 and in fp32). Same numbers either way."
        ),
    )
    pack_tokens: Int = Field(
        4096, ge=1,
        description=(
            "With the packed path: the most tokens one π_ref forward holds when a rank's groups share it "
            "(π_θ runs one forward per group); a longer group runs alone; 1 = one forward per group. Bounds "
            "a shared forward's (L, L) attention mask and logits. Same numbers either way, up to rounding."
        ),
    )
    retain_host_memory: bool = Field(
        True,
        description=(
            "Training on the CPU with glibc: the training process keeps the memory it frees instead of faulting "
            "it in again every step (mallopt: no per-block mappings, the heap's top kept up to 1 GiB); fewer page "
            "faults and less system time per step for the largest step's footprint held until the process exits. "
            "false = the C library's defaults."
        ),
    )
    checkpoint_every: Int = Field(5, ge=1, description="Save a checkpoint every N rollout batches.")
    refilter_between_epochs: bool = Field(
        False,
        description=(
            "Before every epoch after the first, re-probe the pivots under the current policy (probing's m "
            "and sampling) and train the epoch only on those still inside the filter (seed §5: pivots drift)."
        ),
    )
    anchors_per_batch: Int = Field(
        0, ge=0,
        description=(
            "Anchor states trained beside the pivots in every batch: probed states on which every one of "
            "π_ref's probes was accepted (decision all_pass), a seeded cycle through them. While π_θ still "
            "solves an anchor its group has Â = 0 and adds only the β·KL term (spec case 3); once training "
            "makes π_θ fail there, the group has a task signal that restores it. Guards the behaviour the "
            "pivots never exercise (e.g. BFCL's closing turns, with quality.include_stop_decisions). "
            "0 = pivots only, as published; an extension, reported apart (anchors, anchor_reward_mean)."
        ),
    )
    eval_every: Int = Field(
        4, ge=0,
        description=(
            "Held-out accuracy (greedy, eval_states held-out states) measured with the rollout engine before the "
            "first step and every N steps and after the last (the learning curve of the report); 0 = off."
        ),
    )
    eval_states: Int = Field(20, ge=1, description="Held-out states of the learning curve (a fixed seeded choice).")
    tis_cap: Float | None = Field(
        None, gt=0,
        description=(
            "Truncated importance sampling against the sampler: weight each action's surrogate by "
            "min(π_old/π_sampler, C) over its tokens (π_old from the trainer, π_sampler the engine's log-probs); "
            "null = off (π_old is the trainer's, the default)."
        ),
    )
    refresh_tolerance: Float | None = Field(
        None,
        gt=0,
        description=(
            "Largest per-token log-prob gap allowed between trainer and engine after a weight refresh; "
            "null = 1e-4 for fp32, 0.3 for bf16 (filled in once the dtype is resolved)."
        ),
    )
    allow_empty_pivots: bool = Field(
        False,
        description=(
            "An empty pivot set fails the run (naming the filter's counts and what to change); true trains "
            "nothing and keeps the policy = π_ref (for tests and drills)."
        ),
    )
    deepspeed: DeepSpeedSection = Field(default_factory=DeepSpeedSection, description="DeepSpeed engine settings.")
    world_size: Int = Field(1, ge=1, description="Total training processes (= nnodes × nproc_per_node).")
    nnodes: Int = Field(1, ge=1, description="Number of machines.")
    nproc_per_node: Int = Field(1, ge=1, description="Training processes per machine (one per GPU, or CPU ranks).")
    launcher: Literal["torchrun", "deepspeed", "inprocess"] = Field(
        "inprocess",
        description="How ranks start: torchrun, the deepspeed launcher (multi-node with hostfile), or in this process.",
    )
    hostfile: str | None = Field(
        None,
        description="DeepSpeed hostfile ('host slots=N' per line); required by the deepspeed launcher on > 1 node.",
    )
    master_addr: str = Field("127.0.0.1", min_length=1, description="Address of rank 0 for the rendezvous.")
    master_port: Int = Field(29500, ge=1, le=65535, description="TCP port of rank 0 for the rendezvous.")
    node_launch: Literal["ray", "manual"] = Field(
        "ray", description=(
            "With nnodes > 1, who starts each node's ranks: 'ray' (the train stage places one torchrun per node "
            "on the Ray cluster of scale_out.ray_address, one placement-group bundle per node, and restarts "
            "them from the last checkpoint when a node is lost) or 'manual' (a person or a job scheduler runs "
            "infra/multinode/launch_train.py on every node; the run then finds the trained policy)."),
        json_schema_extra={"why": "the nightly flow can only train on several machines if it can start them"},
    )
    ray_cpus_per_node: Float = Field(
        1.0, gt=0, description="node_launch 'ray': CPUs each trainer node's bundle asks Ray for (its ranks' threads).")
    ray_gpus_per_node: Float = Field(
        0.0, ge=0, description="node_launch 'ray': GPUs each trainer node's bundle asks Ray for (nproc_per_node on GPU nodes).")
    node_failure_retries: Int = Field(
        2, ge=0, description=(
            "node_launch 'ray': times the process group is placed again after a trainer node (or its Ray "
            "worker) is lost; every attempt resumes from the latest published checkpoint."))

    @model_validator(mode="after")
    def _layout(self) -> "TrainingSection":
        if self.world_size != self.nnodes * self.nproc_per_node:
            raise bound_error(
                "world_size", self.world_size,
                f"must equal nnodes × nproc_per_node = {self.nnodes} × {self.nproc_per_node}",
            )
        per_step = self.micro_batch_groups * self.world_size
        if self.pivots_per_batch % per_step:
            raise bound_error(
                "pivots_per_batch", self.pivots_per_batch,
                f"must be a multiple of micro_batch_groups × world_size = {per_step}",
            )
        if self.launcher == "inprocess" and self.world_size > 1:
            raise bound_error("launcher", self.launcher, "inprocess runs one process; use torchrun or deepspeed")
        if self.nnodes > 1 and self.node_launch == "ray" and self.launcher != "torchrun":
            raise bound_error("launcher", self.launcher, "node_launch 'ray' starts each node's ranks with torchrun "
                              "(the DeepSpeed engine trains either way); set training.launcher: torchrun, or "
                              "training.node_launch: manual to start the nodes yourself")
        if self.launcher == "deepspeed" and self.nnodes > 1 and not self.hostfile:
            raise bound_error("hostfile", self.hostfile, "the deepspeed launcher needs a hostfile for more than one node")
        return self


# ---------------------------------------------------------------------------------- evaluation
class EvaluationSection(Section):
    num_tasks: Int = Field(
        200, ge=1,
        description="Held-out tasks run from the start (full multi-turn task); all held-out tasks when fewer.",
    )
    max_steps_per_turn: Int = Field(
        20, ge=1,
        description="Executing model calls allowed per user turn; one more quits the task (BFCL's limit: 20).",
    )
    temperature: Float = Field(0.0, ge=0, description="Sampling temperature at evaluation (0 = greedy).")
    seeds: list[Int] = Field(default_factory=lambda: [0], min_length=1, description="One evaluation pass per seed.")
    local_pivots: bool = Field(
        True, description="Also report the local success rate on held-out pivot states (never instead of the task)."
    )
    local_states: Int | None = Field(
        None, ge=1,
        description="Held-out turn states scored locally (calls and text turns; as many stop decisions apart); "
                    "null = 4 per evaluated task, between 32 and 40. A paired test at p < 0.01 needs a few hundred.",
    )


# ------------------------------------------------------------------------------------- quality
class QualitySection(Section):
    """What the results may be trusted for: judge of record, text turns, audited data."""

    judge: Literal["bfcl", "pivotrl"] = Field(
        "bfcl",
        description=("Judge of record: bfcl = BFCL's own checkers from the wheel (multi-turn checker for full "
                     "tasks, ast_checker for greedy single-turn BFCL items); pivotrl = pivotrl's own judge and verifier."),
    )
    include_stop_decisions: bool = Field(
        False,
        description="Closing 'stop here' turns (BFCL's 'Done.') may become pivots (always reported apart).",
    )
    keep_flagged: bool = Field(
        False,
        description="Keep tasks the data audit flagged (failing, no-op or not-ground-truth gold, gold values the history lacks) in warm start, pivots and evaluation.",
    )
    out_of_domain: list[str] = Field(
        default_factory=lambda: ["parallel"],
        description="BFCL categories never seen in warm start or training, scored locally as out-of-domain.",
    )
    out_of_domain_limit: Int = Field(50, ge=1, description="Records per out-of-domain category (file order).")


# ------------------------------------------------------------------------------------- compare
class CompareSection(Section):
    """``pivotrl compare``: SFT and end-to-end RL baselines from the same π_ref as PivotRL."""

    sft_budget: Literal["optimizer_steps", "wall_time"] = Field(
        "optimizer_steps",
        description="What the SFT baseline matches with PivotRL: its optimiser steps, or also its wall time "
        "(wall_time: probing and training; SFT cycles the same batches past PivotRL's step count to the first "
        "step past that wall time, and the comparison evaluates both SFT policies, the one at PivotRL's step "
        "count and the one at its wall time).",
    )
    sft_max_steps: Int = Field(
        10000, ge=1,
        description="Upper bound on SFT steps with sft_budget wall_time (never below PivotRL's step count).",
    )
    sft_lr: Float | None = Field(None, gt=0, description="SFT learning rate (null = training.lr).")
    sft_batch_size: Int = Field(8, ge=1, description="Demonstrations per SFT optimiser step.")
    e2e_budget: Literal["generated_tokens", "rollout_turns", "wall_time"] = Field(
        "wall_time",
        description="What the end-to-end RL baseline matches with PivotRL, probing and training together: its "
        "generated tokens, its rollout turns (model calls: PivotRL's probe and training samples against E2E RL's "
        "model calls in episodes, one environment turn each) or its wall time; E2E RL stops at the first step "
        "past it.",
    )
    e2e_group_size: Int = Field(4, ge=2, description="K: episodes per task in one end-to-end GRPO group.")
    e2e_tasks_per_batch: Int = Field(1, ge=1, description="Tasks per end-to-end RL step.")
    e2e_max_steps: Int = Field(16, ge=1, description="Upper bound on end-to-end RL steps (the budget stops it first).")
    e2e_reward: Literal["full_task", "per_turn"] = Field(
        "full_task", description="Episode reward: all turns passed (0/1), or the fraction of turns passed."
    )
    e2e_max_steps_per_turn: Int = Field(2, ge=1, description="Executing model calls per user turn in training episodes.")
    num_tasks: Int | None = Field(
        50, ge=1, description="Held-out tasks the comparison evaluates (the same for every method; null = evaluation.num_tasks)."
    )


# -------------------------------------------------------------------------------------- faults
class FaultsSection(Section):
    tool_failure_rate: Float = Field(
        0.0, ge=0, lt=1, description="Probability that a tool call raises (fault injection for tests; 0 = off)."
    )
    tool_latency_s: Float = Field(0.0, ge=0, description="Added delay in seconds per tool call (0 = off).")
    storage_failure_rate: Float = Field(
        0.0, ge=0, lt=1, description="Probability that an artifact write fails before publishing (0 = off)."
    )
    kill_trainer_at_step: Int | None = Field(
        None, ge=1, description="Kill the trainer after this step to test resuming (null = off)."
    )
    kill_trainer_node_at_step: Int | None = Field(
        None, ge=1, description=(
            "With training.node_launch 'ray': the last trainer node is lost after this many steps (its raylet "
            "and ranks are killed) to test that the run places the nodes again and resumes (null = off).")
    )
    tool_failure_trajectories: list[str] = Field(
        default_factory=list,
        description="Every tool execution for turn states of these trajectory ids fails (drills a shard that cannot finish).",
    )
    ray_node_loss_shards: list[int] = Field(
        default_factory=list,
        description=("On Ray, the node running a probe or evaluation shard of these indices is lost on the "
                     "shard's first attempt (its raylet is killed; drills node loss; [] = off)."),
    )


# ------------------------------------------------------------------------------------ scale-out
class ScaleOutSection(Section):
    """Sharded probing and evaluation, and where shards run."""

    probe_shard_size: Int | None = Field(
        None, ge=1, description=(
            "Trajectories per probing shard, each its own Prefect task run with its own cache key and "
            "retries (null = probe in one task).")
    )
    shard_retries: Int = Field(
        2, ge=0, description=(
            "Retries of a shard task (a retry redoes only the states it could not decide); on Ray, also the "
            "rounds that rerun the shards whose worker or node was lost (restarting a local cluster).")
    )
    task_runner: Literal["inprocess", "ray"] = Field(
        "inprocess", description=(
            "Where shard tasks run: 'inprocess' (threads of the flow's process, each shard in a child "
            "process) or 'ray' (prefect-ray's RayTaskRunner; one warm rollout engine per Ray worker).")
    )
    max_parallel_shards: Int = Field(
        1, ge=1, description="In-process runner: shards run at the same time (each holds one engine)."
    )
    ray_address: str | None = Field(
        None, description=(
            "Ray cluster to join ('auto', 'HOST:6379' or 'ray://HOST:10001'; null = start a local one).")
    )
    ray_cpus_per_shard: Float = Field(1.0, gt=0, description="CPUs a shard task asks Ray for (its engine's threads).")
    ray_gpus_per_shard: Float = Field(0.0, ge=0, description="GPUs a shard task asks Ray for (one engine per GPU: 1).")
    eval_shard_size: Int | None = Field(
        None, ge=1, description=(
            "Held-out tasks per evaluation shard, each its own Prefect task run (every policy, one engine) "
            "with its own cache key and retries, plus one shard for the state-level measures (null = "
            "evaluate in one task).")
    )


# ------------------------------------------------------------------------------------ tracking
class TrackingSection(Section):
    backend: Literal["none", "mlflow"] = Field(
        "none", description="Experiment tracker: none (records nothing, imports nothing) or mlflow."
    )
    uri: str | None = Field(
        None, description=(
            "Tracking server or store URI (e.g. http://127.0.0.1:5000); null = a local store under the run "
            "root (<storage_root>/mlflow). Credentials come from the environment (MLFLOW_TRACKING_USERNAME/"
            "PASSWORD or MLFLOW_TRACKING_TOKEN), never from here."),
    )
    experiment: str | None = Field(
        None, min_length=1, description="Experiment the runs are recorded in; null = 'pivotrl-<run.name>'."
    )
    run_name: str | None = Field(None, min_length=1, description="Name of the tracker run; null = run.name.")

    @model_validator(mode="after")
    def _no_credentials_in_uri(self) -> "TrackingSection":
        if self.uri and re.match(r"^[A-Za-z][A-Za-z0-9+.-]*://[^/@]*:[^/@]*@", self.uri):
            raise bound_error("uri", "<hidden>", "contains a password; set MLFLOW_TRACKING_USERNAME and "
                        "MLFLOW_TRACKING_PASSWORD in the environment instead")
        return self


# ------------------------------------------------------------------------------------------ run
