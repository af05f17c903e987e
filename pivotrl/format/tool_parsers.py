"""Named tool-call parsers: model output text ↔ an assistant :class:`~pivotrl.data.schema.Message`.

One parser, chosen by ``prompt.tool_parser``, reads every sampled action of a run: probing,
training, the verifiers and evaluation. The names are those of vLLM's ``--tool-call-parser``, so a
checkpoint trained with parser ``X`` is served with ``vllm serve --enable-auto-tool-choice
--tool-call-parser X`` and its calls are read the same way (``tests/integration/test_tool_parsers.py`` checks
the agreement with vLLM's classes on a corpus of outputs).

``pythonic``
    ``[f(x=1), g(y='a')]`` — pivotrl's own action format (:mod:`pivotrl.format.actions`).
``hermes``
    ``<tool_call>\\n{"name": "f", "arguments": {"x": 1}}\\n</tool_call>``, one block per call
    (Qwen2.5, Hermes). Text around the blocks, as vLLM's ``hermes`` parser reads it: the text
    before the first ``<tool_call>`` is the message's content (stripped here; vLLM keeps it as
    written, and an empty one is ``None`` there); text between two blocks and text after the last
    closed block is dropped (neither content nor a call); a ``<tool_call>`` after it opens one
    more block, and a last block may be left unclosed (it runs to the end of the text). A
    ``</tool_call>`` inside a JSON string ends its block early (both parsers).
``llama3_json``
    ``{"name": "f", "parameters": {"x": 1}}``; several calls separated by ``"; "`` (Llama 3.1/3.2).
    ``"arguments"`` is accepted for ``"parameters"``. As vLLM reads it, every top-level JSON
    object in the text is a call and text around them is ignored.

A text without the parser's call marker (``[`` first for pythonic, ``<tool_call>`` for hermes,
``{`` for llama3_json) is a text action; a marked call that does not decode is an
ActionParseError where vLLM returns the text as content with no calls (both: no calls).

Every parser has ``format(message) -> str`` (the text the model should write, without the end-of-turn
token), ``parse(text, tools) -> Message`` (raises :class:`~pivotrl.core.errors.ActionParseError`, never
anything else; a text without calls is a text action), ``is_viable_prefix(text) -> bool`` and
``instruction`` (the one-paragraph description of the format put into a system prompt when the
chat template cannot render tools itself). ``parse(format(m))`` gives back ``m``'s calls (ids
dropped) or its stripped text.
"""

from __future__ import annotations

import json
import math
import re
from typing import Any, Mapping, Protocol, Sequence

from pivotrl.format import actions
from pivotrl.format.action_prefix import is_viable_prefix
from pivotrl.data.schema import Message, ToolCall, ToolSpec
from pivotrl.core.errors import ActionParseError, DataError
from pivotrl.core.registry import Registry

__all__ = ["TOOL_PARSERS", "ToolParser", "get_tool_parser", "instruction_for"]


class ToolParser(Protocol):
    name: str
    instruction: str

    def format(self, message: Message) -> str: ...

    def parse(self, text: str, tools: Sequence[ToolSpec] | None = None) -> Message: ...

    def is_viable_prefix(self, text: str) -> bool: ...


TOOL_PARSERS: Registry[type] = Registry("tool-call parser")


def get_tool_parser(name: str) -> ToolParser:
    """The parser registered as ``name`` (``hermes``, ``llama3_json``, ``pythonic``).

    Raises ConfigError listing the valid names for an unknown one.
    """
    return TOOL_PARSERS.get(name)()


def instruction_for(parser: ToolParser, tools: Sequence[ToolSpec] | None = None) -> str:
    """The format instruction of ``parser`` for a state offering ``tools`` (its ``instruction_for``
    where it has one, else its ``instruction``); its example is never a valid action of that state."""
    own = getattr(parser, "instruction_for", None)
    return own(tools) if callable(own) else parser.instruction


def _text_action(text: str) -> Message:
    stripped = text.strip()
    if not stripped:
        raise ActionParseError("empty action")
    return Message(role="assistant", content=stripped)


def _check_json_value(value: Any, where: str) -> None:
    if isinstance(value, float) and not math.isfinite(value):
        raise DataError(f"{where}: non-finite number {value!r} has no JSON form")
    if isinstance(value, Mapping):
        for k, v in value.items():
            if not isinstance(k, str):
                raise DataError(f"{where}: dict key {k!r} is not a string")
            _check_json_value(v, where)
    elif isinstance(value, (list, tuple)):
        for v in value:
            _check_json_value(v, where)


def _dumps(value: Any, where: str) -> str:
    _check_json_value(value, where)
    return json.dumps(value, ensure_ascii=False)


def _loads_object(text: str) -> Any:
    try:
        return json.loads(text, parse_constant=_reject_constant)
    except (ValueError, RecursionError) as e:
        raise ActionParseError(f"not valid JSON: {e}") from None


def _reject_constant(name: str) -> Any:
    raise ValueError(f"{name} is not a JSON number")


def _call_from_json(obj: Any, arg_keys: tuple[str, ...]) -> ToolCall:
    if not isinstance(obj, dict):
        raise ActionParseError(f"a tool call must be a JSON object, got {type(obj).__name__}")
    name = obj.get("name")
    if not isinstance(name, str) or not name:
        raise ActionParseError("a tool call needs a non-empty string 'name'")
    key = next((k for k in arg_keys if k in obj), None)
    if key is None:
        raise ActionParseError(f"{name}: a tool call needs {' or '.join(repr(k) for k in arg_keys)}")
    args = obj[key]
    if isinstance(args, str):  # OpenAI style: arguments as a JSON string
        args = _loads_object(args)
    if not isinstance(args, dict):
        raise ActionParseError(f"{name}: arguments must be a JSON object, got {type(args).__name__}")
    return ToolCall(name=name, arguments=args)


