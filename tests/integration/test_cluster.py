"""The nightly flow on a cluster of several nodes that share nothing but the run's storage root.

A real local Ray cluster — a head and two worker nodes, separate raylets of one CPU each — on this
machine, every worker node with its own working directory, ``PIVOTRL_CACHE_DIR`` and temporary
folder, and the run root on an S3 API server (moto) on 127.0.0.1; the model itself is on that
server. ``pivotrl run``'s flow runs the whole smoke pipeline there with sharded probing, sharded
evaluation and the train stage as two torchrun node ranks (one rank per node), started by the flow
on the two Ray nodes and meeting over 127.0.0.1 as two machines would. Its probe table, pivot set,
trained weights and report equal the one-machine run's (the session's smoke run, one rank; two
ranks give its weights to 1e-5, test_pipeline.py).

Every Python process of a worker node records the files it opens outside its own folders, the
Python installation, the project's code and the system's folders (``tests/fixtures/node_audit``):
none may be the driver's cache or temporary files, nor another node's.

Then node loss: a worker node's raylet killed while it probes a shard (the shard reruns on the
other node, the run completes), and a trainer node killed mid-epoch (the train stage places both
nodes again — on the surviving node and a replacement, started as a cluster's autoscaler would —
resumes from the last published checkpoint and ends with the uninterrupted run's weights).
"""

from __future__ import annotations

import json
import os
import re
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import pandas as pd
import pytest

from pivotrl.runtime.ray_local import RayCluster
from pivotrl.storage import ArtifactStore

pytestmark = pytest.mark.integration

REPO = Path(__file__).resolve().parents[2]
BUCKET = "pivotrl-cluster"
AUDIT = REPO / "tests" / "fixtures" / "node_audit"
#: Report fields (JSON paths) and Markdown rows that are measurements of a machine, not results.
MEASURED = re.compile(r"(mfu|peak_gflops|time_s|tokens_per_s|trainer_s)(\[\d+\])?$")  # [i]: one of a list
MEASURED_MD = re.compile(r"MFU|tokens/s|GFLOP/s|peak|trainer_s=|forward\+backward")
#: Where a node's processes may open files besides its own folders (code, interpreter, system).
SYSTEM = ("/proc", "/sys", "/dev", "/etc", "/usr", "/lib", "/lib64", "/bin", "/sbin", "/run",
          str(Path.home() / ".cache"), str(Path.home() / ".config" / "pip"))  # pip: the BFCL wheel's download


def _node_dirs(base: Path, i: int) -> dict[str, Path]:
    dirs = {k: base / f"node{i}" / k for k in ("cache", "tmp", "work")}
    for d in dirs.values():
        d.mkdir(parents=True, exist_ok=True)
    return dirs


