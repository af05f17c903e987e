"""Launcher entry of the pipeline's PivotRL training stage, for process groups.

``python -m pivotrl.pipeline.rl_stage --spec spec.json`` under torchrun or the deepspeed launcher
(see :func:`pivotrl.training.launch.render_launch_command` with ``entry="rl_stage"``). The spec is
``{"config": <RunConfig JSON>, "inputs": {"probe": ..., "reference": ...}, "output": <path>}``;
every rank runs the pipeline's train stage through its process entry, ``pivotrl.pipeline.entry``
(rank 0 owns the rollout engine and broadcasts the batches; see :mod:`pivotrl.training.loop`), and
rank 0 writes the result JSON to ``output``.

It lives in the pipeline layer, which composes the trainer: :mod:`pivotrl.training` (the loop,
the trainer, the launcher) imports nothing of ``pivotrl.pipeline``; the launcher names this module
as a string only (:data:`pivotrl.training.launch.ENTRIES`).
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
from pathlib import Path

from pivotrl.pipeline.entry import run_stage, write_result


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m pivotrl.pipeline.rl_stage")
    ap.add_argument("--spec", required=True)
    args = ap.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    from pivotrl.pipeline.processes import watch_parent

    # torchrun starts each rank in a session of its own: a rank whose launcher is gone (Ctrl-C, a lost
    # node) ends with its engine and verifier workers instead of waiting in a rendezvous forever.
    watch_parent()
    spec = json.loads(Path(args.spec).read_text())

    result = run_stage("train", spec["config"], spec["inputs"])
    if int(os.environ.get("RANK", "0")) == 0 and spec.get("output"):
        write_result(spec["output"], result)
    return 0


if __name__ == "__main__":
    sys.exit(main())
