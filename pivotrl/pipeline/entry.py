"""Process entry point of a pipeline stage: ``python -m pivotrl.pipeline.entry STAGE --spec FILE``.

The spec is a JSON file ``{"config": <RunConfig as JSON>, "inputs": {...}, "output": <path>,
"attempt": <int, optional>}``; the stage's result dict is written as JSON to ``output`` (atomically).
``attempt`` (0 for the first run of a stage, 1 for its first retry...) seeds the injected storage
faults (``faults.storage_failure_rate``) so that a retried stage does not fail at the same writes. Heavy stages run in their
own process so that the rollout engine, the trainer and their memory live and die with the stage.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

from pivotrl.errors import ConfigError, DataError, ModelError, PivotRLError, TrainingError

#: Stages of ``pivotrl compare`` (pivotrl.pipeline.compare / compare_eval), run the same way.
COMPARE_STAGES = ("sft_baseline", "e2e_baseline", "compare_evaluate")
STAGES = ("reference", "probe", "train", "evaluate") + COMPARE_STAGES

#: Exit code of a stage process that failed for a reason a retry cannot fix (bad config or data,
#: an unreadable model, a broken training invariant).
PERMANENT_FAILURE_EXIT = 3


class StageError(PivotRLError, RuntimeError):
    """A stage process failed. ``permanent``: retrying cannot help (see PERMANENT_FAILURE_EXIT)."""

    def __init__(self, message: str, *, permanent: bool) -> None:
        super().__init__(message)
        self.permanent = permanent


def is_permanent(exc: BaseException) -> bool:
    """True for failures a retry cannot fix: config, data, model and training-invariant errors,
    and stage processes that exited with PERMANENT_FAILURE_EXIT. Storage, tool and verifier
    failures (and crashes) are transient."""
    if isinstance(exc, StageError):
        return exc.permanent
    return isinstance(exc, (ConfigError, DataError, ModelError, TrainingError))


def run_stage(stage: str, config: dict[str, Any], inputs: dict[str, Any], *, attempt: int = 0) -> dict[str, Any]:
    """Run ``stage`` in this process and return its result dict.

    The store is the run's (``pivotrl.pipeline.common.make_store``: storage faults of
    ``faults.storage_failure_rate`` seeded by ``run.seed`` and ``attempt``, writes retried).
    Raises ConfigError for an invalid config (naming the key) or an unknown stage.
    """
    from pivotrl.config import parse_config
    from pivotrl.errors import ConfigError
    from pivotrl.pipeline import stages
    from pivotrl.pipeline.common import make_store

    if stage not in STAGES:
        raise ConfigError(f"unknown stage {stage!r}; valid: {', '.join(STAGES)}")
    cfg = parse_config(config, source=f"the {stage} stage spec")
    store = make_store(cfg, attempt=attempt)
    if stage == "reference":
        return stages.stage_reference(cfg, store, inputs["demos"])
    if stage == "probe":
        return stages.stage_probe(cfg, store, inputs["demos"], inputs["reference"])
    if stage == "train":
        return stages.stage_train(cfg, store, inputs["probe"], inputs["reference"])
    if stage == "evaluate":
        return stages.stage_evaluate(cfg, store, inputs["demos"], inputs["reference"], inputs["probe"], inputs["train"])
    if stage in COMPARE_STAGES:
        from pivotrl.pipeline.compare_eval import run_compare_stage

        return run_compare_stage(stage, cfg, store, inputs)
    raise ConfigError(f"unknown stage {stage!r}; valid: {', '.join(STAGES)}")


def run_stage_process(stage: str, config: dict[str, Any], inputs: dict[str, Any], *, threads: int = 2,
                      env: dict[str, str] | None = None, attempt: int = 0) -> dict[str, Any]:
    """Run ``stage`` in a child process (same interpreter); raise RuntimeError with the exit code
    (negative: the signal that killed it) and the last lines of its output if it fails. Output is
    streamed to this process's stdout. ``attempt``: see :func:`run_stage`."""
    with tempfile.TemporaryDirectory(prefix=f"pivotrl-{stage}-") as tmp:
        spec = Path(tmp) / "spec.json"
        out = Path(tmp) / "result.json"
        spec.write_text(json.dumps({"config": config, "inputs": inputs, "output": str(out), "attempt": attempt}))
        # A process group of this process (if any) is not the child's: drop launcher variables.
        launcher_vars = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")
        child_env = {**{k: v for k, v in os.environ.items() if k not in launcher_vars},
                     "OMP_NUM_THREADS": str(threads), **(env or {})}
        proc = subprocess.Popen([sys.executable, "-m", "pivotrl.pipeline.entry", stage, "--spec", str(spec)],
                                stdout=subprocess.PIPE, stderr=subprocess.STDOUT, env=child_env, text=True)
        tail: list[str] = []
        assert proc.stdout is not None
        for line in proc.stdout:
            sys.stdout.write(line)
            tail = (tail + [line])[-30:]
        rc = proc.wait()
        if rc != 0 or not out.exists():
            raise StageError(f"stage {stage!r} failed with exit code {rc}; last output:\n{''.join(tail)}",
                             permanent=rc == PERMANENT_FAILURE_EXIT)
        return json.loads(out.read_text())


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m pivotrl.pipeline.entry")
    ap.add_argument("stage", choices=STAGES)
    ap.add_argument("--spec", required=True)
    a = ap.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    spec = json.loads(Path(a.spec).read_text())
    try:
        result = run_stage(a.stage, spec["config"], spec["inputs"], attempt=int(spec.get("attempt", 0)))
    except PivotRLError as exc:
        logging.getLogger("pivotrl.pipeline").error("stage %s failed: %s: %s", a.stage, type(exc).__name__, exc)
        if is_permanent(exc):
            return PERMANENT_FAILURE_EXIT
        raise
    write_result(spec["output"], result)
    return 0


def write_result(path: str, result: dict[str, Any]) -> None:
    """Write a stage's result dict as JSON to ``path`` atomically (temp file, then rename)."""
    tmp = Path(path + ".tmp")
    tmp.write_text(json.dumps(result, default=str))
    tmp.replace(path)


if __name__ == "__main__":
    sys.exit(main())
