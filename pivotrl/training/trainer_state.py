"""Helpers of the PivotRL trainer: its checkpoints (with RNG states), padding of log-prob tensors,
and the per-step metric sums reduced over ranks."""

from __future__ import annotations

import json
import math
import os
import random
import shutil
from pathlib import Path
from typing import Any, Mapping, Sequence

import torch

from pivotrl.core.errors import TrainingError
from pivotrl.training.deepspeed_utils import export_hf_checkpoint, rank_and_world, replace_directory

__all__ = [
    "TRAINER_STATE_FILE",
    "MetricSums",
    "load_trainer_checkpoint",
    "pad_cat",
    "rng_state",
    "save_trainer_checkpoint",
    "set_rng_state",
]

TRAINER_STATE_FILE = "trainer_state.json"


def pad_cat(tensors: Sequence[torch.Tensor]) -> torch.Tensor:
    """Concatenate (K_j, T_j) tensors along dim 0, right-padding T with zeros → (Σ K_j, max T_j)."""
    t_max = max(t.shape[1] for t in tensors)
    return torch.cat([torch.nn.functional.pad(t, (0, t_max - t.shape[1])) for t in tensors], dim=0)


def rng_state() -> dict[str, Any]:
    """This process's Python, NumPy, torch (and CUDA) RNG states."""
    state: dict[str, Any] = {"python": random.getstate(), "torch": torch.get_rng_state()}
    try:
        import numpy as np

        state["numpy"] = np.random.get_state()
    except ImportError:  # pragma: no cover - numpy ships with torch installs
        pass
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def set_rng_state(state: Mapping[str, Any]) -> None:
    """Restore an :func:`rng_state` dict."""
    random.setstate(state["python"])
    torch.set_rng_state(state["torch"])
    if "numpy" in state:
        import numpy as np

        np.random.set_state(state["numpy"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


class MetricSums:
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
        # sampler–trainer mismatch (pivotrl.objective.tis) and truncated importance weights
        "mismatch_abs", "mismatch_tokens", "mismatch_log_ratio", "mismatch_actions", "tis_weight_sum", "tis_actions",
        "policy_flop",
        "ref_flop",
    )

    def __init__(self, engines: int = 1) -> None:
        # per rollout engine j < engines: the sampler–trainer mismatch sums of the actions it sampled
        # (``mismatch_abs_e{j}``, ``mismatch_tokens_e{j}``) and the largest per-token |Δ| (``mismatch_max_e{j}``)
        self.keys = self.SUM_KEYS + tuple(f"mismatch_{k}_e{j}" for j in range(engines) for k in ("abs", "tokens"))
        self.sums = dict.fromkeys(self.keys, 0.0)
        self.engine_max = [0.0] * engines
        self.ratio_min = math.inf
        self.ratio_max = -math.inf

    def add(self, key: str, value: float) -> None:
        self.sums[key] += value

    def reduce(self) -> tuple[dict[str, float], float, float]:
        """(global sums with ``mismatch_max_e{j}`` per engine, global ratio min, global ratio max),
        all-reduced when world > 1 (every rank builds the same engines count from the same batch)."""
        rank, world = rank_and_world()
        vec = torch.tensor([self.sums[k] for k in self.keys], dtype=torch.float64)
        lo = torch.tensor([self.ratio_min], dtype=torch.float64)
        hi = torch.tensor([self.ratio_max] + self.engine_max, dtype=torch.float64)
        if world > 1:
            dist = torch.distributed
            dist.all_reduce(vec, op=dist.ReduceOp.SUM)
            dist.all_reduce(lo, op=dist.ReduceOp.MIN)
            dist.all_reduce(hi, op=dist.ReduceOp.MAX)
        tot = dict(zip(self.keys, vec.tolist()))
        tot.update({f"mismatch_max_e{j}": float(v) for j, v in enumerate(hi.tolist()[1:])})
        return tot, float(lo), float(hi[0])


def save_trainer_checkpoint(trainer: Any, directory: str | os.PathLike[str]) -> Path:
    """Save everything a :class:`PivotRLTrainer` needs to resume into ``directory`` (atomically;
    every rank calls).

    Layout: ``deepspeed/`` (engine checkpoint: weights, fp32 master weights, optimizer
    state, tag ``step<N>``), ``hf/`` (HF export of the current weights), ``rng_rank<r>.pt``
    (each rank's Python/NumPy/torch RNG states), ``trainer_state.json`` (step,
    ``data_position``, ``extra_state``, ``at_reference``: π_θ still has π_ref's weights, settings,
    world size). Written into
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
    tag = f"step{trainer.step}"
    trainer.engine.save_checkpoint(str(partial / "deepspeed"), tag=tag)
    export_hf_checkpoint(trainer.engine, partial / "hf", tokenizer_dir=trainer.tokenizer_dir)
    torch.save(rng_state(), partial / f"rng_rank{rank}.pt")
    if rank == 0:
        state = {
            "step": trainer.step,
            "tag": tag,
            "data_position": trainer.data_position,
            "extra_state": trainer.extra_state,
            "at_reference": bool(getattr(trainer, "at_reference", False)),
            "world_size": world,
            "settings": {"training": trainer.settings.model_dump(mode="json"), "dtype": trainer.dtype, "seed": trainer.seed},
        }
        (partial / TRAINER_STATE_FILE).write_text(json.dumps(state, indent=2, sort_keys=True))
    if world > 1:
        torch.distributed.barrier()
    if rank == 0:
        replace_directory(partial, target)
    if world > 1:
        torch.distributed.barrier()
    return target

def load_trainer_checkpoint(trainer: Any, directory: str | os.PathLike[str]) -> dict[str, Any]:
    """Restore a :func:`save_trainer_checkpoint` directory: weights, optimizer, step, data position, RNG.

    Returns the trainer state dict. Raises TrainingError if the checkpoint is incomplete or was
    written with a different world size under ZeRO ≥ 1 (partitioned optimizer state).
    """
    root = Path(directory)
    state_path = root / TRAINER_STATE_FILE
    if not state_path.is_file():
        raise TrainingError(f"no trainer checkpoint at {root} ({TRAINER_STATE_FILE} missing)")
    state = json.loads(state_path.read_text())
    _, world = rank_and_world()
    if state["world_size"] != world and trainer.settings.deepspeed.zero_stage > 0:
        raise TrainingError(
            f"checkpoint {root} was written by {state['world_size']} ranks with ZeRO stage "
            f"{trainer.settings.deepspeed.zero_stage}; resume it with the same world size (now {world})"
        )
    load_path, _ = trainer.engine.load_checkpoint(str(root / "deepspeed"), tag=state["tag"])
    if load_path is None:
        raise TrainingError(f"DeepSpeed could not load {root / 'deepspeed'} tag {state['tag']}")
    trainer.step = int(state["step"])
    trainer.data_position = int(state["data_position"])
    trainer.extra_state = dict(state.get("extra_state") or {})
    trainer.at_reference = bool(state.get("at_reference", False))  # older checkpoints: as if it had moved
    rank, _ = rank_and_world()
    rng_path = root / f"rng_rank{rank}.pt"
    if rng_path.is_file():
        set_rng_state(torch.load(rng_path, weights_only=False))
    return state
