"""Preflight of a run's storage root and remote demonstration sources, before any stage runs.

A storage root that cannot work (no credentials, credentials refused, permission denied for reading
or writing, a bucket that does not exist, an endpoint that does not answer) fails in seconds with one
message naming what to set, instead of failing inside the first stage after its retries; the root
must take a small object written and removed (:func:`check_storage`). Remote ``chat`` sources
(``s3://…`` and other fsspec URLs in ``data.sources``) get the same check for reading
(:func:`check_sources`): credentials, endpoint, and the object answering a HEAD. Used by the CLI
before Prefect starts and by the flows at their start (a deployment run has no CLI in front of it).
Each check makes one attempt with short timeouts: what fails here is classified once
(:class:`StorageAccessError`, never retried, or :class:`StorageError` for an endpoint that does not
answer).
"""

from __future__ import annotations

import os
import tempfile
import uuid
from typing import Any, Iterable, Mapping

from pivotrl.core.errors import SourceNotFoundError, StorageAccessError, StorageError

#: The environment variables an s3:// root reads (named in every error).
S3_VARIABLES = ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_ENDPOINT_URL_S3")
CREDENTIALS_HOW_TO = ("set AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY (and AWS_ENDPOINT_URL_S3 for a non-AWS "
        "endpoint), or AWS_PROFILE / an instance role")

#: Error codes of an S3 answer that no retry can change.
_ACCESS_CODES = ("AccessDenied", "InvalidAccessKeyId", "SignatureDoesNotMatch", "AllAccessDisabled",
                 "AccountProblem", "InvalidToken", "ExpiredToken", "NoSuchBucket", "InvalidBucketName")


def access_problem(exc: BaseException) -> str | None:
    """A short reason if ``exc`` (or its cause chain) is a refusal no retry can fix, else None:
    missing credentials, a refused or unknown key, permission denied, no such bucket."""
    seen: set[int] = set()
    e: BaseException | None = exc
    while e is not None and id(e) not in seen:
        seen.add(id(e))
        names = {c.__name__ for c in type(e).__mro__}
        if names & {"NoCredentialsError", "PartialCredentialsError", "CredentialRetrievalError"}:
            return "no credentials"
        if isinstance(e, PermissionError):
            return "permission denied"
        text = f"{e!r} {e}"
        for code in _ACCESS_CODES:
            if code in text:
                return code
        if "specified bucket does not exist" in text:
            return "NoSuchBucket"
        e = e.__cause__ or e.__context__
    return None


def check_storage(root_url: str, storage_options: Mapping[str, Any] | None = None, *,
                  timeout_s: float = 4.0) -> None:
    """Check that the storage root ``root_url`` can be used; returns None when it can.

    Local roots: a small file is written and removed in the directory (or its nearest existing
    parent). ``s3://`` roots: credentials must be found (options ``key``/``secret``, ``anon: true``,
    the environment, a profile or a role), the bucket must answer a listing within ``timeout_s``
    (one attempt, no retries), and a small object ``<root>/.pivotrl-preflight-<uuid>`` is written
    and removed (a bucket that lists but denies writes fails here, not in the first stage). Other
    protocols: the root's parent must answer ``exists``, and the same object is written and removed.

    Raises:
        StorageAccessError: credentials missing or refused, permission denied, no such bucket —
            one line naming the root and what to set.
        StorageError: the endpoint does not answer, or the root cannot be opened.
    """
    options = dict(storage_options or {})
    text = os.path.expanduser(root_url)
    if "://" not in text or text.startswith("file://"):
        _check_local(text[len("file://"):] if text.startswith("file://") else text)
        return
    protocol = text.split("://", 1)[0]
    if protocol in ("s3", "s3a"):
        _check_s3(text, options, timeout_s)
        return
    import fsspec

    try:
        fs, path = fsspec.core.url_to_fs(text, **options)
        fs.exists(path)
    except Exception as e:
        _raise(root_url, e)
    _prove_write(fs, path, root_url, options)


def check_cache_dir(path: str | os.PathLike[str]) -> None:
    """Check that the local cache folder (``RunSection.local_cache()``: ``$PIVOTRL_CACHE_DIR`` or
    ``run.cache_dir``) can take the downloads, the converted models and the calibration: the folder,
    or the nearest of its parents that exists, is a directory this user can write in (a small file is
    written and removed). Returns None when it can.

    Raises:
        StorageAccessError: one line naming the folder, what is wrong and what to set.
    """
    _check_local(str(path), "cache folder",
                 "set run.cache_dir (or PIVOTRL_CACHE_DIR, which takes its place) to another folder")


