"""What a pivotrl run tells its experiment tracker, stage by stage.

**One tracker run per nightly flow run**, not a parent with a child per stage. A person browsing
the MLflow UI compares *nights*: tonight's reward curve against last week's, tonight's held-out
success against last week's. With one run per night that is "select two runs, Compare"; with a
child per stage it would mean finding the right child under each parent, and a stage served from
the cache (the usual case for demonstrations and probing) would leave an empty child behind. The
stages of one night share one resolved config and one lineage, so their values live side by side
in one run under namespaced keys (``train/reward_mean``, ``probe/kept``,
``eval/pivotrl/full_task_success``); the stage structure itself is in Prefect, whose flow-run id is
a tag.

Per run:

* **params**: the resolved config, one dotted key each (``training.group_size`` = ``4``);
* **metrics**: demonstration and pivot-filter counts and the warm start's losses (step 0); every
  numeric column of ``metrics.parquet`` as a series with one point per training step, sent live as
  each step finishes (``pivotrl.tracking.live``)
  (``train/<column>``: reward, zero-variance fraction, clip fractions, ratio statistics, KL,
  entropy, grad norm, policy and reference tokens/s, MFU, refresh Δ — whatever the trainer
  recorded), the train stage's speed over all steps (``train_stage/mfu``, ``train_stage/trainer_s``,
  ...) and the warm start's (``warm_start/mfu``, ...); the evaluation's
  numbers per policy (``eval/<policy>/<metric>``);
* **artifacts**: the pivot-filter summary, the report (``report.md``, ``report.json``) and its plots;
* **tags** linking the run to lineage (values equal to the manifests'): ``pivotrl.pivots.sha256``,
  ``pivotrl.probes.sha256``, ``pivotrl.reference.hash``, ``pivotrl.base_model.hash``,
  ``pivotrl.verifier.name`` / ``.config_hash`` / ``.code_hash``, ``pivotrl.source.<i>.uri`` /
  ``.sha256``, ``pivotrl.trajectories.sha256``, ``pivotrl.metrics.sha256``, ``pivotrl.report.sha256``,
  ``pivotrl.code_version``, ``pivotrl.config_hash``, ``prefect.flow_run_id``.

Tracking is observability: a tracker that fails (server down, bad credentials) is reported once as
a warning and switched off for the rest of the run; the pipeline and its artifacts are unaffected.
"""

from __future__ import annotations

import json
import logging
import math
import os
import tempfile
from pathlib import Path
from typing import Any, Mapping

from pivotrl.core.errors import StorageError, TrackingError
from pivotrl.provenance.fingerprints import verifier_code_hash
from pivotrl.tracking.base import TRACKERS, MetricPoint, Tracker

log = logging.getLogger("pivotrl.tracking")

__all__ = ["RunRecorder", "flatten_params", "logged_steps", "make_tracker", "metric_key", "sent_steps_key",
           "verifier_code_hash", "STAGES"]

#: The stages whose results :meth:`RunRecorder.stage` understands, in flow order.
STAGES = ("demonstrations", "reference", "probe", "train", "evaluate")


def make_tracker(cfg: Any) -> Tracker:
    """The tracker of ``cfg.tracking`` (a RunConfig). ``none`` imports no tracker library.

    Raises ConfigError for an unknown backend, TrackingError if the backend cannot be built.
    """
    import pivotrl.tracking.none  # noqa: F401 - registers "none"

    if cfg.tracking.backend == "mlflow":
        import pivotrl.tracking.mlflow  # noqa: F401 - registers "mlflow" (imports mlflow when built)
    root = os.path.expanduser(cfg.run.storage_root)
    local = None if "://" in root and not root.startswith("file://") else root.removeprefix("file://")
    return TRACKERS.get(cfg.tracking.backend)(cfg.tracking, local)


def flatten_params(obj: Any, prefix: str = "") -> dict[str, str]:
    """``{"training": {"beta": 0.0}}`` → ``{"training.beta": "0.0"}``; lists and empty dicts as JSON."""
    if isinstance(obj, Mapping) and obj:
        out: dict[str, str] = {}
        for k, v in obj.items():
            out.update(flatten_params(v, f"{prefix}.{k}" if prefix else str(k)))
        return out
    if isinstance(obj, (list, tuple, Mapping)):
        return {prefix: json.dumps(obj, sort_keys=True, default=str)}
    return {prefix: "null" if obj is None else str(obj)}


#: Keys of the train stage's summary logged as ``train_stage/<key>`` (pivotrl.runtime.mfu.summarize).
STAGE_SPEED = ("trainer_s", "model_tflop", "policy_tokens_per_s", "ref_tokens_per_s", "mfu")


def _numbers(obj: Any, prefix: str) -> list[MetricPoint]:
    """Every finite number in a nested dict as a step-0 metric point (booleans skipped)."""
    out: list[MetricPoint] = []
    if isinstance(obj, Mapping):
        for k, v in obj.items():
            out += _numbers(v, f"{prefix}/{k}")
    elif isinstance(obj, (int, float)) and not isinstance(obj, bool) and math.isfinite(obj):
        out.append((prefix, float(obj), 0))
    return out


