"""The one action format of pivotrl, used for demonstrations, probing, training and evaluation.

An *action* is the text of one assistant message (PivotRL §3: the whole output of one model call).

Tool-calling action
    A Python-style list of one or more calls, e.g.::

        [cd(folder='document'), mkdir(dir_name='temp')]

    * A call is ``name(arguments)``; ``name`` is an identifier or a dotted name
      (``math.factorial(number=5)``); whitespace around the dots is allowed, as in Python. Tool
      names outside this form (``get-weather``) cannot be expressed: data sources reject them.
    * Arguments are keyword arguments ``param=value`` or positional values. Positional values come
      first and are mapped to names in the order of the tool's ``parameters["properties"]``; the
      tool must then be known (``tools`` given and containing the name) and have enough properties.
      A name given twice (positionally and by keyword, or two keywords) is an error. Argument
      names that are not Python identifiers or are reserved words (``from``, ``Content-Type``) are
      written in a final ``**{'from': 'LAX'}`` dict literal; ``**`` before anything else is rejected.
    * Values are Python literals: strings (any quoting Python allows, no bytes / f-strings), integers,
      finite floats, ``True``/``False``/``None``, numbers with a leading ``-`` or ``+``, lists,
      tuples (read as lists) and dicts with string keys, nested to any depth. Nothing is evaluated:
      the text is parsed with :mod:`ast` and only literal nodes are read.
    * Whitespace (including newlines) is allowed around the list and between tokens; a trailing comma
      inside the list or an argument list is allowed. Anything after the closing ``]``, comments,
      ``*args``, ``**name``, an empty list ``[]`` or anything other than a list of calls is
      rejected with :class:`~pivotrl.core.errors.ActionParseError`.

Text action
    Any text that does not start with ``[`` after stripping whitespace (e.g. a final answer or a
    question to the user). Its content is the stripped text; an empty (or all-whitespace) action
    is rejected.

``format_action`` writes the canonical form: calls separated by ``", "``, keyword arguments only,
sorted by name (so the text does not depend on how a message was stored: JSON storage sorts keys),
values written as Python literals with dict keys sorted. ``parse_action(format_action(m))``
gives back ``m``'s calls (without call ids: ids are assigned by whoever executes the calls).
A message with tool calls is rendered from its calls only; its text content is not part of the action.
"""

from __future__ import annotations

import ast
import io
import keyword
import math
import tokenize
import unicodedata
import warnings
from typing import Any, Mapping, Sequence

from pivotrl.data.schema import Message, ToolCall, ToolSpec
from pivotrl.core.errors import ActionParseError, DataError

__all__ = [
    "format_action",
    "format_call",
    "format_value",
    "is_action_name",
    "parse_action",
    "parse_call",
    "raw_calls",
]


# --------------------------------------------------------------------------------------- formatting


def format_value(value: Any) -> str:
    """Render one JSON value as a Python literal (dict keys sorted; tuples as lists).

    Raises DataError for values with no literal form (non-finite floats, non-string dict keys,
    objects that are not JSON values).
    """
    if value is None or isinstance(value, bool):
        return repr(value)
    if isinstance(value, int):
        return repr(value)
    if isinstance(value, float):
        if not math.isfinite(value):
            raise DataError(f"action value {value!r}: non-finite numbers have no literal form")
        return repr(value)
    if isinstance(value, str):
        return repr(value)
    if isinstance(value, (list, tuple)):
        return "[" + ", ".join(format_value(v) for v in value) + "]"
    if isinstance(value, Mapping):
        items = []
        for k in sorted(value):
            if not isinstance(k, str):
                raise DataError(f"action value: dict key {k!r} is not a string")
            items.append(f"{k!r}: {format_value(value[k])}")
        return "{" + ", ".join(items) + "}"
    raise DataError(f"action value of type {type(value).__name__} is not a JSON value")


def _is_keyword_name(name: str) -> bool:
    # Python reads identifiers NFKC-normalised ("µ" becomes "μ"): such names go through **{...} too.
    return name.isidentifier() and not keyword.iskeyword(name) and unicodedata.normalize("NFKC", name) == name


def is_action_name(name: str) -> bool:
    """Whether a tool name can be written in an action: identifiers joined by dots (``math.factorial``).

    Names such as ``get-weather`` cannot (they would read as a subtraction).
    """
    return bool(name) and all(_is_keyword_name(part) for part in name.split("."))


