"""The train stage over several machines, started by the run itself: one node launcher per Ray node.

``training.nnodes > 1`` with ``training.node_launch: ray``: :func:`launch_on_ray` joins the Ray
cluster of ``scale_out.ray_address`` and reserves a placement group of ``nnodes`` bundles
(``ray_cpus_per_node`` CPUs and ``ray_gpus_per_node`` GPUs each) with the ``STRICT_SPREAD``
strategy, so every bundle is on a different node. A small task on bundle 0 names rank 0's address
and a free port; then one task per bundle runs that node's share exactly as a person would on a
node by hand (``infra/multinode/launch_train.py node``): it reads the launch spec from the run's
storage, writes a local copy into its own temporary folder and runs torchrun with its node rank
(:func:`pivotrl.training.launch.render_launch_command`, entry ``rl_stage``). Each node's ranks
read everything else (π_ref, the pivot set, checkpoints, the BFCL data) from the storage root or
fetch it into that node's cache; nothing comes from the machine that started the run. Node 0
hands its ranks' result (a small JSON dict) back through Ray.

Why torch.distributed ranks placed by Ray rather than Ray Train's ``TorchTrainer``: the ranks are
the same processes, with the same entry and the same rendezvous, as under Slurm, Kubernetes or a
hand-started torchrun, so the trainer has one launch path, tested the same way on every backend;
Ray only decides where the nodes go and notices when one is lost.

A lost node (its raylet or Ray worker dies; the other node's ranks then fail in their next
collective) ends the attempt: the placement group is released and placed again, up to
``node_failure_retries`` times, and the ranks resume from the latest checkpoint every rank
published (:mod:`pivotrl.training.checkpoints`). A rank that fails by itself (an error in the
trainer, an exit code without a lost node) is not retried: it would fail the same way.

Ray is imported inside the functions: the training package imports without it.
"""

from __future__ import annotations

import json
import logging
import os
import re
import shutil
import signal
import socket
import subprocess
import tempfile
import time
from pathlib import Path
from typing import Any, Callable

from pivotrl.core.errors import TrainingError

__all__ = ["NodeLost", "RAYLET_PID_ENV", "launch_on_ray", "node_share"]

log = logging.getLogger("pivotrl.training")

#: The PID of the raylet of the node a rank runs on (set by :func:`node_share` for its launcher):
#: the ``faults.kill_trainer_node_at_step`` drill kills it to lose the whole node.
RAYLET_PID_ENV = "PIVOTRL_RAYLET_PID"

#: Seconds to wait for the cluster to offer ``nnodes`` bundles on different nodes.
PLACEMENT_TIMEOUT_S = 600.0


class NodeLost(TrainingError):
    """A trainer node's Ray node went away under its task (its raylet died)."""


def _die_with_parent() -> None:  # pragma: no cover - runs in the child between fork and exec
    """The launcher gets SIGTERM when the Ray worker that started it dies (lost node, cancelled
    task), and stops its ranks: no rank outlives its node's task."""
    import ctypes

    ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG


def rendezvous_point() -> tuple[str, int]:
    """``(address, port)`` of this node for rank 0's rendezvous: the node's IP as Ray knows it and
    a TCP port free on it now."""
    import ray

    with socket.socket() as s:
        s.bind(("", 0))
        port = s.getsockname()[1]
    return ray.util.get_node_ip_address(), port


