"""BFCL, the first real source: its data, its simulated environments and its judges.

* :mod:`~pivotrl.bfcl.wheel` — the pinned ``bfcl-eval`` wheel, fetched, checked and unpacked into the cache;
* :mod:`~pivotrl.bfcl.data` — its tasks as trajectories (:mod:`~pivotrl.bfcl.multi_turn` the multi-turn ones,
  :mod:`~pivotrl.bfcl.records` the file reading and schema rewriting they share);
* :mod:`~pivotrl.bfcl.envs` — the simulated multi-turn tools (file system, trading, ...), branchable per sample;
* :mod:`~pivotrl.bfcl.judge` — BFCL's multi-turn checker on a played task;
* :mod:`~pivotrl.bfcl.single` — BFCL's AST checker on single-turn items (:mod:`~pivotrl.bfcl.ast_decoder` its decoder
  and the import from the wheel, :mod:`~pivotrl.bfcl.single_tables` its verdicts over a local evaluation table).
"""
