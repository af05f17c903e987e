"""What the model reads of its tools: the tool schemas rendered for the system prompt
(``prompt.tool_style``: one Python-like signature line per tool, ``compact``, BFCL preambles cut to
the first sentence; or one JSON schema per line, ``json``) and the tool outputs cut to
``prompt.max_tool_output_chars``. Pure core; shared by the pythonic renderer (:mod:`pivotrl.format.prompts`)
and the template renderer (:mod:`pivotrl.format.chat_render`).
"""

from __future__ import annotations

import json
import re
from typing import Any, Callable, Mapping, Sequence

from pivotrl.data.schema import ToolSpec
from pivotrl.core.registry import Registry

__all__ = ["TOOL_STYLES", "compact_schema", "first_sentence", "render_tools", "split_tool_description", "template_tools",
           "tool_signature", "truncate_tool_output"]

_TRUNCATION_MARKER = "\n[... {n} more characters truncated]"


def truncate_tool_output(content: str, max_chars: int) -> str:
    """``content`` cut to its first ``max_chars`` characters, with a marker naming how many more
    there were (``\n[... N more characters truncated]``); unchanged when it fits."""
    if len(content) <= max_chars:
        return content
    return content[:max_chars] + _TRUNCATION_MARKER.format(n=len(content) - max_chars)

_TOOLS_HEADER = "Tools (Python signatures; a parameter with a default value is optional):"

TOOL_STYLES: Registry[Callable[[Sequence[ToolSpec]], str]] = Registry("tool rendering style")


# ------------------------------------------------------------------------------------ tool styles

_BFCL_PREAMBLE = re.compile(r"^\s*This tool belongs to (?P<group>.*?)\s*Tool description:\s*(?P<desc>.*)$", re.S)
# A sentence ends at . ! ? followed by whitespace and an upper-case letter, a digit or a quote.
_SENTENCE_END = re.compile(r"(?<=[.!?])\s+(?=[A-Z0-9'\"(])")
_MAX_DESCRIPTION_CHARS = 160

_JSON_TYPES = {
    "string": "str",
    "integer": "int",
    "number": "float",
    "float": "float",
    "boolean": "bool",
    "dict": "dict",
    "object": "dict",
    "any": "Any",
    "null": "None",
}


def first_sentence(text: str, max_chars: int = _MAX_DESCRIPTION_CHARS) -> str:
    """The first sentence of ``text`` (whitespace collapsed), cut to ``max_chars`` with ``...``."""
    text = " ".join(text.split())
    sentence = _SENTENCE_END.split(text, maxsplit=1)[0] if text else ""
    if len(sentence) > max_chars:
        sentence = sentence[: max_chars - 3].rstrip() + "..."
    return sentence


def split_tool_description(description: str) -> tuple[str, str]:
    """Split a BFCL multi-turn description into (group, own description).

    ``"This tool belongs to the Math API, which provides ... Tool description: Add two numbers."``
    → ``("The Math API, which provides ...", "Add two numbers.")``. Descriptions without that
    boilerplate give ``("", description)``.
    """
    m = _BFCL_PREAMBLE.match(description)
    if not m:
        return "", description.strip()
    group = first_sentence(m.group("group"), max_chars=400).rstrip(".")
    if group:
        group = group[0].upper() + group[1:]
    return group, m.group("desc").strip()


def _type_str(schema: Any) -> str:
    if not isinstance(schema, Mapping):
        return "Any"
    if "enum" in schema and isinstance(schema["enum"], list) and schema["enum"]:
        return "Literal[" + ", ".join(repr(v) for v in schema["enum"]) + "]"
    t = schema.get("type")
    if isinstance(t, list):
        return " | ".join(_JSON_TYPES.get(str(x), str(x)) for x in t)
    if t in ("array", "tuple"):
        base = "list" if t == "array" else "tuple"
        items = schema.get("items")
        return f"{base}[{_type_str(items)}]" if isinstance(items, Mapping) and items else base
    return _JSON_TYPES.get(str(t), str(t) if t else "Any")


def _default_str(schema: Mapping[str, Any]) -> str:
    value = schema["default"]
    # BFCL writes a default of None as the string 'None'.
    return "None" if value == "None" else repr(value)


def tool_signature(tool: ToolSpec) -> str:
    """Python-like signature: ``name(req: str, opt: int = 0, other: bool = ...)``.

    Required parameters (``parameters["required"]``) come first and have no default; an optional
    parameter shows its schema ``default`` (``None`` for BFCL's ``'None'``) or ``...`` if none is
    given. Parameter order otherwise follows ``parameters["properties"]``.
    """
    params = tool.parameters or {}
    props = params.get("properties") or {}
    required = params.get("required") or []
    parts_req: list[str] = []
    parts_opt: list[str] = []
    if isinstance(props, Mapping):
        for pname, pschema in props.items():
            ptype = _type_str(pschema)
            if pname in required:
                parts_req.append(f"{pname}: {ptype}")
            else:
                default = (
                    _default_str(pschema) if isinstance(pschema, Mapping) and "default" in pschema else "..."
                )
                parts_opt.append(f"{pname}: {ptype} = {default}")
    return f"{tool.name}({', '.join(parts_req + parts_opt)})"


