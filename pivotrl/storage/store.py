"""Artifact store on fsspec (a local directory or any fsspec URL such as ``s3://bucket/prefix``).

Keys are ``/``-separated paths relative to the store's root. Every write is atomic: the bytes go
to a temporary key ``.tmp/<uuid>`` under the root and are then moved into place (a rename on a
local disk, copy + delete on object stores), so a reader sees either the whole artifact or none.
Directories (:mod:`pivotrl.storage.dirs`) and manifests (:mod:`pivotrl.storage.manifest`) build
on these writes.

The store is the one place a storage failure is retried: a remote store's transient failures
(timeouts, refused or reset connections, 5xx answers), with exponential backoff, and an injected
fault (``failure_rate``, any store), at once — both under the store's
:class:`~pivotrl.core.retry.RetryPolicy`, through the project's one retry function. Nothing above
the store (the pipeline, the Prefect tasks) retries a storage error again. Every retried write
starts again from a fresh temporary key, and temporary keys a failed attempt could not remove are
removed once the store answers again, so an outage leaves neither a half artifact nor a stray
temporary key.

This module never imports prefect, vllm, deepspeed or torch; pandas is imported only for Parquet.
"""

from __future__ import annotations

import hashlib
import io
import json
import logging
import os
import random
import uuid
from contextlib import contextmanager
from typing import IO, TYPE_CHECKING, Any, Callable, Iterable, Iterator, Mapping, TypeVar

from pivotrl.core.errors import PivotRLError, StorageAccessError, StorageError
from pivotrl.storage.dirs import DirectoryMixin
from pivotrl.storage.files import HashingWriter, replace_path
from pivotrl.storage.check import storage_error
from pivotrl.storage.manifest import ManifestMixin
from pivotrl.core.retry import RetryPolicy, call_with_retries, is_transient

if TYPE_CHECKING:
    import pandas as pd

    from pivotrl.config import RunConfig

__all__ = ["ArtifactStore", "InjectedStorageFault"]

log = logging.getLogger("pivotrl.storage")
_T = TypeVar("_T")
_TMP = ".tmp"


class InjectedStorageFault(StorageError):
    """A write failed on purpose (``faults.storage_failure_rate``): it stands for a transient
    failure, so the store retries it under its policy, and only there."""


class ArtifactStore(ManifestMixin, DirectoryMixin):
    """Artifacts under one root URL (local directory or fsspec URL), addressed by relative keys.

    Args:
        root_url: ``"runs"``, ``"/data/runs"``, ``"file:///data/runs"``, ``"s3://bucket/prefix"``...
        storage_options: fsspec options (endpoint, anon...). Kept in memory only, never written
            into a manifest. Credentials belong in the environment.
        failure_rate: probability that a write fails (InjectedStorageFault) after uploading its
            temporary copy and before publishing it: fault injection for tests and drills
            (``faults.storage_failure_rate``; 1.0: every write fails).
        seed: seed of the fault-injection draws (None = unpredictable).
        retry: retry policy (default :class:`RetryPolicy`) for transient failures of a remote store
            and for injected faults (retried at once); a local directory's own errors are never retried.

    ``attempts`` counts the attempts of every operation made through the retry policy (the first
    try and each retry); ``write_retries`` the retries of writes.

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
        if not 0.0 <= failure_rate <= 1.0:
            raise StorageError(f"failure_rate = {failure_rate}: must be in [0, 1]")
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
        self._retry = retry or RetryPolicy()
        self.attempts = 0
        self.write_retries = 0
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
            raise storage_error(action, url, e) from e

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

    def _retryable(self, e: BaseException) -> bool:
        return isinstance(e, InjectedStorageFault) or (not self._local and is_transient(e))

    def _retrying(self, what: str, op: Callable[[], _T]) -> _T:
        """Run ``op``; on a transient failure of a remote store wait and run it again, on an injected
        fault run it again at once (both under the RetryPolicy).

        Other errors propagate at once and unchanged. When every attempt failed, a StorageError
        naming ``what`` and the number of attempts is raised from the last error.
        """
        def on_retry(e: BaseException, attempt: int, wait: float) -> None:
            log.warning("cannot %s (%s: %s); retry %d of %d in %.1f s", what, type(e).__name__, e,
                        attempt, self._retry.attempts - 1, wait)
            if what.startswith("write "):
                self.write_retries += 1
            self.fs.invalidate_cache()

        def attempt() -> _T:
            self.attempts += 1
            return op()

        policy = self._retry
        try:
            result = call_with_retries(attempt, policy.attempts - 1, policy.base_delay_s,
                                       max_backoff_s=policy.max_delay_s, retry_if=self._retryable,
                                       on_retry=on_retry, wait_if=lambda e: not isinstance(e, InjectedStorageFault))
        except Exception as e:
            if policy.attempts > 1 and self._retryable(e):
                reason = "injected faults" if isinstance(e, InjectedStorageFault) else "storage unreachable"
                raise StorageError(f"cannot {what}: {reason} after {policy.attempts} attempts "
                                   f"({type(e).__name__}: {e})") from e
            raise
        if self._orphans:
            self._sweep()
        return result

    def _maybe_fail(self, url: str) -> None:
        if self._failure_rate and self._rng.random() < self._failure_rate:
            raise InjectedStorageFault(f"cannot write {url}: injected storage fault (faults.storage_failure_rate)")

    def _move(self, src: str, dst: str) -> None:
        if self._local:
            replace_path(src, dst)  # atomic rename on one file system
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
                writer = HashingWriter(raw)
                fill(writer)  # type: ignore[arg-type]
            self._maybe_fail(url)
            with self._errors("write", url):
                self._move(tmp, self._path(key))
        except PivotRLError:
            self._discard(tmp)
            raise
        except OSError as e:
            self._discard(tmp)
            raise storage_error("write", url, e) from e
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
        """sha256 hex digest of the bytes at ``key`` (streamed, ``hashlib.file_digest``)."""
        def op() -> str:
            with self._errors("read", self.url(key)):
                with self.fs.open(self._path(key), "rb") as f:
                    return hashlib.file_digest(f, "sha256").hexdigest()

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
