"""run.sizing: a slower machine gets a smaller default run, decided by a measured calibration, kept
per machine (stable stage keys), never overriding a size the user set."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from pivotrl.config import config_hash, load_config
from pivotrl.runtime.sizing import REFERENCE, apply_sizing, choose_tier, predict_minutes, sized_config

REPO = Path(__file__).resolve().parents[2]

AVX2_FP32 = 96.0  # best 1-thread 1024x1024 fp32 matmul under the AVX2 imitation (benchmarks/RESULTS.md)


@pytest.fixture(autouse=True)
def _config_cache_dir(monkeypatch):
    """These tests set run.cache_dir; the suite's PIVOTRL_CACHE_DIR would take its place."""
    monkeypatch.delenv("PIVOTRL_CACHE_DIR", raising=False)


def _cfg(tmp_path, *overrides):
    return load_config("configs/default.yaml", [f"run.cache_dir={tmp_path / 'cache'}", *overrides])


def test_prediction_and_tier_follow_the_measured_throughput():
    assert predict_minutes(REFERENCE["gflops"]) == pytest.approx(REFERENCE["minutes"])
    assert choose_tier(REFERENCE["gflops"]) == 1.0 and choose_tier(2 * REFERENCE["gflops"]) == 1.0
    # 2.1x slower: 43 min unscaled (over 40), 30 at half the work, 24 at a quarter
    assert predict_minutes(AVX2_FP32) == pytest.approx(20.1 * 206 / 96)
    assert predict_minutes(AVX2_FP32) > 40 > predict_minutes(AVX2_FP32, 0.5) > predict_minutes(AVX2_FP32, 0.25)
    assert choose_tier(AVX2_FP32) == 0.5
    # 3x slower (e.g. an older core): 60 min unscaled, 42 at half the work, 33 at a quarter
    assert predict_minutes(REFERENCE["gflops"] / 3, 0.5) > 40 > predict_minutes(REFERENCE["gflops"] / 3, 0.25)
    assert choose_tier(REFERENCE["gflops"] / 3) == 0.25
    assert choose_tier(1.0) == 0.25  # nothing fits: the smallest tier, never zero


def test_slow_machine_scales_the_work_sizes_and_keeps_explicit_ones(tmp_path):
    calls = []

    def measure(dtype, threads):
        calls.append((dtype, threads))
        return AVX2_FP32

    cfg = _cfg(tmp_path, "training.max_steps=10")
    sized, s = apply_sizing(cfg, ["run.cache_dir", "training.max_steps"], measure=measure)
    assert (s.mode, s.tier, s.gflops) == ("auto", 0.5, AVX2_FP32) and len(calls) == 1
    assert s.changed == {"warm_start.epochs": [2, 1], "probing.max_states": [160, 80],
                         "quality.out_of_domain_limit": [50, 25]}
    assert s.explicit == ("training.max_steps",) and sized.training.max_steps == 10
    assert (sized.warm_start.epochs, sized.probing.max_states, sized.quality.out_of_domain_limit) == (1, 80, 25)
    assert config_hash(sized) != config_hash(cfg)  # the sizes are part of every stage key
    assert "work x0.5" in s.line() and "probing.max_states 160→80" in s.line()
    # kept per machine: the next run measures nothing and gets the same sizes (same keys)
    again, s2 = apply_sizing(cfg, ["training.max_steps"], measure=lambda *a: pytest.fail("measured twice"))
    assert config_hash(again) == config_hash(sized) and s2.changed == s.changed
    (entry,) = json.loads((tmp_path / "cache" / "calibration.json").read_text()).values()
    assert entry["gflops"] == AVX2_FP32 and entry["threads"] == 1


def test_reference_class_fixed_mode_and_overrides_leave_the_config_alone(tmp_path):
    cfg = _cfg(tmp_path)
    same, s = apply_sizing(cfg, measure=lambda *a: REFERENCE["gflops"])
    assert same == cfg and s.changed is None and s.tier == 1.0 and "sizes fit" in s.line()
    fixed = _cfg(tmp_path, "run.sizing=fixed")
    out, s = apply_sizing(fixed, measure=lambda *a: pytest.fail("fixed measures nothing"))
    assert out == fixed and s.mode == "fixed"
    # every scaled key set explicitly: nothing changes even on a slow machine
    keys = ["warm_start.epochs=2", "probing.max_states=160", "training.max_steps=10", "quality.out_of_domain_limit=50"]
    slow = _cfg(tmp_path / "b", *keys)
    (tmp_path / "b" / "cache").mkdir(parents=True)
    lines = []
    out = sized_config(slow, keys, echo=lines.append)  # measures this machine for real (about a second)
    assert out == slow and lines[0].startswith("sizing: auto, ") and "GFLOP/s measured now" in lines[0]


