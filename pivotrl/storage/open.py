"""Opening an artifact by its URI: the store that holds it and its key there.

``pivotrl lineage``, ``pivotrl pivots diff`` and the exports start from a path or URL a run printed;
:func:`open_artifact` finds the artifact's manifest (or the sibling manifest that describes a
checkpoint directory or a report's plot). Pure core.
"""

from __future__ import annotations

import json
import os
from typing import Any, Mapping

from pivotrl.core.errors import StorageError
from pivotrl.storage.manifest import MANIFEST_SUFFIX
from pivotrl.storage.store import ArtifactStore

__all__ = ["open_artifact"]


def open_artifact(uri: str, storage_options: Mapping[str, Any] | None = None) -> tuple[ArtifactStore, str]:
    """The store holding ``uri`` (rooted at its parent directory) and the artifact's key in it.

    ``uri``: any fsspec URL or local path of an artifact written by ``ArtifactStore.write_artifact``;
    inputs recorded in its manifest are full URLs and resolve wherever they live.
    Raises StorageError if ``uri`` has no manifest beside it (nothing is created on a local disk).
    """
    import fsspec

    text = uri.rstrip("/")
    parent, _, name = text.rpartition("/")
    if not parent or not name:
        raise StorageError(f"{uri}: not an artifact URI (expected <directory>/<name>)")
    try:
        fs, path = fsspec.core.url_to_fs(os.path.expanduser(text) + MANIFEST_SUFFIX, **dict(storage_options or {}))
        found = fs.exists(path)
    except Exception as e:  # unknown protocol, unreachable store
        raise StorageError(f"cannot open {uri}: {type(e).__name__}: {e}") from e
    if not found:
        described = _describing_manifest(fs, path[: -len(MANIFEST_SUFFIX)], text)
        if described is None:
            raise StorageError(f"{uri} has no manifest ({uri}{MANIFEST_SUFFIX} not found): not a pipeline artifact")
        name = described
    return ArtifactStore(os.path.expanduser(parent), storage_options), name


def _describing_manifest(fs: Any, path: str, uri: str) -> str | None:
    """Name of the sibling artifact that describes ``path`` (which has no manifest of its own), or None.

    A published checkpoint directory (the policy, π_ref) is described by the sibling manifest whose
    ``extra.checkpoint`` names it; a file written beside exactly one artifact (``report.md`` and the
    plots beside ``report.json``) by that artifact.
    """
    parent = path.rstrip("/").rpartition("/")[0]
    try:
        names = sorted(str(p).rpartition("/")[2] for p in fs.ls(parent, detail=False))
        is_dir = fs.isdir(path)
    except Exception:  # unreadable location: no describing manifest
        return None
    artifacts = [n[: -len(MANIFEST_SUFFIX)] for n in names if n.endswith(MANIFEST_SUFFIX)]
    target = fs.unstrip_protocol(path.rstrip("/"))
    for name in artifacts:
        try:
            extra = json.loads(fs.cat_file(f"{parent}/{name}{MANIFEST_SUFFIX}")).get("extra") or {}
        except Exception:
            continue
        checkpoint = str(extra.get("checkpoint") or "").rstrip("/")
        if checkpoint and (checkpoint == target or checkpoint == uri.rstrip("/")):
            return name
    if not is_dir and fs.exists(path) and len(artifacts) == 1:
        return artifacts[0]
    return None
