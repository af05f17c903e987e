"""Pivot selection (PivotRL §3): which turn states are pivots, and why two pivot sets differ.

* :mod:`~pivotrl.pivots.filter` — μ̂, σ̂² of a state's probe rewards and the pivot decision;
* :mod:`~pivotrl.pivots.diff` — state-by-state reasons two ``pivots.parquet`` differ.
"""
