"""Typed results of the pipeline stages: small, frozen, JSON-able (URIs, keys, hashes, counts —
never tensors or tables).

A stage function (``pivotrl.pipeline.reference`` / ``probe`` / ``train`` / ``evaluate``) returns
one of these; between processes and in Prefect's task results they travel as their
:meth:`StageResult.to_dict` and come back with :meth:`StageResult.of`, which also accepts the
dicts of task results cached before these types existed. Pure core: standard library only.
"""

from __future__ import annotations

import dataclasses
import inspect
import json
import re
from dataclasses import dataclass
from typing import Any, Mapping, TypeVar

from pivotrl.core.errors import ConfigError

__all__ = ["EvalResult", "ProbeResult", "ReferenceResult", "StageResult", "TrainResult"]

R = TypeVar("R", bound="StageResult")


class StageResult:
    """Conversions shared by the stage results."""

    def to_dict(self) -> dict[str, Any]:
        """The result as a JSON-able dict (field name → value), as stage processes and Prefect pass it."""
        return {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}  # type: ignore[arg-type]

    @classmethod
    def of(cls: type[R], value: R | Mapping[str, Any]) -> R:
        """``value`` itself if it is a ``cls``, else a ``cls`` built from a mapping of its fields
        (unknown keys are ignored; fields with a default may be absent). Raises ConfigError naming
        the missing fields."""
        if isinstance(value, cls):
            return value
        if not isinstance(value, Mapping):
            raise ConfigError(f"{cls.__name__}: expected a mapping or {cls.__name__}, got {type(value).__name__}")
        fields = dataclasses.fields(cls)  # type: ignore[arg-type]
        missing = [f.name for f in fields if f.name not in value
                   and f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING]
        if missing:
            raise ConfigError(f"{cls.__name__}: missing field(s) {missing} in {sorted(value)}")
        return cls(**{f.name: value[f.name] for f in fields if f.name in value})  # type: ignore[call-arg]

    @classmethod
    def field_docs(cls) -> dict[str, str]:
        """Each field's description, from the ``Attributes:`` section of the class docstring
        (``name: text``, ``a, b: text`` and ``a: text; b: text`` entries). Fields without one are
        absent."""
        doc = inspect.getdoc(cls) or ""
        block = doc.split("Attributes:", 1)[1] if "Attributes:" in doc else ""
        entries: list[str] = []
        for line in block.splitlines():
            if re.match(r"^    \S", line):  # a new entry (4 spaces after getdoc's dedent)
                entries.append(line.strip())
            elif line.strip() and entries:
                entries[-1] += " " + line.strip()
        names = {f.name for f in dataclasses.fields(cls)}  # type: ignore[arg-type]
        docs: dict[str, str] = {}
        for entry in entries:
            for part in re.split(r";\s+(?=\w+(?:,\s*\w+)*:\s)", entry):
                head, _, text = part.partition(": ")
                for name in (n.strip() for n in head.split(",")):
                    if name in names and text:
                        docs[name] = text.strip()
        return docs

    def markdown(self, max_chars: int = 300) -> str:
        """The result as a Markdown table — field, value (long values cut at ``max_chars``), and
        what it means (:meth:`field_docs`) — under the class's one-line summary."""
        docs = self.field_docs()
        summary = (inspect.getdoc(type(self)) or type(self).__name__).splitlines()[0]
        lines = [f"## {type(self).__name__}", "", summary, "", "| field | value | meaning |", "|---|---|---|"]
        for f in dataclasses.fields(self):  # type: ignore[arg-type]
            value = getattr(self, f.name)
            text = value if isinstance(value, str) else json.dumps(value, sort_keys=True, default=str)
            if len(text) > max_chars:
                text = text[:max_chars] + " …"
            cell = text.replace("|", "\\|").replace("\n", " ")
            meaning = docs.get(f.name, "").replace("``", "`").replace("|", "/")
            lines.append(f"| `{f.name}` | {cell} | {meaning} |")
        return "\n".join(lines) + "\n"


@dataclass(frozen=True)
class ReferenceResult(StageResult):
    """The reference stage: the base model and π_ref.

    Attributes:
        base_dir: local directory of the resolved base model (HF format).
        base_hash: its checkpoint hash (sha256 hex).
        ref_key: store key of the warm-started π_ref, or None without warm start (π_ref = base).
        ref_hash: checkpoint hash of π_ref.
        sft: the warm start's record (examples, skipped, metrics, checkpoint_hash), or None.
        prompt_format: the resolved prompt format (format, tool_parser, template_hash, prefix_stable).
    """

    base_dir: str
    base_hash: str
    ref_key: str | None
    ref_hash: str
    sft: dict[str, Any] | None = None
    prompt_format: dict[str, Any] = dataclasses.field(default_factory=dict)


@dataclass(frozen=True)
class ProbeResult(StageResult):
    """The probe stage: the probe table and the pivot set selected from it (λ_diff).

    Attributes:
        probes_key: store key prefix of ``probes.parquet``.
        probes: the URI of ``probes.parquet``.
        pivots_key: store key prefix of ``pivots.parquet``, ``stats.json``, ``summary.md``.
        pivots: the URI of ``pivots.parquet``.
        stats: the pivot statistics (``pivotrl.pipeline.probe.pivot_stats``).
        summary_md: those statistics as Markdown.
    """

    probes_key: str
    probes: str
    pivots_key: str
    pivots: str
    stats: dict[str, Any]
    summary_md: str = ""


@dataclass(frozen=True)
class TrainResult(StageResult):
    """The train stage.

    Attributes:
        train_key: store key prefix of the run (``metrics.parquet``, ``summary.json``, checkpoints).
        policy_key: store key of the trained policy (HF format), or None when nothing was trained
            (an empty pivot set: the policy is π_ref).
        metrics: URI of ``metrics.parquet`` (one row per step).
        summary: steps, pivots, final_reward_mean, policy, and the trainer's speed over all steps (trainer_s,
            model_tflop, policy_tokens_per_s, ref_tokens_per_s, mfu: pivotrl.runtime.mfu.summarize); None on
            ranks other than 0.
    """

    train_key: str
    policy_key: str | None
    metrics: str
    summary: dict[str, Any] | None = None


@dataclass(frozen=True)
class EvalResult(StageResult):
    """The evaluate stage: the report.

    Attributes:
        eval_key: store key prefix of the evaluation's files.
        report_json, report_md: URIs of the report.
        report: the report itself (``report.json``).
    """

    eval_key: str
    report_json: str
    report_md: str
    report: dict[str, Any]
