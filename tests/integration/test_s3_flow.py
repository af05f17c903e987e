"""The smoke pipeline with its run root on a real S3 API server (moto, in a subprocess) and on a
local directory: same artifacts, same payload hashes; a storage outage in the middle of a run is
ridden out with nothing lost, duplicated or left half-written.

The model source is the local tiny checkpoint; only the run root is on S3. Payloads that record
wall-clock times, temporary paths, the run root's URL or the config hash (which covers
``run.storage_root``) are compared after masking those fields (see ``_payload_digests``).
"""

from __future__ import annotations

import contextlib
import hashlib
import io
import json
import logging
import os
import re
import signal
import subprocess
import sys
import threading
import time
import urllib.request
import uuid
from pathlib import Path
from typing import Any, Iterator

import pytest

from servers import free_port

from pivotrl.config import RunConfig, load_config
from pivotrl.core.errors import StorageError
from pivotrl.storage import COMPLETE_MARKER, MANIFEST_SUFFIX, ArtifactStore, RetryPolicy, is_transient

pytestmark = pytest.mark.integration

REPO = Path(__file__).resolve().parents[2]
BUCKET = "pivotrl-flow"
#: Keys (JSON) and columns (Parquet) that hold times, throughputs, temporary paths or the config hash.
VOLATILE = {"time_s", "tokens_per_s", "out_dir", "wall_s", "config_hash", "step_time_s", "rollout_s",
            "trainer_s", "mfu", "refresh_s", "policy_tokens_per_s", "ref_tokens_per_s",
            # the rollout engine's generation wall time and what derives from it (pivotrl.runtime.generation)
            "s"}
#: ... and the generation timings under any prefix (gen_s, heldout_before_gen_mfu...).
GENERATION_TIMING = re.compile(r"gen_(s|tokens_per_s|mfu)$")
#: The client gives up quickly on a stopped server, so the store's own retry policy does the waiting.
FAST_FAIL = {"config_kwargs": {"connect_timeout": 1, "read_timeout": 1, "retries": {"max_attempts": 1}}}


class S3Server:
    """``python -m moto.server`` on loopback, as a child process that can be paused (SIGSTOP)."""

    def __init__(self) -> None:
        self.port = free_port()
        self.endpoint = f"http://127.0.0.1:{self.port}"
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(self.port)],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
        )
        deadline = time.time() + 60
        while True:
            try:  # an S3 call (ListBuckets), not /moto-api/: moto loads its S3 backend on the first
                # one (seconds under load), which a client's short read timeout must not pay
                urllib.request.urlopen(f"{self.endpoint}/", timeout=30)
                return
            except OSError:
                if self.proc.poll() is not None or time.time() > deadline:
                    raise RuntimeError(f"moto server did not start (exit code {self.proc.poll()})")
                time.sleep(0.2)

    def pause(self) -> None:
        os.kill(self.proc.pid, signal.SIGSTOP)

    def resume(self) -> None:
        os.kill(self.proc.pid, signal.SIGCONT)

    def stop(self) -> None:
        self.resume()
        self.proc.terminate()
        try:
            self.proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()


@contextlib.contextmanager
def s3_environment(bucket: str) -> Iterator[tuple[S3Server, pytest.MonkeyPatch]]:
    """A started S3 server with its endpoint and test credentials in the environment only (never in
    configs) and ``bucket`` created; stopped on exit. Yields the server and the monkeypatch that set
    the environment (for more settings undone with it)."""
    import s3fs  # a declared dependency: missing, this fails

    server = S3Server()
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("AWS_ACCESS_KEY_ID", "testing")
        mp.setenv("AWS_SECRET_ACCESS_KEY", "testing")
        mp.setenv("AWS_ENDPOINT_URL_S3", server.endpoint)
        mp.delenv("AWS_PROFILE", raising=False)
        s3fs.S3FileSystem.clear_instance_cache()
        s3fs.S3FileSystem(skip_instance_cache=True).mkdir(bucket)
        try:
            yield server, mp
        finally:
            s3fs.S3FileSystem.clear_instance_cache()
            server.stop()


@pytest.fixture(scope="module")
def s3():
    """The S3 server with credentials and endpoint in the environment only (never in configs)."""
    with s3_environment(BUCKET) as (server, _):
        yield server


def _config(root: str, model: Path, *extra: str) -> RunConfig:
    return load_config(str(REPO / "configs" / "smoke.yaml"), [f"run.storage_root={root}", f"model.source={model}", *extra])


def _run_in_process(cfg: RunConfig) -> dict[str, Any]:
    """Every stage of the pipeline in this process, in the nightly flow's order."""
    from smoke_runs import run_smoke_stages

    _, _, demos, ref, probe, train, ev = run_smoke_stages(cfg)
    # the stages' typed results as the flow passes them between tasks (their dicts)
    return {"demos": demos, "reference": ref.to_dict(), "probe": probe.to_dict(), "train": train.to_dict(),
            "evaluate": ev.to_dict()}


