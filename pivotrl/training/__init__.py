"""Training: per-token log-probs, DeepSpeed engines, the SFT warm start and the PivotRL trainer.

Import the submodules directly; this package imports nothing heavy at import time::

    from pivotrl.training.logprobs import group_logprobs
    from pivotrl.training.pivotrl import Group, PivotRLTrainer
    from pivotrl.training.sft import run_sft
    from pivotrl.training.launch import render_launch_command, launch
"""

from __future__ import annotations
