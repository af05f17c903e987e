"""What a person running ``pivotrl run`` sees and can do: the precision chosen at start, a clean
stop on Ctrl-C / SIGTERM, and a failing stage told in one line (not a library traceback).

:func:`start_run_console` is called by the CLI once its config is valid, before the flow starts.
"""

from __future__ import annotations

import logging
import re
from typing import Any, Callable

from pivotrl.core.errors import PivotRLError


def _strip(record: logging.LogRecord) -> logging.LogRecord:
    exc = record.exc_info[1] if record.exc_info else None
    if isinstance(exc, PivotRLError) and record.name.split(".")[0] in _QUIET:
        record.exc_info = None
        record.exc_text = None
    return record


_QUIET: set[str] = set()


def quiet_stage_tracebacks(logger_names: tuple[str, ...] = ("prefect",)) -> None:
    """Drop the traceback (keep the message) of pivotrl errors logged by ``logger_names`` (and
    their children): a failed stage's reason and the path of its full log are in the message; its
    traceback through Prefect's engine is noise. Works however late Prefect configures its
    logging (it wraps the log record factory); idempotent."""
    if not _QUIET:
        factory = logging.getLogRecordFactory()

        def make(*args: Any, **kwargs: Any) -> logging.LogRecord:
            return _strip(factory(*args, **kwargs))

        logging.setLogRecordFactory(make)
    _QUIET.update(n.split(".")[0] for n in logger_names)


def precision_lines(cfg: Any, *, measure: bool = True) -> list[str]:
    """The precision line of a run, plus a warning (with a measured bf16/fp32 slowdown when
    ``measure``) for an explicit bf16 on a device that emulates it."""
    from pivotrl.runtime.precision import bf16_slowdown, run_precision

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
    from pivotrl.pipeline.processes import StopOnSignal

    StopOnSignal().install()
    for line in precision_lines(cfg):
        echo(line)
    quiet_stage_tracebacks()


#: A library's log record that belongs in the stage log, not on the console: vLLM's own format
#: (``INFO 12-02 15:58:31 [file.py:12] ...``, also behind an engine process's ``(EngineCore pid=N)``
#: prefix) and, in the stage processes' format, another library's INFO/WARNING/DEBUG record
#: (``2026-12-02 15:54:52,288 botocore.credentials INFO ...``).
_LIBRARY_RECORD = re.compile(
    r"^(?:\(\S+ pid=\d+\) )?(?:DEBUG|INFO|WARNING) \d\d-\d\d \d\d:\d\d:\d\d(?:\.\d+)? \["
    r"|^\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d+ (?!pivotrl[.\s])\S+ (?:DEBUG|INFO|WARNING) ")
#: A Python warning (``path.py:12: FutureWarning: ...``); its next line, the source it points at, goes with it.
_PY_WARNING = re.compile(r"^\S+\.py:\d+: \w*Warning: ")


class ConsoleFilter:
    """Which lines of a stage process's output reach the console: everything but other libraries'
    routine log records (vLLM engine start-up, storage clients) and Python warnings, which are kept
    in the stage's log only. Errors, tracebacks, pivotrl's own lines and plain prints stay.

    Call it on each line in order (a warning's source line follows it); True = show it."""

    def __init__(self) -> None:
        self._after_warning = False

    def __call__(self, line: str) -> bool:
        if self._after_warning:
            self._after_warning = False
            if line.startswith((" ", "\t")):
                return False
        if _PY_WARNING.match(line):
            self._after_warning = True
            return False
        return not _LIBRARY_RECORD.match(line)