@TOOL_PARSERS.register("pythonic")
class PythonicParser:
    """``[f(x=1), g(y='a')]`` (see :mod:`pivotrl.format.actions`); vLLM's ``pythonic`` parser reads the same."""

    name = "pythonic"
    # The example is built from placeholder names, never from real tools: small models copy an
    # example that looks like an answer (a base Qwen2.5-Coder-0.5B wrote the former example
    # ``[cd(folder='docs'), ls(a=True)]`` on 27 of 29 single-turn states). ``instruction_for(tools)``
    # renames a placeholder that one of the state's own tools happens to be called.
    example_names = ("tool_a", "tool_b")
    instruction = (
        "To call tools, reply with only a Python list of calls with keyword arguments, e.g. "
        "[tool_a(arg='value'), tool_b()] (with the names and arguments of the tools above). "
        "The results come back as tool messages. "
        "To answer or to end your turn, reply with plain text that does not start with '['."
    )

    def instruction_for(self, tools: Sequence[ToolSpec] | None = None) -> str:
        """The instruction for a state offering ``tools``: its example never calls one of them
        (a placeholder name that collides gets a numeric suffix, e.g. ``tool_a_2``)."""
        taken = {t.name for t in tools or ()}
        text = self.instruction
        for name in self.example_names:
            if name in taken:
                fresh = next(f"{name}_{i}" for i in range(2, 2 + len(taken) + 1) if f"{name}_{i}" not in taken)
                text = text.replace(f"[{name}(", f"[{fresh}(").replace(f" {name}(", f" {fresh}(")
        return text

    def format(self, message: Message) -> str:
        return actions.format_action(message)

    def parse(self, text: str, tools: Sequence[ToolSpec] | None = None) -> Message:
        return actions.parse_action(text, tools)

    def is_viable_prefix(self, text: str) -> bool:
        return is_viable_prefix(text)


_HERMES_BLOCK = re.compile(r"<tool_call>(.*?)</tool_call>|<tool_call>(.*)", re.S)


@TOOL_PARSERS.register("hermes")
class HermesParser:
    """``<tool_call>\\n{"name": ..., "arguments": {...}}\\n</tool_call>`` blocks (Qwen2.5, Hermes).

    Content is the stripped text before the first block; text between and after blocks is
    dropped; see the module docstring for the whole rule (vLLM's)."""

    name = "hermes"
    instruction = (
        "To call tools, reply with one block per call: <tool_call>\n"
        '{"name": <tool name>, "arguments": <JSON object of arguments>}\n</tool_call>. '
        "The results come back as tool messages. To answer or to end your turn, reply with plain text."
    )

    def format(self, message: Message) -> str:
        if not message.tool_calls:
            return message.content
        blocks = [
            '<tool_call>\n{"name": ' + json.dumps(c.name, ensure_ascii=False) + ', "arguments": '
            + _dumps(dict(c.arguments), f"tool call {c.name!r}") + "}\n</tool_call>"
            for c in message.tool_calls
        ]
        prefix = message.content.strip()
        return (prefix + "\n" if prefix else "") + "\n".join(blocks)

    def parse(self, text: str, tools: Sequence[ToolSpec] | None = None) -> Message:
        if not isinstance(text, str):
            raise ActionParseError(f"an action must be a string, got {type(text).__name__}")
        if "<tool_call>" not in text:
            return _text_action(text)
        calls = []
        for closed, open_ in _HERMES_BLOCK.findall(text):
            body = (closed or open_).strip()
            calls.append(_call_from_json(_loads_object(body), ("arguments",)))
        content = text[: text.index("<tool_call>")].strip()
        return Message(role="assistant", content=content, tool_calls=tuple(calls))

    def is_viable_prefix(self, text: str) -> bool:
        return True


@TOOL_PARSERS.register("llama3_json")
class Llama3JsonParser:
    """``{"name": ..., "parameters": {...}}`` objects separated by ``"; "`` (Llama 3.1/3.2 JSON calls)."""

    name = "llama3_json"
    instruction = (
        'To call a tool, reply with only a JSON object {"name": <tool name>, "parameters": <JSON object '
        'of arguments>}; separate several calls with "; ". The results come back as tool messages. '
        "To answer or to end your turn, reply with plain text that does not start with '{'."
    )

    def format(self, message: Message) -> str:
        if not message.tool_calls:
            return message.content
        return "; ".join(
            '{"name": ' + json.dumps(c.name, ensure_ascii=False) + ', "parameters": '
            + _dumps(dict(c.arguments), f"tool call {c.name!r}") + "}"
            for c in message.tool_calls
        )

    def parse(self, text: str, tools: Sequence[ToolSpec] | None = None) -> Message:
        if not isinstance(text, str):
            raise ActionParseError(f"an action must be a string, got {type(text).__name__}")
        if "{" not in text:
            return _text_action(text)
        # As vLLM reads it: every top-level JSON object in the text is a call; other text is ignored.
        decoder = json.JSONDecoder(parse_constant=_reject_constant)
        calls: list[ToolCall] = []
        end = -1
        for start in (i for i, ch in enumerate(text) if ch == "{"):
            if start <= end:
                continue
            try:
                obj, length = decoder.raw_decode(text[start:])
            except (ValueError, RecursionError) as e:
                raise ActionParseError(f"not valid JSON at character {start}: {e}") from None
            end = start + length
            calls.append(_call_from_json(obj, ("arguments", "parameters")))
        return Message(role="assistant", tool_calls=tuple(calls))

    def is_viable_prefix(self, text: str) -> bool:
        return True
