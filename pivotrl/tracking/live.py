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

from pivotrl.tracking.record import RunRecorder, logged_steps, metric_key, sent_steps_key

__all__ = ["ENV_RUN_ID", "step_logger", "logged_steps"]

#: Environment variable holding the tracker run id of the flow run in progress.
ENV_RUN_ID = "PIVOTRL_TRACKING_RUN_ID"


def step_logger(cfg: Any, store: Any, train_key: str) -> Callable[[Mapping[str, Any]], None]:
    """A function that sends one metrics row (``{"step": N, ...}``) to the tracker run named by
    :data:`ENV_RUN_ID`; a no-op when tracking is off or no run is open."""
    run_id = os.environ.get(ENV_RUN_ID, "")
    if cfg.tracking.backend == "none" or not run_id:
        return lambda row: None
    rec = RunRecorder(cfg, store, run_id)
    sent: list[int] = []

    def log(row: Mapping[str, Any]) -> None:
        step = int(row["step"])
        points = [(f"train/{metric_key(k)}", float(v), step) for k, v in row.items()
                  if k != "step" and isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)]

        def send() -> None:
            rec.tracker.log_metrics(run_id, points)
            sent.append(step)
            store.write_json(sent_steps_key(train_key, run_id), {"steps": sorted(set(sent))})

        rec._safely(f"sending training step {step}", send)

    return log
