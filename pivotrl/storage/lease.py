"""Leases on stage keys in the artifact store: two runs on one storage root never compute the same
stage at once.

A lease is a small JSON file ``leases/<stage key>.json`` created *exclusively* in the store (local
directories: ``open(..., "xb")``; object stores: a conditional put, ``If-None-Match: *``, where the
driver supports it). It holds its owner's id and an expiry time; the owner renews it every
``ttl / 3`` seconds from a background thread while the stage runs and deletes it when done. A run
that finds the lease held waits (polling) until it is released, then looks again at what the holder
left — a completed stage is then reused instead of recomputed. A lease whose owner died is broken
and taken over, so a killed run never blocks later ones: at once when the owner ran on this machine
(same host name and boot id) and its process is gone (or its pid now belongs to a newer process);
otherwise once its expiry passed without renewal.

Nothing here imports Prefect; the stage tasks (``pivotrl.tasks.stages``) take a lease around each
stage.
"""

from __future__ import annotations

import json
import logging
import os
import socket
import threading
import time
import uuid
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, Callable, Iterator

from pivotrl.core.errors import StorageError

log = logging.getLogger("pivotrl.storage.lease")

#: Folder under the run root that holds the leases.
LEASE_DIR = "leases"

# The leases this process holds now: owner id -> (filesystem, path); see release_held_leases.
_HELD: dict[str, tuple[Any, str]] = {}


@dataclass(frozen=True)
class LeaseInfo:
    """What a lease acquisition found: ``waited_s`` seconds spent waiting for ``holders`` (the owner
    descriptions of the leases waited on, oldest first; empty when the lease was free)."""

    key: str
    owner: str
    waited_s: float
    holders: tuple[dict[str, Any], ...] = ()


def _boot_id() -> str | None:
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            return f.read().strip()
    except OSError:
        return None


def _process_start(pid: int) -> str | None:
    """The start time of process ``pid`` (clock ticks since boot, Linux), None where unknown."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[19]
    except (OSError, IndexError):
        return None


def _owner_is_dead(held: dict[str, Any]) -> bool:
    """True if the lease's owner ran on this machine and its process no longer runs."""
    if held.get("host") != socket.gethostname() or held.get("boot_id") != _boot_id():
        return False  # another machine (or this one before a reboot: then its expiry decides)
    try:
        pid = int(held["pid"])
    except (KeyError, TypeError, ValueError):
        return False
    if pid == os.getpid():
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    except PermissionError:  # another user's live process
        return False
    try:
        with open(f"/proc/{pid}/stat") as f:
            if f.read().rsplit(")", 1)[1].split()[0] == "Z":  # killed, not yet reaped
                return True
    except (OSError, IndexError):
        pass
    started = held.get("pid_started")
    return started is not None and _process_start(pid) not in (None, started)  # the pid was reused


def lease_path(store: Any, key: str) -> str:
    """Filesystem path of the lease of stage key ``key`` in ``store`` (an ArtifactStore)."""
    safe = key.replace("/", "_")
    return store._path(f"{LEASE_DIR}/{safe}.json")


def _create_exclusive(fs: Any, path: str, data: bytes) -> bool:
    """Create ``path`` with ``data`` unless it exists; True if this call created it."""
    try:
        fs.makedirs(path.rsplit("/", 1)[0], exist_ok=True)
    except Exception:  # object stores have no directories
        pass
    try:
        with fs.open(path, "xb") as f:
            f.write(data)
        return True
    except FileExistsError:
        return False
    except (ValueError, NotImplementedError, TypeError):
        # A driver without exclusive create: check, write, read back (a narrow race remains).
        if fs.exists(path):
            return False
        fs.pipe_file(path, data)
        return json.loads(fs.cat_file(path)).get("owner") == json.loads(data).get("owner")
    except Exception as e:
        if "PreconditionFailed" in repr(e) or "412" in str(e):
            return False
        raise


def _read(fs: Any, path: str) -> dict[str, Any] | None:
    try:
        if hasattr(fs, "invalidate_cache"):
            fs.invalidate_cache(path)
        return json.loads(fs.cat_file(path))
    except FileNotFoundError:
        return None
    except (ValueError, OSError):  # half-written by a driver without atomic puts: treat as held
        return {"owner": "?", "expires_at": time.time() + 1.0}