def _check_local(path: str, what: str = "storage root", choose: str = "choose another run.storage_root") -> None:
    p = os.path.abspath(path)
    while not os.path.exists(p):
        parent = os.path.dirname(p)
        if parent == p:
            break
        p = parent
    if not os.path.isdir(p):  # the root, or the nearest of its parents that exists, is a file
        raise StorageAccessError(f"{what} {path}: {p} is a file, not a directory; {choose} or move the file")
    if not os.access(p, os.W_OK | os.X_OK):
        raise StorageAccessError(f"{what} {path}: {p} is not writable by this user; {choose}")
    try:
        with tempfile.NamedTemporaryFile(prefix=".pivotrl-preflight-", dir=p):
            pass  # written and removed
    except OSError as e:
        raise StorageAccessError(f"{what} {path}: cannot write in {p} ({e.strerror or e}); {choose}") from None


def _prove_write(fs: Any, path: str, url: str, options: Mapping[str, Any] | None) -> None:
    """Write a small object under the root and remove it: StorageAccessError when refused."""
    probe = f"{path.rstrip('/')}/.pivotrl-preflight-{uuid.uuid4().hex}"
    try:
        fs.pipe_file(probe, b"pivotrl preflight: written and removed before a run\n")
        fs.rm_file(probe)
    except Exception as e:
        reason = access_problem(e)
        if reason is not None:
            raise StorageAccessError(
                f"storage root {url}: it can be listed but not written (access refused: {reason}); a run "
                "writes and removes objects under it: grant s3:PutObject and s3:DeleteObject on it, or choose "
                "another run.storage_root") from e
        _raise(url, e, options)


def _s3_credentials(what: str, options: Mapping[str, Any]) -> None:
    """StorageAccessError naming ``what`` when no AWS credentials can be found (no network call)."""
    if options.get("anon") or (options.get("key") and options.get("secret")):
        return
    import botocore.session

    session = botocore.session.Session(profile=options.get("profile") or None)
    try:
        creds = session.get_credentials()
    except Exception as e:  # a broken profile or config file
        raise StorageAccessError(f"{what}: cannot read AWS credentials ({type(e).__name__}: {e}); {CREDENTIALS_HOW_TO}") from e
    if creds is None or not creds.access_key:
        raise StorageAccessError(f"{what}: no AWS credentials found; {CREDENTIALS_HOW_TO}")


def _s3fs(options: Mapping[str, Any], timeout_s: float) -> Any:
    """An S3FileSystem making one attempt per call, with ``timeout_s`` connect and read timeouts.

    Two retry layers are turned off: botocore's (``total_max_attempts: 1``; its legacy
    ``max_attempts: 1`` means one *retry*, so two attempts) and s3fs's own loop around every call
    (``retries``, 5 attempts with backoff, a class attribute). With both on, an endpoint that does
    not answer cost 10 read timeouts (46 s for 4-s timeouts) and a slow first answer a fixed
    ``k × timeout_s`` stall before the real error.
    """
    import s3fs

    cfg = dict(options.get("config_kwargs") or {})
    cfg.update({"connect_timeout": timeout_s, "read_timeout": timeout_s,
                "retries": {"mode": "standard", "total_max_attempts": 1}})
    fs = s3fs.S3FileSystem(**{**options, "config_kwargs": cfg, "skip_instance_cache": True})
    fs.retries = 1  # s3fs's _error_wrapper: one try, no sleep-and-retry on timeouts
    return fs


def _check_s3(url: str, options: dict[str, Any], timeout_s: float) -> None:
    bucket = url.split("://", 1)[1].split("/", 1)[0]
    if not bucket:
        raise StorageAccessError(f"storage root {url}: no bucket in the URL (expected s3://<bucket>/<prefix>)")
    _s3_credentials(f"storage root {url}", options)
    try:
        fs = _s3fs(options, timeout_s)
        fs.ls(bucket, refresh=True)
    except FileNotFoundError as e:
        raise StorageAccessError(f"storage root {url}: bucket {bucket!r} does not exist (NoSuchBucket) at "
                                 f"{_endpoint(options)}; create it or fix run.storage_root") from e
    except Exception as e:
        _raise(url, e, options)
    _prove_write(fs, url.split("://", 1)[1], url, options)


