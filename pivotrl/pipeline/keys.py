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
                   ``quality``, the trained run's key); inside it each policy's part of a
                   shard has its own :func:`~pivotrl.pipeline.evaluate.policy_part_key` (the
                   policy's weights, not the trained run), reused across training changes
sft_baseline       :func:`pivotrl.pipeline.compare.sft_baseline_key` (``compare.sft_*``, ``prompt``,
                   the learning rate, π_ref's hash, the PivotRL run's keys)
e2e_baseline       :func:`pivotrl.pipeline.compare.e2e_baseline_key` (``compare.e2e_*``, ``training``,
                   ``rollout``, ``prompt``, the judge, π_ref's hash, the PivotRL run's keys)
compare_evaluate   :func:`pivotrl.pipeline.compare_eval.compare_eval_key` (``evaluation``,
                   ``quality``, ``rollout``, ``compare.num_tasks``, the baselines' run keys)
=================  ==========================================================================

So a change to ``training`` alone leaves the demonstrations, reference and probe keys as they
were; a change to ``evaluation`` alone changes only the evaluate key. Computing a key loads no
model: at most a manifest (a small JSON file) is read from the store. The Prefect tasks
(``pivotrl.tasks.stages``) take each stage's lease on its key.

Reuse is one rule per stage, the stage's own: its artifacts exist under its key
(:func:`cached_result`, e.g. :func:`pivotrl.pipeline.demos.cached_demonstrations`). The stage
calls it first thing; the task calls it under the lease before it starts a stage process, so a
stage already computed costs a few existence checks and no process.
"""

from __future__ import annotations

from typing import Any, Callable, Mapping

from pivotrl.config import RunConfig
from pivotrl.core.errors import ConfigError
from pivotrl.pipeline.compare import cached_e2e_baseline, cached_sft_baseline
from pivotrl.pipeline.compare_eval import cached_compare_evaluate
from pivotrl.pipeline.demos import cached_demonstrations
from pivotrl.pipeline.evaluate_stage import cached_evaluate
from pivotrl.pipeline.probe_stage import cached_probe
from pivotrl.pipeline.reference import cached_reference
from pivotrl.pipeline.registry import STAGES, stage_spec
from pivotrl.pipeline.train import cached_train
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


#: Each stage's reuse check: ``fn(cfg, store, *inputs)`` (the inputs in its run function's order)
#: → its result if its artifacts exist under its key, else None. Loads no model.
CACHED: dict[str, Callable[..., Any]] = {
    "demonstrations": cached_demonstrations, "reference": cached_reference, "probe": cached_probe,
    "train": cached_train, "evaluate": lambda cfg, store, demos, ref, probe, train: cached_evaluate(
        cfg, store, demos, ref, train),
    "sft_baseline": cached_sft_baseline, "e2e_baseline": cached_e2e_baseline,
    "compare_evaluate": lambda cfg, store, demos, ref, probe, train, sft, e2e: cached_compare_evaluate(
        cfg, store, demos, ref, train, sft, e2e),
}


def cached_result(stage: str, cfg: RunConfig, store: ArtifactStore,
                  inputs: Mapping[str, Any] | None = None) -> dict[str, Any] | None:
    """The result of ``stage`` (as the dict its stage process returns) if its artifacts exist under
    its content key in ``store``, else None — the same check the stage makes before any work.
    ``inputs`` as for :func:`stage_key`. Raises ConfigError for an unknown stage or a missing input."""
    spec = stage_spec(stage)
    inputs = inputs or {}
    missing = [k for k in spec.inputs if k not in inputs]
    if missing:
        raise ConfigError(f"stage {stage!r} needs the results of {missing} to look for its artifacts")
    hit = CACHED[stage](with_resolved_dtype(cfg), store, *(inputs[k] for k in spec.inputs))
    if hit is None:
        return None
    return hit.to_dict() if hasattr(hit, "to_dict") else dict(hit)


__all__ = ["CACHED", "STAGE_INPUTS", "cached_result", "stage_key"]
