"""A sandbox function for tests (imported by a sandbox worker through PYTHONPATH): every caller
leaves its pid in ``payload["dir"]`` and waits until ``payload["n"]`` callers have (at most
``payload["timeout_s"]``); returns how many it saw. Two calls see 2 only if two workers run them at
the same time."""

from __future__ import annotations

import os
import time
from typing import Any, Mapping


def meet(payload: Mapping[str, Any], settings: Mapping[str, Any]) -> int:
    folder, n = payload["dir"], int(payload["n"])
    open(os.path.join(folder, str(os.getpid())), "w").close()
    deadline = time.monotonic() + float(payload.get("timeout_s", 60))
    while len(os.listdir(folder)) < n and time.monotonic() < deadline:
        time.sleep(0.02)
    return len(os.listdir(folder))
