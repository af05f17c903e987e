"""Prefect tasks that record a nightly run in the experiment tracker (see ``pivotrl.tracking``).

:func:`tracking_tasks` returns the three hooks a flow calls — ``start()`` before the first stage,
``stage(name, result)`` after each stage, ``end(status)`` at the end. With ``tracking.backend:
none`` they are plain no-op functions (no task runs, no tracker library imported); otherwise each is
a small uncached task that never fails the flow (a tracker failure is a warning, see
``pivotrl.tracking.record``).
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any, Callable, Mapping

from prefect import task
from prefect.cache_policies import NO_CACHE


def _recorder(config: Mapping[str, Any], run_id: str | None):
    from pivotrl.pipeline.common import make_store
    from pivotrl.tasks.stages import config_of
    from pivotrl.tracking import RunRecorder

    cfg = config_of(config)
    return RunRecorder(cfg, make_store(cfg), run_id)


@task(name="track-start", cache_policy=NO_CACHE, persist_result=False)
def track_start(config: dict[str, Any]) -> str:
    """Create the tracker run (config as params, code/verifier tags); returns its id ("" = off)."""
    from prefect.runtime import flow_run

    return _recorder(config, None).start(flow_run_id=flow_run.id)


@task(name="track-stage", cache_policy=NO_CACHE, persist_result=False)
def track_stage(config: dict[str, Any], run_id: str, stage: str, result: dict[str, Any]) -> None:
    """Record one stage's metrics, artifacts and lineage tags in run ``run_id``."""
    if run_id:
        _recorder(config, run_id).stage(stage, result)


@task(name="track-end", cache_policy=NO_CACHE, persist_result=False)
def track_end(config: dict[str, Any], run_id: str, status: str = "FINISHED") -> None:
    if run_id:
        _recorder(config, run_id).end(status)


@dataclass
class TrackingHooks:
    """The tracking calls of one flow run, bound to its config and tracker run id."""

    start: Callable[[], None]
    stage: Callable[[str, dict[str, Any]], None]
    end: Callable[[str], None]


def tracking_hooks(config: dict[str, Any]) -> TrackingHooks:
    """Hooks for ``config``; no-ops when ``tracking.backend`` is ``none``."""
    if (config.get("tracking") or {}).get("backend", "none") == "none":
        return TrackingHooks(start=lambda: None, stage=lambda _s, _r: None, end=lambda _st="FINISHED": None)
    box: dict[str, str] = {"run_id": ""}

    def start() -> None:
        from pivotrl.tracking.live import ENV_RUN_ID

        box["run_id"] = track_start(config)
        if box["run_id"]:  # the stage processes inherit it and send training steps live
            os.environ[ENV_RUN_ID] = box["run_id"]

    def stage(name: str, result: dict[str, Any]) -> None:
        track_stage(config, box["run_id"], name, result)

    def end(status: str = "FINISHED") -> None:
        from pivotrl.tracking.live import ENV_RUN_ID

        if os.environ.get(ENV_RUN_ID) == box["run_id"]:
            os.environ.pop(ENV_RUN_ID, None)
        track_end(config, box["run_id"], status)

    return TrackingHooks(start=start, stage=stage, end=end)
