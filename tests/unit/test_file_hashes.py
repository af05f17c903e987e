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


def test_weights_hash_is_the_tensors_not_the_files(tmp_path: Path) -> None:
    """Two checkpoints with the same tensors written in another order, with other header metadata,
    config and tokenizer files hash the same; one changed value, dtype or name does not; a truncated
    file is a named error."""
    import torch
    from safetensors.torch import save_file

    from pivotrl.core.errors import ModelError
    from pivotrl.runtime.models import checkpoint_hash, weights_hash

    g = torch.Generator().manual_seed(0)
    tensors = {"embed.weight": torch.randn(8, 4, generator=g), "lm_head.bias": torch.randn(8, generator=g),
               "norm.weight": torch.randn(4, generator=g).to(torch.bfloat16)}

    def ckpt(name: str, ts: dict, meta: dict | None = None, config: str = "{}") -> Path:
        d = tmp_path / name
        d.mkdir()
        save_file(ts, str(d / "model.safetensors"), metadata=meta)
        (d / "config.json").write_text(config)
        return d

    a = ckpt("a", tensors, {"format": "pt"})
    b = ckpt("b", dict(reversed(list(tensors.items()))), {"format": "pt", "written_by": "another exporter"},
             config='{"torch_dtype": "float32"}')
    assert weights_hash(a) == weights_hash(b) and checkpoint_hash(a) != checkpoint_hash(b)
    changed = dict(tensors, **{"lm_head.bias": tensors["lm_head.bias"].clone()})
    changed["lm_head.bias"][3] += 1e-3
    recast = dict(tensors, **{"norm.weight": tensors["norm.weight"].float()})
    renamed = {("model." + k): v for k, v in tensors.items()}
    others = {weights_hash(ckpt(n, ts)) for n, ts in (("c", changed), ("d", recast), ("e", renamed))}
    assert len(others) == 3 and weights_hash(a) not in others
    blob = (a / "model.safetensors").read_bytes()
    (a / "model.safetensors").write_bytes(blob[:-5])
    with pytest.raises(ModelError, match=r"model\.safetensors"):
        weights_hash(a)
    (a / "model.safetensors").write_bytes(b"\x10\x00\x00\x00\x00\x00\x00\x00not json at all!")
    with pytest.raises(ModelError, match="not a readable safetensors file"):
        weights_hash(a)
    with pytest.raises(ModelError, match="no \\*.safetensors"):
        weights_hash(tmp_path)
