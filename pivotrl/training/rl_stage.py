"""Launcher entry of the pipeline's PivotRL training stage, for process groups.

``python -m pivotrl.training.rl_stage --spec spec.json`` under torchrun or the deepspeed launcher
(see :func:`pivotrl.training.launch.render_launch_command` with ``entry="rl_stage"``). The spec is
``{"config": <RunConfig JSON>, "inputs": {"probe": ..., "reference": ...}, "output": <path>}``;
every rank runs the pipeline's train stage through its process entry, ``pivotrl.pipeline.entry``
(rank 0 owns the rollout engine and broadcasts the batches; see :mod:`pivotrl.training.loop`), and
rank 0 writes the result JSON to ``output``.

This launcher shim is the one module under ``pivotrl.training`` that reaches the pipeline (at run
time, inside :func:`main`): it stays at this path because launch commands and cluster jobs name
``pivotrl.training.rl_stage``. The loop itself (:mod:`pivotrl.training.loop`) and every other
training module import nothing of ``pivotrl.pipeline``.
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

    from pivotrl.pipeline.entry import run_stage, write_result  # the launcher shim's one pipeline import

    result = run_stage("train", spec["config"], spec["inputs"])
    if int(os.environ.get("RANK", "0")) == 0 and spec.get("output"):
        write_result(spec["output"], result)
    return 0


if __name__ == "__main__":
    sys.exit(main())
