"""The project's one retry mechanism (tenacity): storage operations and sandbox requests.

:func:`call_with_retries` runs a callable and, on an exception the caller deems retryable, waits
``min(backoff_s · 2^k, max_backoff_s)`` seconds before retry k (k = 0, 1, ...). Each kind of
failure is retried in one place only: the artifact store retries a *transient* remote failure
(:func:`is_transient`) and an injected storage fault under its :class:`RetryPolicy` (nothing above
the store retries a storage error again); the sandbox pool and the verifiers retry a failed tool
request. Both go through :func:`call_with_retries`, so waits, counting and the final error behave
the same everywhere.

Pure core: imports tenacity and the standard library only.
"""

from __future__ import annotations

import errno
import time
from dataclasses import dataclass, field
from typing import Callable, TypeVar

import tenacity

from pivotrl.core.errors import ConfigError, StorageAccessError, StorageError, ToolExecutionError

__all__ = ["RetryPolicy", "RetryStats", "call_with_retries", "is_transient"]

R = TypeVar("R")


@dataclass
class RetryStats:
    """How many calls were made through :func:`call_with_retries` and how many were retries."""

    calls: int = 0
    retries: int = 0
    failures: int = 0  # calls that failed after all retries
    last_errors: list[str] = field(default_factory=list)


def call_with_retries(
    fn: Callable[[], R],
    retries: int,
    backoff_s: float,
    retry_on: tuple[type[BaseException], ...] = (ToolExecutionError,),
    stats: RetryStats | None = None,
    max_backoff_s: float | None = None,
    *,
    retry_if: Callable[[BaseException], bool] | None = None,
    on_retry: Callable[[BaseException, int, float], None] | None = None,
    wait_if: Callable[[BaseException], bool] | None = None,
) -> R:
    """Call ``fn()``; on a retryable exception try again up to ``retries`` more times.

    An exception is retryable when it is an instance of ``retry_on`` or, if ``retry_if`` is given,
    when ``retry_if(exc)`` is True (``retry_on`` is then ignored); a StorageAccessError (the store
    refuses us: no credentials, access denied, no such bucket) never is. Waits
    ``min(backoff_s * 2**k, max_backoff_s)`` seconds before the k-th retry (``max_backoff_s=None``:
    no cap); a retry of an exception for which ``wait_if(exc)`` is False goes at once (nothing to
    wait out, e.g. an injected fault). ``on_retry(exc, k, wait_s)`` is called before each wait
    (k = 1 for the first retry).
    Records calls, retries, the last errors and a final failure in ``stats`` if given.

    Re-raises the last exception when every attempt failed; other exceptions propagate at once.
    Raises ConfigError for negative ``retries``/``backoff_s``/``max_backoff_s``.
    """
    if retries < 0 or backoff_s < 0 or (max_backoff_s is not None and max_backoff_s < 0):
        raise ConfigError(f"call_with_retries: retries={retries}, backoff_s={backoff_s}, "
                          f"max_backoff_s={max_backoff_s}: all must be >= 0")
    chosen = retry_if or (lambda e: isinstance(e, retry_on))

    def retryable(e: BaseException) -> bool:  # a refusal (StorageAccessError) is never worth a retry
        return not isinstance(e, StorageAccessError) and chosen(e)

    if stats is not None:
        stats.calls += 1

    def wait(state: tenacity.RetryCallState) -> float:
        exc = state.outcome.exception() if state.outcome else None
        if wait_if is not None and exc is not None and not wait_if(exc):
            return 0.0
        delay = backoff_s * 2 ** (state.attempt_number - 1)
        return delay if max_backoff_s is None else min(delay, max_backoff_s)

    def after(state: tenacity.RetryCallState) -> None:  # every retryable failure, the last one too
        exc = state.outcome.exception() if state.outcome else None
        if stats is not None and exc is not None:
            stats.last_errors = (stats.last_errors + [f"{type(exc).__name__}: {exc}"])[-10:]

    def before_sleep(state: tenacity.RetryCallState) -> None:
        if stats is not None:
            stats.retries += 1
        exc = state.outcome.exception() if state.outcome else None
        if on_retry is not None and exc is not None:
            on_retry(exc, state.attempt_number, state.upcoming_sleep)

    retrying = tenacity.Retrying(
        stop=tenacity.stop_after_attempt(retries + 1), wait=wait,
        retry=tenacity.retry_if_exception(retryable), reraise=True, after=after,
        before_sleep=before_sleep, sleep=lambda s: time.sleep(s),
    )
    try:
        return retrying(fn)
    except BaseException as e:
        if stats is not None and isinstance(e, Exception) and retryable(e):
            stats.failures += 1  # retryable and re-raised: every attempt was used
        raise


@dataclass(frozen=True)
class RetryPolicy:
    """How a store retries an operation that failed for a transient reason.

    ``attempts`` tries in all (1 = no retry); the wait before retry i (0-based) is
    ``min(base_delay_s · 2^i, max_delay_s)`` seconds. The default rides out about a minute of outage
    on top of the driver's own retries. Local directories retry only injected faults (their own
    errors are not transient), without waiting.
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
