"""Live training metrics: each training step sent to the tracker as it finishes, off the training
thread.

The flow that started the tracker run puts its id in the environment (:data:`ENV_RUN_ID`); the
training stage, a child process, inherits it and hands every row of ``metrics.parquet`` to a
:class:`LiveLogger` the moment it is appended. The logger only queues the row: a background thread
sends it, so a tracker that is slow or down costs the training loop nothing. While the tracker does
not answer, the steps are kept (in memory, and in ``metrics.parquet`` anyway) and sent together once
it answers again (one try every ``retry_every_s``); one warning says so. At the end of the stage
:meth:`LiveLogger.close` gives the queue at most ``flush_s`` seconds, then says how many steps were
not sent. The steps sent are listed in ``<train key>/tracking/<run id>.json``, so the end-of-stage
record (``RunRecorder``) sends only what the live logger did not (all of it when the stage was
served from the cache).

How long one call to the tracker may take is bounded by the backend (``pivotrl.tracking.mlflow``:
a short HTTP timeout and retry budget of ours).
"""

from __future__ import annotations

import logging
import math
import os
import queue
import threading
import time
from typing import Any, Callable, Mapping

from pivotrl.tracking.record import logged_steps, make_tracker, metric_key, sent_steps_key

__all__ = ["ENV_RUN_ID", "LiveLogger", "step_logger", "logged_steps"]

log = logging.getLogger("pivotrl.tracking")

#: Environment variable holding the tracker run id of the flow run in progress.
ENV_RUN_ID = "PIVOTRL_TRACKING_RUN_ID"


class LiveLogger:
    """Sends training steps to ``tracker`` run ``run_id`` from a background thread.

    Calling it with a metrics row (``{"step": N, ...}``) queues the row's finite numbers as
    ``train/<column>`` points at step N and returns at once. ``retry_every_s``: how often steps kept
    during an outage are tried again; ``flush_s``: the most :meth:`close` waits for the queue.
    Tracker errors (any exception) never reach the caller: they cost one warning per outage.
    """

    def __init__(self, tracker: Any, run_id: str, store: Any, train_key: str, *,
                 retry_every_s: float = 5.0, flush_s: float = 10.0) -> None:
        self._metric_key = metric_key
        self.tracker, self.run_id, self.store, self.train_key = tracker, run_id, store, train_key
        self.retry_every_s, self.flush_s = retry_every_s, flush_s
        self.sent: list[int] = []
        self.failures = 0
        self._pending: list[tuple[int, list[tuple[str, float, int]]]] = []
        self._queue: queue.Queue[Any] = queue.Queue()
        self._down_since: float | None = None
        self._last_try = 0.0
        self._thread = threading.Thread(target=self._run, name="pivotrl-live-tracking", daemon=True)
        self._thread.start()

    def __call__(self, row: Mapping[str, Any]) -> None:
        step = int(row["step"])
        points = [(f"train/{self._metric_key(k)}", float(v), step) for k, v in row.items()
                  if k != "step" and isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)]
        self._queue.put((step, points))

    # ------------------------------------------------------------------------- worker thread
    def _run(self) -> None:
        closing = False
        while True:
            wait = self.retry_every_s if self._pending else None
            try:
                item = self._queue.get(timeout=wait)
            except queue.Empty:
                item = None
            if item is _CLOSE:
                closing = True
            elif item is not None:
                self._pending.append(item)
            while not closing and not self._queue.empty():  # take what queued meanwhile in one go
                nxt = self._queue.get_nowait()
                if nxt is _CLOSE:
                    closing = True
                else:
                    self._pending.append(nxt)
            due = self._down_since is None or closing or time.monotonic() - self._last_try >= self.retry_every_s
            if self._pending and due:
                self._send()
            if closing:
                return

    def _send(self) -> None:
        self._last_try = time.monotonic()
        batch = list(self._pending)
        try:
            self.tracker.log_metrics(self.run_id, [p for _, pts in batch for p in pts])
        except Exception as e:  # noqa: BLE001 - a tracker failure must never reach training
            self.failures += 1
            if self._down_since is None:
                self._down_since = time.monotonic()
                log.warning("experiment tracker does not answer (%s); training goes on, its steps are kept and "
                            "sent when the tracker answers again", str(e).splitlines()[0] if str(e) else type(e).__name__)
            return
        del self._pending[:len(batch)]
        if self._down_since is not None:
            log.warning("experiment tracker answers again after %.0f s: %d kept step(s) sent",
                        time.monotonic() - self._down_since, len(batch))
            self._down_since = None
        self.sent += [s for s, _ in batch]
        try:
            self.store.write_json(sent_steps_key(self.train_key, self.run_id), {"steps": sorted(set(self.sent))})
        except Exception as e:  # noqa: BLE001 - the end-of-stage record then sends those steps again
            log.warning("cannot record which steps were sent to the tracker: %s", e)

    # --------------------------------------------------------------------------------- close
    def close(self) -> int:
        """Send what is queued (waiting at most ``flush_s`` seconds); returns how many steps were
        not sent (warned about: they stay in ``metrics.parquet``, and the end-of-stage record sends
        them if the tracker answers by then)."""
        self._queue.put(_CLOSE)
        self._thread.join(timeout=self.flush_s)
        unsent = len(self._pending) + self._queue.qsize()
        if self._thread.is_alive() or unsent:
            log.warning("%d training step(s) not sent to the experiment tracker (it did not answer); they are "
                        "in metrics.parquet, and the end of the stage sends them if the tracker answers by then",
                        unsent)
        return unsent


_CLOSE = object()


def step_logger(cfg: Any, store: Any, train_key: str) -> Callable[[Mapping[str, Any]], None]:
    """A function that takes one metrics row (``{"step": N, ...}``) for the tracker run named by
    :data:`ENV_RUN_ID` (a :class:`LiveLogger`; call its ``close()`` at the end of the stage); a
    no-op (importing nothing) when tracking is off or no run is open."""
    run_id = os.environ.get(ENV_RUN_ID, "")
    if cfg.tracking.backend == "none" or not run_id:
        return lambda row: None
    from pivotrl.core.errors import TrackingError

    try:
        tracker = make_tracker(cfg)
    except TrackingError as e:
        log.warning("experiment tracking switched off for the train stage: %s", e)
        return lambda row: None
    return LiveLogger(tracker, run_id, store, train_key)
