"""Orchestration cost and memory of the nightly flow: Prefect overhead, reused re-run, peak RSS per stage.

Usage::

    python benchmarks/bench_pipeline.py [--config configs/smoke.yaml] [--model DIR] [--root DIR]
                                        [--set KEY=VALUE ...] [--json OUT] [--quick]

Runs ``pivotrl.flows.nightly.nightly`` twice on the same storage root (default: the smoke config
with the tiny random model of ``pivotrl.testing.save_tiny_checkpoint``, created in a temporary
directory unless ``--model`` is given), against a fresh ephemeral Prefect API whose home is a
temporary directory. Before the first run a trivial flow starts that API, and its time is
reported separately (it is a once-per-process cost, not a per-flow one).

* **Prefect overhead** of a flow run: its wall time (measured around the call) minus the sum of
  its task runs' own run times (``total_run_time`` read back through the Prefect client), absolute
  and as a fraction of the wall time. Task run time includes starting each heavy stage's child
  process; the script also times that start-up alone (a fresh interpreter importing torch,
  transformers and the stage module), so it can be told apart from the stage's work.
* **Reused re-run**: the second run's wall time as a fraction of the first (every stage task finds
  its artifacts under its content key and starts no stage process; the task table's "reused"
  column reads that from each task run's log).
* **Peak RSS per stage**: a thread polls, every ``--poll-s`` seconds, the resident memory of each
  stage child process (``python -m pivotrl.pipeline.entry STAGE``) plus its descendants (e.g. a
  vLLM engine process), and of this process (the flow and the in-process demonstrations task).
  Polling can miss a spike shorter than the interval; each stage child's own ``ru_maxrss`` is not
  visible from here, so the table says "polled".

The 1-minute load average is written next to every timing.
"""

from __future__ import annotations

import argparse
import contextlib
import logging
import os
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))
from _common import header, load1, md_table, write_json  # noqa: E402

QUICK_OVERRIDES = [
    "warm_start.epochs=1", "probing.max_states=2", "probing.num_probes=2", "training.group_size=2",
    "training.max_steps=1", "training.updates_per_batch=1", "evaluation.num_tasks=1",
    "evaluation.max_steps_per_turn=1", "rollout.max_tokens=8",
    "data.sources.0.limit_per_category=2", "data.sources.1.limit_per_category=1",
    # Two probed states of a random model may leave no pivot: the orchestration is measured either way.
    "training.allow_empty_pivots=true",
]


class StageMemory:
    """Polls peak RSS (bytes) of stage child processes (with descendants) and of this process."""

    def __init__(self, poll_s: float) -> None:
        import psutil

        self._psutil = psutil
        self.poll_s = poll_s
        self.peaks: dict[str, dict[str, float]] = {}  # stage → {"tree": bytes, "procs": n, "seconds": s}
        self.main_peak = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, daemon=True)

    def __enter__(self) -> StageMemory:
        self._thread.start()
        return self

    def __exit__(self, *exc: Any) -> None:
        self._stop.set()
        self._thread.join()

    def _loop(self) -> None:
        ps = self._psutil
        me = ps.Process()
        seen: dict[int, float] = {}
        while not self._stop.is_set():
            try:
                self.main_peak = max(self.main_peak, me.memory_info().rss)
                for child in me.children(recursive=True):
                    try:
                        cmd = child.cmdline()
                        if "pivotrl.pipeline.entry" not in cmd:
                            continue
                        stage = cmd[cmd.index("pivotrl.pipeline.entry") + 1]
                        procs = [child, *child.children(recursive=True)]
                        tree = sum(p.memory_info().rss for p in procs)
                        d = self.peaks.setdefault(stage, {"tree": 0, "procs": 0, "seconds": 0.0})
                        d["tree"] = max(d["tree"], tree)
                        d["procs"] = max(d["procs"], len(procs))
                        seen.setdefault(child.pid, time.monotonic())
                        d["seconds"] = max(d["seconds"], time.monotonic() - seen[child.pid])
                    except (ps.NoSuchProcess, ps.AccessDenied, ValueError, IndexError):
                        continue
            except ps.Error:
                pass
            self._stop.wait(self.poll_s)


