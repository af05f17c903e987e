"""What the PivotRL trainer reads of a run config: the validated ``training`` section, the compute
dtype (``model.dtype``) and the seed (``run.seed``).

The bounds live in one place, the config schema (:class:`pivotrl.config.TrainingSection`); the
trainer and the launcher take the validated section as it is and check nothing again. Programs and
tests that have no run config build the section from keywords with :func:`training_section`.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from pydantic import ValidationError

from pivotrl.config import TrainingSection
from pivotrl.core.errors import ConfigError

if TYPE_CHECKING:
    from pivotrl.config import RunConfig

__all__ = ["LOG_RATIO_CLAMP", "TRAINER_DTYPE", "TrainingSection", "run_trainer_inputs", "training_section"]

#: model.dtype of a resolved run config → the trainer's dtype name ("bfloat16" = bf16 compute with
#: fp32 master weights).
TRAINER_DTYPE = {"bf16": "bfloat16", "fp32": "float32"}

#: Bound on whole-turn log-ratios before ``exp`` in the loss (nats); not a config field.
LOG_RATIO_CLAMP = 20.0


def training_section(**fields: Any) -> TrainingSection:
    """A validated :class:`TrainingSection` from keywords (the section's YAML keys, e.g.
    ``group_size=4, lr=1e-3, deepspeed={"zero_stage": 1}``); unset keys take the schema defaults.

    Raises ConfigError listing every bad key with its rule (unknown keys included).
    """
    try:
        return TrainingSection(**fields)
    except ValidationError as err:
        problems = "; ".join(f"{'.'.join(str(p) for p in e['loc']) or '(section)'}: {e['msg']}" for e in err.errors())
        raise ConfigError(f"invalid training settings: {problems}") from None


def run_trainer_inputs(cfg: RunConfig) -> dict[str, Any]:
    """The trainer's inputs from a validated, dtype-resolved run config:
    ``{"training": cfg.training, "dtype": "bfloat16" | "float32", "seed": cfg.run.seed}``.

    Raises ConfigError if ``model.dtype`` is still ``auto`` (resolve it first).
    """
    if cfg.model.dtype not in TRAINER_DTYPE:
        raise ConfigError(f"model.dtype={cfg.model.dtype!r} must be resolved to bf16 or fp32 before training")
    return {"training": cfg.training, "dtype": TRAINER_DTYPE[cfg.model.dtype], "seed": cfg.run.seed}
