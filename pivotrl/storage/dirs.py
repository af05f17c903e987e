"""Directories in the artifact store (checkpoints): published whole, behind a ``_COMPLETE`` marker.

A directory is uploaded file by file to a temporary prefix, moved under its key, and becomes
visible to :meth:`DirectoryMixin.get_dir` only once its ``_COMPLETE`` marker (written last: relative
path → size and sha256, plus the tree hash) exists.

Pure core: never imports prefect, vllm, deepspeed or torch.
"""

from __future__ import annotations

import functools
import os
from pathlib import Path
from typing import Any, Mapping

from pivotrl.core.hashing import content_hash
from pivotrl.core.errors import StorageError
from pivotrl.storage.files import atomic_dir, file_sha256, replace_path
from pivotrl.storage.manifest import utc_now

__all__ = ["COMPLETE_MARKER", "DirectoryMixin"]

COMPLETE_MARKER = "_COMPLETE"


def _tree_hash(listing: Mapping[str, Mapping[str, Any]]) -> str:
    return content_hash({rel: info["sha256"] for rel, info in listing.items()})


class DirectoryMixin:
    """The directory methods of :class:`~pivotrl.storage.ArtifactStore` (which supplies the I/O)."""

    def put_dir(self, local_dir: str | os.PathLike[str], key: str) -> str:
        """Publish a local directory (e.g. a checkpoint) under ``key``. Returns the URL.

        Files go to a temporary prefix first, then replace whatever was under ``key``; the
        ``_COMPLETE`` marker (JSON: relative path → size and sha256, plus ``tree_sha256``) is written
        last, so :meth:`get_dir` never sees a half-published directory.

        A transient failure repeats the upload from a fresh temporary prefix (RetryPolicy).

        Raises:
            StorageError: ``local_dir`` is not a directory or contains a top-level ``_COMPLETE``;
                any upload failure (the temporary prefix is removed).
        """
        src = Path(local_dir)
        url = self.url(key)
        if not src.is_dir():
            raise StorageError(f"cannot publish {url}: {src} is not a directory")
        files = sorted(p.relative_to(src).as_posix() for p in src.rglob("*") if p.is_file())
        if COMPLETE_MARKER in files:
            raise StorageError(f"cannot publish {url}: {src} contains a file named {COMPLETE_MARKER}")
        listing: dict[str, dict[str, Any]] = {}
        for rel in files:
            listing[rel] = {"size": (src / rel).stat().st_size, "sha256": file_sha256(src / rel)}
        self._retrying(f"write {url}", lambda: self._put_dir_once(src, files, key))
        marker_doc = {"files": listing, "tree_sha256": _tree_hash(listing), "created_at": utc_now()}
        self.write_json(f"{key}/{COMPLETE_MARKER}", marker_doc)
        return url

    def _put_dir_once(self, src: Path, files: list[str], key: str) -> None:
        url = self.url(key)
        tmp = self._tmp_path()
        final = self._path(key)
        try:
            with self._errors("write", url):
                for rel in files:
                    if self._local:
                        os.makedirs(os.path.dirname(f"{tmp}/{rel}"), exist_ok=True)
                    self.fs.put_file(str(src / rel), f"{tmp}/{rel}")
            self._maybe_fail(url)
            with self._errors("write", url):
                self._fresh(final)
                if self.fs.exists(final):
                    marker = f"{final}/{COMPLETE_MARKER}"
                    if self.fs.exists(marker):
                        self.fs.rm(marker)  # unpublish first: readers must never see a mix
                    self.fs.rm(final, recursive=True)
                    self._fresh(final)
                if self._local:
                    if files:
                        replace_path(tmp, final)
                    else:
                        os.makedirs(final, exist_ok=True)
                else:
                    for rel in files:
                        self.fs.mv(f"{tmp}/{rel}", f"{final}/{rel}")
        except BaseException:
            self._discard(tmp)
            raise
        self._discard(tmp)

    def dir_listing(self, key: str) -> dict[str, Any]:
        """The ``_COMPLETE`` marker of a published directory (``files``, ``tree_sha256``, ``created_at``).

        Raises StorageError if ``key`` has no marker (never published, or publishing was interrupted).
        """
        marker = f"{key}/{COMPLETE_MARKER}"
        if not self.exists(marker):
            raise StorageError(
                f"{self.url(key)} has no {COMPLETE_MARKER} marker: the directory was never published "
                f"or its upload was interrupted"
            )
        doc = self.read_json(marker)
        if not isinstance(doc, dict) or not isinstance(doc.get("files"), dict):
            raise StorageError(f"{self.url(marker)}: malformed {COMPLETE_MARKER} marker")
        return doc

    def has_dir(self, key: str) -> bool:
        """True if a directory is completely published at ``key``."""
        return self.exists(f"{key}/{COMPLETE_MARKER}")

    def get_dir(self, key: str, local_dir: str | os.PathLike[str], *, verify: bool = True) -> Path:
        """Download the published directory ``key`` into ``local_dir`` (created; must be absent or empty).

        Only the files listed in the marker are fetched; with ``verify`` each file's size and
        sha256 are checked. The download goes to a temporary sibling that is renamed into place.

        Raises:
            StorageError: no ``_COMPLETE`` marker, ``local_dir`` not empty, a missing or corrupt file.
        """
        doc = self.dir_listing(key)
        dst = Path(local_dir)
        if dst.exists() and (not dst.is_dir() or any(dst.iterdir())):
            raise StorageError(f"cannot get {self.url(key)}: {dst} exists and is not an empty directory")
        with atomic_dir(dst, mode=None) as tmp:
            for rel, info in sorted(doc["files"].items()):
                target = tmp / rel
                target.parent.mkdir(parents=True, exist_ok=True)
                self._retrying(f"read {self.url(f'{key}/{rel}')}",
                               functools.partial(self._get_file, f"{key}/{rel}", target))
                if verify:
                    size = target.stat().st_size
                    if size != info.get("size") or file_sha256(target) != info.get("sha256"):
                        raise StorageError(
                            f"{self.url(f'{key}/{rel}')}: content does not match the {COMPLETE_MARKER} "
                            f"marker (size {size}, expected {info.get('size')})"
                        )
        return dst

    def _get_file(self, key: str, target: Path) -> None:
        with self._errors("read", self.url(key)):
            self.fs.get_file(self._path(key), str(target))