class ReusedTasks(logging.Handler):
    """The names of the task runs that logged reusing their stage ("no stage process started",
    :func:`pivotrl.tasks.stages.run_once`), read from Prefect's task-run loggers in this process."""

    def __init__(self) -> None:
        super().__init__(logging.INFO)
        self.names: set[str] = set()

    def emit(self, record: logging.LogRecord) -> None:
        if "no stage process started" in record.getMessage():
            self.names.add(str(getattr(record, "task_run_name", "")))

    def __enter__(self) -> "ReusedTasks":
        # The benchmark keeps Prefect at WARNING; the task loggers pass INFO to this handler alone.
        logger = logging.getLogger("prefect.task_runs")
        self._saved = (logger.level, [(h, h.level) for h in logger.handlers])
        for h in logger.handlers:
            h.setLevel(max(h.level, logger.getEffectiveLevel()))
        logger.setLevel(logging.INFO)
        logger.addHandler(self)
        return self

    def __exit__(self, *exc: Any) -> None:
        logger = logging.getLogger("prefect.task_runs")
        logger.removeHandler(self)
        level, handlers = self._saved
        logger.setLevel(level)
        for h, lvl in handlers:
            h.setLevel(lvl)


def _task_runs(flow_run_id: Any) -> tuple[list[dict[str, Any]], float]:
    """Task runs of a flow run (name, state, run seconds) and the flow run's own total_run_time."""
    from prefect import get_client
    from prefect.client.schemas.filters import FlowRunFilter, FlowRunFilterId

    with get_client(sync_client=True) as client:
        runs = client.read_task_runs(flow_run_filter=FlowRunFilter(id=FlowRunFilterId(any_=[flow_run_id])))
        flow_run = client.read_flow_run(flow_run_id)
    out = [{"task": r.name.rsplit("-", 1)[0], "name": r.name, "state": r.state_name,
            "run_s": r.total_run_time.total_seconds(), "start": r.start_time} for r in runs]
    out.sort(key=lambda r: (r["start"] is None, r["start"] or 0))
    return out, flow_run.total_run_time.total_seconds()


def _stage_process_start_s() -> float:
    """Seconds for a fresh interpreter to import what a heavy stage process imports before working."""
    t0 = time.perf_counter()
    subprocess.run([sys.executable, "-c", "import torch, transformers, pivotrl.pipeline.stages, pivotrl.pipeline.entry"],
                   check=True, cwd=str(ROOT), env={**os.environ, "OMP_NUM_THREADS": "1"})
    return time.perf_counter() - t0


