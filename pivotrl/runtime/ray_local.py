"""A real local Ray cluster for tests and benchmarks: a head node and worker nodes on this machine,
each a ``ray start --block`` process in its own session (so stopping them stops exactly this
cluster, never another Ray instance of the machine). Ray maps 127.0.0.1 to the machine's own
address, so the nodes listen there (nothing leaves the machine).
"""

from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, Callable, Mapping

#: Prefix of the line that carries the alive nodes' JSON in :meth:`RayCluster.nodes`' child's stdout.
_NODES = "pivotrl-ray-nodes:"


class RayCluster:
    """A real Ray cluster on this machine: a head node with no CPUs (so no shard runs beside the
    driver) and ``workers`` worker nodes of one CPU each, every node a ``ray start --block``
    process in its own session, so that stopping them stops exactly this cluster."""

    def __init__(self, workers: int = 2, cpus_per_worker: int = 1,
                 worker_env: Callable[[int], Mapping[str, str]] | None = None) -> None:
        """``worker_env(i)``: extra environment of the i-th worker node started (0, 1, …; also those
        :meth:`add_worker` adds later), inherited by every process that node runs, e.g. its own
        ``PIVOTRL_CACHE_DIR`` and ``TMPDIR`` so that the nodes of one machine share no folder
        (``PWD``: the node's working directory)."""
        import tempfile

        self.worker_env = worker_env
        self.started = 0  # worker nodes started so far

        self.tmp = tempfile.mkdtemp(prefix="pvray", dir="/tmp")  # short: Ray's socket paths
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            self.port = s.getsockname()[1]
        self.address = f"127.0.0.1:{self.port}"
        ray = str(Path(sys.executable).with_name("ray"))
        # A loopback-only cluster of this machine needs no token authentication, and Ray turns it on
        # by itself as soon as any earlier Ray session left a token in ~/.ray (its drivers then fail
        # to connect): off for these nodes and for the drivers of this process, unless set.
        os.environ.setdefault("RAY_AUTH_MODE", "disabled")
        env = {**os.environ, "OMP_NUM_THREADS": "1", "RAY_USAGE_STATS_ENABLED": "0"}
        common = ["--block", "--node-ip-address=127.0.0.1", "--disable-usage-stats",
                  "--object-store-memory=80000000"]
        self.procs: list[subprocess.Popen] = []
        try:
            self._start(ray, env, common, workers, cpus_per_worker)
        except BaseException:
            self.stop()  # a node that did not come up: stop the ones that did
            raise

    def _start(self, ray: str, env: dict[str, str], common: list[str], workers: int, cpus_per_worker: int) -> None:
        self.procs = [subprocess.Popen(
            [ray, "start", "--head", f"--port={self.port}", "--num-cpus=0", "--include-dashboard=false",
             f"--temp-dir={self.tmp}", *common], env=env, start_new_session=True,
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)]
        self._wait(lambda n: len(n) >= 1)
        self._ray, self._env, self._common = ray, env, common
        for _ in range(workers):  # one at a time: nodes starting together on one host collide
            self.add_worker(cpus_per_worker)

    def add_worker(self, cpus: int = 1) -> None:
        """Start one more worker node of ``cpus`` CPUs and wait until the cluster counts it as alive
        (e.g. to replace a node a test has lost). The node carries a resource of its own,
        ``pivotrl_node_<i>``, so that it is told apart from a lost node the cluster still counts.

        Raises RuntimeError when the node exits while starting or is not alive within 120 s."""
        tag = f"pivotrl_node_{self.started}"
        env = {**self._env, **(self.worker_env(self.started) if self.worker_env else {})}
        self.started += 1
        cwd = env.pop("PWD", None)  # the node's working directory, when its environment names one
        self.procs.append(subprocess.Popen(
            [self._ray, "start", f"--address={self.address}", f"--num-cpus={cpus}",
             f"--resources={json.dumps({tag: 1})}", *self._common], env=env,
            cwd=cwd, start_new_session=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL))
        self._wait(lambda n: any(tag in x.get("Resources", {}) for x in n))

    def nodes(self) -> list[dict[str, Any]]:
        code = ("import json, ray; ray.init(address=%r, logging_level='ERROR'); "
                "print(%r + json.dumps([n for n in ray.nodes() if n['Alive']], default=str))" % (self.address, _NODES))
        try:
            out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
        except subprocess.TimeoutExpired:  # a head still starting (or a loaded machine): none known yet
            return []
        # Ray may print its own lines to stdout too (a worker's log forwarded, a warning): read ours.
        lines = [ln for ln in out.stdout.splitlines() if ln.startswith(_NODES)]
        if out.returncode != 0 or not lines:
            return []
        try:
            return json.loads(lines[-1][len(_NODES):])
        except json.JSONDecodeError:  # a line cut short: none known this time, asked again by the caller
            return []

    def _wait(self, ready, timeout: float = 120) -> None:
        t0 = time.time()
        while time.time() - t0 < timeout:
            if self.procs and self.procs[-1].poll() is not None:
                raise RuntimeError("a ray node exited during start-up")
            if ready(self.nodes()):
                return
            time.sleep(1)
        raise RuntimeError("the ray cluster did not come up")

    def leftovers(self) -> list[int]:
        """PIDs of processes of this cluster still alive (their command line names its session)."""
        pids = []
        for d in Path("/proc").iterdir():
            if d.name.isdigit():
                try:
                    cmd = (d / "cmdline").read_bytes().decode(errors="replace")
                except OSError:
                    continue
                if self.tmp in cmd or f":{self.port}" in cmd and "ray" in cmd:
                    pids.append(int(d.name))
        return pids

    def stop(self, grace_s: float = 3.0) -> None:
        """Stop the worker nodes (SIGTERM to each node's session), then the head: its GCS and
        raylet take about 30 s to exit on SIGTERM, so after ``grace_s`` the head's session is
        killed (a test cluster keeps no state worth a graceful exit). Then any process of this
        cluster still alive is killed and its temporary directory removed."""
        import signal

        def _signal(p: subprocess.Popen, sig: int) -> None:
            try:
                os.killpg(p.pid, sig)
            except ProcessLookupError:
                pass

        workers, head = self.procs[1:], self.procs[:1]
        for group, wait_s in ((workers, 30.0), (head, grace_s)):
            for p in group:
                if p.poll() is None:
                    _signal(p, signal.SIGTERM)
            for p in group:
                try:
                    p.wait(timeout=wait_s)
                except subprocess.TimeoutExpired:
                    _signal(p, signal.SIGKILL)
                    p.wait()
        for pid in self.leftovers():  # processes the nodes spawned, if any outlived them
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        shutil.rmtree(self.tmp, ignore_errors=True)

    def __enter__(self) -> "RayCluster":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.stop()
