"""Prompt formats on real chat templates (copied under tests/fixtures/chat_templates) with tiny
offline tokenizers: the choice ``auto`` makes, rendered states equal to ``apply_chat_template``,
token-exact states inside supervised examples, per-turn examples for a template that is not
prefix-stable, the parser check, and the pythonic renderer unchanged."""

from __future__ import annotations

from pathlib import Path

import pytest

from pivotrl.format.chat_format import resolve_format, template_hash
from pivotrl.data.schema import Message, ToolCall, ToolSpec, Trajectory
from pivotrl.data.states import extract_turn_states
from pivotrl.core.errors import ConfigError
from pivotrl.runtime.models import load_tokenizer
from pivotrl.format.prompts import build_sft_examples, encode_state
from pivotrl.testing import save_tiny_checkpoint, tiny_chat_tokenizer, tiny_tokenizer

TEMPLATES = Path(__file__).resolve().parents[1] / "fixtures" / "chat_templates"
FAMILY = {"qwen2.5": "qwen2.5", "llama3.1": "llama3.1", "gemma3": "gemma3"}
EXPECTED = {  # template → (format, parser, tools rendered by the template)
    "qwen2.5": ("chat_template", "hermes", True),
    "llama3.1": ("chat_template", "llama3_json", True),
    "gemma3": ("chat_template", "pythonic", False),
    "smollm2": ("pythonic", "pythonic", False),
}
TOOLS = (ToolSpec("get_weather", "Get the weather of a city.",
                  {"type": "object", "properties": {"city": {"type": "string"}, "days": {"type": "integer"}},
                   "required": ["city"]}),)


def _call(city: str) -> Message:
    return Message(role="assistant", tool_calls=(ToolCall("get_weather", {"city": city, "days": 2}, id="c1"),))


TRAJ = Trajectory("t1", (
    Message("system", "You are a weather assistant."),
    Message("user", "Weather in Paris?"),
    _call("Paris"),
    Message("tool", '{"temp": 20}', name="get_weather", tool_call_id="c1"),
    Message("assistant", "It is 20 degrees in Paris."),
    Message("user", "And in Rome?"),
    _call("Rome"),
    Message("tool", '{"temp": 25}', name="get_weather", tool_call_id="c1"),
    Message("assistant", "25 degrees in Rome."),
), TOOLS)
KW = {"format": "auto", "tool_parser": "auto"}


def _tokenizer(name: str, root: Path):
    template = (TEMPLATES / f"{name}.jinja").read_text()
    if name == "smollm2":
        tok = tiny_tokenizer()
        tok.chat_template = template
    else:
        tok = tiny_chat_tokenizer(FAMILY[name], template)
    return load_tokenizer(save_tiny_checkpoint(root / name, tokenizer=tok))


@pytest.fixture(scope="module")
def toks(tmp_path_factory):
    root = tmp_path_factory.mktemp("templates")
    return {name: _tokenizer(name, root) for name in EXPECTED}


@pytest.mark.parametrize("name", list(EXPECTED))
def test_auto_picks_the_format_and_parser_the_template_speaks(toks, name):
    fmt = resolve_format(toks[name], "auto", "auto")
    assert (fmt.format, fmt.tool_parser, fmt.tools_in_template) == EXPECTED[name]
    assert fmt.prefix_stable
    assert fmt.template_hash == template_hash(toks[name]) and len(fmt.template_hash) == 16


def _openai(messages):
    out = []
    for m in messages:
        if m.tool_calls:
            out.append({"role": "assistant", "content": "", "tool_calls": [
                {"type": "function", "id": c.id, "function": {"name": c.name, "arguments": dict(c.arguments)}}
                for c in m.tool_calls]})
        elif m.role == "tool":
            out.append({"role": "tool", "content": m.content, "name": m.name, "tool_call_id": m.tool_call_id})
        else:
            out.append({"role": m.role, "content": m.content})
    return out


@pytest.mark.parametrize("name", ["qwen2.5", "llama3.1"])
def test_rendered_state_equals_apply_chat_template(toks, name):
    tok = toks[name]
    for state in extract_turn_states(TRAJ):
        ids = encode_state(state, tok, max_len=4096, **KW)
        want = tok.apply_chat_template(_openai(state.messages), tools=[t.to_dict() for t in TOOLS], tokenize=False,
                                       add_generation_prompt=True)
        assert tok.decode(ids, skip_special_tokens=False) == want
        # Pieces are cut at special tokens, so here they tokenise as the whole text does.
        assert ids == tok(want, add_special_tokens=False)["input_ids"]


