"""Fail fast on a storage root that cannot work: an s3:// root without credentials, or with a bucket
that does not exist, on a real S3 API server (moto on 127.0.0.1), fails `pivotrl run` in seconds
with one line naming what to set, before Prefect or any stage starts; such errors are never retried."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from pivotrl.core.errors import StorageAccessError
from pivotrl.pipeline.entry import is_permanent
from pivotrl.storage import ArtifactStore
from pivotrl.storage.check import check_storage

pytestmark = pytest.mark.integration

REPO = Path(__file__).resolve().parents[2]
PIVOTRL = str(Path(sys.executable).parent / "pivotrl")


@pytest.fixture(scope="module")
def s3_endpoint():
    import s3fs  # noqa: F401  (a declared dependency: missing, this fails)
    from test_s3_flow import S3Server

    server = S3Server()
    try:
        yield server.endpoint
    finally:
        server.stop()


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> Path:
    from pivotrl.testing import save_tiny_checkpoint

    return save_tiny_checkpoint(tmp_path_factory.mktemp("tiny") / "model")


def _env(tmp_path: Path, endpoint: str, **extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("AWS_")}
    # no ~/.aws of the machine running the tests
    return {**env, "HOME": str(tmp_path), "AWS_ENDPOINT_URL_S3": endpoint, "AWS_EC2_METADATA_DISABLED": "true",
            "PREFECT_HOME": str(tmp_path / "prefect"), **extra}


def _run(env: dict[str, str], root: str, model: Path) -> tuple[subprocess.CompletedProcess, float]:
    t0 = time.monotonic()
    out = subprocess.run([PIVOTRL, "run", "--config", "configs/smoke.yaml", "--set", f"run.storage_root={root}",
                          "--set", f"model.source={model}"], cwd=REPO, env=env, capture_output=True, text=True,
                         timeout=60)
    return out, time.monotonic() - t0


def test_s3_root_without_credentials_fails_in_seconds_with_one_line(s3_endpoint, tiny, tmp_path):
    out, wall = _run(_env(tmp_path, s3_endpoint), "s3://pivotrl-preflight/runs", tiny)
    assert out.returncode == 2, out.stderr
    lines = out.stderr.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in out.stderr, out.stderr
    assert "no AWS credentials" in lines[0] and "AWS_ACCESS_KEY_ID" in lines[0] and "AWS_SECRET_ACCESS_KEY" in lines[0]
    assert "AWS_ENDPOINT_URL_S3" in lines[0]
    print(f"missing credentials: exit 2 after {wall:.2f} s (load {os.getloadavg()[0]:.1f}): {lines[0]}")


def test_s3_bucket_that_does_not_exist_fails_in_seconds_with_one_line(s3_endpoint, tiny, tmp_path):
    env = _env(tmp_path, s3_endpoint, AWS_ACCESS_KEY_ID="testing", AWS_SECRET_ACCESS_KEY="testing")
    out, wall = _run(env, "s3://no-such-bucket-here/runs", tiny)
    assert out.returncode == 2, out.stderr
    lines = out.stderr.strip().splitlines()
    assert len(lines) == 1 and "NoSuchBucket" in lines[0] and "no-such-bucket-here" in lines[0], out.stderr
    print(f"missing bucket: exit 2 after {wall:.2f} s (load {os.getloadavg()[0]:.1f})")


def test_access_errors_are_permanent_and_not_retried(s3_endpoint, monkeypatch, tmp_path, caplog):
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "testing")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "testing")
    monkeypatch.setenv("AWS_ENDPOINT_URL_S3", s3_endpoint)
    with pytest.raises(StorageAccessError, match="NoSuchBucket"):
        check_storage("s3://missing-bucket/x")
    store = ArtifactStore("s3://missing-bucket/x", {"skip_instance_cache": True})
    with caplog.at_level("WARNING", logger="pivotrl.storage"):
        with pytest.raises(StorageAccessError) as err:
            store.write_json("a.json", {"x": 1})  # the store's retry policy would log each retry
    assert is_permanent(err.value) and "retry" not in caplog.text
    check_storage(str(tmp_path / "local-root"))  # a writable local root passes
    assert list(tmp_path.iterdir()) == []  # its test file written and removed
    import s3fs

    fs = s3fs.S3FileSystem(skip_instance_cache=True)
    fs.mkdir("pivotrl-writable")
    check_storage("s3://pivotrl-writable/runs")  # lists, writes and removes its test object
    assert fs.find("pivotrl-writable", refresh=True) == []


def test_an_endpoint_that_does_not_answer_gets_one_request_per_check(monkeypatch):
    """The pre-run checks make one attempt: an endpoint that accepts connections and never answers
    sees one request from the storage root's check and one from a source's, each ending in a
    StorageError naming the endpoint (botocore's own retry and s3fs's retry loop made it 10 requests,
    each waiting out the read timeout: 46 s with the default 4-s timeout)."""
    import socket
    import threading

    import s3fs  # noqa: F401  (a declared dependency: missing, this fails)
    from pivotrl.core.errors import StorageError

    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen(32)
    requests: list[bytes] = []
    held: list[socket.socket] = []

    def accept() -> None:
        while True:
            try:
                conn, _ = listener.accept()
            except OSError:
                return
            held.append(conn)  # kept open, never answered
            conn.settimeout(5)
            try:
                requests.append(conn.recv(65536))
            except OSError:
                pass

    threading.Thread(target=accept, daemon=True).start()
    endpoint = f"http://127.0.0.1:{listener.getsockname()[1]}"
    for k in [k for k in os.environ if k.startswith("AWS_")]:
        monkeypatch.delenv(k)
    monkeypatch.setenv("AWS_ENDPOINT_URL_S3", endpoint)
    monkeypatch.setenv("AWS_EC2_METADATA_DISABLED", "true")
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "testing")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "testing")
    from pivotrl.storage.check import check_source

    try:
        with pytest.raises(StorageError, match=rf"does not answer at {endpoint} .*ReadTimeoutError"):
            check_storage("s3://a-bucket/runs", timeout_s=0.5)
        assert len(requests) == 1 and requests[0].startswith(b"GET /a-bucket"), requests
        with pytest.raises(StorageError, match=rf"does not answer at {endpoint} .*ReadTimeoutError"):
            check_source("s3://a-bucket/demos.jsonl", timeout_s=0.5)
        assert len(requests) == 2 and requests[1].startswith(b"HEAD /a-bucket/demos.jsonl"), requests
    finally:
        listener.close()
        for conn in held:
            conn.close()


def test_flow_checks_storage_before_any_stage(s3_endpoint, tiny, tmp_path, monkeypatch):
    """A deployment run has no CLI in front of it: the flow itself fails first, not retried."""
    from pivotrl.flows.nightly import nightly

    for k in [k for k in os.environ if k.startswith("AWS_")]:
        monkeypatch.delenv(k)
    monkeypatch.setenv("HOME", str(tmp_path))
    monkeypatch.setenv("AWS_ENDPOINT_URL_S3", s3_endpoint)
    with pytest.raises(StorageAccessError, match="AWS_ACCESS_KEY_ID"):
        nightly.fn(config_path=str(REPO / "configs" / "smoke.yaml"),
                   overrides=["run.storage_root=s3://pivotrl-preflight/runs", f"model.source={tiny}"])


def test_stage_lease_is_exclusive_on_s3(s3_endpoint, monkeypatch):
    """The lease's exclusive create is a conditional put (If-None-Match) on an object store."""
    import threading

    import s3fs

    from pivotrl.storage.lease import stage_lease

    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "testing")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "testing")
    monkeypatch.setenv("AWS_ENDPOINT_URL_S3", s3_endpoint)
    s3fs.S3FileSystem(skip_instance_cache=True).mkdir("pivotrl-lease")
    store = ArtifactStore("s3://pivotrl-lease/root", {"skip_instance_cache": True})
    events: list[tuple[str, int]] = []

    def hold(i: int) -> None:
        with stage_lease(store, "pivotrl-train-k", poll=0.1):
            events.append(("in", i))
            time.sleep(0.3)
            events.append(("out", i))

    threads = [threading.Thread(target=hold, args=(i,)) for i in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
    assert len(events) == 6 and all(events[k][0] == "in" and events[k + 1] == ("out", events[k][1])
                                     for k in range(0, 6, 2)), events
    assert store.list("leases") == []


# ------------------------------------------------------------------ remote sources, denied writes
SOURCE_KEY = "demos/chat.jsonl"


@pytest.fixture(scope="module")
def read_only_s3(tmp_path_factory):
    """A moto S3 server that enforces IAM: one bucket holding a demonstration file, and the keys of
    a user who may list and read it but not write ``(endpoint, key id, secret, bucket)``. Moto
    checks no request until ``INITIAL_NO_AUTH_ACTION_COUNT`` have been served: exactly the five of
    the setup below."""
    import s3fs  # noqa: F401  (a declared dependency: missing, this fails)
    import json

    import boto3
    from servers import free_port, server

    port = free_port()
    endpoint = f"http://127.0.0.1:{port}"
    env = {**os.environ, "INITIAL_NO_AUTH_ACTION_COUNT": "5"}
    log = tmp_path_factory.mktemp("moto-iam") / "moto.log"
    with server([sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(port)], log,
                ready=f"{endpoint}/moto-api/", what="moto server (IAM enforced)", env=env):
        admin = dict(endpoint_url=endpoint, region_name="us-east-1", aws_access_key_id="testing",
                     aws_secret_access_key="testing")
        bucket = "pivotrl-read-only"
        s3 = boto3.client("s3", **admin)
        s3.create_bucket(Bucket=bucket)
        line = {"id": "t1", "messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "Done."}]}
        s3.put_object(Bucket=bucket, Key=SOURCE_KEY, Body=(json.dumps(line) + "\n").encode())
        iam = boto3.client("iam", **admin)
        iam.create_user(UserName="reader")
        iam.put_user_policy(UserName="reader", PolicyName="read-only", PolicyDocument=json.dumps({
            "Version": "2012-10-17",
            "Statement": [{"Effect": "Allow", "Action": ["s3:ListBucket", "s3:GetObject"], "Resource": "*"}]}))
        key = iam.create_access_key(UserName="reader")["AccessKey"]
        yield endpoint, key["AccessKeyId"], key["SecretAccessKey"], bucket


def _run_with(env: dict[str, str], model: Path, *sets: str) -> tuple[subprocess.CompletedProcess, float]:
    t0 = time.monotonic()
    cmd = [PIVOTRL, "run", "--config", "configs/smoke.yaml", "--set", f"model.source={model}"]
    for s in sets:
        cmd += ["--set", s]
    out = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=120)
    return out, time.monotonic() - t0


def _chat_source(url: str) -> str:
    return "data.sources=[{kind: chat, url: '" + url + "'}]"


def test_a_remote_source_without_credentials_fails_with_one_line(s3_endpoint, tiny, tmp_path):
    out, wall = _run_with(_env(tmp_path, s3_endpoint), tiny, f"run.storage_root={tmp_path / 'root'}",
                          _chat_source("s3://pivotrl-demos/chat.jsonl"))
    assert out.returncode == 2, out.stderr
    lines = out.stderr.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in out.stderr, out.stderr
    assert lines[0].startswith("data error: data.sources[0] (chat): s3://pivotrl-demos/chat.jsonl: no AWS credentials")
    assert "AWS_ACCESS_KEY_ID" in lines[0] and "AWS_SECRET_ACCESS_KEY" in lines[0]
    print(f"remote source, no credentials: exit 2 after {wall:.2f} s (load {os.getloadavg()[0]:.1f}): {lines[0]}")


def test_a_remote_source_at_a_closed_endpoint_fails_with_one_line(tiny, tmp_path):
    from servers import free_port

    closed = f"http://127.0.0.1:{free_port()}"  # nothing listens there
    env = _env(tmp_path, closed, AWS_ACCESS_KEY_ID="testing", AWS_SECRET_ACCESS_KEY="testing")
    out, wall = _run_with(env, tiny, f"run.storage_root={tmp_path / 'root'}", _chat_source("s3://pivotrl-demos/c.jsonl"))
    assert out.returncode == 2, out.stderr
    lines = out.stderr.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in out.stderr, out.stderr
    assert lines[0].startswith("data error: data.sources[0] (chat): s3://pivotrl-demos/c.jsonl: the store does not "
                               f"answer at {closed}")
    print(f"remote source, closed endpoint: exit 2 after {wall:.2f} s (load {os.getloadavg()[0]:.1f})")


def test_remote_sources_are_checked_for_reading(read_only_s3, monkeypatch):
    from pivotrl.core.errors import SourceNotFoundError
    from pivotrl.storage.check import check_sources

    endpoint, key, secret, bucket = read_only_s3
    for k in [k for k in os.environ if k.startswith("AWS_")]:
        monkeypatch.delenv(k)
    monkeypatch.setenv("AWS_ENDPOINT_URL_S3", endpoint)
    monkeypatch.setenv("AWS_EC2_METADATA_DISABLED", "true")
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", key)
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", secret)
    from pivotrl.config import ChatSource

    check_sources([ChatSource(url=f"s3://{bucket}/{SOURCE_KEY}")])  # the reader may read it
    with pytest.raises(SourceNotFoundError, match=rf"^data.sources\[1\] \(chat\): s3://{bucket}/nope.jsonl: no such "):
        check_sources([ChatSource(url=f"s3://{bucket}/{SOURCE_KEY}"), ChatSource(url=f"s3://{bucket}/nope.jsonl")])
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "wrong")
    with pytest.raises(StorageAccessError, match=r"read access refused") as e:
        check_sources([ChatSource(url=f"s3://{bucket}/{SOURCE_KEY}")])
    assert is_permanent(e.value) and "\n" not in str(e.value)