def main(argv: list[str] | None = None, work: Path | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--config", default=str(ROOT / "configs" / "smoke.yaml"))
    ap.add_argument("--model", default=None, help="model.source (default: a fresh tiny checkpoint)")
    ap.add_argument("--root", default=None, help="run.storage_root (default: a temporary directory)")
    ap.add_argument("--set", dest="overrides", action="append", default=[], help="extra config override KEY=VALUE")
    ap.add_argument("--poll-s", type=float, default=0.2)
    ap.add_argument("--runs", type=int, default=2, help="flow runs on the same root (the 2nd and later reuse every stage)")
    ap.add_argument("--json", default=None, help="also write the raw numbers here")
    ap.add_argument("--quick", action="store_true", help="shrink the smoke config further (for tests)")
    ap.add_argument("--keep", action="store_true", help="keep the temporary directory (store, flow log) afterwards")
    args = ap.parse_args(argv)

    work = work or Path(tempfile.mkdtemp(prefix="pivotrl-bench-pipeline-"))
    os.environ["PREFECT_HOME"] = str(work / "prefect-home")
    os.environ.pop("PREFECT_API_URL", None)
    os.environ.setdefault("PREFECT_SERVER_ANALYTICS_ENABLED", "false")
    os.environ.setdefault("PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS", "180")
    os.environ.setdefault("DO_NOT_TRACK", "1")
    os.environ.setdefault("PREFECT_LOGGING_LEVEL", "WARNING")
    print(header("Pipeline: Prefect overhead, reused re-run, peak RSS per stage"))

    model = args.model
    if model is None:
        from pivotrl.testing import save_tiny_checkpoint

        model = str(save_tiny_checkpoint(work / "tiny-model"))
    root = args.root or str(work / "store")
    overrides = [f"run.storage_root={root}", f"model.source={model}", *(QUICK_OVERRIDES if args.quick else []),
                 *args.overrides]

    from prefect import flow

    from pivotrl.flows.nightly import nightly

    @flow(name="bench-warmup")
    def warmup() -> int:
        return 1

    la = load1()
    t0 = time.perf_counter()
    warmup()
    api_start = (time.perf_counter() - t0, la)

    runs = []
    flow_log = work / "flow-output.log"  # the stage processes' streamed output, kept out of the tables
    with StageMemory(args.poll_s) as mem, open(flow_log, "w") as log_file, contextlib.redirect_stdout(log_file), \
            ReusedTasks() as reused:
        for i in range(args.runs):
            la = load1()
            t0 = time.perf_counter()
            state = nightly(config_path=args.config, overrides=overrides, return_state=True)
            wall = time.perf_counter() - t0
            if not state.is_completed():
                raise SystemExit(f"flow run {i} ended {state.name}: {state.message}")
            tasks, flow_total = _task_runs(state.state_details.flow_run_id)
            for t in tasks:
                t["reused"] = "yes" if t["name"] in reused.names else "no"
            runs.append({"wall_s": wall, "flow_run_time_s": flow_total, "tasks": tasks, "load": la,
                         "load_end": load1()})
            print(f"flow run {i}: {wall:.1f} s", file=sys.stderr, flush=True)
            if i == 0:
                stage_mem = {k: dict(v) for k, v in mem.peaks.items()}
                main_peak_cold = mem.main_peak
    proc_start = (_stage_process_start_s(), load1())

    print(f"config: {args.config} with overrides {overrides}  \nPrefect home: a fresh temporary directory "
          f"(ephemeral API); starting it + a trivial flow: {api_start[0]:.1f} s (load {api_start[1]:.2f})  \n"
          f"a stage child process importing torch + transformers + the stage module: {proc_start[0]:.1f} s "
          f"(load {proc_start[1]:.2f}); 4 of the 5 tasks start one\n")
    rows = []
    for i, r in enumerate(runs):
        tsum = sum(t["run_s"] for t in r["tasks"])
        rows.append(["cold" if i == 0 else f"re-run {i}", r["wall_s"], r["flow_run_time_s"], tsum, r["wall_s"] - tsum,
                     (r["wall_s"] - tsum) / r["wall_s"], r["wall_s"] / runs[0]["wall_s"], r["load"], r["load_end"]])
    print(md_table(["flow run", "wall s", "flow run time s (Prefect)", "sum of task run times s", "overhead s",
                    "overhead fraction", "wall / cold wall", "load (start)", "load (end)"], rows))
    print("\nTask runs (run time as recorded by Prefect):\n")
    trows = [["cold" if i == 0 else f"re-run {i}", t["task"], t["state"], t["reused"], t["run_s"]]
             for i, r in enumerate(runs) for t in r["tasks"]]
    print(md_table(["flow run", "task", "final state", "reused", "run s"], trows))
    print("\nPeak RSS per stage, cold run (polled every %.2f s; child process + descendants):\n" % args.poll_s)
    mrows = [[stage, v["tree"] / 2**20, int(v["procs"]), v["seconds"]] for stage, v in stage_mem.items()]
    mrows.append(["flow process (flow + demonstrations task, in-process)", main_peak_cold / 2**20, 1, runs[0]["wall_s"]])
    print(md_table(["stage", "peak RSS MiB", "processes", "process lifetime s"], mrows))
    if args.json:
        write_json(args.json, {"runs": runs, "stage_memory": stage_mem, "main_peak": main_peak_cold,
                               "api_start_s": api_start, "stage_process_start_s": proc_start, "overrides": overrides})
    return 0


def _main_cleaning_up(argv: list[str] | None = None) -> int:
    """``main`` in a temporary directory (Prefect home, tiny model, store, flow log), removed after a
    successful run unless ``--keep`` is given, and kept (its path printed) after a failure."""
    work = Path(tempfile.mkdtemp(prefix="pivotrl-bench-pipeline-"))
    try:
        rc = main(argv, work)
    except BaseException:
        print(f"kept for inspection: {work}", file=sys.stderr)
        raise
    if "--keep" in (argv if argv is not None else sys.argv[1:]):
        print(f"kept: {work}")
    else:
        shutil.rmtree(work, ignore_errors=True)
    return rc


if __name__ == "__main__":
    raise SystemExit(_main_cleaning_up())
