"""Launcher entry of the pipeline's PivotRL training stage, for process groups.

``python -m pivotrl.training.rl_stage --spec spec.json`` under torchrun or the deepspeed launcher
(see :func:`pivotrl.training.launch.render_launch_command` with ``entry="rl_stage"``). The spec is
``{"config": <RunConfig JSON>, "inputs": {"probe": ..., "reference": ...}, "output": <path>}``;
every rank runs :func:`pivotrl.pipeline.stages.stage_train` (rank 0 owns the rollout engine and
broadcasts the batches) and rank 0 writes the result JSON to ``output``.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
from pathlib import Path


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m pivotrl.training.rl_stage")
    ap.add_argument("--spec", required=True)
    args = ap.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    spec = json.loads(Path(args.spec).read_text())

    from pivotrl.config import RunConfig
    from pivotrl.pipeline.common import make_store
    from pivotrl.pipeline.stages import stage_train

    cfg = RunConfig.model_validate(spec["config"])
    store = make_store(cfg)
    result = stage_train(cfg, store, spec["inputs"]["probe"], spec["inputs"]["reference"])
    if int(os.environ.get("RANK", "0")) == 0 and spec.get("output"):
        tmp = Path(spec["output"] + ".tmp")
        tmp.write_text(json.dumps(result, default=str))
        tmp.replace(spec["output"])
    return 0


if __name__ == "__main__":
    sys.exit(main())