class Cluster:
    """The test's cluster: the Ray nodes, the S3 server, each worker node's folders, the driver's."""

    def __init__(self, base: Path, s3_endpoint: str) -> None:
        self.base = base
        self.driver = {k: base / "driver" / k for k in ("cache", "tmp")}
        for d in self.driver.values():
            d.mkdir(parents=True, exist_ok=True)
        self.endpoint = s3_endpoint
        self.ray = RayCluster(workers=2, worker_env=self.node_env)
        self._replacing = threading.Event()
        self._replacer: threading.Thread | None = None

    def node_env(self, i: int) -> dict[str, str]:
        d = _node_dirs(self.base, i)
        code = [str(REPO / p) for p in ("pivotrl", "tasks", "flows", "tests/fixtures/node_audit")]
        allowed = [str(d["cache"]), str(d["tmp"]), str(d["work"]), sys.prefix, sys.base_prefix, *code, *SYSTEM,
                   "/tmp/pvray"]  # Ray's own session folders (pivotrl.runtime.ray_local)
        return {"PIVOTRL_CACHE_DIR": str(d["cache"]), "TMPDIR": str(d["tmp"]), "PWD": str(d["work"]),
                "PYTHONPATH": str(AUDIT), "PIVOTRL_NODE_ALLOWED": os.pathsep.join(allowed),
                "PIVOTRL_NODE_OPENS": str(self.base / f"node{i}" / "opens.log"),
                # the machine's CPUs are one machine's: engines of all nodes claim them in one place
                "PIVOTRL_CPU_CLAIMS_DIR": str(self.base / "cpu-claims")}

    def opens(self) -> list[str]:
        """Every file a worker node's process opened outside its allowed folders, as ``node<i>: path``."""
        out = []
        for log in sorted(self.base.glob("node*/opens.log")):
            out += [f"{log.parent.name}: {line.split(' ', 1)[1]}" for line in log.read_text().splitlines()]
        return out

    def keep_two_workers(self) -> None:
        """Replace a lost worker node (its ``ray start --block`` process exited), as a cluster's
        autoscaler or a Kubernetes controller would, until :meth:`stop`."""
        def loop() -> None:
            while not self._replacing.is_set():
                alive = [p for p in self.ray.procs[1:] if p.poll() is None]
                if len(alive) < 2:
                    try:
                        self.ray.add_worker(1)
                    except Exception as e:  # noqa: BLE001 - it exited or was slow to join: counted again next time
                        print(f"replacing a lost worker node: {e}", file=sys.stderr, flush=True)
                time.sleep(1)

        self._replacer = threading.Thread(target=loop, daemon=True)
        self._replacer.start()

    def stop(self) -> None:
        self._replacing.set()
        if self._replacer is not None:
            self._replacer.join(timeout=180)
        self.ray.stop()


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    import shutil

    from test_s3_flow import s3_environment

    from pivotrl.testing import save_tiny_checkpoint

    base = Path(tempfile.mkdtemp(prefix="pvc", dir="/tmp"))  # short: Ray's socket paths live under it
    with s3_environment(BUCKET) as (server, mp):
        # The model lives on the storage server too: no node reads it from the driver's disk.
        tiny = save_tiny_checkpoint(tmp_path_factory.mktemp("cluster-model") / "tiny")
        ArtifactStore(f"s3://{BUCKET}/models").put_dir(str(tiny), "tiny")
        c = Cluster(base, server.endpoint)
        c.keep_two_workers()  # a lost worker node is replaced, as a cluster's autoscaler would
        mp.setenv("PREFECT_HOME", str(base / "prefect"))
        from prefect.testing.utilities import prefect_test_harness

        try:
            with prefect_test_harness(server_startup_timeout=180), pytest.MonkeyPatch.context() as driver:
                # The driver (this process and the stage processes it starts) has its own folders too.
                driver.setenv("PIVOTRL_CACHE_DIR", str(c.driver["cache"]))
                driver.setenv("TMPDIR", str(c.driver["tmp"]))
                driver.setattr(tempfile, "tempdir", None)
                yield c
        finally:
            c.stop()
            time.sleep(1)
            assert c.ray.leftovers() == []
            shutil.rmtree(base, ignore_errors=True)


def _diff(a: Any, b: Any, path: str = "") -> list[str]:
    """Where two JSON-like values differ, as paths (for the assertion message)."""
    if isinstance(a, dict) and isinstance(b, dict):
        return [d for k in sorted(set(a) | set(b), key=str) for d in
                (_diff(a.get(k), b.get(k), f"{path}.{k}") if k in a and k in b else [f"{path}.{k} only in one"])]
    if isinstance(a, list) and isinstance(b, list) and len(a) == len(b):
        return [d for i, (x, y) in enumerate(zip(a, b)) for d in _diff(x, y, f"{path}[{i}]")]
    return [] if a == b else [f"{path}: {a!r} != {b!r}"[:400]]


def _overrides(cluster: Cluster, root: str, *extra: str) -> list[str]:
    return [f"run.storage_root=s3://{BUCKET}/{root}", f"model.source=s3://{BUCKET}/models/tiny",
            "scale_out.task_runner=ray", f"scale_out.ray_address={cluster.ray.address}",
            "scale_out.ray_cpus_per_shard=1", "scale_out.probe_shard_size=2", "scale_out.eval_shard_size=1",
            "training.launcher=torchrun", "training.nnodes=2", "training.nproc_per_node=1", "training.world_size=2",
            "training.ray_cpus_per_node=1", *extra]


