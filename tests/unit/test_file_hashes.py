"""File hashes through ``hashlib.file_digest`` give the digests of the chunked reads they replaced."""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path

import pytest

from pivotrl.core.hashing import content_hash, file_sha256


def _chunked(path: Path, digest: "hashlib._Hash | None" = None) -> "hashlib._Hash":
    """The replaced implementation: 1 MiB blocks into one sha256."""
    digest = digest or hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return digest


@pytest.mark.parametrize("size", [0, 1, (1 << 20) - 1, 1 << 20, (1 << 20) * 2 + 7])
def test_file_sha256_equals_the_chunked_digest(tmp_path: Path, size: int) -> None:
    data = os.urandom(size)
    path = tmp_path / "blob.bin"
    path.write_bytes(data)
    assert file_sha256(path) == _chunked(path).hexdigest() == hashlib.sha256(data).hexdigest()


def test_source_hash_of_a_file_and_a_directory_is_unchanged(tmp_path: Path) -> None:
    from pivotrl.pipeline.demos import _url_sha256

    (tmp_path / "d" / "sub").mkdir(parents=True)
    (tmp_path / "d" / "a.jsonl").write_bytes(os.urandom(3 << 20))
    (tmp_path / "d" / "sub" / "b.jsonl").write_text(json.dumps({"x": 1}))
    one = tmp_path / "d" / "a.jsonl"
    assert _url_sha256(str(one)) == _chunked(one).hexdigest()
    root = str(tmp_path / "d")
    want = content_hash({"a.jsonl": _chunked(one).hexdigest(),
                         "sub/b.jsonl": _chunked(tmp_path / "d" / "sub" / "b.jsonl").hexdigest()})
    assert _url_sha256(root) == want


def test_checkpoint_hash_is_unchanged(tmp_path: Path) -> None:
    from pivotrl.runtime.models import checkpoint_hash

    (tmp_path / "model.safetensors").write_bytes(os.urandom((1 << 20) + 5))
    (tmp_path / "config.json").write_text('{"a": 1}')
    want = hashlib.sha256()
    for name in ("model.safetensors", "config.json"):
        p = tmp_path / name
        want.update(f"{name}\0{p.stat().st_size}\0".encode())
        _chunked(p, want)
    assert checkpoint_hash(tmp_path) == want.hexdigest()