def format_call(call: ToolCall) -> str:
    """Render one call as ``name(a=1, b='x')`` (keyword arguments sorted by name).

    Argument names that cannot be Python keywords (``from``, ``Content-Type``) go, sorted, into
    one final ``**{'from': ...}`` dict literal. Raises DataError for a tool name that
    :func:`is_action_name` rejects, or an argument value with no literal form.
    """
    if not is_action_name(call.name):
        raise DataError(f"tool name {call.name!r} cannot be written as an action (dotted identifiers only)")
    names = sorted(call.arguments)
    parts = [f"{k}={format_value(call.arguments[k])}" for k in names if _is_keyword_name(k)]
    extra = {k: call.arguments[k] for k in names if not _is_keyword_name(k)}
    if extra:
        parts.append(f"**{format_value(extra)}")
    return f"{call.name}({', '.join(parts)})"


def format_action(message: Message) -> str:
    """Render an assistant message as action text (deterministic).

    Tool calls → ``[call, call]`` (see :func:`format_call`); a message without tool calls → its
    content unchanged. Raises DataError if an argument value has no literal form.
    """
    if message.tool_calls:
        return "[" + ", ".join(format_call(c) for c in message.tool_calls) + "]"
    return message.content


# ------------------------------------------------------------------------------------------ parsing

_RawCall = tuple[str, list[Any], list[tuple[str, Any]]]


def _literal(node: ast.AST) -> Any:
    """Convert a literal AST node to a JSON value; ActionParseError for anything else."""
    if isinstance(node, ast.Constant):
        v = node.value
        if v is None or isinstance(v, (bool, str)):
            return v
        if isinstance(v, int):
            return v
        if isinstance(v, float):
            if not math.isfinite(v):
                raise ActionParseError(f"non-finite number {v!r} is not allowed")
            return v
        raise ActionParseError(f"literal of type {type(v).__name__} is not allowed")
    if isinstance(node, ast.UnaryOp) and isinstance(node.op, (ast.USub, ast.UAdd)):
        operand = node.operand
        if (
            isinstance(operand, ast.Constant)
            and isinstance(operand.value, (int, float))
            and not isinstance(operand.value, bool)
        ):
            v = operand.value
            if isinstance(v, float) and not math.isfinite(v):
                raise ActionParseError(f"non-finite number {v!r} is not allowed")
            return -v if isinstance(node.op, ast.USub) else v
        raise ActionParseError("a sign is only allowed before a number")
    if isinstance(node, (ast.List, ast.Tuple)):
        return [_literal(e) for e in node.elts]
    if isinstance(node, ast.Dict):
        out: dict[str, Any] = {}
        for k, v in zip(node.keys, node.values):
            if k is None:
                raise ActionParseError("'**' inside a dict is not allowed")
            key = _literal(k)
            if not isinstance(key, str):
                raise ActionParseError(f"dict key {key!r} is not a string")
            out[key] = _literal(v)
        return out
    raise ActionParseError(f"{type(node).__name__} is not a literal value")


def _dotted_name(node: ast.AST) -> str:
    if isinstance(node, ast.Name):
        return node.id
    if isinstance(node, ast.Attribute):
        return f"{_dotted_name(node.value)}.{node.attr}"
    raise ActionParseError(f"call target {type(node).__name__} is not a (dotted) name")


def _raw_call(node: ast.AST) -> _RawCall:
    if not isinstance(node, ast.Call):
        raise ActionParseError(f"list element {type(node).__name__} is not a function call")
    name = _dotted_name(node.func)
    positional = []
    for a in node.args:
        if isinstance(a, ast.Starred):
            raise ActionParseError(f"{name}: '*' arguments are not allowed")
        positional.append(_literal(a))
    keywords = []
    for kw in node.keywords:
        if kw.arg is None:  # **{...}: argument names that are not Python identifiers
            if not isinstance(kw.value, ast.Dict):
                raise ActionParseError(f"{name}: '**' is only allowed before a dict literal")
            keywords.extend(_literal(kw.value).items())
        else:
            keywords.append((kw.arg, _literal(kw.value)))
    return name, positional, keywords


