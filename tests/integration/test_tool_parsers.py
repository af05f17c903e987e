"""Named tool-call parsers: parse(format(a)) == a under fuzzing, the registry, error cases, and
agreement with vLLM's parser classes of the same name on a corpus of model outputs."""

from __future__ import annotations

import json
import keyword

import pytest
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st

from pivotrl.data.schema import Message, ToolCall, ToolSpec
from pivotrl.core.errors import ActionParseError, ConfigError
from pivotrl.format.tool_parsers import TOOL_PARSERS, get_tool_parser

PARSERS = ["hermes", "llama3_json", "pythonic"]

_ident = st.from_regex(r"[A-Za-z_][A-Za-z0-9_]{0,11}", fullmatch=True).filter(lambda s: s not in {"None", "True", "False"})
#: Tool-name parts: identifiers that are not Python keywords (``A.as(...)`` cannot be written as an action).
_name_part = _ident.filter(lambda s: not keyword.iskeyword(s))
_json_scalar = st.none() | st.booleans() | st.integers(-10**12, 10**12) | st.floats(allow_nan=False, allow_infinity=False) \
    | st.text(max_size=20)
_json_value = st.recursive(_json_scalar, lambda inner: st.lists(inner, max_size=3)
                           | st.dictionaries(st.text(max_size=8), inner, max_size=3), max_leaves=8)


@st.composite
def _call(draw, dotted: bool) -> ToolCall:
    name = draw(_name_part)
    if dotted and draw(st.booleans()):
        name = f"{name}.{draw(_name_part)}"
    keys = st.text(min_size=1, max_size=10) if draw(st.booleans()) else _ident
    args = draw(st.dictionaries(keys, _json_value, max_size=4))
    return ToolCall(name=name, arguments=args)


def _calls_message(parser: str):
    return st.lists(_call(dotted=parser == "pythonic"), min_size=1, max_size=3).map(
        lambda calls: Message(role="assistant", tool_calls=tuple(calls)))


_MARKERS = {"hermes": "<tool_call>", "llama3_json": "{", "pythonic": "["}


@pytest.mark.parametrize("name", PARSERS)
@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(data=st.data())
def test_parse_of_format_gives_back_the_calls(name, data):
    parser = get_tool_parser(name)
    msg = data.draw(_calls_message(name))
    text = parser.format(msg)
    # JSON strings holding the closing tag would end a hermes block early (vLLM reads them so too).
    assume(not (name == "hermes" and text.count("</tool_call>") != len(msg.tool_calls)))
    got = parser.parse(text, None)
    assert got.tool_calls == msg.tool_calls
    assert got.content == ""


@pytest.mark.parametrize("name", PARSERS)
@settings(max_examples=100, deadline=None)
@given(text=st.text(min_size=1, max_size=60))
def test_text_actions_come_back_stripped(name, text):
    marker = _MARKERS[name]
    assume(text.strip() and (not text.strip().startswith(marker) if name == "pythonic" else marker not in text))
    parser = get_tool_parser(name)
    got = parser.parse(parser.format(Message(role="assistant", content=text)))
    assert got.tool_calls == () and got.content == text.strip()


@pytest.mark.parametrize("name", PARSERS)
@settings(max_examples=200, deadline=None)
@given(text=st.text(max_size=80))
def test_parse_raises_only_action_parse_errors(name, text):
    parser = get_tool_parser(name)
    for candidate in (text, _MARKERS[name] + text):
        try:
            parser.parse(candidate)
        except ActionParseError:
            pass


def test_registry_names_and_unknown_name():
    assert set(PARSERS) <= set(TOOL_PARSERS.names())
    with pytest.raises(ConfigError, match="valid names: hermes, llama3_json, pythonic"):
        get_tool_parser("mistral")


def test_formats_as_the_templates_write_them():
    msg = Message(role="assistant", tool_calls=(ToolCall("get_weather", {"city": "Paris", "days": 2}),
                                               ToolCall("ls", {})))
    assert get_tool_parser("hermes").format(msg) == (
        '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "days": 2}}\n</tool_call>\n'
        '<tool_call>\n{"name": "ls", "arguments": {}}\n</tool_call>')
    assert get_tool_parser("llama3_json").format(msg) == (
        '{"name": "get_weather", "parameters": {"city": "Paris", "days": 2}}; {"name": "ls", "parameters": {}}')
    assert get_tool_parser("pythonic").format(msg) == "[get_weather(city='Paris', days=2), ls()]"