def _mask(obj: Any, root: str) -> Any:
    if isinstance(obj, dict):
        return {k: _mask(v, root) for k, v in obj.items() if k not in VOLATILE and not GENERATION_TIMING.search(k)}
    if isinstance(obj, list):
        return [_mask(v, root) for v in obj]
    if isinstance(obj, str):
        return obj.replace(root, "<root>")
    return obj


def _digest(store: ArtifactStore, key: str) -> str:
    """sha256 of the payload at ``key``; for payloads with volatile fields, of the masked payload."""
    name = key.rsplit("/", 1)[-1]
    raw = store.read_bytes(key)
    if (name in ("report.json", "summary.json", "reference.json") or name.endswith(".sft.json")
            or key.startswith("eval/shards/") and name.endswith(".json")):
        masked = json.dumps(_mask(json.loads(raw), store.root_url), sort_keys=True).encode()
        return "masked:" + hashlib.sha256(masked).hexdigest()
    if name == "metrics.parquet":
        import pandas as pd

        df = pd.read_parquet(io.BytesIO(raw))
        df = df[[c for c in df.columns if c not in VOLATILE and not GENERATION_TIMING.search(c)]]
        return "masked:" + hashlib.sha256(df.to_json(orient="records", double_precision=12).encode()).hexdigest()
    if name == "report.md":
        lines = raw.decode().replace(store.root_url, "<root>").splitlines()
        # The speed table's rows (seconds, tokens/s, MFU) are measurements, not results.
        kept = [ln for ln in lines if not re.search("|".join(sorted(VOLATILE)), ln)
                and not ln.startswith(("| warm start (forward+backward)", "| PivotRL trainer", "| generation, "))]
        return "masked:" + hashlib.sha256("\n".join(kept).encode()).hexdigest()
    if name.endswith(".pt"):  # torch.save writes a random serialization id into every archive
        return "torch-archive"
    return hashlib.sha256(raw).hexdigest()


def _payload_digests(store: ArtifactStore) -> dict[str, str]:
    """key → payload digest for every artifact of a run (manifests and markers aside)."""
    out = {}
    for key in store.list():
        if key.endswith(MANIFEST_SUFFIX) or key.endswith(COMPLETE_MARKER):
            continue
        out[key] = _digest(store, key)
    return out


def _manifest_hashes(store: ArtifactStore) -> dict[str, tuple[str, str, dict[str, str | None]]]:
    """key → (kind, payload sha256 or 'volatile', input name → input sha256) of every manifest."""
    out = {}
    for key in store.list():
        if key.endswith(MANIFEST_SUFFIX):
            m = store.read_manifest(key[: -len(MANIFEST_SUFFIX)])
            volatile = m.kind in ("report", "training_metrics", "policy_checkpoint", "reference_checkpoint",
                                  "eval_shard_states", "eval_shard_tasks")  # carry the generation timings
            out[m.key] = (m.kind, "volatile" if volatile else m.sha256,
                          {n: r.get("sha256") for n, r in m.inputs.items() if n not in ("metrics",)})
    return out


def _tmp_keys(store: ArtifactStore) -> list[str]:
    tmp = f"{store._root}/.tmp"
    store.fs.invalidate_cache()
    return store.fs.find(tmp) if store.fs.exists(tmp) else []


@pytest.fixture(scope="module")
def local_run(smoke_run):
    """The session's in-process smoke run on a local root (conftest.py), as ``_run_in_process`` returns it."""
    _, store, demos, ref, probe, train, ev = smoke_run
    return store, {"demos": demos, "reference": ref.to_dict(), "probe": probe.to_dict(), "train": train.to_dict(),
                   "evaluate": ev.to_dict()}


def _s3_root() -> str:
    return f"s3://{BUCKET}/{uuid.uuid4().hex[:10]}/runs"


# ------------------------------------------------------------------------------------- tests
def test_local_run_has_every_artifact(local_run):
    store, out = local_run
    kinds = sorted(k for k, *_ in _manifest_hashes(store).values())
    # The one-machine run is one shard of probing and of evaluation (a task shard and a states shard).
    assert kinds == ["candidates", "eval_shard_states", "eval_shard_tasks", "pivots", "policy_checkpoint",
                     "probe_shard", "probes", "reference_checkpoint", "report", "training_metrics", "trajectories"]
    assert out["probe"]["stats"]["total"]["candidates"] == 17  # the smoke config's pivot split
    assert _tmp_keys(store) == []