def test_the_sizing_line_says_whether_the_calibration_was_measured_now_or_read_from_its_file(tmp_path):
    cfg = _cfg(tmp_path)
    _, first = apply_sizing(cfg, measure=lambda *a: AVX2_FP32)
    _, again = apply_sizing(cfg, measure=lambda *a: pytest.fail("measured a second time"))
    calibration = tmp_path / "cache" / "calibration.json"
    assert first.calibration == "measured" and again.calibration == str(calibration)
    assert first.line().startswith("sizing: auto, 96 GFLOP/s measured now (reference class 206)")
    assert again.line().startswith(f"sizing: auto, 96 GFLOP/s read from {calibration} (measured "
                                   f"{first.measured_at}) (reference class 206)")
    assert first.measured_at == again.measured_at


def test_pivotrl_config_shows_the_cache_folder_in_use(tmp_path, monkeypatch):
    """``run.cache_dir`` as configured (what a run reads back), with the folder in use beside it when
    PIVOTRL_CACHE_DIR takes its place (it showed ~/.cache/pivotrl alone before)."""
    from typer.testing import CliRunner

    from pivotrl.flows.cli import app

    args = ["config", "--config", "configs/default.yaml", "--set", "run.sizing=fixed"]
    monkeypatch.setenv("PIVOTRL_CACHE_DIR", str(tmp_path / "env-cache"))
    out = CliRunner().invoke(app, args)
    assert out.exit_code == 0, out.output
    assert (f"  cache_dir: ~/.cache/pivotrl  # in use: {tmp_path / 'env-cache'} (PIVOTRL_CACHE_DIR takes its "
            "place)") in out.output.splitlines()
    monkeypatch.delenv("PIVOTRL_CACHE_DIR")
    out = CliRunner().invoke(app, [*args, "--set", f"run.cache_dir={tmp_path / 'cache'}"])
    assert out.exit_code == 0, out.output
    assert f"  cache_dir: {tmp_path / 'cache'}" in out.output.splitlines()  # the folder in use: no note


def test_smoke_config_is_fixed():
    assert load_config("configs/smoke.yaml").run.sizing == "fixed"


def test_pivotrl_config_prints_the_sized_values_and_why(tmp_path, monkeypatch):
    from typer.testing import CliRunner

    import pivotrl.runtime.sizing as sizing
    from pivotrl.flows.cli import app

    apply_sizing(_cfg(tmp_path), measure=lambda *a: AVX2_FP32)  # this machine's calibration, kept in the cache
    monkeypatch.setattr(sizing, "measure_gflops", lambda *a: pytest.fail("pivotrl config measured again"))
    args = ["config", "--config", "configs/default.yaml", "--set", f"run.cache_dir={tmp_path / 'cache'}",
            "--set", "training.max_steps=10"]
    out = CliRunner().invoke(app, args)
    assert out.exit_code == 0, out.output
    lines = out.output.splitlines()
    assert "  max_states: 80  # scaled from 160: run.sizing auto, work x0.5" in lines
    assert "  epochs: 1  # scaled from 2: run.sizing auto, work x0.5" in lines
    assert "  max_steps: 10  # set explicitly: not scaled" in lines
    # the calibration came from the file, and the line says so (not "measured")
    calibration = tmp_path / "cache" / "calibration.json"
    assert any(line.startswith(f"# sizing: auto, 96 GFLOP/s read from {calibration} (measured 20")
               and "work x0.5" in line for line in lines), lines
    sized, _ = apply_sizing(_cfg(tmp_path, "training.max_steps=10"), ["run.cache_dir", "training.max_steps"])
    assert f"# config hash: {config_hash(sized)} (as configured, before sizing: " in out.output
    # what is printed is what a run reads back
    body = "\n".join(line.split("  #")[0] for line in lines if not line.startswith("#"))
    (tmp_path / "shown.yaml").write_text(body)
    assert config_hash(load_config(str(tmp_path / "shown.yaml"))) == config_hash(sized)