def metric_key(name: str) -> str:
    """An MLflow-safe metric key (letters, digits, ``_ - . / space``)."""
    return "".join(c if c.isalnum() or c in "_-./ " else "_" for c in name)


class RunRecorder:
    """Records one pipeline run in a tracker (see the module docstring for what goes where).

    ``cfg``: the RunConfig; ``store``: its ArtifactStore; ``run_id``: an existing tracker run to
    add to (None until :meth:`start`). Every method is a no-op once the tracker has failed.
    """

    def __init__(self, cfg: Any, store: Any, run_id: str | None = None, tracker: Tracker | None = None) -> None:
        self.cfg, self.store, self.run_id = cfg, store, run_id
        self._tracker = tracker

    @property
    def tracker(self) -> Tracker:
        if self._tracker is None:
            self._tracker = make_tracker(self.cfg)
        return self._tracker

    def _safely(self, what: str, fn: Any) -> Any:
        if self.run_id == "":  # disabled (backend none, or failed earlier)
            return None
        try:
            return fn()
        except (TrackingError, StorageError) as e:
            log.warning("experiment tracking switched off for this run: %s while %s. The pipeline goes on; "
                        "its artifacts and manifests are unaffected.", e, what)
            self.run_id = ""
            return None

    # ---------------------------------------------------------------------------- lifecycle
    def start(self, flow_run_id: str | None = None) -> str:
        """Create the run with the resolved config as params; returns its id ("" = not tracking)."""
        from pivotrl.config import config_hash, public_config
        from pivotrl.storage import code_version

        def go() -> str:
            t = self.tracker
            tags = {"pivotrl.run": self.cfg.run.name, "pivotrl.code_version": code_version(),
                    "pivotrl.config_hash": config_hash(self.cfg), "pivotrl.verifier.name": self.cfg.verifier.name,
                    "pivotrl.verifier.code_hash": verifier_code_hash(),
                    "pivotrl.verifier.config_hash": _section_hash(self.cfg, "verifier"),
                    "pivotrl.storage_root": self.store.root_url}
            if flow_run_id:
                tags["prefect.flow_run_id"] = str(flow_run_id)
            experiment = self.cfg.tracking.experiment or f"pivotrl-{self.cfg.run.name}"
            run_id = t.start_run(experiment, self.cfg.tracking.run_name or self.cfg.run.name, tags)
            data = public_config(self.cfg)
            data.pop("tracking", None)
            t.log_params(run_id, flatten_params(data))
            return run_id

        self.run_id = None  # enabled until proven otherwise
        self.run_id = self._safely("starting the run", go) or ""
        return self.run_id

    def end(self, status: str = "FINISHED") -> None:
        """Mark the run ``FINISHED`` or ``FAILED``."""
        self._safely("ending the run", lambda: self.tracker.end_run(self.run_id, status))

    # ------------------------------------------------------------------------------- stages
    def stage(self, name: str, out: Mapping[str, Any]) -> None:
        """Record what stage ``name`` (one of :data:`STAGES`) produced, given its result dict."""
        handler = getattr(self, f"_{name}", None)
        if handler is None:
            raise ValueError(f"unknown stage {name!r}; valid: {', '.join(STAGES)}")
        self._safely(f"recording stage {name!r}", lambda: handler(out))

    def _manifest_sha(self, uri: str | None) -> str | None:
        m = self.store.read_manifest_url(uri) if uri else None
        return m.sha256 if m is not None else None

    def _demonstrations(self, out: Mapping[str, Any]) -> None:
        tags = {"pivotrl.trajectories.sha256": self._manifest_sha(out.get("trajectories")),
                "pivotrl.candidates.sha256": self._manifest_sha(out.get("candidates"))}
        m = self.store.read_manifest_url(out["trajectories"]) if out.get("trajectories") else None
        for name, rec in sorted((m.inputs if m else {}).items()):
            i = name.removeprefix("source[").rstrip("]")
            tags[f"pivotrl.source.{i}.uri"] = rec.get("uri")
            tags[f"pivotrl.source.{i}.sha256"] = rec.get("sha256") or source_sha256(str(rec.get("uri", "")))
        self.tracker.set_tags(self.run_id, {k: str(v) for k, v in tags.items() if v is not None})
        self.tracker.log_metrics(self.run_id, _numbers(out.get("counts", {}), "demos"))

    def _reference(self, out: Mapping[str, Any]) -> None:
        tags = {"pivotrl.reference.hash": out.get("ref_hash"), "pivotrl.base_model.hash": out.get("base_hash"),
                "pivotrl.reference.uri": self.store.url(out["ref_key"]) if out.get("ref_key") else None}
        self.tracker.set_tags(self.run_id, {k: str(v) for k, v in tags.items() if v is not None})
        sft = out.get("sft") or {}
        points = _numbers({k: v for k, v in sft.items() if k != "metrics"}, "warm_start")
        self.tracker.log_metrics(self.run_id, points + _numbers(sft.get("metrics") or {}, "warm_start"))

    def _probe(self, out: Mapping[str, Any]) -> None:
        probes = self.store.read_manifest_url(out["probes"]) if out.get("probes") else None
        extra = probes.extra if probes is not None else {}
        self.tracker.set_tags(self.run_id, {k: str(v) for k, v in {
            "pivotrl.pivots.sha256": self._manifest_sha(out.get("pivots")),
            "pivotrl.probes.sha256": probes.sha256 if probes is not None else None,
            "pivotrl.pivots.uri": out.get("pivots"),
            "pivotrl.verifier.hash": extra.get("verifier_hash"),
            "pivotrl.chat_template.hash": extra.get("chat_template_hash")}.items() if v is not None})
        self.tracker.log_metrics(self.run_id, _numbers((out.get("stats") or {}).get("total", {}), "probe"))
        if out.get("summary_md"):
            self._upload_text("pivot_set.md", out["summary_md"], "probe")

    def _train(self, out: Mapping[str, Any]) -> None:
        self.tracker.set_tags(self.run_id, {k: str(v) for k, v in {
            "pivotrl.metrics.sha256": self._manifest_sha(out.get("metrics")),
            "pivotrl.policy.uri": self.store.url(out["policy_key"]) if out.get("policy_key") else "reference"}.items()})
        df = self.store.read_parquet(out["metrics"].removeprefix(self.store.root_url + "/"))
        sent = logged_steps(self.store, out["train_key"], self.run_id)  # already sent live, step by step
        points: list[MetricPoint] = []
        for col in df.columns:
            if col == "step" or not _is_numeric(df[col]):
                continue
            for step, v in zip(df["step"], df[col]):
                if int(step) not in sent and v is not None and math.isfinite(float(v)):
                    points.append((f"train/{metric_key(col)}", float(v), int(step)))
        # The stage's speed over all steps (summary.json: trainer_s, model_tflop, tokens/s, mfu).
        summary = out.get("summary") or {}
        points += _numbers({k: summary[k] for k in STAGE_SPEED if k in summary}, "train_stage")
        self.tracker.log_metrics(self.run_id, points)

    def _evaluate(self, out: Mapping[str, Any]) -> None:
        report = out.get("report") or {}
        points: list[MetricPoint] = []
        for p in report.get("policies", []):
            name = metric_key(str(p.get("policy", "?")).split(" (")[0])
            points += _numbers({k: v for k, v in p.items() if k != "policy"}, f"eval/{name}")
        self.tracker.log_metrics(self.run_id, points)
        self.tracker.set_tags(self.run_id, {"pivotrl.report.sha256": str(self._manifest_sha(out.get("report_json"))),
                                            "pivotrl.report.uri": str(out.get("report_json"))})
        ekey = out["eval_key"]
        for key in sorted(self.store.list(ekey)):
            if key.endswith((".md", ".json", ".png")) and not key.endswith(".manifest.json"):
                self._upload_bytes(key.rsplit("/", 1)[-1], self.store.read_bytes(key), "report")

    # ----------------------------------------------------------------------------- uploads
    def _upload_bytes(self, name: str, data: bytes, artifact_dir: str) -> None:
        with tempfile.TemporaryDirectory(prefix="pivotrl-track-") as tmp:
            path = os.path.join(tmp, name)
            Path(path).write_bytes(data)
            self.tracker.log_artifact(self.run_id, path, artifact_dir)

    def _upload_text(self, name: str, text: str, artifact_dir: str) -> None:
        self._upload_bytes(name, text.encode("utf-8"), artifact_dir)


