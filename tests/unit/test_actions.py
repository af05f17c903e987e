from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pivotrl.format.actions import (
    format_action,
    format_value,
    is_action_name,
    parse_action,
    parse_call,
)
from pivotrl.format.action_prefix import is_viable_prefix
from pivotrl.data.schema import Message, ToolCall, ToolSpec
from pivotrl.core.errors import ActionParseError, DataError

TOOLS = [
    ToolSpec("sort", parameters={"type": "object", "properties": {"file_name": {"type": "string"}}}),
    ToolSpec(
        "post_tweet",
        parameters={"type": "object", "properties": {"content": {}, "tags": {}, "mentions": {}}},
    ),
]


def calls(msg: Message) -> list[tuple[str, dict]]:
    return [(c.name, dict(c.arguments)) for c in msg.tool_calls]


def test_parse_two_calls_keyword():
    m = parse_action("[cd(folder='document'), mkdir(dir_name='temp')]")
    assert m.role == "assistant" and m.content == ""
    assert calls(m) == [("cd", {"folder": "document"}), ("mkdir", {"dir_name": "temp"})]


def test_parse_literals_nested_negative_dotted():
    m = parse_action("  [math.factorial(number=-5, x=+2.5, y=[1, (2, -3)], z={'a': None, 'b': [True, False]})]\n")
    assert calls(m) == [
        ("math.factorial", {"number": -5, "x": 2.5, "y": [1, [2, -3]], "z": {"a": None, "b": [True, False]}})
    ]


def test_parse_multiline_trailing_commas_and_crlf():
    m = parse_action("[\r\n  f(\r\n    x='a',\r\n  ),\r\n]")
    assert calls(m) == [("f", {"x": "a"})]


def test_positional_arguments_follow_schema_order():
    m = parse_action("[post_tweet('hi', ['#a'], mentions=['@b'])]", TOOLS)
    assert calls(m) == [("post_tweet", {"content": "hi", "tags": ["#a"], "mentions": ["@b"]})]
    assert dict(parse_call("sort('final_report.pdf')", TOOLS).arguments) == {"file_name": "final_report.pdf"}


@pytest.mark.parametrize(
    "text, with_tools, fragment",
    [
        ("[sort('a')]", False, "no tool 'sort' is known"),  # positional arguments need the schemas
        ("[unknown('a')]", True, "no tool 'unknown' is known"),
        ("[sort('a', 'b')]", True, "2 positional arguments given, the tool has 1"),
        ("[sort('a', file_name='b')]", True, "'file_name' given more than once"),
        ("[f(x=1, x=2)]", False, "'x' given more than once"),
    ],
)
def test_positional_errors(text, with_tools, fragment):
    with pytest.raises(ActionParseError, match=fragment):
        parse_action(text, TOOLS if with_tools else None)


@pytest.mark.parametrize(
    "text",
    [
        "[f(x=1)] and more",  # trailing text
        "[f(x=1)] # a comment",
        "[f(x=1), # inside\n g()]",
        "([f(x=1)])",  # starts with '(' → text action, checked separately below
        "[]",
        "[f(x=1)][g()]",
        "[f(*a)]",
        "[f(**a)]",
        "[f(**{1: 2})]",
        "[f(x=a)]",
        "[f(x=1+2)]",
        "[f(x=b'bytes')]",
        "[f(x=f'{y}')]",
        "[f(x={1, 2})]",
        "[f(x={1: 'a'})]",
        "[f(x=1e999)]",
        "[f(x=-'a')]",
        "[f(x=1j)]",
        "[1, 2]",
        "[f()(x=1)]",
        "[f(x=1)",
    ],
)
def test_rejected(text):
    if text.startswith("("):
        assert parse_action(text).content == text  # a text action, not calls
        return
    with pytest.raises(ActionParseError):
        parse_action(text)


def test_text_actions():
    assert parse_action("  The file is sorted.\n") == Message(role="assistant", content="The file is sorted.")
    with pytest.raises(ActionParseError, match="empty"):
        parse_action("  \n ")


def test_format_is_canonical_and_round_trips():
    msg = Message(
        role="assistant",
        content="ignored",
        tool_calls=(
            ToolCall("mv", {"source": "a'b.txt", "destination": "temp"}, id="call_0"),
            ToolCall("math.mean", {"numbers": [1, -2.5, 3], "opts": {"z": None, "a": True}}),
        ),
    )
    text = format_action(msg)
    assert text == (
        "[mv(destination='temp', source=\"a'b.txt\"), "
        "math.mean(numbers=[1, -2.5, 3], opts={'a': True, 'z': None})]"
    )
    assert calls(parse_action(text)) == calls(msg)
    assert format_action(Message(role="assistant", content="Done.")) == "Done."


