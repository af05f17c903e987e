"""The artifact store: the same tests on a local directory and on a real S3 API server (moto)."""

from __future__ import annotations

import hashlib
import json
import socket
import uuid
from pathlib import Path

import pandas as pd
import pytest

from pivotrl.config import config_hash, load_config
from pivotrl.core.errors import StorageError
from pivotrl.provenance.lineage import lineage_tree
from pivotrl.storage import COMPLETE_MARKER, ArtifactStore, Manifest

HELLO_SHA256 = "2cf24dba5fb0a30e26e83b2ac5b9e29e1b161e5c1fa7425e73043362938b9824"  # sha256(b"hello")
BUCKET = "pivotrl-test"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="session")
def s3_endpoint():
    """A moto S3 server in a thread for the whole session; credentials only in the environment."""
    import s3fs  # noqa: F401  (a declared dependency: missing, this fails)
    from moto.server import ThreadedMotoServer

    port = _free_port()
    server = ThreadedMotoServer(ip_address="127.0.0.1", port=port, verbose=False)
    server.start()
    endpoint = f"http://127.0.0.1:{port}"
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("AWS_ACCESS_KEY_ID", "testing")
        mp.setenv("AWS_SECRET_ACCESS_KEY", "testing")
        mp.setenv("AWS_ENDPOINT_URL_S3", endpoint)
        mp.delenv("AWS_PROFILE", raising=False)
        import s3fs

        s3fs.S3FileSystem.clear_instance_cache()
        s3fs.S3FileSystem(skip_instance_cache=True).mkdir(BUCKET)
        yield endpoint
        s3fs.S3FileSystem.clear_instance_cache()
    server.stop()


def _make_store(kind: str, tmp_path: Path, request, **kw) -> ArtifactStore:
    if kind == "local":
        return ArtifactStore(str(tmp_path / "store"), **kw)
    request.getfixturevalue("s3_endpoint")
    return ArtifactStore(f"s3://{BUCKET}/{uuid.uuid4().hex[:12]}/runs", **kw)


@pytest.fixture(params=["local", "s3"])
def store(request, tmp_path) -> ArtifactStore:
    return _make_store(request.param, tmp_path, request)


def _frame() -> pd.DataFrame:
    return pd.DataFrame({"id": ["t1", "t2", "t3"], "reward": [1.0, 0.0, 0.5], "turn": [0, 2, 5]})


def _tmp_keys(store: ArtifactStore) -> list[str]:
    tmp = f"{store._root}/.tmp"
    store.fs.invalidate_cache(tmp)
    return store.fs.find(tmp) if store.fs.exists(tmp) else []


# ------------------------------------------------------------------------------ round trips
def test_round_trips(store):
    assert store.write_bytes("a/hello.bin", b"hello") == store.url("a/hello.bin")
    assert store.read_bytes("a/hello.bin") == b"hello"
    assert store.sha256("a/hello.bin") == HELLO_SHA256
    store.write_text("a/note.txt", "π_ref ≠ π_old\n")
    assert store.read_text("a/note.txt") == "π_ref ≠ π_old\n"
    store.write_json("a/obj.json", {"b": [1, 2.5, None], "a": "x"})
    assert store.read_json("a/obj.json") == {"a": "x", "b": [1, 2.5, None]}
    assert store.read_bytes("a/obj.json") == b'{\n  "a": "x",\n  "b": [\n    1,\n    2.5,\n    null\n  ]\n}\n'
    store.write_parquet("b/frame.parquet", _frame())
    pd.testing.assert_frame_equal(store.read_parquet("b/frame.parquet"), _frame())
    store.write_bytes("a/chunks.bin", iter([b"he", b"l", b"lo"]))
    assert store.sha256("a/chunks.bin") == HELLO_SHA256
    assert store.list() == ["a/chunks.bin", "a/hello.bin", "a/note.txt", "a/obj.json", "b/frame.parquet"]
    assert store.list("b") == ["b/frame.parquet"]
    assert store.list("nothing/here") == []
    assert store.exists("a/hello.bin") and store.exists("a") and not store.exists("a/hello")
    store.write_bytes("a/hello.bin", b"HELLO")  # overwrite
    assert store.read_bytes("a/hello.bin") == b"HELLO"
    store.delete("a")
    assert store.list() == ["b/frame.parquet"]
    assert _tmp_keys(store) == []


