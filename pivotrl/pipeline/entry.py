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
import time
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Iterator

from pivotrl.config.sections import local_cache_dir
from pivotrl.core.errors import (
    ConfigError, DataError, ModelError, PivotRLError, StorageAccessError, StorageError, TrainingError,
)
from pivotrl.pipeline.console import ConsoleFilter
from pivotrl.pipeline.evaluate_stage import eval_shard
from pivotrl.pipeline.probe_stage import probe_shard
from pivotrl.pipeline.registry import STAGES as REGISTRY
from pivotrl.pipeline.registry import run_stage_fn
from pivotrl.storage.files import atomic_file

#: What a stage process runs: every stage of :data:`pivotrl.pipeline.registry.STAGES`, and one
#: shard of a sharded stage (``probe_shard``, ``eval_shard``).
SHARD_STAGES = ("probe_shard", "eval_shard")
STAGES = tuple(REGISTRY) + SHARD_STAGES

#: Exit code of a stage process that failed for a reason a retry cannot fix (bad config or data,
#: an unreadable model, a broken training invariant).
PERMANENT_FAILURE_EXIT = 3
#: Exit code of a stage process whose store gave up on a storage operation after its own retries
#: (its RetryPolicy): the stage's task does not retry it again.
STORAGE_FAILURE_EXIT = 4


class StageError(PivotRLError, RuntimeError):
    """A stage process failed. ``permanent``: retrying cannot help (see PERMANENT_FAILURE_EXIT);
    ``storage``: the store failed after its own retries (see STORAGE_FAILURE_EXIT)."""

    def __init__(self, message: str, *, permanent: bool, storage: bool = False) -> None:
        super().__init__(message)
        self.permanent = permanent
        self.storage = storage


def is_permanent(exc: BaseException) -> bool:
    """True for failures a retry cannot fix: config, data, model and training-invariant errors,
    a store that refuses access (StorageAccessError), and stage processes that exited with
    PERMANENT_FAILURE_EXIT. Other storage, tool and verifier
    failures (and crashes) are transient."""
    if isinstance(exc, StageError):
        return exc.permanent
    return isinstance(exc, (ConfigError, DataError, ModelError, TrainingError, StorageAccessError))


def retried_by_task(exc: BaseException) -> bool:
    """True for a failure a stage's (or shard's) Prefect task retries: a crashed or failed stage
    process. Never a permanent failure (:func:`is_permanent`), nor a storage error: the store
    retried that already under its own policy, and a retry here would multiply its attempts."""
    if isinstance(exc, StageError):
        return not (exc.permanent or exc.storage)
    return not (is_permanent(exc) or isinstance(exc, StorageError))


def run_stage(stage: str, config: dict[str, Any], inputs: dict[str, Any], *, attempt: int = 0) -> dict[str, Any]:
    """Run ``stage`` in this process and return its result as a dict (a stage's typed result,
    :mod:`pivotrl.pipeline.results`, through its ``to_dict``).

    The store is the run's (``pivotrl.pipeline.common.make_store``: storage faults of
    ``faults.storage_failure_rate`` seeded by ``run.seed`` and ``attempt``, writes retried).
    ``model.dtype: auto`` is resolved here (pivotrl.runtime.precision): the stage computes, keys and
    records its artifacts in the resolved dtype, and every manifest it writes carries the
    resolution (``extra.precision``: requested, dtype, reason).
    Raises ConfigError for an invalid config (naming the key) or an unknown stage.
    """
    from pivotrl.config import parse_config
    from pivotrl.core.errors import ConfigError
    from pivotrl.pipeline.common import make_store
    from pivotrl.runtime.precision import run_precision, with_resolved_dtype

    if stage not in STAGES:
        raise ConfigError(f"unknown stage {stage!r}; valid: {', '.join(STAGES)}")
    cfg = parse_config(config, source=f"the {stage} stage spec")
    precision = run_precision(cfg)
    import torch

    logging.getLogger("pivotrl.pipeline").info("%s stage, %s, %d torch threads", stage, precision.line(),
                                               torch.get_num_threads())
    cfg = with_resolved_dtype(cfg)
    from pivotrl.pipeline.demos import cache_dir
    from pivotrl.pipeline.tempdirs import remove_stale_tempdirs

    if cache_dir(cfg).is_dir():  # work folders of stages killed before they removed them
        for path in remove_stale_tempdirs(cache_dir(cfg)):
            logging.getLogger("pivotrl.pipeline").info("removed the work folder of a stopped stage: %s", path)
    store = make_store(cfg, attempt=attempt)
    store.manifest_extra = {"precision": precision.record()}
    if stage == "probe_shard":
        return probe_shard(cfg, store, inputs["demos"], inputs["reference"], inputs["shard"])
    if stage == "eval_shard":
        return eval_shard(cfg, store, *(inputs[k] for k in ("demos", "reference", "probe", "train")), inputs["shard"])
    result = run_stage_fn(stage, cfg, store, inputs)
    return result.to_dict() if hasattr(result, "to_dict") else result


