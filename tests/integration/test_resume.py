"""Kill and resume the PivotRL training stage: nothing lost, nothing counted twice.

The smoke setup (configs/smoke.yaml, the tiny model) runs demonstrations → reference → probe →
train in a child process with ``faults.kill_trainer_at_step=1`` and a checkpoint after every step:
the trainer SIGKILLs its own process at the start of step 2 (index 1). The same command run again
must resume from the last complete checkpoint and end with the metrics and weights of an
uninterrupted run in a separate storage root (which, for good measure, runs with 20% injected
storage-write faults: each failed write is retried and publishes nothing half-written).
"""

from __future__ import annotations

import re

import json
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pandas as pd
import pytest

# Several processes each (launchers, stage subprocesses, benchmark scripts): not in `make test-fast`.
pytestmark = pytest.mark.integration

REPO = Path(__file__).resolve().parents[2]

CHILD = textwrap.dedent(
    """
    import json, logging, sys
    from pivotrl.config import load_config
    from pivotrl.pipeline import stages
    from pivotrl.pipeline.common import make_store
    from pivotrl.pipeline.demos import build_demonstrations

    if __name__ == "__main__":
        logging.basicConfig(level=logging.INFO, format="%(name)s %(levelname)s %(message)s")
        cfg = load_config(sys.argv[1], sys.argv[2:])
        store = make_store(cfg)
        demos = build_demonstrations(cfg, store)
        ref = stages.stage_reference(cfg, store, demos)
        probe = stages.stage_probe(cfg, store, demos, ref)
        train = stages.stage_train(cfg, store, probe, ref)
        print("RESULT " + json.dumps({"train": train.to_dict(), "pivots": probe.stats["total"]["kept"]}, default=str))
    """
)

#: metrics that measure time, not training
TIMING = ("step_time_s", "tokens_per_s", "rollout_s", "trainer_s", "policy_tokens_per_s", "ref_tokens_per_s",
          "mfu", "refresh_s")
#: The rollout engine's generation wall time and what derives from it, under any prefix (gen_s,
#: heldout_gen_mfu, heldout_before_gen_tokens_per_s...: pivotrl.runtime.generation).
GENERATION_TIMING = re.compile(r"gen_(s|tokens_per_s|mfu)$")


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    from pivotrl.testing import save_tiny_checkpoint

    base = tmp_path_factory.mktemp("resume")
    model = save_tiny_checkpoint(base / "tiny")
    script = base / "child.py"
    script.write_text(CHILD)
    return base, model, script


def run_child(setup, root: str, *overrides: str) -> tuple[subprocess.CompletedProcess, float]:
    base, model, script = setup
    args = [sys.executable, str(script), "configs/smoke.yaml", f"run.storage_root={base / root}",
            f"model.source={model}", "training.max_steps=3", "training.epochs=3", "training.checkpoint_every=1",
            *overrides]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO)}
    t0 = time.monotonic()
    proc = subprocess.run(args, cwd=REPO, env=env, capture_output=True, text=True, timeout=900)
    return proc, time.monotonic() - t0


def result_of(proc: subprocess.CompletedProcess) -> dict:
    lines = [x for x in proc.stdout.splitlines() if x.startswith("RESULT ")]
    assert proc.returncode == 0 and len(lines) == 1, proc.stderr[-3000:]
    return json.loads(lines[0][len("RESULT "):])


def test_a_killed_training_stage_resumes_to_the_uninterrupted_result(setup):
    from pivotrl.runtime.models import checkpoint_hash

    base = setup[0]
    kill = "faults.kill_trainer_at_step=1"
    killed, t_killed = run_child(setup, "interrupted", kill)
    assert killed.returncode == -signal.SIGKILL, killed.stderr[-3000:]
    (tkey_dir,) = (base / "interrupted" / "train").iterdir()
    tkey = f"train/{tkey_dir.name}"
    assert (tkey_dir / "faults" / "killed-at-1").exists()
    # Only step 1 was published completely; no final metrics or summary exist yet.
    ckpts = tkey_dir / "checkpoints"
    assert {p.relative_to(ckpts).parts[0] for p in ckpts.rglob("_COMPLETE")} == {"step-000001"}
    assert not (tkey_dir / "metrics.parquet").exists() and not (tkey_dir / "summary.json").exists()

    resumed, t_resumed = run_child(setup, "interrupted", kill)  # the same command again
    res = result_of(resumed)
    assert f"resuming PivotRL training from {tkey}/checkpoints/step-000001 (step 1)" in resumed.stderr
    # The uninterrupted run also survives injected storage faults (every write is retried).
    straight, t_straight = run_child(setup, "uninterrupted", "faults.storage_failure_rate=0.2")
    ref = result_of(straight)
    write_retries = straight.stderr.count("injected storage fault")
    assert write_retries > 0

    assert res["pivots"] == ref["pivots"] >= 2 and res["train"]["train_key"] == ref["train"]["train_key"] == tkey
    assert res["train"]["summary"]["steps"] == ref["train"]["summary"]["steps"] == 3
    a = pd.read_parquet(base / "interrupted" / tkey / "metrics.parquet")
    b = pd.read_parquet(base / "uninterrupted" / tkey / "metrics.parquet")
    assert list(a["step"]) == list(b["step"]) == [1, 2, 3]  # no step lost, none counted twice
    assert list(a.columns) == list(b.columns)
    cols = [c for c in a.columns if c not in TIMING and not GENERATION_TIMING.search(c)]
    pd.testing.assert_frame_equal(a[cols], b[cols], rtol=1e-6, atol=1e-7)
    # Same pivot batches (sizes and rewards per step) and bitwise the same final weights.
    assert list(a["pivots"]) == list(b["pivots"]) and list(a["reward_mean"]) == list(b["reward_mean"])
    assert checkpoint_hash(base / "interrupted" / tkey / "policy") == checkpoint_hash(base / "uninterrupted" / tkey / "policy")
    print(f"\nkilled run {t_killed:.1f} s, resumed {t_resumed:.1f} s, uninterrupted {t_straight:.1f} s; "
          f"pivots {ref['pivots']}, reward_mean per step {list(a['reward_mean'])}, "
          f"{write_retries} storage write retries")
    leftovers = [p for r in ("interrupted", "uninterrupted") for p in (base / r / ".tmp").rglob("*") if p.is_file()]
    assert leftovers == []
