"""Artifact storage on fsspec: atomic writes, published directories, manifests and retries.

* :mod:`~pivotrl.storage.store` — :class:`ArtifactStore` (keys, atomic writes, reads, listing);
* :mod:`~pivotrl.storage.dirs` — checkpoint directories behind a ``_COMPLETE`` marker;
* :mod:`~pivotrl.storage.manifest` — :class:`Manifest` beside every artifact, code and library versions;
* :mod:`~pivotrl.core.retry` — the one retry mechanism (tenacity) and the store's policy;
* :mod:`~pivotrl.storage.files` — the atomic publishing of local files and the file hash;
* :mod:`~pivotrl.storage.open` — an artifact's store and key from the URI a run printed.

Pure core: never imports prefect, vllm, deepspeed or torch.
"""

from pivotrl.storage.dirs import COMPLETE_MARKER
from pivotrl.storage.files import atomic_dir, atomic_file, file_sha256, replace_path
from pivotrl.storage.manifest import (
    MANIFEST_FORMAT_VERSION,
    MANIFEST_SUFFIX,
    Manifest,
    code_version,
    package_versions,
)
from pivotrl.core.retry import RetryPolicy, RetryStats, call_with_retries, is_transient
from pivotrl.storage.store import ArtifactStore
from pivotrl.storage.open import open_artifact

__all__ = [
    "ArtifactStore", "Manifest", "RetryPolicy", "RetryStats", "call_with_retries", "code_version",
    "package_versions", "is_transient", "COMPLETE_MARKER", "MANIFEST_SUFFIX", "MANIFEST_FORMAT_VERSION",
    "atomic_dir", "atomic_file", "file_sha256", "open_artifact", "replace_path",
]