@pytest.mark.parametrize("name, text", [
    ("hermes", '<tool_call>\n{"name": "f", "arguments": {"x": 1}\n</tool_call>'),  # unbalanced JSON
    ("hermes", '<tool_call>\n{"name": "f", "parameters": {"x": 1}}\n</tool_call>'),  # hermes needs "arguments"
    ("hermes", '<tool_call>\n{"arguments": {}}\n</tool_call>'),
    ("llama3_json", '{"name": "f"}'),
    ("llama3_json", '{"name": "f", "parameters": {"x": NaN}}'),
    ("llama3_json", '{"name": "f", "parameters": [1]}'),
    ("pythonic", "[f(x=1) trailing"),
])
def test_malformed_calls_are_parse_errors(name, text):
    with pytest.raises(ActionParseError):
        get_tool_parser(name).parse(text)


# ------------------------------------------------------------------------------ vLLM agreement

_TOOLS = [ToolSpec("get_weather", "", {"type": "object", "properties": {"city": {"type": "string"}}}),
          ToolSpec("cd", "", {"type": "object", "properties": {"folder": {"type": "string"}}})]

CORPUS = {
    "hermes": [
        '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>',
        '<tool_call>\n{"name": "cd", "arguments": {"folder": "docs"}}\n</tool_call>\n'
        '<tool_call>\n{"name": "ls", "arguments": {"a": true, "depth": 2, "tags": ["x", {"k": null}]}}\n</tool_call>',
        'Let me check.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Zürich 東京"}}\n</tool_call>',
        '<tool_call>{"name": "get_weather", "arguments": {"city": "Rome"}}',  # unclosed last block
        '<tool_call>\n{"name": "f", "arguments": {"x": 1.5e3, "y": -0.25}}\n</tool_call> trailing words',
        "The weather in Paris is sunny.",
        "",
        '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"\n</tool_call>',
        '<tool_call>\n{"name": "get_weather", "parameters": {"city": "Paris"}}\n</tool_call>',
        "<tool_call>not json</tool_call>",
    ],
    "llama3_json": [
        '{"name": "get_weather", "parameters": {"city": "Paris"}}',
        '{"name": "get_weather", "arguments": {"city": "Paris"}}',
        '<|python_tag|>{"name": "cd", "parameters": {"folder": "docs"}}',
        '{"name": "cd", "parameters": {"folder": "a"}}; {"name": "ls", "parameters": {"a": true, "n": [1, 2]}}',
        'Sure: {"name": "get_weather", "parameters": {"city": "Köln"}} done',
        '{"name": "f", "parameters": {"nested": {"deep": {"x": "}{"}}}}',
        "It is sunny in Paris.",
        '{"name": "get_weather"}',
        '{"name": "get_weather", "parameters": {"city": "Paris"}',
        "The set {1, 2} has two elements.",
    ],
    "pythonic": [
        "[get_weather(city='Paris')]",
        "[cd(folder='docs'), ls(a=True, depth=2)]",
        "[f(x=[1, 2, {'k': None}], y=-3, z=1.5)]",
        "[get_weather(city=\"Zürich\")]",
        "[f()]",
        "The weather is sunny.",
        "[get_weather(city='Paris')",
        "[get_weather(city='Paris')] and more",
        "[1, 2, 3]",
    ],
}
_VLLM_CLASSES = {"hermes": ("hermes_tool_parser", "Hermes2ProToolParser"),
                 "llama3_json": ("llama_tool_parser", "Llama3JsonToolParser"),
                 "pythonic": ("pythonic_tool_parser", "PythonicToolParser")}


def _ours(name: str, text: str) -> list[tuple[str, dict]]:
    try:
        msg = get_tool_parser(name).parse(text, _TOOLS)
    except ActionParseError:
        return []
    return [(c.name, dict(c.arguments)) for c in msg.tool_calls]