def node_share(spec_root: str, spec_key: str, node_rank: int, master_addr: str, master_port: int,
               launch_keys: dict[str, Any], storage_options: dict[str, Any] | None = None) -> str | None:
    """One node's share of the process group, run in a Ray task on that node: read the launch spec
    from storage (``spec_root`` / ``spec_key``, with ``storage_options``), copy it into this node's
    temporary folder and run torchrun with ``node_rank``. Returns node 0's result JSON text (None on other nodes).

    Raises TrainingError naming the node and the launcher's exit code when it fails.
    """
    from pivotrl.storage import ArtifactStore
    from pivotrl.training.launch import LaunchConfig, launch_env, render_launch_command

    spec = ArtifactStore(spec_root, storage_options).read_json(spec_key)
    work = Path(tempfile.mkdtemp(prefix=f"pivotrl-node{node_rank}-"))
    try:
        out = work / "rl_stage-result.json"
        local = work / "rl_stage-spec.json"
        local.write_text(json.dumps({**spec, "output": str(out)}))
        lc = LaunchConfig(**launch_keys, node_rank=node_rank, master_addr=master_addr, master_port=master_port)
        env = launch_env(lc)
        raylet = os.getppid()  # a Ray worker's parent is its node's raylet
        env[RAYLET_PID_ENV] = str(raylet)
        cmd = render_launch_command(lc, entry="rl_stage", spec_path=local)
        print(f"node {node_rank}: {' '.join(cmd)}", flush=True)
        t0 = time.time()
        rc, cause = _run_teed(cmd, env)
        if rc != 0 and os.getppid() != raylet:  # the raylet died under this task: the node is lost
            raise NodeLost(f"trainer node {node_rank}: its Ray node was lost (torchrun exited with {rc})")
        if rc != 0:
            raise TrainingError(f"trainer node {node_rank}: torchrun exited with {rc} after {time.time() - t0:.0f} s"
                                + (f"; a rank's error: {cause}" if cause else "") + " (the ranks' output is in the "
                                "stage's log)")
        return out.read_text() if node_rank == 0 else None
    finally:
        shutil.rmtree(work, ignore_errors=True)


_ERROR_LINE = re.compile(r"^(?:[\w.]+\.)?[A-Z]\w*(?:Error|Exception): .+")


def _run_teed(cmd: list[str], env: dict[str, str]) -> tuple[int, str | None]:
    """Run the launcher, its output passed through line by line (Ray forwards it to the stage's log);
    returns its exit code and the last ``SomethingError: message`` line its ranks printed, if any."""
    cause = None
    with subprocess.Popen(cmd, env=env, preexec_fn=_die_with_parent, stdout=subprocess.PIPE,
                          stderr=subprocess.STDOUT, text=True, errors="replace") as proc:
        assert proc.stdout is not None
        for line in proc.stdout:
            print(line, end="", flush=True)
            if _ERROR_LINE.match(line.strip()) and "ChildFailedError" not in line:
                cause = line.strip()[:500]
    return proc.returncode, cause


def _lost(exc: BaseException) -> bool:
    """True when a node task ended because its worker or node went away (Ray's error, or the task's
    own :class:`NodeLost`), not by its own error nor by the cancel that followed another node's failure."""
    import ray.exceptions as rex

    if isinstance(exc, NodeLost):
        return True
    return isinstance(exc, rex.RayError) and not isinstance(exc, (rex.RayTaskError, rex.TaskCancelledError))


