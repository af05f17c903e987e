"""Executable tool environments behind demonstrations (``Trajectory.env``).

``kind == "bfcl"``: :class:`pivotrl.envs.bfcl.BFCLEnvironment` (BFCL's simulated multi-turn tools).
"""

from __future__ import annotations

from pivotrl.envs.bfcl import BFCLEnvironment, replay

__all__ = ["BFCLEnvironment", "replay"]
