"""Data audit at load time: gold calls that fail, replays that do not reproduce, malformed chat records.

BFCL multi-turn gold (:func:`failure_status`, :func:`audit_bfcl_replay`)
    Every ground-truth call is executed while the task is converted (``pivotrl.bfcl.multi_turn``). A call
    whose output is an execution error (``"Error during execution: ..."``) or a failure status
    (a JSON object with an ``"error"`` key, or a ``*status``/``success`` key that is ``false``) is a
    *flag*; so is a second replay from the same ``initial_config`` that does not give the same
    outputs and final state, and so is a *no-op* gold call (``pivotrl.bfcl.multi_turn``): a call of a
    method that changes the environment's state in some other gold replay of the category but
    leaves it unchanged here (e.g. ``{"retweet_status": "Already retweeted"}``).

    *Not BFCL's ground truth* (:func:`audit_bfcl_turn`). At the end of every user turn the state
    reached by replaying the demonstration's calls is compared with the state BFCL's own checker
    reaches by executing that task's ground truth turn by turn
    (:class:`pivotrl.bfcl.envs.GroundTruthChecker`: BFCL's ``execute_multi_turn_func_call``,
    ``state_checker`` and ``response_checker``, i.e. exactly what a model answering with the
    demonstration would be scored against). A turn whose state differs (a class attribute that is
    ``!=``), or whose ground-truth outputs are not all among the replay's outputs so far, is
    flagged. BFCL defines no other ground-truth state: its multi-turn records hold
    ``initial_config`` and the answers only the per-turn call strings, so the checker's replay of
    the ground truth *is* the task's ground-truth state. (The demonstration's calls come from the
    same strings, so this flags what our conversion reads differently from Python's evaluation of
    them, e.g. a tuple argument, which BFCL stores as a tuple and JSON, hence our call, as a list.)

    *Not in the history* (:func:`underivable_values`, conservative: it looks only at identifiers,
    whose value the model cannot compute or know from the world). For each gold call, every leaf
    of its arguments (recursing into lists and objects) is *checked* if it is

    * a string without whitespace that contains a digit and a letter (``USR002``, ``report1.txt``,
      ``@mike53``), or a string containing a digit given for a parameter named ``*_id``; or
    * an integer (not a boolean) given for a parameter named ``*_id`` (``order_id=12446``).

    Its *tokens* are its maximal runs of ASCII letters and digits that contain a digit
    (``report1.txt`` → ``report1``; ``ticket_001`` → ``001``; ``12446`` → ``12446``). A token is
    *found* when it occurs, case-insensitively and as a substring, in the visible text, or when it
    has runs of four or more digits and each of them occurs there (the letters around a long number
    may be spelled out: "P followed by 12345678" gives ``P12345678``). A checked value is in the
    history when each of its tokens is found in the *visible text*: the content of every system and user message up to and including the
    current turn's, every earlier tool output (this is how the initial configuration becomes
    visible: only through the outputs of calls made before), the arguments of every earlier call,
    and the trajectory's tool schemas (names, descriptions, parameters). Anything else is not
    checked: free text (it may paraphrase the user), words without digits (stock symbols, airport
    codes, currency codes: world knowledge or a lookup tool gives them), dates and other numbers
    (they may be computed, e.g. ``79.pdf`` from ``"79.00 B"``). A value that fails is flagged
    ``not in the history`` with the token that is nowhere.

    *Free text against its claim* (:mod:`pivotrl.data.claims`): a gold string argument that is a
    tool output altered, differs from the user's quote, states another number or name than the user
    dictated, or lacks the text the user asked it to include.

    Flags go to ``trajectory.meta["audit_flags"]`` (one string each, naming turn, call and reason).
    A flagged task stays loadable but is kept out of the warm start, the pivot candidates and the
    evaluation unless ``quality.keep_flagged`` is set.

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
import re
from typing import Any, Iterator, Mapping, Sequence

from pivotrl.data.schema import Message, Trajectory
from pivotrl.core.errors import ActionParseError, DataError

__all__ = ["AUDIT_FLAGS_KEY", "GROUND_TRUTH_MARK", "NOT_IN_HISTORY_MARK", "audit_bfcl_replay", "audit_bfcl_turn",
           "audit_chat_record", "audit_parser", "failure_status", "is_flagged", "not_in_history_flags",
           "underivable_values"]

AUDIT_FLAGS_KEY = "audit_flags"
_ERROR_PREFIX = "Error during execution"
#: In a flag's text: a turn that does not reach BFCL's ground truth (:func:`audit_bfcl_turn`).
GROUND_TRUTH_MARK = ": not BFCL's ground truth: "
#: In a flag's text: a gold call value the history does not hold (:func:`not_in_history_flags`).
NOT_IN_HISTORY_MARK = ": not in the history: "
_TOKEN = re.compile(r"[A-Za-z0-9]+")
_LONG_DIGITS = re.compile(r"[0-9]{4,}")


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


def audit_bfcl_turn(turn: int, differences: Mapping[str, Sequence[str]], missing: Sequence[str]) -> list[str]:
    """Flags of one turn compared with BFCL's ground truth (module docstring): ``differences`` =
    class name → attributes whose state differs (``GroundTruthChecker.state_differences``),
    ``missing`` = ground-truth outputs of the turn not among the replay's outputs so far."""
    flags = []
    if differences:
        where = ", ".join(f"{c}.{a}" for c, attrs in differences.items() for a in attrs)
        flags.append(f"turn {turn}{GROUND_TRUTH_MARK}the replayed state differs in {where}")
    if missing:
        shown = ", ".join(repr(m[:120]) for m in missing[:3])
        flags.append(f"turn {turn}{GROUND_TRUTH_MARK}{len(missing)} ground-truth outputs are not among the "
                     f"replay's: {shown}")
    return flags