def test_the_default_config_is_found_from_any_directory(tmp_path):
    """``pivotrl config`` without --config, run outside the checkout, reads the embedded default
    config (it printed "config file not found: configs/default.yaml" before)."""
    import subprocess
    import sys

    code = "from pivotrl.flows.cli import main; main()"
    env = {"PATH": "/usr/bin:/bin", "HOME": str(tmp_path), "PIVOTRL_CACHE_DIR": str(tmp_path / "cache")}
    out = subprocess.run([sys.executable, "-c", code, "config", "--set", f"run.cache_dir={tmp_path / 'cache'}",
                          "--set", "run.sizing=fixed"], cwd=tmp_path, env=env, capture_output=True, text=True,
                         timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    shown = "\n".join(line.split("  #")[0] for line in out.stdout.splitlines() if not line.startswith("#"))
    (tmp_path / "shown.yaml").write_text(shown)
    want = load_config(str(REPO / "configs" / "default.yaml"), [f"run.cache_dir={tmp_path / 'cache'}", "run.sizing=fixed"])
    assert config_hash(load_config(str(tmp_path / "shown.yaml"))) == config_hash(want)


def test_pivotrl_config_stops_on_a_missing_model_or_demonstration_file(tmp_path):
    """``pivotrl config`` checks what ``pivotrl run`` checks before Prefect starts (the storage root
    apart): a local model and every local chat source must exist; exit 2 with a one-line reason."""
    from typer.testing import CliRunner

    from pivotrl.flows.cli import app

    base = ["config", "--set", f"run.cache_dir={tmp_path / 'cache'}", "--set", "run.sizing=fixed"]
    demos = tmp_path / "demos.jsonl"
    out = CliRunner().invoke(app, [*base, "--set", f"data.sources=[{{kind: bfcl, categories: [multi_turn_base]}}, {{kind: chat, url: {demos}}}]"])
    assert out.exit_code == 2 and f"data error: data.sources[1] (chat): {demos}: no such file" in out.output
    out = CliRunner().invoke(app, [*base, "--set", f"data.sources=[{{kind: chat, url: 'file://{tmp_path}'}}]"])
    assert out.exit_code == 2 and "is a directory, not a file" in out.output
    out = CliRunner().invoke(app, [*base, "--set", f"model.source={tmp_path / 'no-model'}"])
    assert out.exit_code == 2 and "model error: model source" in out.output and "make smoke" not in out.output
    # every missing input at once: the model and each missing chat file, one a line
    out = CliRunner().invoke(app, [*base, "--set", f"model.source={tmp_path / 'runs/models/tiny'}", "--set",
                                   f"data.sources=[{{kind: chat, url: {tmp_path / 'a.jsonl'}}}, "
                                   f"{{kind: chat, url: {tmp_path / 'b.jsonl'}}}]"])
    assert out.exit_code == 2
    assert "model error: model source" in out.output and "created by `make smoke`" in out.output
    assert f"data error: data.sources[0] (chat): {tmp_path / 'a.jsonl'}: no such file" in out.output
    assert f"data error: data.sources[1] (chat): {tmp_path / 'b.jsonl'}: no such file" in out.output
    demos.write_text("")
    out = CliRunner().invoke(app, [*base, "--set", f"data.sources=[{{kind: chat, url: {demos}}}, "
                                                   "{kind: chat, url: 's3://bucket/demos.jsonl'}]"])
    assert out.exit_code == 0, out.output  # a remote source is checked when the demonstrations stage reads it


def test_the_cache_dir_environment_variable_holds_the_calibration_the_trainer_reads(tmp_path, monkeypatch):
    from pivotrl.runtime.mfu import calibrated_peak_gflops

    env_cache = tmp_path / "env-cache"
    monkeypatch.setenv("PIVOTRL_CACHE_DIR", str(env_cache))
    cfg = _cfg(tmp_path)
    assert cfg.run.local_cache() == env_cache  # the variable takes run.cache_dir's place, as for models and data
    apply_sizing(cfg, measure=lambda *a: AVX2_FP32)
    assert not (tmp_path / "cache" / "calibration.json").exists()
    (entry,) = json.loads((env_cache / "calibration.json").read_text()).values()
    assert entry["gflops"] == AVX2_FP32
    # the warm start and the trainer read their MFU peak from the same file (no second measurement)
    peak = calibrated_peak_gflops(entry["dtype"], str(cfg.run.local_cache()),
                                  measure=lambda *a: pytest.fail("measured a second calibration"))
    assert peak == AVX2_FP32
    monkeypatch.delenv("PIVOTRL_CACHE_DIR")
    assert cfg.run.local_cache() == tmp_path / "cache"


def test_pivotrl_config_names_a_cache_folder_it_cannot_write_in_one_line(tmp_path, monkeypatch):
    from typer.testing import CliRunner

    import pivotrl.runtime.sizing as sizing
    from pivotrl.flows.cli import app

    blocker = tmp_path / "not-a-folder"
    blocker.write_text("x\n", encoding="utf-8")
    monkeypatch.setenv("PIVOTRL_CACHE_DIR", str(blocker / "cache"))
    monkeypatch.setattr(sizing, "measure_gflops", lambda *a: pytest.fail("measured before the cache was checked"))
    out = CliRunner().invoke(app, ["config", "--config", "configs/default.yaml"])
    assert out.exit_code == 2, out.output
    assert out.output.strip() == (f"storage error: cache folder {blocker / 'cache'}: {blocker} is a file, not a "
                                  "directory; set run.cache_dir (or PIVOTRL_CACHE_DIR, which takes its place) to "
                                  "another folder or move the file")
