"""The tracker interface: what the pipeline tells an experiment tracker, and nothing more.

A tracker records *runs*: one per nightly flow run (see ``pivotrl.tracking.record`` for why one run
and not one per stage). Every call names the run by the id :meth:`Tracker.start_run` returned, so
a tracker holds no "current run" state and can be called from any thread of the flow.

Backends are chosen by ``tracking.backend`` through :data:`TRACKERS` (``none``, ``mlflow``); a
backend's client library is imported when the backend is built, never when this module is.
"""

from __future__ import annotations

from typing import Any, Callable, Mapping, Protocol, Sequence, runtime_checkable

from pivotrl.core.registry import Registry

__all__ = ["Tracker", "TRACKERS", "MetricPoint"]

#: One point of a metric series: (key, value, step). ``step`` is the training step (1-based) for
#: per-step metrics, 0 for a stage's one-off values.
MetricPoint = tuple[str, float, int]


@runtime_checkable
class Tracker(Protocol):
    """An experiment tracker backend.

    Errors: a backend raises :class:`~pivotrl.core.errors.TrackingError` (never its client library's
    exception) naming the tracker URI and the call that failed.
    """

    #: Where runs are recorded (a URI a person can open), e.g. ``http://127.0.0.1:5000``.
    uri: str

    def start_run(self, experiment: str, name: str, tags: Mapping[str, str]) -> str:
        """Create a run in ``experiment`` (created if missing); returns the run id."""

    def log_params(self, run_id: str, params: Mapping[str, str]) -> None:
        """Record parameters (string values; a key is written once per run)."""

    def log_metrics(self, run_id: str, points: Sequence[MetricPoint]) -> None:
        """Record metric points; the same key at several steps forms a series."""

    def set_tags(self, run_id: str, tags: Mapping[str, str]) -> None:
        """Set (or overwrite) tags of the run."""

    def log_artifact(self, run_id: str, local_path: str, artifact_dir: str | None = None) -> None:
        """Upload one local file under ``artifact_dir`` of the run's artifact root."""

    def end_run(self, run_id: str, status: str = "FINISHED") -> None:
        """Mark the run finished (``FINISHED``, ``FAILED`` or ``KILLED``)."""


#: Tracker backends by ``tracking.backend`` name; each entry builds a Tracker from
#: ``(tracking section, local store root or None)``.
TRACKERS: Registry[Callable[[Any, str | None], Tracker]] = Registry("tracking backend")
