"""What a person running ``pivotrl run`` sees and can do: the precision chosen at start, a clean
stop on Ctrl-C / SIGTERM, and a failing stage told in one line (not a library traceback).

:func:`start_run_console` is called by the CLI once its config is valid, before the flow starts.
"""

from __future__ import annotations

import logging
from typing import Any, Callable

from pivotrl.errors import PivotRLError


class _NoPivotRLTracebacks(logging.Filter):
    """Drop the traceback (keep the message) of a logged pivotrl error: a failed stage's reason and
    the path of its full log are in the message; its traceback through Prefect's engine is noise."""

    def filter(self, record: logging.LogRecord) -> bool:
        exc = record.exc_info[1] if record.exc_info else None
        if isinstance(exc, PivotRLError):
            record.exc_info = None
            record.exc_text = None
        return True


def quiet_stage_tracebacks(logger_names: tuple[str, ...] = ("prefect",)) -> int:
    """Install the filter on the console handlers of ``logger_names`` (Prefect's loggers must be
    configured: import prefect first). Returns the number of handlers filtered."""
    n = 0
    for name in logger_names:
        for handler in logging.getLogger(name).handlers:
            if not any(isinstance(f, _NoPivotRLTracebacks) for f in handler.filters):
                handler.addFilter(_NoPivotRLTracebacks())
                n += 1
    return n


def precision_lines(cfg: Any, *, measure: bool = True) -> list[str]:
    """The precision line of a run, plus a warning (with a measured bf16/fp32 slowdown when
    ``measure``) for an explicit bf16 on a device that emulates it."""
    from pivotrl.precision import bf16_slowdown, run_precision

    p = run_precision(cfg)
    lines = [p.line()]
    if p.warning:
        slow = f" (measured here: a bf16 matmul takes {bf16_slowdown():.0f}x the fp32 time)" if measure else ""
        lines.append(f"warning: {p.warning}{slow}")
    return lines


def start_run_console(cfg: Any, echo: Callable[[str], Any] = print) -> None:
    """Install the SIGINT/SIGTERM handler that stops the run's whole process tree
    (pivotrl.pipeline.processes.StopOnSignal), print the precision (and its warning, once), and
    keep pivotrl errors' tracebacks out of Prefect's console log."""
    import prefect  # noqa: F401 - configures Prefect's logging, which the filter attaches to

    from pivotrl.pipeline.processes import StopOnSignal

    StopOnSignal().install()
    for line in precision_lines(cfg):
        echo(line)
    quiet_stage_tracebacks()