def test_a_root_that_lists_but_denies_writes_fails_before_any_stage(read_only_s3, tiny, tmp_path):
    endpoint, key, secret, bucket = read_only_s3
    env = _env(tmp_path, endpoint, AWS_ACCESS_KEY_ID=key, AWS_SECRET_ACCESS_KEY=secret)
    out, wall = _run_with(env, tiny, f"run.storage_root=s3://{bucket}/runs")
    assert out.returncode == 2, out.stderr
    lines = out.stderr.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in out.stderr, out.stderr
    assert lines[0].startswith(f"storage error: storage root s3://{bucket}/runs: it can be listed but not written "
                               "(access refused"), lines[0]
    assert "[pivotrl] stage" not in out.stdout  # no stage started
    print(f"denied writes: exit 2 after {wall:.2f} s (load {os.getloadavg()[0]:.1f}): {lines[0]}")


def test_denied_writes_are_permanent_and_never_retried(read_only_s3, monkeypatch, tmp_path):
    """Past the pre-run check (a deployment whose rights changed mid-run): the store's writes, its
    pipeline retries and the stage lease all give a StorageAccessError at once."""
    from pivotrl.config import load_config
    from pivotrl.storage.lease import stage_lease
    from pivotrl.pipeline.common import make_store

    endpoint, key, secret, bucket = read_only_s3
    for k in [k for k in os.environ if k.startswith("AWS_")]:
        monkeypatch.delenv(k)
    monkeypatch.setenv("AWS_ENDPOINT_URL_S3", endpoint)
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", key)
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", secret)
    cfg = load_config("configs/smoke.yaml", [f"run.storage_root=s3://{bucket}/runs",
                                             "run.storage_options={skip_instance_cache: true}"])
    store = make_store(cfg)
    with pytest.raises(StorageAccessError, match="access refused") as e:
        store.write_json("a.json", {"x": 1})
    assert is_permanent(e.value) and store.write_retries == 0
    with pytest.raises(StorageAccessError, match=r"cannot take the lease on stage probe-k at .*access refused") as e:
        with stage_lease(store, "probe-k"):
            pass
    assert is_permanent(e.value)


