"""BFCL, the first real source: its data, its simulated environments and its judges.

* :mod:`~pivotrl.bfcl.data` — the pinned ``bfcl-eval`` wheel's tasks as trajectories;
* :mod:`~pivotrl.bfcl.envs` — the simulated multi-turn tools (file system, trading, ...), branchable per sample;
* :mod:`~pivotrl.bfcl.judge` — BFCL's multi-turn checker on a played task;
* :mod:`~pivotrl.bfcl.single` — BFCL's AST checker on single-turn items.
"""
