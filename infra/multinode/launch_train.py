"""Run the PivotRL training stage on several machines, with the run's storage as the only shared medium.

Two steps (see infra/README.md):

    # 1. once, anywhere: make sure demonstrations, π_ref and the pivot set exist (content-addressed,
    #    so this is a lookup when the nightly flow or `pivotrl probe` already made them) and publish
    #    the training stage's launch spec next to the run's artifacts
    python infra/multinode/launch_train.py prepare --config configs/multinode-gpu.yaml
    # → s3://…/launch/rl_stage-<hash>.json

    # 2. on every node (node_rank 0 … nnodes-1), the same command:
    NODE_RANK=1 MASTER_ADDR=node-0 python infra/multinode/launch_train.py node --spec s3://…/launch/rl_stage-<hash>.json

Step 2 downloads the spec, takes the launch settings from the config's ``training`` section
(``launcher``, ``nnodes``, ``nproc_per_node``, ``master_addr``, ``master_port``; ``node_rank`` and
``master_addr`` can come from the command line or the environment: ``NODE_RANK``,
``JOB_COMPLETION_INDEX`` (Kubernetes Indexed Jobs), ``MASTER_ADDR``), renders the launcher command
with ``pivotrl.training.launch.render_launch_command`` (entry ``rl_stage``) and runs it. The DeepSpeed
launcher runs in per-node mode (``no_ssh``), so no node needs ssh access to another. Rank 0 publishes
checkpoints and the training summary to storage; ``pivotrl run`` then finds them and goes on to
evaluation.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any


def _prepare(args: argparse.Namespace) -> int:
    from pivotrl.core.hashing import content_hash
    from pivotrl.pipeline import stages
    from pivotrl.pipeline.common import make_store
    from pivotrl.pipeline.demos import build_demonstrations
    from pivotrl.pipeline.prepare import prepared_config

    # The nightly flow's config (validated, storage checked, sized) and stages: the same keys and tables.
    cfg = prepared_config(args.config, args.overrides or [])
    store = make_store(cfg)
    demos = build_demonstrations(cfg, store)
    ref = stages.stage_reference(cfg, store, demos)
    probe = stages.stage_probe(cfg, store, demos, ref)
    spec = {"config": cfg.model_dump(mode="json"), "inputs": {"probe": probe.to_dict(), "reference": ref.to_dict()}}
    key = f"launch/rl_stage-{content_hash(spec)[:16]}.json"
    print(store.write_json(key, spec))
    return 0


def _read_spec(url: str) -> dict[str, Any]:
    from pivotrl.storage import ArtifactStore

    parent, _, name = url.rstrip("/").rpartition("/")
    return ArtifactStore(parent).read_json(name)


def _node(args: argparse.Namespace) -> int:
    from pivotrl.config import parse_config
    from pivotrl.training.launch import LaunchConfig, launch_env, render_launch_command

    spec = _read_spec(args.spec)
    training = parse_config(spec["config"], source=args.spec).training  # the one validation in this process
    rank = args.node_rank if args.node_rank is not None else os.environ.get("NODE_RANK",
                                                                             os.environ.get("JOB_COMPLETION_INDEX"))
    overrides: dict[str, Any] = {}
    addr = args.master_addr or os.environ.get("MASTER_ADDR")
    if addr:
        overrides["master_addr"] = addr
    if args.launcher:
        overrides["launcher"] = args.launcher
    launcher = overrides.get("launcher", training.launcher)
    # deepspeed: every node starts its own ranks; no ssh between nodes
    settings = LaunchConfig.of(training, node_rank=int(rank) if rank is not None else 0,
                               no_ssh=launcher == "deepspeed", **overrides)
    own = args.workdir is None  # a folder of our own is removed at the end, whatever the outcome
    workdir = Path(args.workdir or tempfile.mkdtemp(prefix="pivotrl-launch-"))
    try:
        workdir.mkdir(parents=True, exist_ok=True)
        local_spec = workdir / "rl_stage-spec.json"
        local_spec.write_text(json.dumps({**spec, "output": str(workdir / "rl_stage-result.json")}))
        cmd = render_launch_command(settings, entry="rl_stage", spec_path=local_spec, python=args.python)
        print(" ".join(cmd), flush=True)
        if args.dry_run:
            return 0
        return _supervise(cmd, launch_env(settings), settings.node_rank)
    finally:
        if own:
            shutil.rmtree(workdir, ignore_errors=True)


def _supervise(cmd: list[str], env: dict[str, str], node_rank: int) -> int:
    """Run the launcher in its own session; SIGINT/SIGTERM to this process stops the launcher and
    every rank it started (a stop of this process alone orphaned the ranks before) and exits 130."""
    import signal
    import time

    from pivotrl.pipeline.processes import descendants, stop_tree

    t0 = time.time()
    proc = subprocess.Popen(cmd, env=env, start_new_session=True)
    stopping: list[int] = []

    def stop(signum: int, _frame: Any) -> None:
        stopping.append(signum)
        tree = [p for p in descendants() if p.pid == proc.pid] + descendants(proc.pid)
        stop_tree(tree, grace_s=10.0)

    old = {sig: signal.signal(sig, stop) for sig in (signal.SIGINT, signal.SIGTERM)}
    try:
        rc = proc.wait()
    finally:
        for sig, handler in old.items():
            signal.signal(sig, handler)
    if stopping:
        print(f"node {node_rank}: stopped by {signal.Signals(stopping[0]).name}; the launcher and its ranks are "
              "stopped (a restart with the same spec resumes from the latest checkpoint)", file=sys.stderr, flush=True)
        return 130
    print(f"node {node_rank}: training {'finished' if rc == 0 else f'failed (exit code {rc})'} after "
          f"{time.time() - t0:.0f} s", flush=True)
    return rc


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="launch_train.py", description=__doc__.split("\n\n")[0])
    sub = ap.add_subparsers(dest="command", required=True)
    p = sub.add_parser("prepare", help="publish the training stage's launch spec to the run's storage")
    p.add_argument("--config", "-c", required=True, help="run config (path or fsspec URL)")
    p.add_argument("--set", "-s", dest="overrides", action="append", help="dotted.key=value override")
    p.set_defaults(func=_prepare)
    n = sub.add_parser("node", help="run this node's share of the training stage")
    n.add_argument("--spec", required=True, help="URL printed by `prepare`")
    n.add_argument("--node-rank", type=int, default=None, help="default: $NODE_RANK or $JOB_COMPLETION_INDEX")
    n.add_argument("--master-addr", default=None, help="default: $MASTER_ADDR, else the config's")
    n.add_argument("--launcher", choices=("torchrun", "deepspeed"), default=None, help="default: the config's")
    n.add_argument("--workdir", default=None, help="local folder for the spec copy and launcher log")
    n.add_argument("--python", default=None, help="interpreter of the ranks (default: this one)")
    n.add_argument("--dry-run", action="store_true", help="print the launcher command only")
    n.set_defaults(func=_node)
    args = ap.parse_args(argv)
    return int(args.func(args))


if __name__ == "__main__":
    sys.exit(main())