def test_a_config_at_an_s3_url_is_read_or_refused_with_one_line(s3_endpoint, tiny, tmp_path):
    import s3fs

    url = "s3://pivotrl-configs/smoke.yaml"
    cmd = [PIVOTRL, "config", "--config", url, "--set", f"model.source={tiny}", "--set", "run.sizing=fixed",
           "--set", f"run.storage_root={tmp_path / 'root'}"]

    def config(env: dict[str, str]) -> subprocess.CompletedProcess:
        return subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=60)

    out = config(_env(tmp_path, s3_endpoint))  # no credentials
    assert out.returncode == 2 and "Traceback" not in out.stderr, out.stderr
    assert out.stderr.strip() == (f"error (StorageAccessError): config {url}: no AWS credentials found; set "
                                  "AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY (and AWS_ENDPOINT_URL_S3 for a non-AWS "
                                  "endpoint), or AWS_PROFILE / an instance role")
    env = _env(tmp_path, s3_endpoint, AWS_ACCESS_KEY_ID="testing", AWS_SECRET_ACCESS_KEY="testing")
    fs = s3fs.S3FileSystem(key="testing", secret="testing", client_kwargs={"endpoint_url": s3_endpoint})
    fs.mkdir("pivotrl-configs")
    out = config(env)  # the bucket, not the object
    assert out.returncode == 2 and out.stderr.strip() == f"error (SourceNotFoundError): config {url}: no such file (object or bucket)", out.stderr
    fs.put(str(REPO / "configs" / "smoke.yaml"), "pivotrl-configs/smoke.yaml")
    out = config(env)
    assert out.returncode == 0, out.stderr
    assert f"source: {tiny}" in out.stdout and "group_size:" in out.stdout
