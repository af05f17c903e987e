"""The pinned ``bfcl-eval`` wheel, fetched, checked and unpacked into the cache (never installed).

:func:`ensure_bfcl` returns ``<cache_dir>/bfcl_eval-<version>``, the directory that contains
``bfcl_eval/`` (its ``data/`` files and the simulators :mod:`pivotrl.bfcl.envs` runs): fetched once
with ``pip download --no-deps bfcl-eval==`` :data:`BFCL_VERSION` (Apache-2.0), its sha256 checked
against :data:`BFCL_WHEEL_SHA256`, unzipped into a temporary directory and renamed into place with
a ``.sha256`` marker, so a partial copy is never visible and a concurrent writer's copy is reused.
Errors: StorageError (download, missing local wheel, unzip), DataError (checksum mismatch).
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

from pivotrl.core.errors import DataError, StorageError
from pivotrl.core.hashing import file_sha256
from pivotrl.storage.files import atomic_dir

__all__ = ["BFCL_VERSION", "BFCL_WHEEL_SHA256", "ensure_bfcl"]

BFCL_VERSION = "2026.3.23"
BFCL_WHEEL_SHA256 = "3bb6dfa5f0c68ad403c9ec50b00db2bb3b4cc9b38ab1ff33f48fe30d853d3a0a"

_DONE_MARKER = ".sha256"


def ensure_bfcl(cache_dir: str | os.PathLike[str], wheel: str | os.PathLike[str] | None = None) -> Path:
    """Directory containing ``bfcl_eval/`` from the pinned, sha256-checked ``bfcl-eval`` wheel.

    ``<cache_dir>/bfcl_eval-<version>`` is reused when present; otherwise the wheel is fetched
    with ``python -m pip download --no-deps bfcl-eval==<version>`` (or taken from ``wheel``, a local
    file), checked, unzipped into a temporary directory and renamed into place, so a partial copy is
    never visible. Raises StorageError if the download or extraction fails, DataError if the wheel's
    sha256 is not :data:`BFCL_WHEEL_SHA256`.
    """
    cache = Path(cache_dir).expanduser()
    root = cache / f"bfcl_eval-{BFCL_VERSION}"
    if (root / _DONE_MARKER).is_file() and (root / "bfcl_eval").is_dir():
        return root
    cache.mkdir(parents=True, exist_ok=True)
    if root.exists() and not (root / _DONE_MARKER).is_file():
        shutil.rmtree(root)  # an incomplete earlier copy (no marker)
    with tempfile.TemporaryDirectory(prefix=".bfcl-tmp-", dir=cache) as work:
        if wheel is None:
            dl = Path(work) / "download"
            cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--disable-pip-version-check",
                   f"bfcl-eval=={BFCL_VERSION}", "-d", str(dl)]
            proc = subprocess.run(cmd, capture_output=True, text=True)
            wheels = sorted(dl.glob("*.whl")) if dl.is_dir() else []
            if proc.returncode != 0 or len(wheels) != 1:
                raise StorageError(
                    f"pip download of bfcl-eval=={BFCL_VERSION} failed (exit {proc.returncode}): "
                    f"{proc.stderr.strip()[-2000:]}"
                )
            wheel_path = wheels[0]
        else:
            wheel_path = Path(wheel)
            if not wheel_path.is_file():
                raise StorageError(f"bfcl wheel {str(wheel_path)!r}: no such file")
        digest = file_sha256(wheel_path)
        if digest != BFCL_WHEEL_SHA256:
            raise DataError(
                f"{wheel_path.name}: sha256 {digest} does not match the pinned {BFCL_WHEEL_SHA256}"
            )
        # Renamed into place whole; a concurrent writer that published first wins (its marker is there).
        with atomic_dir(root, already_published=lambda r: (r / _DONE_MARKER).is_file()) as extract:
            try:
                with zipfile.ZipFile(wheel_path) as zf:
                    zf.extractall(extract)
            except (zipfile.BadZipFile, OSError) as e:
                raise StorageError(f"{wheel_path.name}: cannot unzip ({e})") from e
            (extract / _DONE_MARKER).write_text(digest + "\n")
    return root
