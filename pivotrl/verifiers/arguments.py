"""The ``arguments`` verifier: tool names and argument values against explicit rules.

Two rule sources (PivotRL §3.2, "argument rules"):

With ``verifier_context["possible_answers"]`` (BFCL single-turn ground truth,
``[{"name": fname, "arguments": {param: [acceptable values]}}]``), a call matches an answer iff

- the function name is equal;
- every parameter the tool schema lists as required is given;
- every given parameter appears in the answer (no unexpected parameters);
- every answer parameter that is not given has ``""`` among its acceptable values ("may be omitted");
- every given value equals one acceptable value (``""`` itself is only the omission marker).

Values are compared structurally: numbers by value with int/float equivalence in both directions
(``5 == 5.0``; booleans are not numbers), booleans and None exactly, lists element-wise in order,
dicts key by key. Strings are compared after the normalisation BFCL's AST checker applies: case
folded, whitespace and the characters ``, . / - _ * ^`` removed, and ``'`` treated as ``"``
(so ``"New York"`` matches ``"new york"`` and ``"2024-01-02"`` matches ``"20240102"``). A dict
inside an answer maps each key to its own list of acceptable values (``""`` = may be omitted).

Without possible answers, the demonstration's calls are the rule: same name, exactly the same
parameters, equal values (numbers with int/float equivalence; strings exactly, no normalisation).
A call that passes a default value the demonstration left out is therefore rejected here (the
``execution`` verifier accepts it if it has the same effect).

Several calls match order-insensitively: the candidate is accepted iff there is a bijection between
its calls and the expected calls such that each pair matches.
"""

from __future__ import annotations

import re
from typing import Any, Mapping, Sequence

from pivotrl.data.schema import ToolCall, ToolSpec, TurnState
from pivotrl.core.errors import DataError
from pivotrl.verifiers.base import VERIFIERS, VerifierResult, demo_calls, kind_check, parse_actions

__all__ = ["ArgumentsVerifier", "match_calls", "normalise_string"]

_STRIP = re.compile(r"[\s,./\-_*^]")


def normalise_string(s: str) -> str:
    """BFCL-style lenient string key: casefold, drop whitespace and ``, . / - _ * ^``, ``'`` → ``"``."""
    return _STRIP.sub("", s).casefold().replace("'", '"')


def _is_number(x: Any) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool)


def _equal(got: Any, want: Any, lenient: bool) -> bool:
    """Structural equality of plain values (see the module docstring)."""
    if _is_number(got) and _is_number(want):
        return got == want
    if isinstance(got, bool) or isinstance(want, bool) or got is None or want is None:
        return type(got) is type(want) and got == want
    if isinstance(got, str) and isinstance(want, str):
        return normalise_string(got) == normalise_string(want) if lenient else got == want
    if isinstance(got, list) and isinstance(want, list):
        return len(got) == len(want) and all(_matches_one(g, w, lenient) for g, w in zip(got, want))
    if isinstance(got, Mapping) and isinstance(want, Mapping):
        return set(got) == set(want) and all(_equal(got[k], want[k], lenient) for k in want)
    return False


def _matches_one(got: Any, want: Any, lenient: bool) -> bool:
    """``got`` against one acceptable value; a dict in an answer is in "key → acceptable list" form."""
    if lenient and isinstance(want, Mapping):
        if not isinstance(got, Mapping) or any(k not in want for k in got):
            return False
        for k, acceptable in want.items():
            options = acceptable if isinstance(acceptable, list) else [acceptable]
            if k in got:
                if not _matches_any(got[k], options, lenient):
                    return False
            elif "" not in options:
                return False
        return True
    return _equal(got, want, lenient)


def _matches_any(got: Any, acceptable: Sequence[Any], lenient: bool) -> bool:
    return any(_matches_one(got, w, lenient) for w in acceptable if not (isinstance(w, str) and w == ""))


