"""Content hashes and canonical JSON: the one way pivotrl hashes a value, a file or a JSON text.

Stage keys, manifest hashes, config hashes and Parquet cells all go through :func:`canonical_json`,
so two equal values hash alike in every process and on every machine.
"""

from __future__ import annotations

import hashlib
import json
import os
from typing import Any


def canonical_json(obj: Any) -> str:
    """Deterministic JSON (sorted keys, no spaces, UTF-8) used for hashing and Parquet cells."""
    return json.dumps(obj, sort_keys=True, separators=(",", ":"), ensure_ascii=False)


def json_problem(e: json.JSONDecodeError) -> str:
    """What is wrong with a JSON text, where: ``Unterminated string starting at column 7`` (some of
    json's messages end in "at" already; the column is never written after a second one)."""
    return f"{e.msg.removesuffix(' at')} at column {e.colno}"


def content_hash(obj: Any) -> str:
    """sha256 hex digest of ``canonical_json(obj)``."""
    return hashlib.sha256(canonical_json(obj).encode("utf-8")).hexdigest()


def file_sha256(path: str | os.PathLike[str]) -> str:
    """sha256 hex digest of a local file's bytes (``hashlib.file_digest``)."""
    with open(path, "rb") as f:
        return hashlib.file_digest(f, "sha256").hexdigest()
