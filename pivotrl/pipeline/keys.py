"""One function for every stage key: :func:`stage_key`.

A stage's key is the content address of what the stage produces, built by the same functions the
stages use for their artifacts — the config sections the stage reads, the keys of the earlier
stages' artifacts, the fingerprints of the files it reads and the code that decides its output
(:func:`pivotrl.provenance.code_digest.stage_code_digest`):

=================  ==========================================================================
stage              key
=================  ==========================================================================
demonstrations     :func:`pivotrl.pipeline.demos.demos_key` (``data``, demonstration files)
reference          :func:`pivotrl.pipeline.reference.reference_inputs_key` (``warm_start``,
                   ``prompt``, the base model's and chat template's file fingerprints)
probe              :func:`pivotrl.pipeline.probe.pivot_set_key` of
                   :func:`~pivotrl.pipeline.probe.probe_table_key` (``probing``, ``verifier``,
                   ``prompt``, engine settings, the candidates' content hash, π_ref's hash)
train              :func:`pivotrl.pipeline.train.train_key` (``training``, ``rollout``,
                   ``verifier``, the pivot set's content hash, π_ref's hash)
evaluate           :func:`pivotrl.pipeline.evaluate.eval_key` (``evaluation``, ``rollout``,
                   ``quality``, the trained run's key)
sft_baseline       :func:`pivotrl.pipeline.compare.sft_baseline_key` (``compare``, ``prompt``,
                   the learning rate, π_ref's hash, the PivotRL run's key)
e2e_baseline       :func:`pivotrl.pipeline.compare.e2e_baseline_key` (``compare``, ``training``,
                   ``rollout``, ``prompt``, the judge, π_ref's hash, the PivotRL run's keys)
compare_evaluate   :func:`pivotrl.pipeline.compare_eval.compare_eval_key` (``evaluation``,
                   ``quality``, ``rollout``, the four policies' run keys)
=================  ==========================================================================

So a change to ``training`` alone leaves the demonstrations, reference and probe keys as they
were; a change to ``evaluation`` alone changes only the evaluate key. Computing a key loads no
model: at most a manifest (a small JSON file) is read from the store. The Prefect tasks
(``pivotrl.tasks.stages``) use these keys as their cache keys.
"""

from __future__ import annotations

from typing import Any, Mapping

from pivotrl.config import RunConfig
from pivotrl.core.errors import ConfigError
from pivotrl.pipeline.registry import STAGES, stage_spec
from pivotrl.runtime.precision import with_resolved_dtype
from pivotrl.storage import ArtifactStore

#: The stages, in pipeline order, with the inputs each takes (the results of earlier stages).
STAGE_INPUTS: dict[str, tuple[str, ...]] = {name: spec.inputs for name, spec in STAGES.items()}


def stage_key(stage: str, cfg: RunConfig, store: ArtifactStore, inputs: Mapping[str, Any] | None = None) -> str:
    """The content key of ``stage`` (see the table above; the stage's ``key`` in
    :data:`pivotrl.pipeline.registry.STAGES`), e.g. ``train/3f2a…``.

    ``inputs``: the earlier stages' results (dicts or ``pivotrl.pipeline.results`` types) under
    the names of :data:`STAGE_INPUTS`. ``cfg`` is resolved for this machine's dtype here.

    Raises ConfigError for an unknown stage or a missing input; StorageError when a manifest
    cannot be read.
    """
    spec = stage_spec(stage)
    inputs = inputs or {}
    missing = [k for k in spec.inputs if k not in inputs]
    if missing:
        raise ConfigError(f"stage {stage!r} needs the results of {missing} to build its key")
    return spec.key(with_resolved_dtype(cfg), store, inputs)  # model.dtype: auto → bf16 | fp32 here


__all__ = ["STAGE_INPUTS", "stage_key"]
