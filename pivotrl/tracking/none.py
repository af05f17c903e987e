"""``tracking.backend: none``: records nothing and imports nothing."""

from __future__ import annotations

from typing import Any, Mapping, Sequence

from pivotrl.tracking.base import TRACKERS, MetricPoint


class NoTracker:
    """A tracker that drops every call (the default)."""

    uri = ""

    def start_run(self, experiment: str, name: str, tags: Mapping[str, str]) -> str:
        return ""

    def log_params(self, run_id: str, params: Mapping[str, str]) -> None:
        return None

    def log_metrics(self, run_id: str, points: Sequence[MetricPoint]) -> None:
        return None

    def set_tags(self, run_id: str, tags: Mapping[str, str]) -> None:
        return None

    def log_artifact(self, run_id: str, local_path: str, artifact_dir: str | None = None) -> None:
        return None

    def end_run(self, run_id: str, status: str = "FINISHED") -> None:
        return None


@TRACKERS.register("none")
def _build(section: Any, local_root: str | None) -> NoTracker:
    return NoTracker()
