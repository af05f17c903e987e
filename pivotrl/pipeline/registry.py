"""The stages, each described once: :data:`STAGES`.

A :class:`StageSpec` names a stage, the results of earlier stages it takes (``inputs``, in the
order its run function takes them), its module (whose import closure is its code digest, see
:mod:`pivotrl.provenance.code_digest`), the function that computes its content key, the function that runs
it and the type of its result. Everything that dispatches on a stage name reads this table: the
stage process entry (:mod:`pivotrl.pipeline.entry`), the stage keys and the Prefect tasks' cache
keys (:mod:`pivotrl.pipeline.keys`), the tasks' list (``pivotrl.tasks.stages``), the code digests
(a test checks :data:`pivotrl.provenance.code_digest.STAGE_MODULES` against it) and the table in
ARCHITECTURE.md (a test renders it from here).

Every run function has the shape ``run(cfg, store, *inputs) -> result``; :func:`run_stage_fn`
calls it with the inputs taken from a mapping by name (typed with their result types).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Mapping

from pivotrl.config import RunConfig
from pivotrl.core.errors import ConfigError
from pivotrl.pipeline.compare import e2e_baseline_key, sft_baseline_key, stage_e2e_baseline, stage_sft_baseline
from pivotrl.pipeline.compare_eval import compare_eval_key, stage_compare_evaluate
from pivotrl.pipeline.demos import build_demonstrations, demos_key
from pivotrl.pipeline.evaluate import eval_key
from pivotrl.pipeline.evaluate_stage import stage_evaluate
from pivotrl.pipeline.probe import pivot_set_key, probe_table_key
from pivotrl.pipeline.probe_stage import stage_probe
from pivotrl.pipeline.reference import reference_inputs_key, stage_reference
from pivotrl.pipeline.results import EvalResult, ProbeResult, ReferenceResult, StageResult, TrainResult
from pivotrl.pipeline.train import stage_train, train_key
from pivotrl.runtime.precision import with_resolved_dtype
from pivotrl.storage import ArtifactStore

__all__ = ["COMPARE_STAGES", "NIGHTLY_STAGES", "STAGES", "StageSpec", "stage_spec", "typed_inputs"]

#: Each input's result type (the demonstrations' result is a plain dict).
INPUT_TYPES: dict[str, type[StageResult]] = {"reference": ReferenceResult, "probe": ProbeResult,
                                             "train": TrainResult}


@dataclass(frozen=True)
class StageSpec:
    """One stage of the pipeline.

    Attributes:
        name: the stage's name (task name, CLI and log name).
        summary: one line: what the stage does.
        inputs: the earlier stages' results it takes, in its run function's order.
        module: the module that holds the stage (its import closure is its code digest).
        key: ``key(cfg, store, inputs) -> str``, the content key of its artifact (reads at most a
            manifest; ``cfg`` resolved for this machine's dtype).
        run: ``run(cfg, store, *inputs) -> result``.
        result: the result type (None: a plain dict).
        typed: whether ``run`` takes typed inputs (:data:`INPUT_TYPES`) or the dicts the flows pass.
        in_process: the stage runs in the flow's process (it loads no model); else in a stage process.
    """

    name: str
    summary: str
    inputs: tuple[str, ...]
    module: str
    key: Callable[[RunConfig, ArtifactStore, Mapping[str, Any]], str]
    run: Callable[..., Any]
    result: type[StageResult] | None
    typed: bool = True
    in_process: bool = False


def _dict(result: Any) -> dict[str, Any]:
    return result.to_dict() if hasattr(result, "to_dict") else dict(result)


def _probe_key(cfg: RunConfig, store: ArtifactStore, i: Mapping[str, Any]) -> str:
    candidates = store.read_manifest(f"{i['demos']['key']}/candidates.parquet").sha256
    return pivot_set_key(probe_table_key(cfg, candidates, i["reference"]), cfg.probing.lambda_diff)


_SPECS = (
    StageSpec("demonstrations", "load and validate demonstrations, split by trajectory, extract turn states",
              (), "pivotrl.pipeline.demos", lambda cfg, store, i: demos_key(cfg), build_demonstrations, None,
              in_process=True),
    StageSpec("reference", "resolve the base model; supervised warm start on the warm-start split → π_ref",
              ("demos",), "pivotrl.pipeline.reference",
              lambda cfg, store, i: reference_inputs_key(cfg, i["demos"]), stage_reference, ReferenceResult),
    StageSpec("probe", "probe π_ref (m samples per candidate, verifier-scored) and select the pivot set",
              ("demos", "reference"), "pivotrl.pipeline.probe_stage", _probe_key, stage_probe, ProbeResult),
    StageSpec("train", "PivotRL epochs on the pivot set; resumes from the latest checkpoint on retry",
              ("probe", "reference"), "pivotrl.pipeline.train",
              lambda cfg, store, i: train_key(cfg, store, ProbeResult.of(i["probe"]), ReferenceResult.of(i["reference"])),
              stage_train, TrainResult),
    StageSpec("evaluate", "base, π_ref and PivotRL on held-out tasks from scratch and on held-out states; report",
              ("demos", "reference", "probe", "train"), "pivotrl.pipeline.evaluate_stage",
              lambda cfg, store, i: eval_key(cfg, i["demos"], i["reference"], i["train"]), stage_evaluate, EvalResult),
    StageSpec("sft_baseline", "SFT from π_ref on the pivot split's demonstrations (pivotrl compare)",
              ("demos", "reference", "probe", "train"), "pivotrl.pipeline.compare",
              lambda cfg, store, i: sft_baseline_key(cfg, dict(i["demos"]), _dict(ReferenceResult.of(i["reference"])),
                                                     _dict(ProbeResult.of(i["probe"])), _dict(i["train"])),
              stage_sft_baseline, None, typed=False),
    StageSpec("e2e_baseline", "end-to-end RL from π_ref on full tasks at a matched budget (pivotrl compare)",
              ("demos", "reference", "probe", "train"), "pivotrl.pipeline.compare",
              lambda cfg, store, i: e2e_baseline_key(cfg, dict(i["demos"]), _dict(ReferenceResult.of(i["reference"])),
                                                     _dict(ProbeResult.of(i["probe"])), _dict(i["train"])),
              stage_e2e_baseline, None, typed=False),
    StageSpec("compare_evaluate", "π_ref, PivotRL, SFT and E2E RL side by side; the comparison report",
              ("demos", "reference", "probe", "train", "sft", "e2e"), "pivotrl.pipeline.compare_eval",
              lambda cfg, store, i: compare_eval_key(cfg, dict(i["demos"]), _dict(ReferenceResult.of(i["reference"])),
                                                     _dict(i["train"]), dict(i["sft"]), dict(i["e2e"])),
              stage_compare_evaluate, None, typed=False),
)

#: Every stage by name, in pipeline order.
STAGES: dict[str, StageSpec] = {s.name: s for s in _SPECS}
#: The nightly flow's stages and ``pivotrl compare``'s own, in order.
NIGHTLY_STAGES = ("demonstrations", "reference", "probe", "train", "evaluate")
COMPARE_STAGES = ("sft_baseline", "e2e_baseline", "compare_evaluate")


def stage_spec(name: str) -> StageSpec:
    """The spec of stage ``name``. Raises ConfigError naming the valid stages for an unknown one."""
    try:
        return STAGES[name]
    except KeyError:
        raise ConfigError(f"unknown stage {name!r}; valid: {', '.join(STAGES)}") from None


def typed_inputs(spec: StageSpec, inputs: Mapping[str, Any]) -> list[Any]:
    """The inputs of ``spec`` taken from ``inputs`` by name, in its run function's order, typed
    (:data:`INPUT_TYPES`) when the stage takes types. Raises ConfigError naming the missing ones."""
    missing = [k for k in spec.inputs if k not in inputs]
    if missing:
        raise ConfigError(f"stage {spec.name!r} needs the results of {missing}")
    return [INPUT_TYPES[k].of(inputs[k]) if spec.typed and k in INPUT_TYPES else inputs[k] for k in spec.inputs]


def run_stage_fn(name: str, cfg: RunConfig, store: ArtifactStore, inputs: Mapping[str, Any]) -> Any:
    """Run stage ``name`` in this process on ``inputs`` (earlier results by name); returns its result."""
    spec = stage_spec(name)
    return spec.run(with_resolved_dtype(cfg), store, *typed_inputs(spec, inputs))
