"""Data audit at load time: gold calls that fail, replays that do not reproduce, malformed chat records.

BFCL multi-turn gold (:func:`failure_status`, :func:`audit_bfcl_replay`)
    Every ground-truth call is executed while the task is converted (``pivotrl.data.bfcl``). A call
    whose output is an execution error (``"Error during execution: ..."``) or a failure status
    (a JSON object with an ``"error"`` key, or a ``*status``/``success`` key that is ``false``) is a
    *flag*; so is a second replay from the same ``initial_config`` that does not give the same
    outputs and final state, and so is a *no-op* gold call (``pivotrl.data.bfcl``): a call of a
    method that changes the environment's state in some other gold replay of the category but
    leaves it unchanged here (e.g. ``{"retweet_status": "Already retweeted"}``). Flags go to ``trajectory.meta["audit_flags"]`` (one string each,
    naming turn, call and reason). A flagged task stays loadable but is kept out of the warm start,
    the pivot candidates and the evaluation unless ``quality.keep_flagged`` is set.

Chat records (:func:`audit_chat_record`, raises DataError, so ``data.on_invalid = "quarantine"``
skips the record and names file, line, id and field)
    * no NaN or Infinity anywhere in a call's arguments;
    * every demonstration action parses with the run's own tool parser
      (:func:`audit_parser`: ``prompt.tool_parser``, pythonic under ``auto``) as what it is:
      ``format`` then ``parse`` gives back the same calls for a call turn, and a text action with
      the same (stripped) text and no call for a text turn (under pythonic a text turn that starts
      with ``[`` reads as a call list or does not parse); an assistant message with neither text
      nor calls is no action at all;
    * every tool's ``parameters`` is a valid JSON Schema (``jsonschema``) and every demonstration
      call's arguments validate against its tool's schema (not for records whose ``source`` is
      "bfcl": BFCL's schemas use its own type names, "float", "tuple", "any").
"""

from __future__ import annotations

import json
import math
from typing import Any, Mapping, Sequence

from pivotrl.data.schema import Message, Trajectory
from pivotrl.errors import ActionParseError, DataError

__all__ = ["AUDIT_FLAGS_KEY", "audit_bfcl_replay", "audit_chat_record", "audit_parser", "failure_status",
           "is_flagged"]

AUDIT_FLAGS_KEY = "audit_flags"
_ERROR_PREFIX = "Error during execution"


def is_flagged(traj: Trajectory) -> bool:
    """Whether the audit flagged ``traj`` (``meta["audit_flags"]`` non-empty)."""
    return bool((traj.meta or {}).get(AUDIT_FLAGS_KEY))


def failure_status(output: str) -> str | None:
    """Why a tool output reports a failure (module docstring), or None if it does not."""
    if output.startswith(_ERROR_PREFIX):
        return "execution error: " + output[:160]
    try:
        obj = json.loads(output)
    except ValueError:
        return None
    if not isinstance(obj, dict):
        return None
    if "error" in obj:
        return f"error status: {str(obj['error'])[:160]}"
    for key, value in obj.items():
        if value is False and (key.endswith("status") or key == "success"):
            return f"failure status: {key}=false"
    return None


def audit_bfcl_replay(
    first: tuple[Sequence[str], Mapping[str, Any]],
    second: tuple[Sequence[str], Mapping[str, Any]],
    where: Sequence[str],
    calls: Sequence[str],
) -> list[str]:
    """Flags of one BFCL task from two replays of its gold calls.

    ``first``/``second`` = (outputs of every gold call in order, final snapshot); ``where[k]`` names
    call k (``"turn 2 call 0"``) and ``calls[k]`` is its text. Returns one flag per failing call
    (:func:`failure_status`) plus one if the replays differ.
    """
    flags = [f"{w} {c!r}: {why}" for w, c, out in zip(where, calls, first[0]) if (why := failure_status(out))]
    if list(first[0]) != list(second[0]):
        k = next(i for i, (a, b) in enumerate(zip(first[0], second[0])) if a != b) if len(first[0]) == len(second[0]) else 0
        flags.append(f"replay does not reproduce: output of {where[k] if where else 'call 0'} differs")
    elif json.dumps(first[1], sort_keys=True, default=str) != json.dumps(second[1], sort_keys=True, default=str):
        flags.append("replay does not reproduce: final state differs")
    return flags


