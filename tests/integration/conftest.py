"""Fixtures shared by the integration tests: one tiny model and one in-process smoke run per
session (see smoke_runs.py)."""

from __future__ import annotations

from pathlib import Path

import pytest

from smoke_runs import SmokeRun, run_smoke_stages, smoke_config


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory) -> Path:
    """The tiny random model (seed 0) and its tokenizer, saved once per session; tests only read it."""
    from pivotrl.testing import save_tiny_checkpoint

    return save_tiny_checkpoint(tmp_path_factory.mktemp("model") / "tiny")


@pytest.fixture(scope="session")
def smoke_run(tmp_path_factory, tiny_model) -> SmokeRun:
    """The smoke config's every stage, run once per session in this process. Its root is shared:
    read it, never write into it (take :func:`copy_smoke_run` for that)."""
    return run_smoke_stages(smoke_config(tmp_path_factory.mktemp("smoke") / "root", tiny_model))
