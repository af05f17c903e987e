"""Progress lines with an ETA, for stages whose output goes to a pipe or a log file.

A terminal progress bar redraws one line with carriage returns; through a pipe (a stage process's
output streamed by the CLI) nothing shows until the bar ends. :class:`Progress` logs whole lines
instead: one when it starts, one at least every ``interval_s`` seconds while work goes on (from a
heartbeat thread, so a single slow item still shows the run is alive), and one at the end::

    warm start: 12/40 micro-batches (30%), 5.1k tokens, elapsed 1m10s, ETA 2m43s

The ETA is elapsed × (total − done) / done (no ETA before the first item). Pure standard library;
lines go to the ``pivotrl.core.progress`` logger. ``PIVOTRL_PROGRESS_INTERVAL_S`` overrides the default
interval (20 s).
"""

from __future__ import annotations

import logging
import os
import threading
import time
from typing import Any, Callable

log = logging.getLogger("pivotrl.core.progress")

#: Seconds between two progress lines when no environment override is set.
DEFAULT_INTERVAL_S = 20.0


def format_duration(seconds: float) -> str:
    """``75`` → ``"1m15s"``; ``3725`` → ``"1h02m"``; under a minute ``"42s"``."""
    s = max(0, int(round(seconds)))
    if s < 60:
        return f"{s}s"
    if s < 3600:
        return f"{s // 60}m{s % 60:02d}s"
    return f"{s // 3600}h{(s % 3600) // 60:02d}m"


def _count(x: float) -> str:
    if x >= 1e6:
        return f"{x / 1e6:.1f}M"
    if x >= 1e4:
        return f"{x / 1e3:.1f}k"
    return f"{x:g}"


def progress_line(label: str, done: float, total: float | None, unit: str, elapsed_s: float,
                  counters: dict[str, float] | None = None) -> str:
    """One progress line (see the module docstring). ``total`` None or 0: no percentage or ETA."""
    parts = [f"{label}: {_count(done)}/{_count(total)} {unit}" if total else f"{label}: {_count(done)} {unit}"]
    if total:
        parts[0] += f" ({100.0 * done / total:.0f}%)"
    for name, value in (counters or {}).items():
        parts.append(f"{_count(value)} {name}")
    parts.append(f"elapsed {format_duration(elapsed_s)}")
    if total and done > 0:
        parts.append(f"ETA {format_duration(elapsed_s * max(total - done, 0) / done)}")
    elif total:
        parts.append("ETA unknown")
    return ", ".join(parts)


class Progress:
    """Count ``total`` items of ``unit`` under ``label`` and log progress lines (thread-safe).

    Use as a context manager (starts the heartbeat; logs the final line on exit)::

        with Progress("probing", total=len(states), unit="states") as p:
            for s in states:
                ...
                p.update(1)

    ``update(n, **counters)`` adds ``n`` done items and adds to named counters (e.g. tokens=512).
    ``enabled=False`` (e.g. ranks other than 0) logs nothing.
    """

    def __init__(self, label: str, total: float | None, unit: str, *, interval_s: float | None = None,
                 enabled: bool = True, emit: Callable[[str], Any] | None = None,
                 clock: Callable[[], float] = time.monotonic) -> None:
        env = os.environ.get("PIVOTRL_PROGRESS_INTERVAL_S")
        self.label, self.total, self.unit = label, total, unit
        self.interval_s = float(interval_s if interval_s is not None else (env or DEFAULT_INTERVAL_S))
        self.enabled = enabled
        self.emit = emit or log.info
        self.clock = clock
        self.done = 0.0
        self.counters: dict[str, float] = {}
        self._t0 = clock()
        self._last = self._t0
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def line(self) -> str:
        with self._lock:
            return progress_line(self.label, self.done, self.total, self.unit, self.clock() - self._t0, self.counters)

    def _log(self) -> None:
        if self.enabled:
            self.emit(self.line())
        self._last = self.clock()

    def update(self, n: float = 1, **counters: float) -> None:
        """Add ``n`` items (and counters); logs a line if ``interval_s`` passed since the last one."""
        with self._lock:
            self.done += n
            for k, v in counters.items():
                self.counters[k] = self.counters.get(k, 0.0) + v
        if self.clock() - self._last >= self.interval_s:
            self._log()

    def set_counter(self, name: str, value: float) -> None:
        """Set a named counter shown in the lines (e.g. "tasks done")."""
        with self._lock:
            self.counters[name] = float(value)

    def _beat(self) -> None:
        while not self._stop.wait(min(1.0, self.interval_s)):
            if self.clock() - self._last >= self.interval_s:
                self._log()

    def __enter__(self) -> "Progress":
        self._t0 = self._last = self.clock()
        self._log()
        self._thread = threading.Thread(target=self._beat, name=f"progress-{self.label}", daemon=True)
        self._thread.start()
        return self

    def close(self) -> None:
        """Stop the heartbeat (idempotent); no final line."""
        self._stop.set()
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join(timeout=2.0)

    def __exit__(self, *exc: Any) -> None:
        finished = not self._stop.is_set()
        self.close()
        if exc[0] is None and finished:
            self._log()
