"""Prompts that do not teach the wrong thing: the action-format example is never a valid action of
the state it is shown in, and template prompts get compact tool schemas unless ``tool_style: json``."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pivotrl.format.actions import parse_action
from pivotrl.format.chat_format import resolve_format
from pivotrl.data.schema import Message, ToolSpec, TurnState
from pivotrl.core.errors import ActionParseError
from pivotrl.format.prompts import render_prompt, state_token_length
from pivotrl.testing import tiny_chat_tokenizer
from pivotrl.format.tool_render import compact_schema, template_tools

TEMPLATES = Path(__file__).resolve().parents[1] / "fixtures" / "chat_templates"
_EXAMPLE = re.compile(r"e\.g\. (\[.*?\]) \(with the names")

# Names a small model would meet (BFCL's file system) and the placeholders themselves.
_NAMES = st.one_of(st.sampled_from(["cd", "ls", "tool_a", "tool_b", "tool_a_2", "mkdir", "get_weather"]),
                   st.from_regex(r"[a-z][a-z0-9_]{0,10}", fullmatch=True))
_PARAMS = st.lists(st.sampled_from(["folder", "a", "arg", "value", "city", "n"]), max_size=3, unique=True)


def _tool(name: str, params: list[str]) -> ToolSpec:
    props = {p: {"type": "string", "description": f"The {p}. More text here."} for p in params}
    return ToolSpec(name, f"This tool belongs to the X API, which does things. Tool description: Run {name}. Then more.",
                    {"type": "object", "properties": props, "required": params[:1]})


@settings(max_examples=150, deadline=None)
@given(st.lists(st.tuples(_NAMES, _PARAMS), min_size=1, max_size=6, unique_by=lambda t: t[0]))
def test_the_format_example_is_never_a_call_of_the_states_own_tools(spec):
    tools = [_tool(n, p) for n, p in spec]
    text = render_prompt([Message("user", "do it")], tools)
    example = _EXAMPLE.search(text)
    assert example, text
    try:
        parsed = parse_action(example.group(1), tools)
    except ActionParseError:
        return  # not an action at all
    names = {t.name for t in tools}
    called = [c.name for c in parsed.tool_calls]
    assert called and not names.intersection(called), (example.group(1), sorted(names))


def test_the_old_example_would_have_been_a_valid_action_of_a_file_system_state():
    # The tools a BFCL file-system state offers: the example shown there calls none of them.
    tools = [_tool("cd", ["folder"]), _tool("ls", ["a"])]
    text = render_prompt([Message("user", "go to docs")], tools)
    example = _EXAMPLE.search(text).group(1)
    assert example == "[tool_a(arg='value'), tool_b()]"
    assert "cd(" not in text.split("Tools (")[0]
    clash = render_prompt([Message("user", "x")], [_tool("tool_a", ["arg"]), _tool("tool_a_2", [])])
    assert _EXAMPLE.search(clash).group(1) == "[tool_a_3(arg='value'), tool_b()]"


def test_compact_schema_trims_descriptions_and_keeps_what_a_call_needs():
    tool = ToolSpec("mv", "This tool belongs to the Gorilla file system API, which lets you manage files. "
                    "Tool description: Move a file. It may overwrite.",
                    {"type": "dict", "properties": {
                        "source": {"type": "string", "description": "Source name. Long text."},
                        "mode": {"type": "string", "enum": ["a", "b"], "default": "a", "description": "Mode."},
                        "tags": {"type": "array", "items": {"type": "string", "description": "A tag."}}},
                     "required": ["source"]})
    assert compact_schema(tool) == {"type": "function", "function": {
        "name": "mv", "description": "Move a file.",
        "parameters": {"type": "dict", "required": ["source"], "properties": {
            "source": {"type": "string"}, "mode": {"type": "string", "enum": ["a", "b"], "default": "a"},
            "tags": {"type": "array", "items": {"type": "string"}}}}}}
    assert template_tools([tool], "json") == [tool.to_dict()]
    assert template_tools([], "compact") is None


def test_a_template_prompt_is_shorter_with_compact_tools():
    tok = tiny_chat_tokenizer("qwen2.5", (TEMPLATES / "qwen2.5.jinja").read_text())
    assert resolve_format(tok, "auto", "auto").tools_in_template
    long_desc = "Does a thing with the files of the current directory. " * 6
    tools = tuple(ToolSpec(f"tool{i}", "This tool belongs to the Gorilla file system API, which is long. "
                           "Tool description: " + long_desc,
                           {"type": "dict", "properties": {"path": {"type": "string", "description": long_desc}},
                            "required": ["path"]}) for i in range(4))
    state = TurnState("t1#0", "t1", 0, (Message("user", "list files"),), tools, Message("assistant", "ok"))
    kw = {"format": "auto", "tool_parser": "auto"}
    compact = state_token_length(state, tok, tool_style="compact", **kw)
    full = state_token_length(state, tok, tool_style="json", **kw)
    assert compact < full / 2, (compact, full)  # 635 vs 1607 tokens with this tiny tokenizer


@pytest.mark.data
def test_on_real_bfcl_states_the_example_is_never_an_action_of_the_state():
    """Every state of 20 records of each of BFCL's simple_python, multiple and multi_turn_base."""
    import os

    from pivotrl.bfcl.data import load_bfcl
    from pivotrl.data.states import extract_turn_states

    cache = Path(os.environ.get("PIVOTRL_CACHE_DIR") or Path.home() / ".cache" / "pivotrl")
    trajs = load_bfcl(["simple_python", "multiple", "multi_turn_base"], cache, limit_per_category=20)
    n = 0
    for traj in trajs:
        for state in extract_turn_states(traj):
            example = _EXAMPLE.search(render_prompt(state.messages, state.tools)).group(1)
            names = {t.name for t in state.tools}
            assert not names.intersection(c.name for c in parse_action(example, state.tools).tool_calls), state.state_id
            n += 1
    assert n > 60