def _call_mismatch(
    got: ToolCall, name: str, rules: Mapping[str, Sequence[Any]], required: Sequence[str], lenient: bool
) -> str | None:
    """None if ``got`` satisfies the rules of one expected call, else the reason."""
    if got.name != name:
        return "wrong_tool"
    for p in required:
        if p not in got.arguments:
            return f"missing_argument:{p}"
    for p in got.arguments:
        if p not in rules:
            return f"unexpected_argument:{p}"
    for p, acceptable in rules.items():
        if p not in got.arguments:
            if "" not in acceptable:
                return f"missing_argument:{p}"
        elif not _matches_any(got.arguments[p], acceptable, lenient):
            return f"wrong_value:{p}"
    return None


def match_calls(
    calls: Sequence[ToolCall],
    expected: Sequence[tuple[str, Mapping[str, Sequence[Any]]]],
    tools: Sequence[ToolSpec] = (),
    *,
    lenient: bool,
) -> str | None:
    """Order-insensitive match of candidate calls against expected ``(name, {param: [acceptable]})``.

    Returns None when a bijection of matching pairs exists, else a reason: "wrong_call_count",
    "wrong_tool" (the multisets of names differ) or the first pair's mismatch reason.
    ``lenient`` selects BFCL string normalisation and the dict-of-acceptable-lists form.
    """
    if len(calls) != len(expected):
        return "wrong_call_count"
    if sorted(c.name for c in calls) != sorted(name for name, _ in expected):
        return "wrong_tool"
    required = {t.name: list((t.parameters or {}).get("required") or []) for t in tools}
    ok = [
        [_call_mismatch(c, name, rules, required.get(name, ()), lenient) is None for name, rules in expected]
        for c in calls
    ]
    owner: list[int] = [-1] * len(expected)  # expected j → candidate i (augmenting-path matching)

    def augment(i: int, seen: set[int]) -> bool:
        for j in range(len(expected)):
            if ok[i][j] and j not in seen:
                seen.add(j)
                if owner[j] < 0 or augment(owner[j], seen):
                    owner[j] = i
                    return True
        return False

    for i in range(len(calls)):
        if not augment(i, set()):
            for j, (name, rules) in enumerate(expected):
                reason = _call_mismatch(calls[i], name, rules, required.get(name, ()), lenient)
                if reason is not None and reason != "wrong_tool":
                    return reason
            return "no_matching_call"
    return None


def expected_calls(state: TurnState) -> tuple[list[tuple[str, Mapping[str, Sequence[Any]]]], bool]:
    """The rules of a state: ``(expected calls, lenient)`` from possible answers if present
    (lenient), else from the demonstration's calls (each value its only acceptable one; strict)."""
    possible = state.verifier_context.get("possible_answers")
    where = f"turn state {state.state_id!r}: verifier_context.possible_answers"
    if possible is not None:
        if not isinstance(possible, list):
            raise DataError(f"{where}: expected a list")
        out = []
        for i, entry in enumerate(possible):
            if not isinstance(entry, Mapping) or not isinstance(entry.get("name"), str):
                raise DataError(f"{where}[{i}]: expected {{'name': str, 'arguments': {{param: [values]}}}}")
            args = entry.get("arguments") or {}
            if not isinstance(args, Mapping) or any(not isinstance(v, list) for v in args.values()):
                raise DataError(f"{where}[{i}].arguments: every parameter needs a list of acceptable values")
            out.append((entry["name"], args))
        return out, True
    return [(c.name, {p: [v] for p, v in c.arguments.items()}) for c in demo_calls(state)], False


@VERIFIERS.register("arguments")
class ArgumentsVerifier:
    """Reasons: "match", "text", "parse_error", "wrong_kind", "wrong_call_count", "wrong_tool",
    "missing_argument:<p>", "unexpected_argument:<p>", "wrong_value:<p>", "no_matching_call"."""

    def score(self, state: TurnState, actions: Sequence[str]) -> list[VerifierResult]:
        """One result per action (length m or K). Raises DataError for a malformed state."""
        expected, lenient = expected_calls(state)
        out = []
        for parsed in parse_actions(state, actions, getattr(self, "tool_parser", None)):
            verdict = kind_check(tuple(ToolCall(name) for name, _ in expected), parsed, state)
            if verdict is None:
                reason = match_calls(parsed.calls, expected, state.tools, lenient=lenient)
                verdict = VerifierResult.accept() if reason is None else VerifierResult.reject(reason)
            out.append(verdict)
        return out
