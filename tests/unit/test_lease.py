"""A stage lease left by a killed run on this machine is taken over at once, not after its expiry."""

from __future__ import annotations

import json
import logging
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from pivotrl.core.errors import StorageError
from pivotrl.storage.lease import lease_path, stage_lease
from pivotrl.storage import ArtifactStore

REPO = Path(__file__).resolve().parents[2]

HOLDER = """
import sys, time
import pytest

from pivotrl.core.errors import StorageError
from pivotrl.storage.lease import stage_lease
from pivotrl.storage import ArtifactStore
with stage_lease(ArtifactStore(sys.argv[1]), "probes/abc", ttl=120.0):
    print("held", flush=True)
    time.sleep(600)
"""


def test_a_lease_held_by_a_killed_process_on_this_host_is_taken_over_at_once(tmp_path, caplog):
    store = ArtifactStore(str(tmp_path / "root"))
    child = subprocess.Popen([sys.executable, "-c", HOLDER, store.root_url], stdout=subprocess.PIPE, text=True,
                             cwd=REPO, env={**os.environ, "PYTHONPATH": str(REPO)})
    try:
        assert child.stdout.readline().strip() == "held"
        held = json.loads(Path(lease_path(store, "probes/abc")).read_text())
        assert held["pid"] == child.pid and held["host"] and held["expires_at"] > time.time() + 60
    finally:
        child.send_signal(signal.SIGKILL)  # no finally runs in the child: the lease stays behind
        child.wait(timeout=30)
    assert Path(lease_path(store, "probes/abc")).exists()

    with caplog.at_level(logging.WARNING, logger="pivotrl.storage.lease"):
        # timeout=10 s: waiting for the dead holder's 120-s expiry would fail here
        with stage_lease(store, "probes/abc", ttl=120.0, timeout=10.0) as info:
            mine = json.loads(Path(lease_path(store, "probes/abc")).read_text())
    assert mine["pid"] == os.getpid() and mine["owner"] == info.owner
    assert f"held by pid {child.pid} on this host" in caplog.text and "taking it over" in caplog.text
    assert not Path(lease_path(store, "probes/abc")).exists()  # released on exit


def test_a_lease_of_a_live_process_is_waited_for(tmp_path):
    store = ArtifactStore(str(tmp_path / "root"))
    child = subprocess.Popen([sys.executable, "-c", HOLDER, store.root_url], stdout=subprocess.PIPE, text=True,
                             cwd=REPO, env={**os.environ, "PYTHONPATH": str(REPO)})
    try:
        assert child.stdout.readline().strip() == "held"
        seen = []
        t0 = time.monotonic()
        with pytest.raises(StorageError, match="still being computed by another run"):
            with stage_lease(store, "probes/abc", ttl=120.0, poll=0.2, timeout=1.0, on_wait=seen.append):
                pass
        assert time.monotonic() - t0 >= 1.0 and seen and seen[0]["pid"] == child.pid
    finally:
        child.send_signal(signal.SIGKILL)
        child.wait(timeout=30)


def test_a_process_stopped_by_a_signal_releases_the_leases_it_holds(tmp_path):
    from pivotrl.storage.lease import release_held_leases

    store = ArtifactStore(str(tmp_path / "root"))
    path = Path(lease_path(store, "train/abc"))
    with stage_lease(store, "train/abc", ttl=120.0), stage_lease(store, "probes/def", ttl=120.0):
        assert path.exists() and len(list(path.parent.glob("*.json"))) == 2
        assert release_held_leases() == 2  # what the run's signal handler calls before os._exit
        assert list(path.parent.glob("*.json")) == []
    assert release_held_leases() == 0  # nothing held after the with
