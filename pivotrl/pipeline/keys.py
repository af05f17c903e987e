"""One function for every stage key: :func:`stage_key`.

A stage's key is the content address of what the stage produces, built by the same functions the
stages use for their artifacts — the config sections the stage reads, the keys of the earlier
stages' artifacts, the fingerprints of the files it reads and the code that decides its output
(:func:`pivotrl.code_digest.stage_code_digest`):

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
from pivotrl.errors import ConfigError
from pivotrl.storage import ArtifactStore

#: The stages, in pipeline order, with the inputs each takes (the results of earlier stages).
STAGE_INPUTS: dict[str, tuple[str, ...]] = {
    "demonstrations": (),
    "reference": ("demos",),
    "probe": ("demos", "reference"),
    "train": ("probe", "reference"),
    "evaluate": ("demos", "reference", "probe", "train"),
    "sft_baseline": ("demos", "reference", "train"),
    "e2e_baseline": ("demos", "reference", "probe", "train"),
    "compare_evaluate": ("demos", "reference", "probe", "train", "sft", "e2e"),
}


def stage_key(stage: str, cfg: RunConfig, store: ArtifactStore, inputs: Mapping[str, Any] | None = None) -> str:
    """The content key of ``stage`` (see the table above), e.g. ``train/3f2a…``.

    ``inputs``: the earlier stages' results (dicts or ``pivotrl.pipeline.results`` types) under
    the names of :data:`STAGE_INPUTS`. ``cfg`` is resolved for this machine's dtype here.

    Raises ConfigError for an unknown stage or a missing input; StorageError when a manifest
    cannot be read.
    """
    from pivotrl.pipeline.results import ProbeResult, ReferenceResult
    from pivotrl.precision import with_resolved_dtype

    if stage not in STAGE_INPUTS:
        raise ConfigError(f"unknown stage {stage!r}; valid: {', '.join(STAGE_INPUTS)}")
    inputs = inputs or {}
    missing = [k for k in STAGE_INPUTS[stage] if k not in inputs]
    if missing:
        raise ConfigError(f"stage {stage!r} needs the results of {missing} to build its key")
    cfg = with_resolved_dtype(cfg)  # model.dtype: auto → bf16 | fp32 on this hardware, as the stages do
    if stage == "demonstrations":
        from pivotrl.pipeline.demos import demos_key

        return demos_key(cfg)
    if stage == "reference":
        from pivotrl.pipeline.reference import reference_inputs_key

        return reference_inputs_key(cfg, inputs["demos"])
    if stage == "probe":
        from pivotrl.pipeline.probe import pivot_set_key, probe_table_key

        candidates = store.read_manifest(f"{inputs['demos']['key']}/candidates.parquet").sha256
        return pivot_set_key(probe_table_key(cfg, candidates, inputs["reference"]), cfg.probing.lambda_diff)
    if stage == "train":
        from pivotrl.pipeline.train import train_key

        return train_key(cfg, store, ProbeResult.of(inputs["probe"]), ReferenceResult.of(inputs["reference"]))
    if stage == "evaluate":
        from pivotrl.pipeline.evaluate import eval_key

        return eval_key(cfg, inputs["demos"], inputs["reference"], inputs["train"])
    demos, ref = dict(inputs["demos"]), ReferenceResult.of(inputs["reference"]).to_dict()
    train = _as_dict(inputs["train"])
    if stage == "sft_baseline":
        from pivotrl.pipeline.compare import sft_baseline_key

        return sft_baseline_key(cfg, demos, ref, train)
    if stage == "e2e_baseline":
        from pivotrl.pipeline.compare import e2e_baseline_key

        return e2e_baseline_key(cfg, demos, ref, ProbeResult.of(inputs["probe"]).to_dict(), train)
    from pivotrl.pipeline.compare_eval import compare_eval_key

    return compare_eval_key(cfg, demos, ref, train, dict(inputs["sft"]), dict(inputs["e2e"]))


def _as_dict(result: Any) -> dict[str, Any]:
    """A stage result as the dict the flows pass (a ``pivotrl.pipeline.results`` object or a dict)."""
    return result.to_dict() if hasattr(result, "to_dict") else dict(result)


__all__ = ["STAGE_INPUTS", "stage_key"]
