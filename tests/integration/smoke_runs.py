"""The smoke run shared by the integration tests (its fixtures are in conftest.py).

Several files read the same smoke run (every stage of ``configs/smoke.yaml`` on the tiny random
model): the pipeline's end-to-end checks, sharded probing against the unsharded table, the S3 flow
against the local run, the comparison baselines. It is computed once; a test that writes into a run
root takes a copy (:func:`copy_smoke_run`), so the shared root holds exactly one run's artifacts.
"""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Any, NamedTuple

REPO = Path(__file__).resolve().parents[2]


def smoke_config(root: str | Path, model: Path, *extra: str) -> Any:
    """The smoke config with its run root and model replaced (``extra``: more ``--set`` overrides)."""
    from pivotrl.config import load_config

    return load_config(str(REPO / "configs" / "smoke.yaml"),
                       [f"run.storage_root={root}", f"model.source={model}", *extra])


class SmokeRun(NamedTuple):
    """A run's config, store and each stage's result, in the nightly flow's order."""

    cfg: Any
    store: Any
    demos: dict[str, Any]
    ref: Any
    probe: Any
    train: Any
    ev: Any


def run_smoke_stages(cfg: Any) -> SmokeRun:
    """Every stage in this process, in the nightly flow's order (a stage already published is reused)."""
    from pivotrl.pipeline import stages
    from pivotrl.pipeline.demos import build_demonstrations
    from pivotrl.storage import ArtifactStore

    store = ArtifactStore.from_config(cfg)
    demos = build_demonstrations(cfg, store)
    ref = stages.stage_reference(cfg, store, demos)
    probe = stages.stage_probe(cfg, store, demos, ref)
    train = stages.stage_train(cfg, store, probe, ref)
    ev = stages.stage_evaluate(cfg, store, demos, ref, probe, train)
    return SmokeRun(cfg, store, demos, ref, probe, train, ev)


def copy_smoke_run(run: SmokeRun, root: Path) -> SmokeRun:
    """A copy of ``run``'s root at ``root`` (which must not exist), and the stages' results on it:
    every stage is found published there and reused, so nothing is computed again."""
    shutil.copytree(Path(run.cfg.run.storage_root), root)
    cfg = run.cfg.model_copy(update={"run": run.cfg.run.model_copy(update={"storage_root": str(root)})})
    return run_smoke_stages(cfg)