def check_source(url: str, *, what: str | None = None, timeout_s: float = 4.0) -> None:
    """Check that the remote demonstration file at ``url`` can be read (one attempt, ``timeout_s``):
    credentials found (``s3://``: as for the storage root, from the environment, a profile or a
    role), the endpoint answers, the object exists and its metadata may be read. Local paths pass
    (:func:`pivotrl.data.sources.check_sources_exist` checks them).

    Raises (one line, starting with ``what``, default the URL):
        StorageAccessError: credentials missing or refused, read access denied.
        SourceNotFoundError: no such object (or bucket).
        StorageError: the endpoint does not answer.
    """
    what = what or url
    if "://" not in url or url.startswith(("file://", "local://")):
        return
    protocol = url.split("://", 1)[0]
    try:
        if protocol in ("s3", "s3a"):
            _s3_credentials(what, {})
            fs, path = _s3fs({}, timeout_s), url.split("://", 1)[1]
        else:
            import fsspec

            fs, path = fsspec.core.url_to_fs(url)
        fs.info(path)
    except StorageError:
        raise
    except FileNotFoundError:
        raise SourceNotFoundError(f"{what}: no such file (object or bucket)") from None
    except Exception as e:
        reason = access_problem(e)
        if reason is not None:
            raise StorageAccessError(f"{what}: read access refused ({reason}); {CREDENTIALS_HOW_TO}") from e
        where = f" at {_endpoint({})} (AWS_ENDPOINT_URL_S3)" if protocol in ("s3", "s3a") else ""
        raise StorageError(f"{what}: the store does not answer{where}: {type(e).__name__}: {e}") from e


def check_sources(sources: Iterable[Any], *, timeout_s: float = 4.0) -> None:
    """:func:`check_source` for every remote ``chat`` source of ``data.sources``.

    Raises the first problem's class with every problem in its message, one line each
    (``data.sources[i] (chat): <url>: …``).
    """
    problems: list[StorageError] = []
    for i, src in enumerate(sources):
        url = getattr(src, "url", None)
        if getattr(src, "kind", None) != "chat" or not url:
            continue
        try:
            check_source(url, what=f"data.sources[{i}] (chat): {url}", timeout_s=timeout_s)
        except StorageError as e:
            problems.append(e)
    if problems:
        raise type(problems[0])("\n".join(str(p) for p in problems))


def _endpoint(options: Mapping[str, Any]) -> str:
    return str((options.get("client_kwargs") or {}).get("endpoint_url") or options.get("endpoint_url")
               or os.environ.get("AWS_ENDPOINT_URL_S3") or os.environ.get("AWS_ENDPOINT_URL") or "AWS S3")


def _raise(url: str, e: BaseException, options: Mapping[str, Any] | None = None) -> None:
    reason = access_problem(e)
    if reason is not None:
        raise StorageAccessError(f"storage root {url}: access refused ({reason}); {CREDENTIALS_HOW_TO}") from e
    where = f" at {_endpoint(options)} (AWS_ENDPOINT_URL_S3)" if options is not None else ""
    raise StorageError(f"storage root {url}: the store does not answer{where}: {type(e).__name__}: {e}") from e


__all__ = ["S3_VARIABLES", "access_problem", "check_cache_dir", "check_source", "check_sources", "check_storage"]


def storage_error(action: str, url: str, e: BaseException) -> StorageError:
    """The StorageError for a failed ``action`` on ``url``: StorageAccessError (never retried) when
    the store refuses access (no credentials, permission denied, no such bucket)."""
    if (reason := access_problem(e)) is not None:
        hint = "; set AWS_ACCESS_KEY_ID / AWS_SECRET_ACCESS_KEY (and AWS_ENDPOINT_URL_S3)" if url.startswith("s3") else ""
        return StorageAccessError(f"cannot {action} {url}: access refused ({reason}){hint}")
    if isinstance(e, FileNotFoundError):
        return StorageError(f"cannot {action} {url}: not found")
    return StorageError(f"cannot {action} {url}: {type(e).__name__}: {e}")
