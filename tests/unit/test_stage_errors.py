"""A failing stage is told in one line with the path of its full log; the start, end and elapsed
time of each stage are printed; pivotrl errors lose their traceback in Prefect's console log."""

from __future__ import annotations

import io
import logging

import pytest

from pivotrl.config import load_config
from pivotrl.pipeline.entry import StageError, _error_line, announce, run_stage_process


def test_a_failing_stage_process_gives_one_line_and_its_log(tmp_path, capsys):
    cfg = load_config("configs/smoke.yaml", [f"run.storage_root={tmp_path / 'runs'}",
                                             f"model.source={tmp_path / 'no-such-model'}"])
    config = cfg.model_dump(mode="json")
    with pytest.raises(StageError) as e:
        run_stage_process("reference", config, {"demos": {"key": "x"}}, threads=1)
    first, second = str(e.value).splitlines()
    assert first.startswith("stage 'reference' failed (exit code 3): ModelError: ") and "no-such-model" in first
    assert second.startswith("full log: ") and e.value.permanent
    log = second.removeprefix("full log: ")
    assert log.startswith(str(tmp_path / "runs" / "logs")) and "ModelError" in open(log).read()
    out = capsys.readouterr().out
    assert "[pivotrl] stage reference: started (log: " in out and "[pivotrl] stage reference: failed after" in out
    assert "precision: fp32 compute (fp32: set explicitly)" in out


def test_announce_prints_start_end_and_elapsed(capsys):
    with announce("demonstrations"):
        pass
    assert capsys.readouterr().out.splitlines() == ["[pivotrl] stage demonstrations: started",
                                                    "[pivotrl] stage demonstrations: finished in 0s"]


def test_error_line_prefers_the_stage_message_then_the_traceback_last_line():
    assert _error_line("probe", ["x\n", "2026 pivotrl.pipeline ERROR stage probe failed: DataError: bad row 3\n"]) \
        == "DataError: bad row 3"
    tb = ["Traceback (most recent call last):\n", '  File "a.py", line 1\n', "RuntimeError: engine died\n"]
    assert _error_line("probe", tb) == "RuntimeError: engine died"
    assert _error_line("probe", []) == "no output"


def test_prefect_console_keeps_the_message_and_drops_the_traceback():
    from pivotrl.pipeline.console import quiet_stage_tracebacks

    stream = io.StringIO()
    logger = logging.getLogger("pivotrl_test_console.task_runs")  # configured later than the call
    quiet_stage_tracebacks(("pivotrl_test_console",))
    handler = logging.StreamHandler(stream)
    logger.addHandler(handler)
    try:
        try:
            raise StageError("stage 'probe' failed (exit code 3): DataError: x\nfull log: /l", permanent=True)
        except StageError:
            logger.error("Task run failed with exception", exc_info=True)
        try:
            raise ValueError("a bug")
        except ValueError:
            logger.error("other failure", exc_info=True)
        try:
            raise StageError("elsewhere", permanent=True)
        except StageError:
            logging.getLogger("pivotrl_other").addHandler(handler)
            logging.getLogger("pivotrl_other").error("kept", exc_info=True)
    finally:
        logger.removeHandler(handler)
        logging.getLogger("pivotrl_other").removeHandler(handler)
    text = stream.getvalue()
    assert "Task run failed with exception\n" in text and text.count("Traceback") == 2
    assert "a bug" in text and "StageError: elsewhere" in text  # other loggers keep their tracebacks


def test_stage_processes_name_the_cpu_accelerator_so_deepspeed_does_not_warn():
    """Without CUDA a stage process sets DS_ACCELERATOR=cpu (inherited by its torchrun ranks), so
    DeepSpeed's "unable to detect" accelerator warning is not printed in every stage."""
    import os
    import subprocess
    import sys

    import torch

    code = ("from pivotrl.pipeline.entry import _name_cpu_accelerator as f; f(); import os; "
            "from deepspeed.accelerator import get_accelerator; get_accelerator(); "
            "print(os.environ.get('DS_ACCELERATOR'))")
    env = {k: v for k, v in os.environ.items() if k != "DS_ACCELERATOR"}
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    if torch.cuda.is_available():  # pragma: no cover - GPU machines: DeepSpeed detects CUDA itself
        assert out.stdout.strip().splitlines()[-1] == "None"
    else:
        assert out.stdout.strip().splitlines()[-1] == "cpu"
        assert "unable to detect" not in out.stdout + out.stderr


def test_a_deepspeed_accelerator_the_user_set_is_kept(monkeypatch):
    import os

    from pivotrl.pipeline.entry import _name_cpu_accelerator

    monkeypatch.setenv("DS_ACCELERATOR", "cuda")
    _name_cpu_accelerator()
    assert os.environ["DS_ACCELERATOR"] == "cuda"
