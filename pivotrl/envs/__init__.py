"""Tool execution outside the trainer's process: a sandboxed worker that runs a tool call with a
time limit and retries (:mod:`~pivotrl.envs.sandbox`, :mod:`~pivotrl.envs.sandbox_worker`).

BFCL's simulated environments live in :mod:`pivotrl.bfcl.envs`.
"""