@pytest.mark.vllm
@pytest.mark.parametrize("name", PARSERS)
def test_calls_agree_with_vllms_parser_of_the_same_name(name):
    import importlib

    pytest.importorskip("vllm")
    from pivotrl.testing import tiny_chat_tokenizer

    module, cls = _VLLM_CLASSES[name]
    vllm_cls = getattr(importlib.import_module(f"vllm.tool_parsers.{module}"), cls)
    tok = tiny_chat_tokenizer("llama3.1" if name == "llama3_json" else "qwen2.5", "")
    parser = vllm_cls(tok)
    corpus = list(CORPUS[name])
    pmsg = Message(role="assistant", tool_calls=(ToolCall("get_weather", {"city": "Paris", "days": [1, 2]}),
                                                ToolCall("cd", {"folder": "a b"})))
    corpus.append(get_tool_parser(name).format(pmsg))
    for text in corpus:
        info = parser.extract_tool_calls(text, request=None)
        theirs = [(c.function.name, json.loads(c.function.arguments)) for c in info.tool_calls] if info.tools_called else []
        assert _ours(name, text) == theirs, text


def test_config_choices_are_the_registered_parsers():
    import typing

    from pivotrl.format.chat_format import PROMPT_FORMATS
    from pivotrl.config import PromptSection

    fields = PromptSection.model_fields
    assert sorted(typing.get_args(fields["tool_parser"].annotation)) == sorted(["auto", *TOOL_PARSERS.names()])
    assert sorted(typing.get_args(fields["format"].annotation)) == sorted(PROMPT_FORMATS)


def test_verifiers_read_actions_with_the_run_parser():
    from pivotrl.data.schema import TurnState
    from pivotrl.verifiers import get_verifier

    demo = Message(role="assistant", tool_calls=(ToolCall("get_weather", {"city": "Paris"}),))
    state = TurnState("s", "t", 0, (Message("user", "Weather?"),), tuple(_TOOLS), demo,
                      verifier_context={"default_verifier": "arguments"})
    hermes = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
    for name in ("arguments", "tool_name", "auto"):
        got = get_verifier(name, tool_parser="hermes").score(state, [hermes, "[get_weather(city='Paris')]"])
        assert [r.accepted for r in got] == [True, False], name
        plain = get_verifier(name).score(state, [hermes, "[get_weather(city='Paris')]"])
        assert [r.accepted for r in plain] == [False, True], name


# ------------------------------------------- hermes: text before, between and after the blocks
_GW = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "%s"}}\n</tool_call>'
AROUND = [  # (text, content, cities called)
    ("  Let me look.\n" + _GW % "Paris", "Let me look.", ["Paris"]),
    (_GW % "Paris" + "\nbetween the calls\n" + _GW % "Rome", "", ["Paris", "Rome"]),
    ("First. " + _GW % "Paris" + " after the last block", "First.", ["Paris"]),
    ("a " + _GW % "Paris" + " b " + _GW % "Rome" + " c", "a", ["Paris", "Rome"]),
    (_GW % "Paris" + ' and then <tool_call>{"name": "get_weather", "arguments": {"city": "Oslo"}}', "",
     ["Paris", "Oslo"]),  # text after a closed block, then an unclosed last block
]


@pytest.mark.parametrize("text, content, cities", AROUND)
def test_hermes_keeps_the_text_before_the_first_block_and_drops_text_between_and_after(text, content, cities):
    got = get_tool_parser("hermes").parse(text, _TOOLS)
    assert got.content == content
    assert [(c.name, dict(c.arguments)) for c in got.tool_calls] == [("get_weather", {"city": c}) for c in cities]


@pytest.mark.vllm
def test_hermes_text_around_blocks_agrees_with_vllms_parser():
    """The same inputs through vLLM's Hermes2ProToolParser: the same calls, and its content is ours
    before stripping (``None`` for none)."""
    pytest.importorskip("vllm")
    from vllm.tool_parsers.hermes_tool_parser import Hermes2ProToolParser

    from pivotrl.testing import tiny_chat_tokenizer

    parser = Hermes2ProToolParser(tiny_chat_tokenizer("qwen2.5", ""))
    for text, content, cities in AROUND:
        info = parser.extract_tool_calls(text, request=None)
        assert info.tools_called, text
        assert [(c.function.name, json.loads(c.function.arguments)) for c in info.tool_calls] == \
            [("get_weather", {"city": c}) for c in cities], text
        assert (info.content or "").strip() == content, text
        assert info.content == (text[: text.index("<tool_call>")] or None)