def stage_log_path(config: dict[str, Any], stage: str) -> Path:
    """Where a stage process's full output is kept: ``<run.storage_root>/logs/`` for a local root,
    else ``<run.cache_dir>/logs/`` (``$PIVOTRL_CACHE_DIR`` in its place when set); one file per stage run, ``<run.name>-<stage>-<UTC time>.log``."""
    run = config.get("run", {})
    root = str(run.get("storage_root", "runs"))
    local = "://" not in root or root.startswith("file://")
    base = Path(os.path.expanduser(root.removeprefix("file://"))) if local else \
        local_cache_dir(str(run.get("cache_dir", "~/.cache/pivotrl")))
    stamp = time.strftime("%Y%m%dT%H%M%SZ", time.gmtime())
    return (base / "logs" / f"{run.get('name', 'run')}-{stage}-{stamp}.log").absolute()


def _say(line: str) -> None:
    sys.stdout.write(f"[pivotrl] {line}\n")
    sys.stdout.flush()


@contextmanager
def announce(stage: str, log_path: Path | None = None) -> Iterator[None]:
    """Print a stage's start, and its end with the elapsed time (or that it failed)."""
    from pivotrl.core.progress import format_duration

    t0 = time.monotonic()
    _say(f"stage {stage}: started" + (f" (log: {log_path})" if log_path else ""))
    try:
        yield
    except BaseException:
        _say(f"stage {stage}: failed after {format_duration(time.monotonic() - t0)}")
        raise
    _say(f"stage {stage}: finished in {format_duration(time.monotonic() - t0)}")


def _error_line(stage: str, tail: list[str]) -> str:
    """The one line that says why a stage failed: its own "stage X failed: ..." log line, else the
    last line of a traceback, else the last line it printed."""
    marker = f"stage {stage} failed: "
    for line in reversed(tail):
        if marker in line:
            return line.split(marker, 1)[1].strip()
    lines = [t.strip() for t in tail if t.strip()]
    for line in reversed(lines):
        if line.startswith("Traceback"):
            break
        if ("Error" in line or "Exception" in line) and not line.startswith(("File ", "^")):
            return line
    return lines[-1] if lines else "no output"