@TOOL_STYLES.register("compact")
def _render_compact(tools: Sequence[ToolSpec]) -> str:
    """One line per tool, ``- signature: first sentence``; tools grouped by their BFCL API."""
    groups: dict[str, list[str]] = {}
    for tool in tools:
        group, desc = split_tool_description(tool.description)
        sentence = first_sentence(desc)
        line = f"- {tool_signature(tool)}" + (f": {sentence}" if sentence else "")
        groups.setdefault(group, []).append(line)
    lines = [_TOOLS_HEADER]
    for group, tool_lines in groups.items():
        if group:
            lines.append(f"# {group}.")
        lines.extend(tool_lines)
    return "\n".join(lines)


@TOOL_STYLES.register("compact_params")
def _render_compact_params(tools: Sequence[ToolSpec]) -> str:
    """As ``"compact"``, plus one indented line per parameter: ``name: first sentence``."""
    groups: dict[str, list[str]] = {}
    for tool in tools:
        group, desc = split_tool_description(tool.description)
        sentence = first_sentence(desc)
        lines = [f"- {tool_signature(tool)}" + (f": {sentence}" if sentence else "")]
        props = (tool.parameters or {}).get("properties") or {}
        if isinstance(props, Mapping):
            for pname, pschema in props.items():
                pdesc = first_sentence(str(pschema.get("description", ""))) if isinstance(pschema, Mapping) else ""
                if pdesc:
                    lines.append(f"  {pname}: {pdesc}")
        groups.setdefault(group, []).extend(lines)
    out = [_TOOLS_HEADER]
    for group, tool_lines in groups.items():
        if group:
            out.append(f"# {group}.")
        out.extend(tool_lines)
    return "\n".join(out)


@TOOL_STYLES.register("json")
def _render_json(tools: Sequence[ToolSpec]) -> str:
    """Every tool's full OpenAI schema, one compact JSON object per line (for comparison)."""
    return "\n".join(["Tools (JSON schemas):"] + [json.dumps(t.to_dict(), ensure_ascii=False) for t in tools])


def render_tools(tools: Sequence[ToolSpec], style: str = "compact") -> str:
    """Render tool schemas for the system prompt.

    Args:
        tools: the tools of the state/trajectory, in order.
        style: a name in ``TOOL_STYLES`` (``"compact"``: one Python-like signature line per tool;
            ``"json"``: one JSON schema per line).

    Returns the tools section text ("" for no tools). Raises ConfigError for an unknown style.
    """
    render = TOOL_STYLES.get(style)
    return render(tools) if tools else ""


# ------------------------------------------------------------------- tools handed to a chat template

# Schema keys a compact schema keeps (what a call needs: names, types, choices, defaults, nesting).
_KEEP_KEYS = ("type", "enum", "default", "required", "properties", "items")


def _compact_param(schema: Any) -> Any:
    if not isinstance(schema, Mapping):
        return schema
    out: dict[str, Any] = {k: v for k, v in schema.items() if k in _KEEP_KEYS}  # in the schema's own order
    if isinstance(out.get("properties"), Mapping):
        out["properties"] = {k: _compact_param(v) for k, v in out["properties"].items()}
    if "items" in out:
        out["items"] = _compact_param(out["items"])
    return out


def compact_schema(tool: ToolSpec) -> dict[str, Any]:
    """A shorter OpenAI function schema of ``tool`` for a chat template that renders ``tools=``.

    The description is cut to its first sentence (BFCL's per-tool "This tool belongs to ..."
    preamble dropped, as in the ``compact`` system-prompt style); parameters keep their names,
    ``type``, ``enum``, ``default``, ``required`` and nested ``properties``/``items``, and lose their
    descriptions and every other key. Returns ``{"type": "function", "function": {...}}``.
    """
    _, desc = split_tool_description(tool.description)
    params = _compact_param(dict(tool.parameters or {}))
    return {"type": "function", "function": {"name": tool.name, "description": first_sentence(desc),
                                             "parameters": params}}


def template_tools(tools: Sequence[ToolSpec], style: str = "compact") -> list[dict[str, Any]] | None:
    """The ``tools=`` list handed to a chat template that renders tools itself
    (``prompt.format: chat_template``): full schemas for ``style == "json"``, otherwise
    :func:`compact_schema` of each (the template's own per-tool JSON is what makes template prompts
    long: ≈ 4,250 vs 870 tokens on BFCL multi-turn states with the full schemas). None for no tools.
    Raises ConfigError for an unknown style."""
    TOOL_STYLES.get(style)
    if not tools:
        return None
    return [t.to_dict() for t in tools] if style == "json" else [compact_schema(t) for t in tools]