def test_urls(store, tmp_path):
    if store.root_url.startswith("file://"):
        assert store.url("x/y.json") == f"file://{tmp_path / 'store'}/x/y.json"
    else:
        assert store.url("x/y.json").startswith(f"s3://{BUCKET}/") and store.url("x/y.json").endswith("/runs/x/y.json")


def test_identical_content_hashes_on_both_stores(tmp_path, request):
    local = _make_store("local", tmp_path, request)
    s3 = _make_store("s3", tmp_path, request)
    cfg = load_config(None, ["run.seed=7"])
    hashes = []
    for st in (local, s3):
        a = st.write_artifact("demo/frame.parquet", _frame(), kind="frame", config=cfg)
        b = st.write_artifact("demo/counts.json", {"kept": 3}, kind="counts", inputs={"frame": a.uri})
        c = st.write_artifact("demo/raw.bin", b"hello", kind="raw")
        hashes.append((a.sha256, b.sha256, c.sha256, b.inputs["frame"]["sha256"], st.sha256("demo/frame.parquet")))
    assert hashes[0] == hashes[1]
    assert hashes[0][2] == HELLO_SHA256 and hashes[0][3] == hashes[0][0] == hashes[0][4]


# ------------------------------------------------------------------------------- atomicity
def test_failed_streaming_write_leaves_nothing(store):
    def chunks():
        yield b"x" * 1000
        raise RuntimeError("payload broke mid-way")

    with pytest.raises(RuntimeError, match="mid-way"):
        store.write_bytes("c/partial.bin", chunks())
    assert not store.exists("c/partial.bin")
    assert store.list() == [] and _tmp_keys(store) == []


def test_failed_overwrite_keeps_the_old_artifact(store):
    store.write_json("c/state.json", {"v": 1})
    with pytest.raises(TypeError):
        store.write_json("c/state.json", {"v": object()})  # JSON cannot encode it
    bad = pd.DataFrame({"mixed": [1, "two", 3.0]})  # pyarrow cannot convert this column
    with pytest.raises(Exception) as e:
        store.write_parquet("c/state.parquet", bad)
    assert not isinstance(e.value, StorageError)
    assert store.read_json("c/state.json") == {"v": 1}
    assert store.list() == ["c/state.json"] and _tmp_keys(store) == []


def test_injected_storage_fault_publishes_nothing(store, tmp_path, request):
    kind = "local" if store.root_url.startswith("file://") else "s3"
    faulty = _make_store(kind, tmp_path, request, failure_rate=0.999, seed=0)
    with pytest.raises(StorageError, match=r"cannot write .*/f\.bin: injected storage fault"):
        faulty.write_bytes("f.bin", b"data")
    assert faulty.list() == [] and _tmp_keys(faulty) == []


# ---------------------------------------------------------------------------- directories
def _checkpoint(root: Path, weights: bytes = b"\x00\x01" * 5000) -> Path:
    (root / "sub").mkdir(parents=True)
    (root / "model.safetensors").write_bytes(weights)
    (root / "config.json").write_text('{"layers": 2}', encoding="utf-8")
    (root / "sub" / "tokenizer.json").write_text("{}", encoding="utf-8")
    return root


def test_put_dir_get_dir_round_trip(store, tmp_path):
    src = _checkpoint(tmp_path / "ckpt")
    store.put_dir(src, "ckpt/step-1")
    assert store.list("ckpt") == [
        f"ckpt/step-1/{COMPLETE_MARKER}", "ckpt/step-1/config.json", "ckpt/step-1/model.safetensors",
        "ckpt/step-1/sub/tokenizer.json",
    ]
    assert store.has_dir("ckpt/step-1")
    marker = store.dir_listing("ckpt/step-1")
    assert marker["files"]["model.safetensors"] == {
        "size": 10000, "sha256": hashlib.sha256(b"\x00\x01" * 5000).hexdigest()
    }
    out = store.get_dir("ckpt/step-1", tmp_path / "out" / "step-1")
    got = sorted(p.relative_to(out).as_posix() for p in out.rglob("*") if p.is_file())
    assert got == ["config.json", "model.safetensors", "sub/tokenizer.json"]  # no marker copied
    assert (out / "model.safetensors").read_bytes() == (src / "model.safetensors").read_bytes()
    with pytest.raises(StorageError, match="exists and is not an empty directory"):
        store.get_dir("ckpt/step-1", out)
    assert _tmp_keys(store) == []