def run_stage_process(stage: str, config: dict[str, Any], inputs: dict[str, Any], *, threads: int = 2,
                      env: dict[str, str] | None = None, attempt: int = 0) -> dict[str, Any]:
    """Run ``stage`` in a child process (same interpreter) and return its result dict.

    The child leads its own session and process group (a Ctrl-C reaches the CLI, which stops the
    whole tree: pivotrl.pipeline.processes) and kills its group if this process dies. Its output is
    streamed to this process's stdout (other libraries' routine log records and Python warnings
    excepted: :class:`pivotrl.pipeline.console.ConsoleFilter`) and kept in full in :func:`stage_log_path`; start, end and
    elapsed time are printed. A failure raises StageError with the exit code (negative: the signal
    that killed it), the one-line reason and the log's path. ``attempt``: see :func:`run_stage`.
    """
    log_path = stage_log_path(config, stage)
    log_path.parent.mkdir(parents=True, exist_ok=True)
    from pivotrl.pipeline.processes import StopChildOnInterrupt, child_lines, wait_child
    from pivotrl.pipeline.tempdirs import stage_tempdir

    # The spec (the whole config) and the result live in a temporary directory removed on success,
    # failure, KeyboardInterrupt and a stop by the CLI's signal handler (tempdirs.stage_tempdir).
    # A Ctrl-C without the CLI's handler stops the child wherever it lands, even mid-Popen
    # (processes.StopChildOnInterrupt), and ends in KeyboardInterrupt once the child is gone. The
    # output is read in short select slices (processes.child_lines): a blocking read would keep a
    # SIGINT that lands just before it from being handled until the child prints again.
    with (StopChildOnInterrupt() as interrupt, stage_tempdir(stage) as tmp, announce(stage, log_path),
          open(log_path, "w", encoding="utf-8") as log_file):
        spec = tmp / "spec.json"
        out = tmp / "result.json"
        spec.write_text(json.dumps({"config": config, "inputs": inputs, "output": str(out), "attempt": attempt}))
        # A process group of this process (if any) is not the child's: drop launcher variables.
        launcher_vars = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")
        child_env = {**{k: v for k, v in os.environ.items() if k not in launcher_vars},
                     "OMP_NUM_THREADS": str(threads), "PYTHONUNBUFFERED": "1", **(env or {})}
        # Model-loading progress bars of every checkpoint load would drown the stage's own lines
        # (HF_HUB_DISABLE_PROGRESS_BARS=0 brings them back).
        child_env.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")
        proc = subprocess.Popen([sys.executable, "-m", "pivotrl.pipeline.entry", stage, "--spec", str(spec)],
                                stdout=subprocess.PIPE, stderr=subprocess.STDOUT, env=child_env, text=True,
                                start_new_session=True)
        interrupt.watch(proc.pid)
        tail: list[str] = []
        shown = ConsoleFilter()  # engine start-up and library warnings: in the log only
        try:
            for line in child_lines(proc):
                if shown(line):
                    sys.stdout.write(line)
                log_file.write(line)
                log_file.flush()
                tail = (tail + [line])[-60:]
            rc = wait_child(proc)
        except BaseException:  # interrupted here (not through the CLI's handler): stop the stage
            from pivotrl.pipeline.processes import descendants, stop_tree

            stop_tree([p for p in descendants() if p.pid == proc.pid] + descendants(proc.pid), grace_s=3.0)
            raise
        if rc != 0 or not out.exists():
            raise StageError(f"stage {stage!r} failed (exit code {rc}): {_error_line(stage, tail)}\n"
                             f"full log: {log_path}", permanent=rc == PERMANENT_FAILURE_EXIT,
                             storage=rc == STORAGE_FAILURE_EXIT)
        return json.loads(out.read_text())


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m pivotrl.pipeline.entry")
    ap.add_argument("stage", choices=STAGES)
    ap.add_argument("--spec", required=True)
    a = ap.parse_args(argv)
    from pivotrl.pipeline.processes import watch_parent

    watch_parent()  # no stage outlives the process that started it
    _name_cpu_accelerator()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    spec = json.loads(Path(a.spec).read_text())
    try:
        result = run_stage(a.stage, spec["config"], spec["inputs"], attempt=int(spec.get("attempt", 0)))
    except PivotRLError as exc:
        logging.getLogger("pivotrl.pipeline").error("stage %s failed: %s: %s", a.stage, type(exc).__name__, exc)
        if is_permanent(exc):
            return PERMANENT_FAILURE_EXIT
        if isinstance(exc, StorageError):
            return STORAGE_FAILURE_EXIT
        raise
    write_result(spec["output"], result)
    return 0


def _name_cpu_accelerator() -> None:
    """Without CUDA, tell DeepSpeed (here and in the stage's torchrun ranks, by environment) that
    its accelerator is the CPU: detecting it, DeepSpeed warns in every process that it was "unable
    to detect" a GPU. A ``DS_ACCELERATOR`` already set is kept."""
    if "DS_ACCELERATOR" in os.environ:
        return
    import torch

    if not torch.cuda.is_available():
        os.environ["DS_ACCELERATOR"] = "cpu"


def write_result(path: str, result: dict[str, Any]) -> None:
    """Write a stage's result dict as JSON to ``path`` atomically (temp file, then rename)."""
    with atomic_file(path) as tmp:
        tmp.write_text(json.dumps(result, default=str))


if __name__ == "__main__":
    sys.exit(main())