def test_prefect_flow_on_s3_matches_the_local_run(s3, local_run, tiny_model, tmp_path, monkeypatch):
    """The real nightly flow (stages in child processes) with its run root on S3: same artifacts and
    payloads as the in-process local run; task results live under the run root on S3."""
    from prefect.testing.utilities import prefect_test_harness

    from pivotrl.flows.nightly import nightly

    local_store, _ = local_run
    root = _s3_root()
    monkeypatch.setenv("PREFECT_HOME", str(tmp_path / "prefect"))
    # The in-process run above initialised a single-process group here; its rendezvous variables
    # (and its bound MASTER_PORT) must not leak into the stage processes.
    for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
        monkeypatch.delenv(name, raising=False)
    with prefect_test_harness(server_startup_timeout=120):
        result = nightly(config_path=str(REPO / "configs" / "smoke.yaml"),
                         overrides=[f"run.storage_root={root}", f"model.source={tiny_model}"])
    store = ArtifactStore(root)
    assert result["report_json"].startswith(store.root_url + "/eval/")
    assert store.read_json(result["report_json"].removeprefix(store.root_url + "/"))["meta"]["pivots"] == 3  # the smoke pivot set
    assert _payload_digests(store) == _payload_digests(local_store)
    assert _manifest_hashes(store) == _manifest_hashes(local_store)
    assert store.list(".prefect-results") == [] and store.list("leases") == []  # no task cache; leases released
    assert _tmp_keys(store) == []
    # The recorded inputs of the pivot set point into the S3 run root, not at the local one.
    m = store.read_manifest(next(k for k in _manifest_hashes(store) if k.endswith("pivots.parquet")))
    assert all(r["uri"].startswith(store.root_url + "/") for r in m.inputs.values())


def test_storage_outage_mid_run_loses_and_duplicates_nothing(s3, local_run, tiny_model, monkeypatch, caplog):
    """SIGSTOP the S3 server when the first artifact appears, SIGCONT 6 s later; the run completes with
    the same payloads as the undisturbed local run and no temporary keys left behind."""
    import s3fs

    local_store, _ = local_run
    monkeypatch.setattr(s3fs.S3FileSystem, "retries", 1)  # the driver gives up at once: the store retries
    root = _s3_root()
    cfg = _config(root, tiny_model, f"run.storage_options={json.dumps(FAST_FAIL)}")
    watcher_fs = s3fs.S3FileSystem(skip_instance_cache=True)
    prefix = root.removeprefix("s3://")
    outage: dict[str, float] = {}

    def interrupt() -> None:
        deadline = time.time() + 120
        while time.time() < deadline:
            watcher_fs.invalidate_cache()
            try:
                found = watcher_fs.find(prefix)
            except OSError:
                found = []
            if any(p.endswith(MANIFEST_SUFFIX) for p in found):
                s3.pause()
                outage["stop"] = time.time()
                time.sleep(6.0)
                s3.resume()
                outage["cont"] = time.time()
                return
            time.sleep(0.05)

    thread = threading.Thread(target=interrupt, daemon=True)
    thread.start()
    caplog.set_level(logging.WARNING, logger="pivotrl.storage")
    try:
        _run_in_process(cfg)
        finished = time.time()
    finally:
        thread.join(timeout=30)
        s3.resume()
    assert "stop" in outage and "cont" in outage and finished > outage["cont"]
    store = ArtifactStore.from_config(cfg)
    assert _payload_digests(store) == _payload_digests(local_store)
    assert _manifest_hashes(store) == _manifest_hashes(local_store)
    assert _tmp_keys(store) == []


def test_store_retries_reads_and_writes_through_an_outage(s3, monkeypatch, caplog):
    """With the server stopped for 3 s, a read and an existence check fail at the driver, are retried
    by the store's policy and return the right answers; a write issued during the outage lands once."""
    import s3fs

    monkeypatch.setattr(s3fs.S3FileSystem, "retries", 1)
    store = ArtifactStore(_s3_root(), FAST_FAIL, retry=RetryPolicy(attempts=8, base_delay_s=0.5, max_delay_s=2.0))
    store.write_json("a/state.json", {"v": 1})
    caplog.set_level(logging.WARNING, logger="pivotrl.storage")

    for op in (lambda: store.read_json("a/state.json"), lambda: store.exists("a/missing.json"),
               lambda: store.write_json("a/during.json", {"v": 2})):
        s3.pause()
        timer = threading.Timer(3.0, s3.resume)
        timer.start()
        t0 = time.time()
        try:
            value = op()
        finally:
            timer.join()
        assert time.time() - t0 >= 2.5  # it really waited for the server
        assert value in ({"v": 1}, False) or value.endswith("a/during.json")
    assert any("retry 1 of 7" in r.getMessage() for r in caplog.records)
    assert store.read_json("a/during.json") == {"v": 2}
    assert store.list("a") == ["a/during.json", "a/state.json"]
    assert _tmp_keys(store) == []


def test_transient_errors_are_told_apart():
    from botocore.exceptions import ConnectTimeoutError, ReadTimeoutError

    assert is_transient(ReadTimeoutError(endpoint_url="http://x"))
    assert is_transient(ConnectTimeoutError(endpoint_url="http://x"))
    assert is_transient(ConnectionResetError())
    wrapped = StorageError("cannot read s3://b/k: timeout")
    wrapped.__cause__ = TimeoutError()
    assert is_transient(wrapped)
    assert not is_transient(FileNotFoundError("s3://b/k"))
    assert not is_transient(PermissionError("denied"))
    assert not is_transient(StorageError("cannot write s3://b/k: injected storage fault"))
    assert not is_transient(ValueError("Out of range float values are not JSON compliant"))
    assert RetryPolicy(attempts=4, base_delay_s=1.0, max_delay_s=3.0).delays() == [1.0, 2.0, 3.0]
    with pytest.raises(StorageError, match="attempts must be ≥ 1"):
        RetryPolicy(attempts=0)