def test_qwen_state_is_written_in_its_native_hermes_format(toks):
    state = extract_turn_states(TRAJ)[-1]
    text = toks["qwen2.5"].decode(encode_state(state, toks["qwen2.5"], max_len=4096, **KW))
    assert '<tools>\n{"type": "function", "function": {"name": "get_weather"' in text
    assert ('<|im_start|>assistant\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "days": 2}}\n'
            '</tool_call><|im_end|>\n<|im_start|>user\n<tool_response>\n{"temp": 20}\n</tool_response><|im_end|>') in text
    assert text.endswith("<|im_start|>assistant\n")


@pytest.mark.parametrize("name", list(EXPECTED))
def test_every_state_is_a_token_prefix_of_the_supervised_example(toks, name):
    tok = toks[name]
    examples, per_turn = build_sft_examples(TRAJ, tok, max_len=8192, **KW)
    assert not per_turn and len(examples) == 1
    ids, mask = examples[0]
    states = extract_turn_states(TRAJ)
    assert len(states) == 4
    fmt = resolve_format(tok, "auto", "auto")
    for state in states:
        sids = encode_state(state, tok, max_len=8192, **KW)
        assert ids[: len(sids)] == sids
        assert mask[len(sids)] == 1 and (len(sids) == 0 or mask[len(sids) - 1] == 0)
    # The loss mask covers each action with its end-of-turn token, nothing else.
    runs, cur = [], []
    for t, m in zip(ids, mask):
        if m:
            cur.append(t)
        elif cur:
            runs.append(cur)
            cur = []
    runs.append(cur) if cur else None
    assert len(runs) == 4 and all(r[-1] in fmt.stop_ids for r in runs)
    parser_texts = [tok.decode(r[:-1]) for r in runs]
    from pivotrl.format.tool_parsers import get_tool_parser

    parsed = [get_tool_parser(fmt.tool_parser).parse(t, TOOLS) for t in parser_texts]
    demo = [m for m in TRAJ.messages if m.role == "assistant"]
    assert [p.tool_calls for p in parsed] == [tuple(ToolCall(c.name, dict(c.arguments)) for c in d.tool_calls) for d in demo]