def test_republishing_replaces_the_old_directory(store, tmp_path):
    store.put_dir(_checkpoint(tmp_path / "v1"), "ckpt/latest")
    store.write_bytes("ckpt/latest/stale.bin", b"left over")
    v2 = tmp_path / "v2"
    v2.mkdir()
    (v2 / "model.safetensors").write_bytes(b"new")
    store.put_dir(v2, "ckpt/latest")
    assert store.list("ckpt/latest") == [f"ckpt/latest/{COMPLETE_MARKER}", "ckpt/latest/model.safetensors"]
    out = store.get_dir("ckpt/latest", tmp_path / "got")
    assert (out / "model.safetensors").read_bytes() == b"new"


def test_get_dir_refuses_an_unfinished_upload(store, tmp_path):
    # What an interrupted upload leaves behind: files, no marker.
    store.write_bytes("ckpt/step-2/model.safetensors", b"half")
    with pytest.raises(StorageError, match=r"ckpt/step-2 has no _COMPLETE marker"):
        store.get_dir("ckpt/step-2", tmp_path / "out")
    assert not (tmp_path / "out").exists() and not store.has_dir("ckpt/step-2")


def test_get_dir_detects_a_file_changed_after_publishing(store, tmp_path):
    store.put_dir(_checkpoint(tmp_path / "ckpt"), "ckpt/step-3")
    store.write_bytes("ckpt/step-3/config.json", b'{"layers": 3}')  # same size, other bytes
    with pytest.raises(StorageError, match=r"config.json: content does not match the _COMPLETE marker"):
        store.get_dir("ckpt/step-3", tmp_path / "out")
    assert not (tmp_path / "out").exists()
    assert list(tmp_path.glob(".out.*")) == []  # the temporary download is gone


# ------------------------------------------------------------------------------- manifests
def test_manifest_records_provenance(store, tmp_path):
    options = "run.storage_options={client_kwargs: {endpoint_url: 'http://10.9.8.7:9'}}"
    cfg = load_config(None, ["probing.seed=11", options])
    raw = store.write_artifact("data/raw.bin", b"hello", kind="raw")
    frame = store.write_artifact(
        "data/frame.parquet", _frame(), kind="candidates",
        inputs={"raw": raw.uri, "wheel": "pypi:bfcl-eval==2026.3.23#simple_python"},
        config=cfg, extra={"seed": 5, "count": 3},
    )
    text = store.read_text("data/frame.parquet.manifest.json")
    doc = json.loads(text)
    assert Manifest.from_dict(doc) == frame == store.read_manifest("data/frame.parquet")
    assert doc["uri"] == store.url("data/frame.parquet") and doc["kind"] == "candidates"
    assert doc["sha256"] == store.sha256("data/frame.parquet")
    assert doc["size"] == len(store.read_bytes("data/frame.parquet"))
    assert doc["inputs"] == {
        "raw": {"uri": raw.uri, "sha256": HELLO_SHA256},
        "wheel": {"uri": "pypi:bfcl-eval==2026.3.23#simple_python", "sha256": None},
    }
    assert doc["config_hash"] == config_hash(cfg)
    assert doc["seeds"] == {"config.run.seed": 0, "config.data.split.seed": 0, "config.probing.seed": 11,
                            "config.evaluation.seeds": [0], "seed": 5}
    assert doc["extra"] == {"seed": 5, "count": 3}
    libraries = {"python", "pivotrl", "torch", "transformers", "vllm", "deepspeed", "prefect"}
    assert set(doc["package_versions"]) == libraries
    assert doc["code_version"].startswith(("git:", "pivotrl=="))
    assert doc["prefect"] is None and doc["created_at"].endswith("+00:00")
    assert "storage_options" not in text and "10.9.8.7" not in text
    assert store.has_artifact("data/frame.parquet") and not store.has_artifact("data/nothing")