def _weights(store: ArtifactStore, key: str, tmp: Path) -> dict[str, Any]:
    from safetensors.torch import load_file

    if str(store.root_url).startswith("s3://"):
        store.get_dir(key, str(tmp))
        return load_file(str(tmp / "model.safetensors"))
    return load_file(str(Path(store.url(key).removeprefix("file://")) / "model.safetensors"))


def _assert_close(w1: dict[str, Any], w2: dict[str, Any]) -> None:
    assert w1.keys() == w2.keys()
    for k in w1:
        assert (w1[k] - w2[k]).abs().max().item() < 1e-5, k


@pytest.fixture(scope="module")
def cluster_run(cluster):
    from pivotrl.flows.nightly import nightly

    t0 = time.time()
    out = nightly(config_path=str(REPO / "configs" / "smoke.yaml"), overrides=_overrides(cluster, "run"))
    return out, time.time() - t0


def test_the_flow_runs_the_whole_pipeline_on_three_nodes_as_on_one_machine(cluster, cluster_run, smoke_run, tmp_path):
    from pivotrl.pipeline.results import EvalResult
    from pivotrl.testing import comparable_report

    out, wall = cluster_run
    print(f"cluster run: {wall:.0f} s")
    store = ArtifactStore(f"s3://{BUCKET}/run")
    ev = EvalResult.of(out)
    report = store.read_json(ev.report_json.split(f"s3://{BUCKET}/run/", 1)[1])
    train_key = report["meta"].get("train_key") or next(
        k.rsplit("/", 1)[0] for k in store.list("train/") if k.endswith("/summary.json"))
    summary = store.read_json(f"{train_key}/summary.json")
    # Two node ranks trained: the launch spec went through storage, both ranks published checkpoints.
    assert store.list("launch/"), "no launch spec on storage"
    ckpt = sorted(k for k in store.list(f"{train_key}/checkpoints/") if k.endswith("ranks.json"))
    assert ckpt and store.read_json(ckpt[-1]) == {"world_size": 2}
    assert summary["steps"] == smoke_run.train.summary["steps"]

    # Same probe table, pivot set, weights and report as the one-machine run.
    probes = store.read_parquet(next(k for k in store.list("probes/") if k.endswith("/probes.parquet")
                                     and "/shards/" not in k))
    pivots = store.read_parquet(next(k for k in store.list("pivots/") if k.endswith("/pivots.parquet")))
    pd.testing.assert_frame_equal(probes, smoke_run.store.read_parquet(f"{smoke_run.probe.probes_key}/probes.parquet"))
    pd.testing.assert_frame_equal(pivots, smoke_run.store.read_parquet(f"{smoke_run.probe.pivots_key}/pivots.parquet"))
    _assert_close(_weights(store, f"{train_key}/policy", tmp_path / "w"),
                  _weights(smoke_run.store, smoke_run.train.policy_key, tmp_path))
    mine, theirs = comparable_report(out, [f"s3://{BUCKET}/run"]), comparable_report(
        smoke_run.ev.to_dict(), [smoke_run.cfg.run.storage_root])
    # What differs is where the run lives and how fast each machine was (every node calibrates its
    # own peak in its own cache), never a result.
    assert [d for d in _diff(mine[0], theirs[0]) if not MEASURED.search(d.split(":")[0])] == [
        f".meta.model_source: 's3://{BUCKET}/models/tiny' != '{smoke_run.cfg.model.source}'",
        f".meta.training.policy: 's3://{BUCKET}/run/{train_key}/policy' != "
        f"'{smoke_run.store.url(smoke_run.train.policy_key)}'"]
    md, md0 = (m.replace(src, "<model>").replace("file://<root>", "<root>").splitlines()
               for m, src in ((mine[1], f"s3://{BUCKET}/models/tiny"), (theirs[1], smoke_run.cfg.model.source)))
    assert len(md) == len(md0)
    lines = [(a, b) for a, b in zip(md, md0) if a != b and not MEASURED_MD.search(a)]
    assert lines == []

    # No worker node opened a file of the driver's or another node's folders, or anything outside its own.
    assert cluster.opens() == []