def _non_finite(value: Any, path: str) -> str | None:
    if isinstance(value, float) and not math.isfinite(value):
        return path
    if isinstance(value, Mapping):
        for k, v in value.items():
            if (p := _non_finite(v, f"{path}.{k}")) is not None:
                return p
    if isinstance(value, (list, tuple)):
        for i, v in enumerate(value):
            if (p := _non_finite(v, f"{path}[{i}]")) is not None:
                return p
    return None


def audit_parser(tool_parser: str) -> str:
    """The parser the demonstrations are checked with for ``prompt.tool_parser``: the named one,
    else (``auto``) pythonic, which ``auto`` picks for ChatML models (the data are loaded before the
    tokenizer is read; a template's own parser is checked by the load-time format probe)."""
    return "pythonic" if tool_parser == "auto" else tool_parser


def audit_chat_record(traj: Trajectory, where: str, tool_parser: str = "pythonic") -> None:
    """The chat-record checks of the module docstring, demonstration actions read with
    ``tool_parser`` (a name of :mod:`pivotrl.tool_parsers`); DataError ``"<where>.<field>: ..."``."""
    import jsonschema

    from pivotrl.tool_parsers import get_tool_parser

    parser = get_tool_parser(tool_parser)
    validators: dict[str, Any] = {}
    for k, tool in enumerate(traj.tools if traj.source != "bfcl" else ()):
        schema = tool.parameters or {"type": "object"}
        cls = jsonschema.validators.validator_for(schema)
        try:
            cls.check_schema(schema)
        except jsonschema.SchemaError as e:
            raise DataError(f"{where}.tools[{k}].function.parameters: not a valid JSON Schema ({e.message})") from None
        validators[tool.name] = cls(schema)
    for i, msg in enumerate(traj.messages):
        if msg.role != "assistant":
            continue
        if not msg.tool_calls:
            _audit_text_action(parser, msg.content, f"{where}.messages[{i}].content", traj)
            continue
        for j, call in enumerate(msg.tool_calls):
            field = f"{where}.messages[{i}].tool_calls[{j}].function.arguments"
            bad = _non_finite(dict(call.arguments), field)
            if bad is not None:
                raise DataError(f"{bad}: NaN or Infinity is not a valid argument value")
            validator = validators.get(call.name)
            if validator is not None:
                error = next(iter(sorted(validator.iter_errors(dict(call.arguments)), key=lambda e: list(e.path))), None)
                if error is not None:
                    at = "".join(f"[{p}]" if isinstance(p, int) else f".{p}" for p in error.path)
                    raise DataError(f"{field}{at}: does not match the tool's parameters schema ({error.message})")
        try:
            parsed = parser.parse(parser.format(msg), traj.tools)
        except (ActionParseError, DataError) as e:
            raise DataError(f"{where}.messages[{i}].tool_calls: the action does not parse with the "
                            f"{tool_parser} parser ({e})") from None
        got = [(c.name, dict(c.arguments)) for c in parsed.tool_calls]
        want = [(c.name, dict(c.arguments)) for c in msg.tool_calls]
        if got != want:
            raise DataError(f"{where}.messages[{i}].tool_calls: the action does not read back as the same calls "
                            f"with the {tool_parser} parser")


def _audit_text_action(parser: Any, content: str | None, field: str, traj: Trajectory) -> None:
    """A text turn must read back, with the run's parser, as the same text and no call."""
    text = (content or "").strip()
    if not text:
        raise DataError(f"{field}: an empty assistant message (no text, no tool call) is not an action")
    try:
        parsed = parser.parse(parser.format(Message(role="assistant", content=text)), traj.tools)
    except ActionParseError as e:
        raise DataError(f"{field}: the text turn {text[:60]!r} does not parse with the {parser.name} parser "
                        f"({e}); the policy could never write it as text") from None
    if parsed.tool_calls or parsed.content != text:
        raise DataError(f"{field}: the text turn {text[:60]!r} reads as tool calls with the {parser.name} "
                        "parser, not as text")
