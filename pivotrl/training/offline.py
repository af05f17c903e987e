"""``python -m pivotrl.training.offline --spec spec.json``: PivotRL updates on pre-collected batches.

The spec's ``training`` mapping holds keys of the run config's ``training`` section; it is validated
once here, by the schema (:func:`pivotrl.training.settings.training_section`).
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any, Sequence

from pivotrl.training.deepspeed_utils import rank_and_world
from pivotrl.training.groups import read_batches
from pivotrl.training.pivotrl import PivotRLTrainer
from pivotrl.training.settings import training_section

__all__ = ["OfflineSpec", "main", "run_offline"]


@dataclass(frozen=True)
class OfflineSpec:
    """The offline entry's spec: train on pre-collected batches.

    ``batches_path``: JSON Lines, one batch per line: ``{"groups": [Group dicts]}``.
    ``metrics_path`` receives one JSON line of metrics per step (rank 0). ``out_dir`` receives
    the final HF export; ``checkpoint_dir`` (optional) a resumable checkpoint at the end.
    ``training``: keys of the run config's ``training`` section; ``dtype``: ``"bfloat16"`` or
    ``"float32"``; ``seed``: the trainer's seed.
    """

    model_dir: str
    batches_path: str
    out_dir: str
    ref_model_dir: str | None = None
    metrics_path: str | None = None
    checkpoint_dir: str | None = None
    resume_from: str | None = None
    training: dict[str, Any] = field(default_factory=dict)
    dtype: str = "bfloat16"
    seed: int = 0


def run_offline(spec: OfflineSpec) -> list[dict[str, float]]:
    """Train on the batches of ``spec`` (see :class:`OfflineSpec`); returns the per-step metrics.

    Raises ConfigError for bad training settings, DataError for a malformed batches file."""
    trainer = PivotRLTrainer(spec.model_dir, spec.ref_model_dir, training=training_section(**spec.training),
                             dtype=spec.dtype, seed=spec.seed)
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

    run_offline(read_spec(argv, OfflineSpec))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