@contextmanager
def stage_lease(store: Any, key: str, *, ttl: float = 60.0, poll: float = 1.0, timeout: float | None = None,
                describe: dict[str, Any] | None = None,
                on_wait: Callable[[dict[str, Any]], None] | None = None) -> Iterator[LeaseInfo]:
    """Hold the exclusive lease on stage ``key`` of ``store`` for the body of the ``with``.

    Args:
        store: the run's ``ArtifactStore`` (its ``fs`` and paths are used directly).
        key: the stage's key (a content hash of what it depends on).
        ttl: seconds a lease stays valid without renewal; renewed every ``ttl / 3`` s.
        poll: seconds between looks at a held lease.
        timeout: give up waiting after this many seconds (None = wait as long as the holder lives).
        describe: facts about the owner written into the lease (e.g. the Prefect flow-run id).
        on_wait: called once with the holder's description when the lease is found held.

    Yields a :class:`LeaseInfo`. Raises StorageError if the lease cannot be written or ``timeout``
    passes.
    """
    fs, path = store.fs, lease_path(store, key)
    owner = uuid.uuid4().hex
    meta = {"owner": owner, "key": key, "host": socket.gethostname(), "boot_id": _boot_id(), "pid": os.getpid(),
            "pid_started": _process_start(os.getpid()), **(describe or {})}
    t0 = time.time()
    holders: list[dict[str, Any]] = []
    while True:
        body = json.dumps({**meta, "acquired_at": time.time(), "expires_at": time.time() + ttl}).encode()
        try:
            if _create_exclusive(fs, path, body):
                break
        except Exception as e:
            from pivotrl.storage.check import storage_error  # access refused: StorageAccessError, never retried

            raise storage_error(f"take the lease on stage {key} at", path, e) from e
        held = _read(fs, path)
        if held is None:
            continue  # released between our attempt and the read
        if _owner_is_dead(held):
            log.warning("lease on %s is held by pid %s on this host (%s), which no longer runs: taking it over",
                        key, held.get("pid"), held.get("host"))
            _remove_if_owner(fs, path, held.get("owner"))
            continue
        if not holders or holders[-1].get("owner") != held.get("owner"):
            holders.append(held)
            if on_wait is not None:
                on_wait(held)
        if float(held.get("expires_at", 0)) < time.time():
            log.warning("lease on %s expired (owner %s, pid %s on %s): breaking it", key, held.get("owner"),
                        held.get("pid"), held.get("host"))
            _remove_if_owner(fs, path, held.get("owner"))
            continue
        if timeout is not None and time.time() - t0 > timeout:
            raise StorageError(f"stage {key} is still being computed by another run after {timeout:.0f} s "
                               f"(lease {path}, held by pid {held.get('pid')} on {held.get('host')})")
        time.sleep(poll)
    stop = threading.Event()

    def renew() -> None:
        while not stop.wait(ttl / 3):
            current = _read(fs, path)
            if current is None or current.get("owner") != owner:
                log.warning("lease on %s was taken over while held", key)
                return
            try:
                fs.pipe_file(path, json.dumps({**current, "expires_at": time.time() + ttl}).encode())
            except Exception as e:  # a missed renewal is harmless unless ttl passes
                log.warning("could not renew the lease on %s: %s", key, e)

    renewer = threading.Thread(target=renew, name=f"lease-{key[:24]}", daemon=True)
    renewer.start()
    _HELD[owner] = (fs, path)
    try:
        yield LeaseInfo(key=key, owner=owner, waited_s=time.time() - t0, holders=tuple(holders))
    finally:
        stop.set()
        renewer.join(timeout=5)
        _HELD.pop(owner, None)
        _remove_if_owner(fs, path, owner)


def release_held_leases() -> int:
    """Delete every lease this process holds (a run stopped by a signal exits without unwinding its
    ``with stage_lease``; the next run would otherwise find the lease of a dead process and break
    it). Returns how many were deleted; a lease that cannot be deleted is left to expire. Never
    raises."""
    released = 0
    for owner, (fs, path) in list(_HELD.items()):
        _HELD.pop(owner, None)
        try:
            _remove_if_owner(fs, path, owner)
            released += 1
        except Exception as e:  # the store went away: the lease expires after its ttl
            log.warning("could not release the lease %s: %s", path, e)
    return released


def _remove_if_owner(fs: Any, path: str, owner: Any) -> None:
    current = _read(fs, path)
    if current is not None and current.get("owner") == owner:
        try:
            fs.rm(path)
        except FileNotFoundError:
            pass


__all__ = ["LEASE_DIR", "LeaseInfo", "lease_path", "release_held_leases", "stage_lease"]