def launch_on_ray(*, address: str, nnodes: int, nproc_per_node: int, cpus_per_node: float, gpus_per_node: float,
                  spec_root: str, spec_key: str, storage_options: dict[str, Any] | None = None,
                  omp_num_threads: int = 1, retries: int = 2,
                  placement_timeout_s: float = PLACEMENT_TIMEOUT_S,
                  on_attempt: Callable[[int], None] | None = None) -> dict[str, Any]:
    """Run the launch spec at ``spec_root``/``spec_key`` as ``nnodes`` × ``nproc_per_node`` ranks,
    one torchrun per node of the Ray cluster at ``address``; returns node 0's result dict.

    A lost node ends the attempt; up to ``retries`` more attempts are placed (the ranks resume from
    the latest checkpoint). Raises TrainingError when the cluster cannot place the nodes within
    ``placement_timeout_s`` (naming what it has), when a rank fails by itself, or when a node is
    still lost after the last attempt.
    """
    import ray
    from ray.util.placement_group import placement_group, remove_placement_group
    from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

    if not ray.is_initialized():
        if address not in ("auto", "local") and not address.startswith("ray://"):
            os.environ.setdefault("RAY_AUTH_MODE", "disabled")  # as the shard runner's clusters
        ray.init(address=address, logging_level="ERROR")
    bundle = {"CPU": float(cpus_per_node), **({"GPU": float(gpus_per_node)} if gpus_per_node else {})}
    keys = {"launcher": "torchrun", "nnodes": nnodes, "nproc_per_node": nproc_per_node,
            "omp_num_threads": omp_num_threads}
    where = ray.remote(num_cpus=0)(rendezvous_point)
    share = ray.remote(max_retries=0)(node_share)
    for attempt in range(retries + 1):
        if on_attempt is not None:
            on_attempt(attempt)
        pg = placement_group([dict(bundle) for _ in range(nnodes)], strategy="STRICT_SPREAD")
        try:
            ready: list[Any] = []
            waited = 0.0
            while not ready and waited < placement_timeout_s:
                ready, _ = ray.wait([pg.ready()], timeout=min(30.0, placement_timeout_s - waited))
                waited += 30.0
                if not ready and waited < placement_timeout_s:
                    log.info("train: waiting for %d nodes with %s each on the Ray cluster (%.0f of %.0f s); alive "
                             "nodes: %s", nnodes, bundle, waited, placement_timeout_s, _nodes_summary())
            if not ready:
                raise TrainingError(
                    f"the Ray cluster at {address} could not place {nnodes} trainer nodes of {bundle} on different "
                    f"nodes within {placement_timeout_s:.0f} s; alive nodes: {_nodes_summary()} (training."
                    "ray_cpus_per_node / ray_gpus_per_node ask for each node's share)")
            on = [PlacementGroupSchedulingStrategy(pg, placement_group_bundle_index=i) for i in range(nnodes)]
            addr, port = ray.get(where.options(scheduling_strategy=on[0]).remote())
            log.info("train: %d nodes × %d ranks on the Ray cluster, rank 0 at %s:%d (attempt %d of %d)",
                     nnodes, nproc_per_node, addr, port, attempt + 1, retries + 1)
            refs = [share.options(scheduling_strategy=on[i], num_cpus=bundle["CPU"], num_gpus=bundle.get("GPU", 0))
                    .remote(spec_root, spec_key, i, addr, port, keys, storage_options) for i in range(nnodes)]
            errors = _wait_all(refs)
            if not errors:
                return json.loads(ray.get(refs[0]))
            lost = [i for i, e in errors.items() if _lost(e)]
            if not lost:
                first = min(errors)
                raise TrainingError(f"{errors[first]}") from None
            log.warning("train: trainer node(s) %s lost (%s); %s", lost, type(errors[lost[0]]).__name__,
                        "placing the nodes again, resuming from the latest checkpoint" if attempt < retries
                        else "no retries left")
        finally:
            remove_placement_group(pg)
    raise TrainingError(f"a trainer node was lost in each of {retries + 1} attempts (training.node_failure_retries = "
                        f"{retries}); alive nodes: {_nodes_summary()}")


def _wait_all(refs: list[Any], grace_s: float = 90.0) -> dict[int, BaseException]:
    """Wait for every node task. After the first failure the others get ``grace_s`` to end by
    themselves (a node lost at the same moment is reported as lost only once Ray's health checks
    declare it dead), then are cancelled (their launchers and ranks stop with their workers).
    Returns the failures by node rank (empty when all finished); a task's own error is unwrapped
    from Ray's RayTaskError."""
    import ray
    import ray.exceptions as rex

    def own(e: Exception) -> BaseException:
        cause = getattr(e, "cause", None)
        return cause if isinstance(e, rex.RayTaskError) and isinstance(cause, Exception) else e

    index = {r: i for i, r in enumerate(refs)}
    pending, errors = list(refs), {}
    failed_at: float | None = None
    while pending:
        timeout = None if failed_at is None else max(0.0, failed_at + grace_s - time.time())
        done, pending = ray.wait(pending, num_returns=1, timeout=timeout)
        if not done:  # the grace after a failure is over: stop the rest
            for r in pending:
                ray.cancel(r, force=True)
            for r in pending:
                try:
                    ray.get(r, timeout=60)
                except Exception as e:  # noqa: BLE001
                    errors.setdefault(index[r], own(e))
            break
        try:
            ray.get(done[0])
        except Exception as e:  # noqa: BLE001 - classified by the caller (lost node or own failure)
            errors[index[done[0]]] = own(e)
            failed_at = time.time() if failed_at is None else failed_at
    return errors


def _nodes_summary() -> str:
    import ray

    alive = [n for n in ray.nodes() if n.get("Alive")]
    def share(n: dict[str, Any]) -> dict[str, Any]:
        return {k: v for k, v in n.get("Resources", {}).items() if k in ("CPU", "GPU")}

    return ", ".join(f"{n.get('NodeManagerAddress')} {share(n)}" for n in alive) or "none"
