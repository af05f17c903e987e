"""pivotrl: PivotRL post-training for tool-using agents (turn-level RL on expert demonstrations)."""

__version__ = "0.1.0"