def test_manifest_of_a_directory_and_of_json(store, tmp_path):
    ckpt = store.write_artifact("ckpt/s1", _checkpoint(tmp_path / "c"), kind="checkpoint")
    listing = store.dir_listing("ckpt/s1")
    assert ckpt.sha256 == listing["tree_sha256"] and ckpt.size == 10000 + 13 + 2
    js = store.write_artifact("x/y.json", {"a": 1}, kind="summary")
    assert js.sha256 == hashlib.sha256(b'{\n  "a": 1\n}\n').hexdigest()


def test_manifest_carries_prefect_ids_inside_a_run(store, monkeypatch):
    m = store.write_artifact("p/none.bin", b"x", kind="raw")
    assert m.prefect is None  # the core alone knows no orchestrator
    import pivotrl.tasks  # noqa: F401  (the orchestration layer registers where the run ids come from)

    flow_id = str(uuid.uuid4())
    monkeypatch.setenv("PREFECT__FLOW_RUN_ID", flow_id)
    m = store.write_artifact("p/x.bin", b"x", kind="raw")
    assert m.prefect == {"flow_run_id": flow_id, "task_run_id": None}


def test_lineage_walks_inputs_and_flags_changes(store):
    raw = store.write_artifact("l/raw.bin", b"hello", kind="raw", inputs={"src": "pypi:bfcl-eval==2026.3.23#multiple"})
    mid = store.write_artifact("l/mid.json", {"n": 1}, kind="mid", inputs={"raw": raw.uri})
    top = store.write_artifact("l/top.json", {"n": 2}, kind="top", inputs={"mid": mid.uri, "raw": raw.uri})
    tree = lineage_tree(store, "l/top.json")
    assert tree["sha256"] == top.sha256 and tree["kind"] == "top"
    assert tree["inputs"]["mid"]["kind"] == "mid" and tree["inputs"]["mid"]["stale"] is False
    assert tree["inputs"]["mid"]["inputs"]["raw"]["sha256"] == HELLO_SHA256
    leaf = {"uri": "pypi:bfcl-eval==2026.3.23#multiple", "kind": "source", "source": True, "sha256": None}
    assert tree["inputs"]["raw"]["inputs"]["src"] == leaf
    store.write_artifact("l/raw.bin", b"changed", kind="raw")  # the input moved on after `mid` was built
    assert lineage_tree(store, "l/top.json")["inputs"]["mid"]["inputs"]["raw"]["stale"] is True


# ---------------------------------------------------------------------------------- errors
def test_errors_name_the_url(store):
    with pytest.raises(StorageError) as e:
        store.read_bytes("missing.bin")
    assert str(e.value) == f"cannot read {store.url('missing.bin')}: not found"
    with pytest.raises(StorageError, match=r"has no manifest \(.*none\.json\.manifest\.json not found\)"):
        store.read_manifest("none.json")
    store.write_text("t.txt", "not json")
    with pytest.raises(StorageError, match=r"t\.txt: not valid JSON"):
        store.read_json("t.txt")
    with pytest.raises(StorageError, match=r"t\.txt: not a Parquet file"):
        store.read_parquet("t.txt")
    for bad in ["../escape", "/abs", "a//b", "a/./b", ".tmp/x", ""]:
        with pytest.raises(StorageError):
            store.write_bytes(bad, b"x")


def test_bad_root_and_local_dir():
    with pytest.raises(StorageError, match="cannot open artifact store nosuchproto://x"):
        ArtifactStore("nosuchproto://x")
    with pytest.raises(StorageError, match="failure_rate = 1.5"):
        ArtifactStore("memory://x", failure_rate=1.5)


def test_a_local_storage_root_under_a_file_is_named_as_a_file(tmp_path):
    from pivotrl.storage.check import check_storage

    blocker = tmp_path / "runs"
    blocker.write_text("a file where a folder belongs\n", encoding="utf-8")
    for root in (blocker / "root", blocker / "a" / "b", blocker):
        with pytest.raises(StorageError) as e:
            check_storage(str(root))
        assert str(e.value) == (f"storage root {root}: {blocker} is a file, not a directory; choose another "
                                "run.storage_root or move the file")
    check_storage(str(tmp_path / "fresh" / "root"))  # a root that does not exist yet is fine


