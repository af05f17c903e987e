"""Local files: the atomic publishing of the project (and the file hash, re-exported).

:func:`atomic_file` and :func:`atomic_dir` hand out a temporary sibling of the target (same
directory, so the final ``os.replace`` is an atomic rename on one file system); the caller fills it,
and only a block that finishes without an exception publishes it. A failed block removes the
temporary path, so a reader sees the whole file/directory or the previous state, never a half one.
Remote artifacts go through :class:`pivotrl.storage.ArtifactStore` (temporary key, then move), which
uses the same functions for its local-disk moves.

Pure core: standard library only (and :func:`pivotrl.core.hashing.file_sha256`, re-exported).
"""

from __future__ import annotations

import hashlib
import os
import shutil
import tempfile
from contextlib import contextmanager
from pathlib import Path
from typing import IO, Callable, Iterator

from pivotrl.core.hashing import file_sha256

__all__ = ["HashingWriter", "atomic_dir", "atomic_file", "file_sha256", "relative_note", "replace_path"]


def relative_note(path: str | os.PathLike[str]) -> str:
    """What to say of a local ``path`` a config names and that was not found: ``a relative path,
    resolved against the current directory <cwd>`` when it is relative (after ``~``), "" when
    it is absolute."""
    if os.path.isabs(os.path.expanduser(os.fspath(path))):
        return ""
    return f"a relative path, resolved against the current directory {os.getcwd()}"


def replace_path(src: str | os.PathLike[str], dst: str | os.PathLike[str], *, replace_existing: bool = False) -> None:
    """Move ``src`` (a file or directory) onto ``dst`` atomically (``os.replace``; the parent of
    ``dst`` is created). A directory ``dst`` must be absent or empty, unless ``replace_existing``:
    then a full ``dst`` directory is renamed aside, ``src`` renamed into place and the old copy
    removed (a reader sees the old or the new directory, never a mix)."""
    dst = Path(dst)
    dst.parent.mkdir(parents=True, exist_ok=True)
    if Path(src).is_dir() and dst.is_dir():
        if not any(dst.iterdir()):
            dst.rmdir()
        elif replace_existing:
            old = dst.with_name(f".{dst.name}.old-{os.getpid()}")
            os.replace(dst, old)
            os.replace(src, dst)
            shutil.rmtree(old, ignore_errors=True)
            return
    os.replace(src, dst)


@contextmanager
def atomic_file(target: str | os.PathLike[str]) -> Iterator[Path]:
    """Yield a temporary path beside ``target`` (an empty file, 0644); on success it replaces ``target``.

    Raises what the block raised (the temporary file is removed first).
    """
    target = Path(target)
    target.parent.mkdir(parents=True, exist_ok=True)
    fd, name = tempfile.mkstemp(prefix=f".{target.name}.", suffix=".tmp", dir=target.parent)
    os.close(fd)
    tmp = Path(name)
    os.chmod(tmp, 0o644)  # mkstemp creates 0600; a published file is readable like any other
    try:
        yield tmp
        os.replace(tmp, target)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


@contextmanager
def atomic_dir(
    target: str | os.PathLike[str], *, mode: int | None = 0o755,
    already_published: Callable[[Path], bool] | None = None, replace_existing: bool = False,
) -> Iterator[Path]:
    """Yield a fresh empty directory beside ``target``; on success it is renamed to ``target``.

    ``target`` must be absent or an empty directory (or, with ``replace_existing``, is replaced
    whole: see :func:`replace_path`). ``mode``: permissions set before publishing
    (``mkdtemp`` creates 0700; None keeps them). ``already_published(target)``: when the rename fails
    because another process published ``target`` first and this returns True, the copy made here is
    dropped and the other one kept (a shared cache entry, renamed whole by its writer).

    Raises what the block raised, or the OSError of the rename (the temporary directory is removed).
    """
    target = Path(target)
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{target.name}.", dir=target.parent))
    try:
        yield tmp
        if mode is not None:
            os.chmod(tmp, mode)
        try:
            replace_path(tmp, target, replace_existing=replace_existing)
        except OSError:
            if already_published is None or not already_published(target):
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


class HashingWriter:
    """File-like wrapper that hashes and counts what passes through it."""

    def __init__(self, raw: IO[bytes]) -> None:
        self._raw = raw
        self.digest = hashlib.sha256()
        self.size = 0

    def write(self, data: bytes) -> int:
        view = memoryview(data).cast("B")
        self.digest.update(view)
        self.size += view.nbytes
        self._raw.write(bytes(view))
        return view.nbytes

    def flush(self) -> None:
        self._raw.flush()

    def writable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return False

    def readable(self) -> bool:
        return False

    def tell(self) -> int:
        return self.size

    @property
    def closed(self) -> bool:
        return False

    def close(self) -> None:  # the owner closes the underlying file
        pass
