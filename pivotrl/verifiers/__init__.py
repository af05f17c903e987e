"""Verifiers: decide whether an action is acceptable at a turn state (PivotRL §3.2).

``get_verifier(name, **opts).score(state, actions) -> list[VerifierResult]`` with names
"tool_name" (called tool names), "arguments" (argument rules / BFCL possible answers),
"execution" (functional equivalence in a sandbox) and "auto" (the state's default verifier).
"""

from __future__ import annotations

from pivotrl.verifiers.base import VERIFIERS, AutoVerifier, Verifier, VerifierResult, get_verifier
from pivotrl.verifiers.tool_name import ToolNameVerifier
from pivotrl.verifiers.arguments import ArgumentsVerifier
from pivotrl.verifiers.execution import ExecutionVerifier

__all__ = [
    "VERIFIERS",
    "ArgumentsVerifier",
    "AutoVerifier",
    "ExecutionVerifier",
    "ToolNameVerifier",
    "Verifier",
    "VerifierResult",
    "get_verifier",
]
