"""Live training metrics: each training step sent to the tracker as it finishes.

The flow that started the tracker run puts its id in the environment (:data:`ENV_RUN_ID`); the
training stage, a child process, inherits it and logs every row of ``metrics.parquet`` the moment
it is appended. The steps sent are listed in ``<train key>/tracking/<run id>.json``, so the
end-of-stage record (``RunRecorder``) sends only what the live logger did not (all of it when the
stage was served from the cache).
"""

from __future__ import annotations

import math
import os
from typing import Any, Callable, Mapping

__all__ = ["ENV_RUN_ID", "step_logger", "logged_steps"]

#: Environment variable holding the tracker run id of the flow run in progress.
ENV_RUN_ID = "PIVOTRL_TRACKING_RUN_ID"


def _marker(train_key: str, run_id: str) -> str:
    return f"{train_key}/tracking/{run_id}.json"


def logged_steps(store: Any, train_key: str, run_id: str) -> set[int]:
    """Training steps already sent live to run ``run_id`` (empty if none)."""
    key = _marker(train_key, run_id)
    return set(store.read_json(key)["steps"]) if run_id and store.exists(key) else set()


def step_logger(cfg: Any, store: Any, train_key: str) -> Callable[[Mapping[str, Any]], None]:
    """A function that sends one metrics row (``{"step": N, ...}``) to the tracker run named by
    :data:`ENV_RUN_ID`; a no-op (importing nothing) when tracking is off or no run is open."""
    run_id = os.environ.get(ENV_RUN_ID, "")
    if cfg.tracking.backend == "none" or not run_id:
        return lambda row: None
    from pivotrl.tracking.record import RunRecorder, metric_key

    rec = RunRecorder(cfg, store, run_id)
    sent: list[int] = []

    def log(row: Mapping[str, Any]) -> None:
        step = int(row["step"])
        points = [(f"train/{metric_key(k)}", float(v), step) for k, v in row.items()
                  if k != "step" and isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)]

        def send() -> None:
            rec.tracker.log_metrics(run_id, points)
            sent.append(step)
            store.write_json(_marker(train_key, run_id), {"steps": sorted(set(sent))})

        rec._safely(f"sending training step {step}", send)

    return log
