"""Progress lines: format, ETA, heartbeat while an item takes long."""

from __future__ import annotations

import time

from pivotrl.core.progress import Progress, format_duration, progress_line


def test_format_duration():
    assert [format_duration(s) for s in (0, 42, 75, 3599, 3725)] == ["0s", "42s", "1m15s", "59m59s", "1h02m"]


def test_progress_line_gives_counts_percent_counters_and_eta():
    line = progress_line("warm start", 10, 40, "micro-batches", 60.0, {"tokens": 12_345})
    assert line == "warm start: 10/40 micro-batches (25%), 12.3k tokens, elapsed 1m00s, ETA 3m00s"
    assert progress_line("probing", 0, 16, "states", 5.0).endswith("ETA unknown")
    assert progress_line("x", 3, None, "items", 1.0) == "x: 3 items, elapsed 1s"


def test_lines_at_start_at_least_every_interval_and_at_end():
    lines: list[str] = []
    with Progress("probing", 4, "states", interval_s=0.2, emit=lines.append) as p:
        assert lines == ["probing: 0/4 states (0%), elapsed 0s, ETA unknown"]
        time.sleep(0.7)  # one slow item: the heartbeat still reports
        deadline = time.monotonic() + 10  # on loaded cores the heartbeat thread may run late
        while len(lines) < 3 and time.monotonic() < deadline:
            time.sleep(0.05)
        assert len(lines) >= 3
        p.update(2)
        p.update(2)
    assert lines[-1].startswith("probing: 4/4 states (100%)")


def test_disabled_progress_is_silent_and_close_stops_the_heartbeat():
    lines: list[str] = []
    with Progress("t", 2, "u", interval_s=0.05, emit=lines.append, enabled=False) as p:
        p.update(2)
    assert lines == []
    p2 = Progress("t", 2, "u", interval_s=0.05, emit=lines.append).__enter__()
    p2.close()
    n = len(lines)
    time.sleep(0.2)
    assert len(lines) == n == 1


def test_the_console_shows_the_stage_and_keeps_library_chatter_in_the_log():
    """A stage process's output on the console: pivotrl's lines, prints, errors and tracebacks;
    vLLM's engine start-up records, other libraries' routine records and Python warnings go to the
    stage's log only (the lines below are as vLLM, botocore and Python write them)."""
    from pivotrl.pipeline.console import ConsoleFilter

    lines = {
        "INFO 12-02 15:58:31 [__init__.py:216] Automatically detected platform cpu.\n": False,
        "(EngineCore_DP0 pid=4242) WARNING 12-02 15:58:40 [cpu.py:120] may crash or produce incorrect outputs\n": False,
        "2026-12-02 15:54:52,288 aiobotocore.credentials INFO Found credentials in environment variables.\n": False,
        "/x/torch/distributed/c10d.py:85: FutureWarning: `torch.distributed.reduce_op` is deprecated\n": False,
        "  warnings.warn(\n": False,
        "2026-12-02 15:55:07,597 pivotrl.core.progress INFO probing: 8/16 states (50%), ETA 20s\n": True,
        "[pivotrl] stage probe: started\n": True,
        "ERROR 12-02 15:58:41 [core.py:700] EngineCore failed to start.\n": True,
        "Traceback (most recent call last):\n": True,
        "  File \"x.py\", line 3, in <module>\n": True,
        "2026-12-02 15:55:07,597 botocore.retries ERROR giving up\n": True,
    }
    shown = ConsoleFilter()
    assert {line: shown(line) for line in lines} == lines
