"""Preflight of a run's storage root: credentials, endpoint and bucket checked before any stage runs.

A storage root that cannot work (no credentials, credentials refused, permission denied, a bucket
that does not exist, an endpoint that does not answer) fails in seconds with one message naming
what to set, instead of failing inside the first stage after its retries. Used by the CLI before
Prefect starts and by the flows at their start (a deployment run has no CLI in front of it).
"""

from __future__ import annotations

import os
from typing import Any, Mapping

from pivotrl.errors import StorageAccessError, StorageError

#: The environment variables an s3:// root reads (named in every error).
S3_VARIABLES = ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_ENDPOINT_URL_S3")
_HOW = ("set AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY (and AWS_ENDPOINT_URL_S3 for a non-AWS "
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

    Local roots: the directory (or its nearest existing parent) must be writable. ``s3://`` roots:
    credentials must be found (options ``key``/``secret``, ``anon: true``, the environment, a
    profile or a role), and the bucket must answer a listing within ``timeout_s`` (one attempt,
    no retries). Other protocols: the root's parent must answer ``exists``.

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


def _check_local(path: str) -> None:
    p = os.path.abspath(path)
    while not os.path.exists(p):
        parent = os.path.dirname(p)
        if parent == p:
            break
        p = parent
    if not os.access(p, os.W_OK | os.X_OK):
        raise StorageAccessError(f"storage root {path}: {p} is not writable by this user")


def _check_s3(url: str, options: dict[str, Any], timeout_s: float) -> None:
    bucket = url.split("://", 1)[1].split("/", 1)[0]
    if not bucket:
        raise StorageAccessError(f"storage root {url}: no bucket in the URL (expected s3://<bucket>/<prefix>)")
    if not (options.get("anon") or (options.get("key") and options.get("secret"))):
        import botocore.session

        session = botocore.session.Session(profile=options.get("profile") or None)
        try:
            creds = session.get_credentials()
        except Exception as e:  # a broken profile or config file
            raise StorageAccessError(f"storage root {url}: cannot read AWS credentials ({type(e).__name__}: {e}); {_HOW}") from e
        if creds is None or not creds.access_key:
            raise StorageAccessError(f"storage root {url}: no AWS credentials found; {_HOW}")
    import s3fs

    cfg = dict(options.get("config_kwargs") or {})
    cfg.update({"connect_timeout": timeout_s, "read_timeout": timeout_s, "retries": {"max_attempts": 1}})
    try:
        fs = s3fs.S3FileSystem(**{**options, "config_kwargs": cfg, "skip_instance_cache": True})
        fs.ls(bucket, refresh=True)
    except FileNotFoundError as e:
        raise StorageAccessError(f"storage root {url}: bucket {bucket!r} does not exist (NoSuchBucket) at "
                                 f"{_endpoint(options)}; create it or fix run.storage_root") from e
    except Exception as e:
        _raise(url, e, options)


def _endpoint(options: Mapping[str, Any]) -> str:
    return str((options.get("client_kwargs") or {}).get("endpoint_url") or options.get("endpoint_url")
               or os.environ.get("AWS_ENDPOINT_URL_S3") or os.environ.get("AWS_ENDPOINT_URL") or "AWS S3")


def _raise(url: str, e: BaseException, options: Mapping[str, Any] | None = None) -> None:
    reason = access_problem(e)
    if reason is not None:
        raise StorageAccessError(f"storage root {url}: access refused ({reason}); {_HOW}") from e
    where = f" at {_endpoint(options)} (AWS_ENDPOINT_URL_S3)" if options is not None else ""
    raise StorageError(f"storage root {url}: the store does not answer{where}: {type(e).__name__}: {e}") from e


__all__ = ["S3_VARIABLES", "access_problem", "check_storage"]
