"""The whole run configuration: :class:`RunConfig` (every section) and its cross-section rules."""

from __future__ import annotations

from typing import Any, Mapping

from pydantic import Field, model_validator

from pivotrl.config.base import Section, bound_error
from pivotrl.config.sections import (
    DataSection, ModelSection, ProbingSection, PromptSection, RolloutSection, RunSection, VerifierSection,
    WarmStartSection,
)
from pivotrl.config.train_eval import (
    DEFAULT_REFRESH_TOLERANCE, CompareSection, EvaluationSection, FaultsSection, QualitySection, ScaleOutSection, TrackingSection,
    TrainingSection,
)


class RunConfig(Section):
    """A whole run. Load with :func:`load_config`; every section has defaults (the embedded CPU run)."""

    run: RunSection = Field(default_factory=RunSection, description="Identity, seed and storage of the run.")
    data: DataSection = Field(default_factory=DataSection, description="Demonstration sources and split.")
    model: ModelSection = Field(default_factory=ModelSection, description="Policy / reference model.")
    prompt: PromptSection = Field(default_factory=PromptSection, description="Prompt rendering.")
    verifier: VerifierSection = Field(default_factory=VerifierSection, description="Functional verifier.")
    rollout: RolloutSection = Field(default_factory=RolloutSection, description="Sampling engine.")
    warm_start: WarmStartSection = Field(default_factory=WarmStartSection, description="Supervised warm start.")
    probing: ProbingSection = Field(default_factory=ProbingSection, description="Pivot filtering (stage 1).")
    training: TrainingSection = Field(default_factory=TrainingSection, description="Local GRPO (stage 2).")
    evaluation: EvaluationSection = Field(default_factory=EvaluationSection, description="Evaluation.")
    quality: QualitySection = Field(default_factory=QualitySection, description="Judge, text turns, data audit.")
    faults: FaultsSection = Field(default_factory=FaultsSection, description="Fault injection (tests only).")
    tracking: TrackingSection = Field(default_factory=TrackingSection, description="Experiment tracking (MLflow).")
    scale_out: ScaleOutSection = Field(
        default_factory=ScaleOutSection, description="Shards of probing and evaluation, and where they run.")
    compare: CompareSection = Field(default_factory=CompareSection, description="SFT and end-to-end RL baselines.")

    @model_validator(mode="before")
    @classmethod
    def _fill_refresh_tolerance(cls, data: Any) -> Any:
        if not isinstance(data, Mapping):
            return data
        training = data.get("training")
        if isinstance(training, TrainingSection):
            training = training.model_dump()
        if training is None or isinstance(training, Mapping):
            training = dict(training or {})
            if training.get("refresh_tolerance") is None:
                model = data.get("model")
                dtype = model.get("dtype", "auto") if isinstance(model, Mapping) else getattr(model, "dtype", "auto")
                if dtype != "auto":  # auto: filled in once resolved (pivotrl.runtime.precision.with_resolved_dtype)
                    training["refresh_tolerance"] = DEFAULT_REFRESH_TOLERANCE.get(dtype, 0.3)
            data = {**data, "training": training}
        return data

    @model_validator(mode="after")
    def _cross_section(self) -> "RunConfig":
        if self.warm_start.enabled and self.data.split.warm_start <= 0:
            raise bound_error(
                "data.split.warm_start", self.data.split.warm_start, "must be > 0 when warm_start.enabled is true"
            )
        if self.rollout.max_tokens >= self.model.max_context:
            raise bound_error(
                "rollout.max_tokens", self.rollout.max_tokens,
                f"must be < model.max_context = {self.model.max_context}",
            )
        if self.warm_start.max_len > self.model.max_context:
            raise bound_error(
                "warm_start.max_len", self.warm_start.max_len,
                f"must be ≤ model.max_context = {self.model.max_context}",
            )
        if self.training.nnodes > 1 and self.training.node_launch == "ray" and self.scale_out.ray_address is None:
            raise bound_error("scale_out.ray_address", None,
                              f"training.nnodes = {self.training.nnodes} with node_launch 'ray' places the trainer "
                              "nodes on a Ray cluster: give its address ('auto' on a cluster node, 'HOST:6379'), "
                              "or set training.node_launch: manual")
        self._engine_layout()
        return self

    def _engine_layout(self) -> None:
        """Training's rollout engines fit the trainer's ranks (``rollout.engine_placement``)."""
        ro, tr = self.rollout, self.training
        if ro.engine_placement == "rank0":
            return
        span = tr.nproc_per_node if ro.engine_placement == "node" else ro.ranks_per_engine
        if ro.engine_placement == "ranks" and tr.nproc_per_node % span:
            raise bound_error("rollout.ranks_per_engine", span,
                        f"must divide training.nproc_per_node = {tr.nproc_per_node} (an engine's ranks share a node)")
        engines = tr.world_size // span
        if ro.num_engines not in (1, engines):
            raise bound_error("rollout.num_engines", ro.num_engines,
                        f"with engine_placement {ro.engine_placement} the layout gives {engines} engine(s) "
                        f"(one every {span} of the {tr.world_size} ranks): set it to 1 (the layout's count) or {engines}")
        if ro.engine != "vllm" or ro.tensor_parallel_size <= span:
            return
        raise bound_error("rollout.tensor_parallel_size", ro.tensor_parallel_size,
                    f"must be ≤ the {span} GPUs of an engine's ranks (engine_placement {ro.engine_placement})")

    def public_dict(self) -> dict[str, Any]:
        """The config as JSON-compatible data without ``run.storage_options`` and ``tracking`` (what
        hashes and manifests see: where a run is recorded and how it reaches storage change no result)."""
        data = self.model_dump(mode="json")
        data["run"].pop("storage_options", None)
        data.pop("tracking", None)
        return data