def _leaves(value: Any, path: str, param: str) -> Iterator[tuple[str, str, Any]]:
    """(path, name of the parameter or key it is under, value) of every scalar in ``value``."""
    if isinstance(value, Mapping):
        for k, v in value.items():
            yield from _leaves(v, f"{path}.{k}", str(k))
    elif isinstance(value, (list, tuple)):
        for i, v in enumerate(value):
            yield from _leaves(v, f"{path}[{i}]", param)
    else:
        yield path, param, value


def _checked_tokens(param: str, value: Any) -> list[str]:
    """The tokens of ``value`` that must be in the history (module docstring), [] if unchecked."""
    is_id = param.endswith("_id")
    if isinstance(value, bool):
        return []
    if isinstance(value, int):
        return [str(value)] if is_id else []
    if not isinstance(value, str) or not any(ch.isdigit() for ch in value):
        return []
    if not is_id and (any(ch.isspace() for ch in value.strip()) or not any(ch.isalpha() for ch in value)):
        return []
    return [t for t in _TOKEN.findall(value) if any(ch.isdigit() for ch in t)]


def underivable_values(arguments: Mapping[str, Any], visible: str) -> list[tuple[str, Any, str]]:
    """The checked values of a call's ``arguments`` (module docstring, "Not in the history") with a
    token that does not occur in ``visible`` (the visible text, case-insensitive): (argument path,
    value, the missing token) each, in argument order."""
    seen = visible.casefold()
    out = []
    for path, param, value in _leaves(dict(arguments), "", ""):
        for token in _checked_tokens(param, value):
            long_runs = _LONG_DIGITS.findall(token)
            if token.casefold() not in seen and not (long_runs and all(r in seen for r in long_runs)):
                out.append((path.lstrip("."), value, token))
                break
    return out


def not_in_history_flags(where: str, call: str, arguments: Mapping[str, Any], visible: str) -> list[str]:
    """One flag per value of the gold call ``call`` (its text; ``where`` = ``"turn 2 call 0"``)
    that the visible text does not hold (:func:`underivable_values`)."""
    return [f"{where} {call!r}{NOT_IN_HISTORY_MARK}{path}={value!r} (no {token!r} in the user turns, earlier "
            "outputs and calls, or the tool schemas)" for path, value, token in underivable_values(arguments, visible)]


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
    ``tool_parser`` (a name of :mod:`pivotrl.format.tool_parsers`); DataError ``"<where>.<field>: ..."``."""
    import jsonschema

    from pivotrl.format.tool_parsers import get_tool_parser

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
