"""The heavy pipeline stages, one module each — this module only re-exports them:

- :mod:`pivotrl.pipeline.reference`: resolve the base model, supervised warm start (π_ref);
- :mod:`pivotrl.pipeline.probe_stage`: probe π_ref on the candidates (in one or many shards), the pivot
  filter (λ_diff), with the probe table of :mod:`pivotrl.pipeline.probe`;
- :mod:`pivotrl.pipeline.train`: keys and I/O around the PivotRL loop (:mod:`pivotrl.training.loop`);
- :mod:`pivotrl.pipeline.evaluate_stage`: base, π_ref and the policy on held-out tasks and states (in one
  or many shards), with the parts and the report of :mod:`pivotrl.pipeline.evaluate`.

Each stage is a plain function ``(cfg, store, inputs) -> typed result`` (:mod:`pivotrl.pipeline.results`)
that reads and writes artifacts only through the store, so it can run in its own process (see
``pivotrl.pipeline.entry``) launched by a Prefect task or by a cluster launcher.
"""

from __future__ import annotations

from pivotrl.pipeline.evaluate_stage import stage_evaluate
from pivotrl.pipeline.probe import probe_table_key
from pivotrl.pipeline.probe_stage import stage_probe
from pivotrl.pipeline.reference import TRAINER_DTYPE, prompt_identity, reference_dir, stage_reference
from pivotrl.pipeline.results import EvalResult, ProbeResult, ReferenceResult, TrainResult
from pivotrl.pipeline.train import stage_train, train_key
from pivotrl.training.checkpoints import latest_checkpoint
from pivotrl.training.loop import pivot_schedule

__all__ = [
    "EvalResult", "ProbeResult", "ReferenceResult", "TRAINER_DTYPE", "TrainResult", "latest_checkpoint",
    "pivot_schedule", "probe_table_key", "prompt_identity", "reference_dir", "stage_evaluate", "stage_probe",
    "stage_reference", "stage_train", "train_key",
]
