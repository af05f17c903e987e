"""Checkpoints of the PivotRL training loop on the artifact store, for one process or many ranks.

Storage is the only medium shared between ranks, so a checkpoint works across machines without a
shared filesystem: every rank uploads its own files to ``<key>/rank-<r>``, and rank 0 writes
``<key>/ranks.json`` last, once every rank has published (a barrier). A checkpoint without
``ranks.json`` is incomplete and never resumed from.

Layout under a training key ``train/<key>``::

    checkpoints/step-<NNNNNN>/rank-<r>/   DeepSpeed state incl. rank r's optimizer partition;
                                          rank 0 adds the HF export (hf/) and metrics.parquet
    checkpoints/step-<NNNNNN>/ranks.json  {"world_size": W}, written last

Imports no pipeline module (the pipeline imports this one).
"""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Any

__all__ = [
    "broadcast", "fetch_checkpoint", "is_local", "latest_checkpoint", "local_checkpoint", "local_path",
    "rank_and_world", "save_checkpoint",
]


def is_local(store: Any) -> bool:
    """True when ``store`` (an ``ArtifactStore``) is rooted on the local file system."""
    root = str(store.root_url)
    return root.startswith(("/", "file://")) or "://" not in root


def local_path(store: Any, key: str) -> Path:
    """The local path of ``key`` in a local store (see :func:`is_local`)."""
    url = str(store.url(key))
    return Path(url[len("file://"):] if url.startswith("file://") else url)


def local_checkpoint(store: Any, key: str, cache: Path) -> Path:
    """A local directory holding the checkpoint published at ``key`` (downloaded if remote).

    Raises StorageError when ``key`` has no completion marker (never published, or its upload was
    interrupted) or a downloaded file does not match it.
    """
    if is_local(store):
        p = local_path(store, key)
        if (p / "_COMPLETE").exists():
            return p
    target = cache / "checkpoints" / key.replace("/", "_")
    if not (target / "_COMPLETE").exists():
        if target.exists():
            shutil.rmtree(target)
        store.get_dir(key, str(target))
        (target / "_COMPLETE").touch()
    return target


def rank_and_world() -> tuple[int, int]:
    """``(rank, world_size)`` of this process (0, 1 outside a process group)."""
    from pivotrl.training.deepspeed_utils import rank_and_world as _rw

    return _rw()


def broadcast(obj: Any, world: int) -> Any:
    """Rank 0's ``obj`` on every rank (pickled by torch.distributed; small Python objects only)."""
    if world == 1:
        return obj
    import torch.distributed as dist

    box = [obj]
    dist.broadcast_object_list(box, src=0)
    return box[0]


def save_checkpoint(store: Any, trainer: Any, key: str, rows: list[dict], work: Path, rank: int, world: int) -> None:
    """Publish a resumable checkpoint under ``key``: every rank uploads its own files to
    ``key/rank-<r>`` (DeepSpeed state incl. its optimizer partition; rank 0 adds the HF export and
    the metrics rows so far), then rank 0 writes ``key/ranks.json`` last."""
    import pandas as pd

    d = work / f"ckpt-{Path(key).name}-rank{rank}"
    out = trainer.save_checkpoint(str(d))
    src = Path(out) if Path(out).exists() else d.with_name(d.name + ".partial")
    if rank == 0:
        pd.DataFrame(rows).to_parquet(src / "metrics.parquet")
    store.put_dir(str(src), f"{key}/rank-{rank}")
    shutil.rmtree(src, ignore_errors=True)
    broadcast(None, world)  # barrier: every rank has published
    if rank == 0:
        store.write_json(f"{key}/ranks.json", {"world_size": world})


def latest_checkpoint(store: Any, prefix: str) -> str | None:
    """Key of the newest checkpoint under ``prefix`` whose every rank published (``ranks.json``
    exists), or None when there is none. A storage failure is not "no checkpoint" (that would
    silently restart training from step 0): the store retries transient failures, then its
    StorageError propagates."""
    keys = store.list(prefix)
    steps = sorted({k.split("/step-")[1].split("/")[0] for k in keys if "/step-" in k and k.endswith("/ranks.json")})
    return f"{prefix}/step-{steps[-1]}" if steps else None


def fetch_checkpoint(store: Any, key: str, cache: Path, rank: int) -> Path:
    """A local directory with rank 0's files (model states, HF export, metrics) and, for rank > 0,
    this rank's own files (its optimizer partition) merged in."""
    base = local_checkpoint(store, f"{key}/rank-0", cache)
    if rank == 0:
        return base
    own = local_checkpoint(store, f"{key}/rank-{rank}", cache)
    merged = cache / "checkpoints" / f"{key.replace('/', '_')}-merged-rank{rank}"
    if not merged.exists():
        shutil.copytree(base, merged)
        shutil.copytree(own, merged, dirs_exist_ok=True)
    return merged