def _copy_run(src: str, dst: str, stages: tuple[str, ...]) -> None:
    """Copy the artifacts of ``stages`` (top-level key prefixes) of one run root to another, on the
    storage server: a second run that reuses them and computes the rest."""
    import s3fs

    fs = s3fs.S3FileSystem(skip_instance_cache=True)
    for stage in stages:
        fs.copy(f"{BUCKET}/{src}/{stage}", f"{BUCKET}/{dst}/{stage}", recursive=True)


def test_a_worker_node_lost_mid_probe_reruns_its_shard_on_the_other_node(cluster, cluster_run, smoke_run):
    """The ``faults.ray_node_loss_shards`` drill on a cluster: the raylet of the worker node that
    runs probe shard 0 is killed while the shard runs; the flow reruns the lost shard on the other
    node (a replacement node joins meanwhile) and the probe table is the one-machine run's."""
    from pivotrl.flows.nightly import probe_only

    _copy_run("run", "probe-loss", ("demos", "reference", "models"))
    workers_before = len(cluster.ray.procs) - 1
    out = probe_only(config_path=str(REPO / "configs" / "smoke.yaml"), overrides=_overrides(
        cluster, "probe-loss", "faults.ray_node_loss_shards=[0]", "scale_out.shard_retries=1"))
    store = ArtifactStore(f"s3://{BUCKET}/probe-loss")
    drills = [k for k in store.list("probes/") if k.endswith("node-loss-drill.json")]
    assert len(drills) == 1  # shard 0's node was lost once
    assert len(cluster.ray.procs) - 1 > workers_before  # ... and replaced
    probes = store.read_parquet(out["probes"].split("/probe-loss/", 1)[1])
    pd.testing.assert_frame_equal(probes, smoke_run.store.read_parquet(f"{smoke_run.probe.probes_key}/probes.parquet"))
    assert cluster.opens() == []


def test_a_trainer_node_lost_mid_epoch_restarts_from_the_last_checkpoint(cluster, cluster_run, smoke_run, tmp_path):
    """``faults.kill_trainer_node_at_step=1``: before step 2 the last trainer node's raylet and rank
    are killed (the node is lost; rank 0 then fails in its next collective). The train stage
    places both nodes again — on the surviving node and the replacement — and the ranks resume
    from the step-1 checkpoint both published; the final weights are the uninterrupted run's."""
    from pivotrl.config import load_config
    from pivotrl.pipeline import stages
    from pivotrl.pipeline.demos import build_demonstrations
    from pivotrl.pipeline.entry import run_stage_process

    # The cluster run's pivot set; a new train key (node_failure_retries is a training setting).
    cfg = load_config(str(REPO / "configs" / "smoke.yaml"), _overrides(
        cluster, "run", "training.node_failure_retries=1", "faults.kill_trainer_node_at_step=1"))
    store = ArtifactStore.from_config(cfg)
    demos = build_demonstrations(cfg, store)
    ref = stages.stage_reference(cfg, store, demos)
    probe = stages.stage_probe(cfg, store, demos, ref)  # all three looked up, nothing computed
    t0 = time.time()
    res = run_stage_process("train", cfg.model_dump(mode="json"), {"probe": probe.to_dict(), "reference": ref.to_dict()},
                            threads=1)
    print(f"train stage with a lost node: {time.time() - t0:.0f} s")
    tkey = res["train_key"]
    assert store.exists(f"{tkey}/faults/node-lost-at-1")
    logs = "\n".join(p.read_text() for p in (cluster.driver["cache"] / "logs").glob("*-train-*.log"))
    assert "trainer node(s) [1] lost" in logs and "(attempt 2 of 2)" in logs, logs[-3000:]
    assert "resuming PivotRL training from" in logs and "step-000001" in logs
    assert store.read_json(f"{tkey}/summary.json")["steps"] == smoke_run.train.summary["steps"]
    _assert_close(_weights(store, f"{tkey}/policy", tmp_path / "w"),
                  _weights(smoke_run.store, smoke_run.train.policy_key, tmp_path))
    assert cluster.opens() == []
