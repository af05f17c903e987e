"""Text turns: stop decisions and explicit answer rules (no reward for arbitrary text).

A state whose demonstration action is text is one of three *candidate kinds*
(``verifier_context["candidate_kind"]``, set by :func:`pivotrl.data.states.extract_turn_states`):

``"stop"``
    A closing "stop here" turn: the demonstration's text equals the trajectory's
    ``meta["stop_text"]`` (BFCL multi-turn: ``"Done."`` after a user turn's last call). It is a
    *stop decision*: any action without a tool call is accepted (reason ``"stop"``), a call is
    rejected (``"wrong_kind"``). Excluded from the pivot set by default
    (``quality.include_stop_decisions``) and reported apart.
``"text_rule"``
    A text answer with an explicit acceptance rule in the record's ``meta``: ``meta["answer_rules"]``
    maps an assistant turn index (as a string) to a rule, ``meta["answer_rule"]`` is the rule of
    the last assistant turn. A rule is an object with one or more of

    * ``"required"``: list of strings that must all occur in the answer (case-insensitive);
    * ``"regex"``: a Python regular expression the stripped answer must match in full;
    * ``"json_schema"``: a JSON Schema the answer, read as JSON, must validate against.

    All given parts must hold (reason ``"rule"``); else ``"rule_failed"``.
``"text_no_rule"``
    Any other text turn: nothing says which answer is right, so it is never a pivot candidate
    (skipped and counted) and every action scores 0 (``"no_rule"``).

``"call"`` is the kind of every state whose demonstration calls tools.
"""

from __future__ import annotations

import json
import re
from typing import Any, Mapping

from pivotrl.data.schema import TurnState
from pivotrl.core.errors import DataError

__all__ = ["CANDIDATE_KINDS", "candidate_kind", "check_answer", "validate_rule"]

CANDIDATE_KINDS: tuple[str, ...] = ("call", "stop", "text_rule", "text_no_rule")
_RULE_KEYS = frozenset({"required", "regex", "json_schema"})


def candidate_kind(state: TurnState) -> str:
    """The state's kind (module docstring); inferred as "call" / "text_no_rule" when unset."""
    kind = state.verifier_context.get("candidate_kind")
    if kind in CANDIDATE_KINDS:
        return str(kind)
    return "call" if state.demo_action.tool_calls else "text_no_rule"


def validate_rule(rule: Any, where: str) -> dict[str, Any]:
    """Check an answer rule's form; returns it as a dict. Raises DataError naming ``where``."""
    if not isinstance(rule, Mapping) or not rule or set(rule) - _RULE_KEYS:
        raise DataError(f"{where}: an answer rule is an object with keys from {sorted(_RULE_KEYS)}, got {rule!r}")
    req = rule.get("required")
    if req is not None and (not isinstance(req, list) or not req or not all(isinstance(x, str) and x for x in req)):
        raise DataError(f"{where}.required: expected a non-empty list of non-empty strings")
    if "regex" in rule:
        try:
            re.compile(str(rule["regex"]))
        except re.error as e:
            raise DataError(f"{where}.regex: not a valid regular expression ({e})") from None
    if "json_schema" in rule:
        import jsonschema

        try:
            jsonschema.validators.validator_for(rule["json_schema"]).check_schema(rule["json_schema"])
        except jsonschema.SchemaError as e:
            raise DataError(f"{where}.json_schema: not a valid JSON Schema ({e.message})") from None
    return dict(rule)


def check_answer(rule: Mapping[str, Any], text: str) -> tuple[bool, str]:
    """Whether ``text`` satisfies every part of ``rule``: ``(True, "rule")`` or ``(False, "rule_failed")``."""
    answer = text.strip()
    ok = True
    if "required" in rule:
        low = answer.casefold()
        ok = ok and all(str(x).casefold() in low for x in rule["required"])
    if ok and "regex" in rule:
        ok = re.fullmatch(str(rule["regex"]), answer, flags=re.DOTALL) is not None
    if ok and "json_schema" in rule:
        import jsonschema

        try:
            jsonschema.validate(json.loads(answer), rule["json_schema"])
        except (ValueError, jsonschema.ValidationError):
            ok = False
    return (True, "rule") if ok else (False, "rule_failed")
