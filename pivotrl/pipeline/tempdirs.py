"""The temporary directories of a run's stages: each stage process writes its ``spec.json`` (which
holds the whole config) and its ``result.json`` in a private directory (:func:`stage_tempdir`),
removed when its block ends — on failure and on KeyboardInterrupt too — and by
:class:`pivotrl.pipeline.processes.StopOnSignal` before the CLI exits; one left by a process that
was killed outright (SIGKILL) is removed by the next run on the machine (:func:`remove_stale_tempdirs`).
"""

from __future__ import annotations

import os
import re
import shutil
import tempfile
from contextlib import contextmanager
from pathlib import Path
from typing import Iterator

#: Temporary directories of this process still in use (removed by StopOnSignal before it exits).
_TEMP_DIRS: set[str] = set()
_TEMP_NAME = re.compile(r"^pivotrl-[A-Za-z0-9_]+-p(\d+)-")


def remove_stale_tempdirs(root: str | os.PathLike[str] | None = None) -> list[str]:
    """Remove the ``pivotrl-<what>-p<pid>-*`` directories in ``root`` (default: the system
    temporary folder; :func:`stage_tempdir`'s, or a stage's work folders in the cache directory)
    of this user whose creating process no longer runs (a stage killed mid-run); returns their paths."""
    removed = []
    root = Path(root) if root is not None else Path(tempfile.gettempdir())
    for d in root.glob("pivotrl-*-p*-*"):
        m = _TEMP_NAME.match(d.name)
        if not m or not d.is_dir() or int(m.group(1)) == os.getpid():
            continue
        try:
            if d.stat().st_uid != os.getuid():
                continue
            os.kill(int(m.group(1)), 0)
        except ProcessLookupError:
            shutil.rmtree(d, ignore_errors=True)
            removed.append(str(d))
        except (PermissionError, OSError):
            continue
    return removed


@contextmanager
def stage_tempdir(stage: str) -> Iterator[Path]:
    """A private temporary directory ``<tmp>/pivotrl-<stage>-p<pid>-<random>`` for the body of the
    ``with``, removed when it ends (normally, on an exception, on KeyboardInterrupt) and by
    :class:`~pivotrl.pipeline.processes.StopOnSignal` if the run is stopped meanwhile. Sweeps stale ones first
    (:func:`remove_stale_tempdirs`)."""
    remove_stale_tempdirs()
    path = tempfile.mkdtemp(prefix=f"pivotrl-{stage}-p{os.getpid()}-")
    _TEMP_DIRS.add(path)
    try:
        yield Path(path)
    finally:
        _TEMP_DIRS.discard(path)
        shutil.rmtree(path, ignore_errors=True)


def remove_tempdirs() -> None:
    """Remove this process's :func:`stage_tempdir` directories (when it is about to exit)."""
    for path in list(_TEMP_DIRS):
        shutil.rmtree(path, ignore_errors=True)
        _TEMP_DIRS.discard(path)