def test_a_cache_folder_under_a_file_is_named_with_what_to_set(tmp_path):
    from pivotrl.storage.check import check_cache_dir

    blocker = tmp_path / "cache"
    blocker.write_text("a file where a folder belongs\n", encoding="utf-8")
    for folder in (blocker, blocker / "sub"):
        with pytest.raises(StorageError) as e:
            check_cache_dir(folder)
        assert str(e.value) == (f"cache folder {folder}: {blocker} is a file, not a directory; set run.cache_dir "
                                "(or PIVOTRL_CACHE_DIR, which takes its place) to another folder or move the file")
    check_cache_dir(tmp_path / "fresh" / "cache")  # a folder that does not exist yet is fine
    assert not (tmp_path / "fresh").exists()  # and the check creates nothing


def test_put_dir_refuses_a_missing_directory(store, tmp_path):
    with pytest.raises(StorageError, match="is not a directory"):
        store.put_dir(tmp_path / "absent", "ckpt/x")


# ------------------------------------------------------------------ one retry, one atomic publish
def test_call_with_retries_waits_exponentially_up_to_the_cap_and_counts(monkeypatch):
    from pivotrl.storage import RetryStats, call_with_retries

    waits: list[float] = []
    monkeypatch.setattr("time.sleep", waits.append)
    seen: list[tuple[int, float]] = []
    attempts = iter([ConnectionResetError("reset")] * 4 + ["done"])

    def flaky() -> str:
        item = next(attempts)
        if isinstance(item, Exception):
            raise item
        return item

    stats = RetryStats()
    out = call_with_retries(flaky, 5, 0.1, retry_on=(ConnectionError,), stats=stats, max_backoff_s=0.3,
                            on_retry=lambda e, k, w: seen.append((k, w)))
    assert out == "done"
    assert waits == pytest.approx([0.1, 0.2, 0.3, 0.3])
    assert [k for k, _ in seen] == [1, 2, 3, 4] and stats.retries == 4 and stats.failures == 0
    with pytest.raises(ValueError):  # not retryable: raised at once, no wait
        call_with_retries(lambda: int("x"), 5, 0.1, retry_on=(ConnectionError,), stats=stats)
    assert len(waits) == 4 and stats.calls == 2


def test_atomic_file_and_dir_publish_whole_or_leave_the_old_state(tmp_path):
    from pivotrl.storage import atomic_dir, atomic_file

    target = tmp_path / "result.json"
    target.write_text("old")
    with pytest.raises(RuntimeError):
        with atomic_file(target) as tmp:
            tmp.write_text("half")
            raise RuntimeError("killed mid-write")
    assert target.read_text() == "old" and sorted(p.name for p in tmp_path.iterdir()) == ["result.json"]
    with atomic_file(target) as tmp:
        tmp.write_text("new")
    assert target.read_text() == "new" and sorted(p.name for p in tmp_path.iterdir()) == ["result.json"]

    ckpt = tmp_path / "ckpt"
    with pytest.raises(RuntimeError):
        with atomic_dir(ckpt) as tmp:
            (tmp / "config.json").write_text("{}")
            raise RuntimeError("killed mid-write")
    assert not ckpt.exists() and sorted(p.name for p in tmp_path.iterdir()) == ["result.json"]
    with atomic_dir(ckpt) as tmp:
        (tmp / "config.json").write_text("{}")
    assert (ckpt / "config.json").read_text() == "{}" and oct(ckpt.stat().st_mode & 0o777) == "0o755"
    # A second writer of the same cache entry finds it published: its copy is dropped, no error.
    with atomic_dir(ckpt, already_published=lambda t: (t / "config.json").is_file()) as tmp:
        (tmp / "config.json").write_text('{"late": true}')
    assert (ckpt / "config.json").read_text() == "{}"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ckpt", "result.json"]
    with pytest.raises(OSError):  # without that check, a non-empty target is an error
        with atomic_dir(ckpt) as tmp:
            (tmp / "x").write_text("x")