def test_argument_names_that_are_not_identifiers():
    msg = Message(role="assistant", tool_calls=(ToolCall("fly", {"to": "JFK", "from": "LAX", "Content-Type": "x"}),))
    text = format_action(msg)
    assert text == "[fly(to='JFK', **{'Content-Type': 'x', 'from': 'LAX'})]"
    assert calls(parse_action(text)) == calls(msg)
    with pytest.raises(ActionParseError, match="'to' given more than once"):
        parse_action("[fly(to='A', **{'to': 'B'})]")


def test_tool_names_outside_the_format_are_rejected():
    assert is_action_name("math.factorial") and not is_action_name("get-weather") and not is_action_name("a..b")
    with pytest.raises(DataError, match="'get-weather' cannot be written"):
        format_action(Message(role="assistant", tool_calls=(ToolCall("get-weather", {}),)))


def test_format_value_rejects_non_json():
    with pytest.raises(DataError):
        format_value(float("nan"))
    with pytest.raises(DataError):
        format_value({1: "a"})


@settings(max_examples=400, deadline=None)
@given(st.text(max_size=80))
def test_fuzz_any_text_only_raises_action_parse_error(text):
    try:
        parse_action(text, TOOLS)
    except ActionParseError:
        pass
    is_viable_prefix(text)


_ALPHABET = st.sampled_from(list("[](){},='\"-.:#\\ \n0123456789abcxyzTrueFalsNo_e+j*"))


@settings(max_examples=400, deadline=None)
@given(st.text(alphabet=_ALPHABET, max_size=60))
def test_fuzz_action_like_text(text):
    for t in (text, "[" + text, "[f(" + text):
        try:
            parse_action(t, TOOLS)
        except ActionParseError:
            pass
        is_viable_prefix(t)


_JSON = st.recursive(
    st.none() | st.booleans() | st.integers(-10**6, 10**6) | st.floats(allow_nan=False, allow_infinity=False)
    | st.text(max_size=8),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=5), inner, max_size=3),
    max_leaves=8,
)


@settings(max_examples=200, deadline=None)
@given(st.dictionaries(st.from_regex(r"[a-z_][a-z0-9_]{0,6}", fullmatch=True) | st.text(max_size=4), _JSON, max_size=4))
def test_fuzz_format_parse_round_trip_and_prefixes_viable(args):
    msg = Message(role="assistant", tool_calls=(ToolCall("pkg.tool", args), ToolCall("g", {})))
    text = format_action(msg)
    assert calls(parse_action(text)) == calls(msg)
    # every prefix of a valid action is viable
    for i in range(0, len(text) + 1, max(1, len(text) // 25)):
        assert is_viable_prefix(text[:i]), text[:i]
    assert is_viable_prefix(text)


@pytest.mark.parametrize(
    "prefix, viable",
    [
        ("", True),
        ("Sure, here", True),  # text action
        ("[", True),
        ("[cd(folder='doc", True),
        ("[cd(folder='doc'), mk", True),
        ("[math . fact", True),
        ("[cd(folder='''multi\nline", True),
        ("[cd(folder='a'),\n]", True),
        ("[The answer is", False),
        ("[cd(folder='a')] thanks", False),
        ("[cd(folder='a')]  \n", True),
        ("[cd(folder='a']", False),
        ("[cd(folder='a\n", False),
        ("[cd(x=1) mkdir", False),
        ("[cd(x=1 2)]", False),
        ("[]", False),
        ("[1", False),
        ("[cd(x=1, # note", False),
    ],
)
def test_is_viable_prefix(prefix, viable):
    assert is_viable_prefix(prefix) is viable


def test_parsing_model_text_prints_no_compiler_warnings():
    import subprocess
    import sys

    code = ("from pivotrl.format.actions import parse_action\n"
            "for t in ['[f(x=1st)]', '[f(x=1if 2 else 3)]', '[f(x=0x)]']:\n"
            "    try:\n        parse_action(t)\n    except Exception:\n        pass\n")
    proc = subprocess.run([sys.executable, "-W", "always", "-c", code], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    assert "SyntaxWarning" not in proc.stderr and "invalid decimal literal" not in proc.stderr, proc.stderr