def sent_steps_key(train_key: str, run_id: str) -> str:
    """Where the training steps sent live to tracker run ``run_id`` are listed (a JSON artifact)."""
    return f"{train_key}/tracking/{run_id}.json"


def logged_steps(store: Any, train_key: str, run_id: str) -> set[int]:
    """Training steps already sent live to run ``run_id`` (empty if none)."""
    key = sent_steps_key(train_key, run_id)
    return set(store.read_json(key)["steps"]) if run_id and store.exists(key) else set()


def source_sha256(uri: str) -> str | None:
    """sha256 of a demonstration source: the pinned, hash-checked BFCL wheel for ``pypi:bfcl-eval``,
    else the file's bytes as they are now (None if unreadable)."""
    if uri.startswith("pypi:bfcl-eval=="):
        from pivotrl.bfcl.wheel import BFCL_WHEEL_SHA256

        return BFCL_WHEEL_SHA256
    try:
        import hashlib

        import fsspec

        with fsspec.open(uri, "rb") as f:
            return hashlib.file_digest(f, "sha256").hexdigest()
    except Exception:  # an unreadable source leaves the tag out; the manifest still names it
        return None


def _is_numeric(series: Any) -> bool:
    import pandas as pd

    return pd.api.types.is_numeric_dtype(series) and not pd.api.types.is_bool_dtype(series)


def _section_hash(cfg: Any, name: str) -> str:
    from pivotrl.config import section_hash

    return section_hash(cfg, name)[:16]
