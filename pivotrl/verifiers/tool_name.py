"""The ``tool_name`` verifier: the cheapest local signal (PivotRL §3.2; one of the paper's settings).

Accept iff the list of called tool names, in order, equals the demonstration's (arguments are not
looked at). A text demonstration action is judged by its text rule (stop decision, explicit answer
rule, or nothing accepted: :mod:`pivotrl.data.text_rules`). Known limit: a correct tool with
wrong arguments is accepted; the full task decides.
"""

from __future__ import annotations

from typing import Sequence

from pivotrl.data.schema import TurnState
from pivotrl.verifiers.base import VERIFIERS, VerifierResult, demo_calls, kind_check, parse_actions

__all__ = ["ToolNameVerifier"]


@VERIFIERS.register("tool_name")
class ToolNameVerifier:
    """Reasons: "match", "stop", "rule", "rule_failed", "no_rule", "parse_error", "wrong_kind", "wrong_tool"."""

    def score(self, state: TurnState, actions: Sequence[str]) -> list[VerifierResult]:
        """One result per action (length m or K). Raises DataError for a malformed state."""
        demo = demo_calls(state)
        want = [c.name for c in demo]
        out = []
        for parsed in parse_actions(state, actions, getattr(self, "tool_parser", None)):
            verdict = kind_check(demo, parsed, state)
            if verdict is None:
                got = [c.name for c in parsed.calls]
                verdict = VerifierResult.accept() if got == want else VerifierResult.reject("wrong_tool")
            out.append(verdict)
        return out