# A template that re-renders earlier assistant turns (as reasoning templates drop old <think> blocks).
REWRITING = (
    "{% for m in messages %}{{ '<|im_start|>' + m['role'] + '\n' }}"
    "{% if m['role'] == 'assistant' and not loop.last %}(earlier answer){% else %}{{ m['content'] }}{% endif %}"
    "{{ '<|im_end|>\n' }}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)


def test_a_template_that_is_not_prefix_stable_gives_per_turn_examples(tmp_path):
    tok = tiny_tokenizer()
    tok.chat_template = REWRITING
    tok = load_tokenizer(save_tiny_checkpoint(tmp_path / "rw", tokenizer=tok))
    fmt = resolve_format(tok, "chat_template", "pythonic")
    assert fmt.format == "chat_template" and not fmt.prefix_stable
    opts = {"format": "chat_template", "tool_parser": "pythonic"}
    examples, per_turn = build_sft_examples(TRAJ, tok, max_len=8192, **opts)
    assert per_turn and len(examples) == 4
    for state, (ids, mask) in zip(extract_turn_states(TRAJ), examples):
        sids = encode_state(state, tok, max_len=8192, **opts)
        assert ids[: len(sids)] == sids and mask == [0] * len(sids) + [1] * (len(ids) - len(sids))
        action = tok.decode(ids[len(sids):])
        assert action.endswith("<|im_end|>") and "(earlier answer)" not in action


# A ChatML template that drops the <think> block of every assistant turn before the last user turn
# (Qwen3's rule); otherwise it renders every turn as it is.
THINK_DROPPING = (
    "{% set ns = namespace(last_user=0) %}{% for m in messages %}{% if m['role'] == 'user' %}"
    "{% set ns.last_user = loop.index0 %}{% endif %}{% endfor %}"
    "{% for m in messages %}{{ '<|im_start|>' + m['role'] + '\n' }}{% set c = m['content'] or '' %}"
    "{% if m['role'] == 'assistant' and loop.index0 < ns.last_user and '</think>' in c %}"
    "{% set c = c.split('</think>')[-1].lstrip('\n') %}{% endif %}{{ c }}{{ '<|im_end|>\n' }}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)


def test_a_template_that_drops_earlier_reasoning_is_not_prefix_stable(tmp_path):
    """Rendered without reasoning, this template is stable turn by turn; an earlier answer with a
    <think> block is re-rendered without it once a later user turn follows. The check renders such a
    conversation, so the format records it as not prefix-stable (and trains per turn)."""
    tok = tiny_tokenizer()
    tok.chat_template = THINK_DROPPING
    tok = load_tokenizer(save_tiny_checkpoint(tmp_path / "think", tokenizer=tok))
    conv = [{"role": "user", "content": "U1"}, {"role": "assistant", "content": "<think>\nP\n</think>\n\nA1"}]
    first = tok.apply_chat_template(conv, tokenize=False)
    later = tok.apply_chat_template(conv + [{"role": "user", "content": "U2"}], tokenize=False)
    assert "<think>" in first and "<think>" not in later  # the template does drop earlier reasoning
    fmt = resolve_format(tok, "chat_template", "pythonic")
    assert fmt.format == "chat_template" and fmt.tool_parser == "pythonic" and not fmt.prefix_stable
    thinking = Trajectory("t2", (Message("user", "Hi"), Message("assistant", "<think>\nx\n</think>\n\nHello"),
                                 Message("user", "Again"), Message("assistant", "Hello again")), ())
    examples, per_turn = build_sft_examples(thinking, tok, max_len=8192, format="chat_template", tool_parser="pythonic")
    assert per_turn and len(examples) == 2
    assert "<think>" in tok.decode(examples[0][0])  # the first turn's action keeps its reasoning


def test_a_parser_that_cannot_read_the_template_is_a_config_error(toks):
    with pytest.raises(ConfigError, match="no parser reads back the tool calls this chat template writes"):
        resolve_format(toks["qwen2.5"], "chat_template", "pythonic")
    with pytest.raises(ConfigError, match="pythonic format writes pythonic calls"):
        resolve_format(toks["smollm2"], "pythonic", "hermes")


def test_pythonic_needs_a_chatml_template(toks):
    with pytest.raises(ConfigError, match="pythonic writes ChatML, which this tokenizer does not speak"):
        resolve_format(toks["gemma3"], "pythonic", "pythonic")


def test_an_end_of_turn_token_that_is_not_a_stop_id_is_refused():
    tok = tiny_chat_tokenizer("gemma3", (TEMPLATES / "gemma3.jinja").read_text())  # no generation config
    with pytest.raises(ConfigError, match="'<end_of_turn>', which is not a stop token"):
        resolve_format(tok, "auto", "auto")


def test_pythonic_rendering_is_unchanged_by_auto(toks):
    """SmolLM2-style and the smoke model's ChatML templates resolve to the pythonic renderer: the
    same ids as before prompt formats existed (the default keyword arguments)."""
    for tok in (toks["smollm2"], tiny_tokenizer()):
        for state in extract_turn_states(TRAJ):
            assert encode_state(state, tok, max_len=8192, **KW) == encode_state(state, tok, max_len=8192)
        assert build_sft_examples(TRAJ, tok, max_len=8192, **KW)[0] == build_sft_examples(TRAJ, tok, max_len=8192)[0]


def test_template_hash_follows_the_template():
    a, b = tiny_tokenizer(), tiny_tokenizer()
    b.chat_template = a.chat_template + " "
    assert template_hash(a) != template_hash(b)


def test_gemma_states_put_tools_in_the_first_user_turn_and_alternate(toks):
    state = extract_turn_states(TRAJ)[2]
    text = toks["gemma3"].decode(encode_state(state, toks["gemma3"], max_len=8192, **KW))
    assert text.startswith("<bos><start_of_turn>user\nYou are a weather assistant.\n\nTools (Python signatures")
    assert "<start_of_turn>model\n[get_weather(city='Paris', days=2)]<end_of_turn>\n" in text
    assert "<start_of_turn>user\nTool result:\n{\"temp\": 20}<end_of_turn>" in text
    assert text.endswith("<start_of_turn>model\n")


def test_a_tokenizer_without_template_that_is_not_chatml_is_refused_clearly():
    tok = tiny_chat_tokenizer("gemma3", "")
    tok.chat_template = None
    with pytest.raises(ConfigError, match="has no chat template and is not ChatML"):
        resolve_format(tok, "auto", "auto")