# Model output such as ``[f(x=1st)]`` makes the compiler warn ("invalid decimal literal") before it
# fails; the parse error is the answer, the warning is noise. Only sources parsed under this name.
_PARSE_FILENAME = "<action>"
warnings.filterwarnings("ignore", category=SyntaxWarning, module=_PARSE_FILENAME)


def _parse_expr(text: str) -> ast.expr:
    """Parse ``text`` as one expression spanning the whole (stripped) text, without comments."""
    text = text.replace("\r\n", "\n").replace("\r", "\n")  # the newlines Python itself accepts
    try:
        tree = ast.parse(text, filename=_PARSE_FILENAME, mode="eval")
    except (SyntaxError, ValueError, RecursionError, MemoryError) as e:
        raise ActionParseError(f"not a valid call list: {type(e).__name__}: {e}") from None
    body = tree.body
    lines = text.split("\n")
    # The node must span exactly the whole text: rejects redundant parentheses and trailing comments.
    if (body.lineno, body.col_offset) != (1, 0) or (body.end_lineno, body.end_col_offset) != (
        len(lines),
        len(lines[-1].encode("utf-8")),
    ):
        raise ActionParseError("text after the closing bracket (or around the list) is not allowed")
    if "#" in text:
        try:
            toks = list(tokenize.generate_tokens(io.StringIO(text).readline))
        except (tokenize.TokenError, SyntaxError, ValueError) as e:  # pragma: no cover - parsed above
            raise ActionParseError(f"not a valid call list: {e}") from None
        if any(t.type == tokenize.COMMENT for t in toks):
            raise ActionParseError("comments are not allowed in an action")
    return body


def _resolve(raw: _RawCall, tools: Sequence[ToolSpec] | None) -> ToolCall:
    name, positional, keywords = raw
    args: dict[str, Any] = {}
    if positional:
        spec = None if tools is None else next((t for t in tools if t.name == name), None)
        if spec is None:
            raise ActionParseError(
                f"{name}: positional arguments need the tool's schema, and no tool {name!r} is known"
            )
        props = spec.parameters.get("properties") or {}
        order = list(props) if isinstance(props, Mapping) else []
        if len(positional) > len(order):
            raise ActionParseError(
                f"{name}: {len(positional)} positional arguments given, the tool has {len(order)} parameters"
            )
        args.update(zip(order, positional))
    for key, value in keywords:
        if key in args:
            raise ActionParseError(f"{name}: argument {key!r} given more than once")
        args[key] = value
    return ToolCall(name=name, arguments=args)


def raw_calls(text: str) -> list[_RawCall]:
    """The calls of a tool-calling action text ``[f(a=1), g()]`` as (name, positional args, keyword args)
    tuples, unresolved against any tool schema. Raises ActionParseError."""
    body = _parse_expr(text)
    if not isinstance(body, ast.List):
        raise ActionParseError(f"a tool-calling action must be a list of calls, got {type(body).__name__}")
    if not body.elts:
        raise ActionParseError("empty call list '[]'")
    return [_raw_call(e) for e in body.elts]


def parse_action(text: str, tools: Sequence[ToolSpec] | None = None) -> Message:
    """Parse model output into an assistant Message (see the module docstring for the format).

    ``tools`` are only needed to name positional arguments. Returns a message with ``tool_calls``
    (ids empty) for a call list, or with ``content`` = the stripped text for a text action.
    Raises ActionParseError for anything else; never any other exception.
    """
    if not isinstance(text, str):
        raise ActionParseError(f"an action must be a string, got {type(text).__name__}")
    stripped = text.strip()
    if not stripped:
        raise ActionParseError("empty action")
    if not stripped.startswith("["):
        return Message(role="assistant", content=stripped)
    calls = tuple(_resolve(raw, tools) for raw in raw_calls(stripped))
    return Message(role="assistant", tool_calls=calls)


def parse_call(text: str, tools: Sequence[ToolSpec] | None = None) -> ToolCall:
    """Parse one call such as ``sort('final_report.pdf')`` (BFCL ground-truth style) into a ToolCall.

    Positional arguments are named from ``tools`` as in :func:`parse_action`. Raises ActionParseError.
    """
    if not isinstance(text, str):
        raise ActionParseError(f"a call must be a string, got {type(text).__name__}")
    stripped = text.strip()
    if not stripped:
        raise ActionParseError("empty call")
    return _resolve(_raw_call(_parse_expr(stripped)), tools)
