"""The run configuration: one typed schema, validated once at load.

Modules: :mod:`~pivotrl.config.base` (Section, strict numbers), :mod:`~pivotrl.config.sections` and
:mod:`~pivotrl.config.train_eval` (the sections), :mod:`~pivotrl.config.schema` (RunConfig),
:mod:`~pivotrl.config.validate` (errors), :mod:`~pivotrl.config.load` (YAML, overrides, hashes, dump).

The schema is the manual: every field carries a description (``dump_config(cfg, comments=True)``
writes it as a YAML comment above the field) and every model forbids unknown keys. A run is
configured by one YAML file (local path or fsspec URL) plus ``dotted.key=value`` overrides::

    cfg = load_config("configs/default.yaml", ["training.beta=0.01", "probing.num_probes=4"])

Every validation problem is reported at once as a :class:`~pivotrl.core.errors.ConfigError` whose
message names the key path, the value and the rule, e.g.
``probing.num_probes = 1: must be ≥ 2 (σ̂² needs two probes)``.

Names follow the spec glossary (PivotRL §3): ``num_probes`` (m), ``group_size`` (K),
``lambda_diff``, ``delta``, ``epsilon``, ``beta``, ``kl_estimator``.
"""

from pivotrl.config.base import Float, Int, Section, is_credential_key
from pivotrl.config.load import config_hash, dump_config, load_config, public_config, section_hash
from pivotrl.config.schema import RunConfig
from pivotrl.config.sections import (
    BFCLSource,
    ChatSource,
    DataSection,
    ModelSection,
    ProbingSection,
    PromptSection,
    RolloutSection,
    RunSection,
    Source,
    SplitSection,
    VerifierSection,
    WarmStartSection,
)
from pivotrl.config.train_eval import (
    CompareSection,
    DeepSpeedSection,
    EvaluationSection,
    FaultsSection,
    QualitySection,
    ScaleOutSection,
    TrackingSection,
    TrainingSection,
)
from pivotrl.config.validate import parse_config

__all__ = [
    "RunConfig",
    "load_config",
    "parse_config",
    "config_hash",
    "section_hash",
    "dump_config",
    "public_config",
    "is_credential_key",
    "Section", "Int", "Float", "Source",
    "RunSection", "BFCLSource", "ChatSource", "SplitSection", "DataSection", "ModelSection", "PromptSection",
    "VerifierSection", "RolloutSection", "WarmStartSection", "ProbingSection", "DeepSpeedSection",
    "TrainingSection", "EvaluationSection", "QualitySection", "CompareSection", "FaultsSection",
    "ScaleOutSection", "TrackingSection",
]
