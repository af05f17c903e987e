"""The one prompt renderer: turn states and demonstrations → text and token ids.

Every consumer (probing, SFT, GRPO, evaluation) renders prompts here, so a state's prompt is
byte-identical wherever it is used (PivotRL §3: the state ``s`` is the complete history before one
model call, including the system prompt and the tool schemas).

``format``/``tool_parser`` (``prompt.format``, ``prompt.tool_parser``) choose between the model's own
chat template (:mod:`pivotrl.format.chat_format`, :mod:`pivotrl.format.chat_render`) and the ``pythonic`` ChatML
layout below, which is what ``auto`` picks for SmolLM2-style templates that ignore ``tools=``.

Layout (ChatML, as SmolLM2's chat template writes it)::

    <|im_start|>system\\n{own system text}\\n\\n{tools section}\\n\\n{action format}<|im_end|>\\n
    <|im_start|>user\\n{content}<|im_end|>\\n
    <|im_start|>assistant\\n{format_action(message)}<|im_end|>\\n
    <|im_start|>tool\\n{tool output, truncated}<|im_end|>\\n
    ...
    <|im_start|>assistant\\n                      ← the generation header every prompt ends with

Tool schemas go into the system message because chat templates of small ChatML models ignore
``tools=``. The default ``"compact"`` style writes one line per tool: a Python-like signature and
the first sentence of the description; BFCL's per-tool boilerplate ("This tool belongs to the X API,
which ... Tool description: ") is stated once per group of tools instead.

Tokenisation is done piecewise so that the prefix property holds by construction: the text before
an assistant action, the action itself (``encode_action``: action tokens + eos) and the text after
it are encoded separately and concatenated. Hence for every assistant turn ``i`` of a trajectory,
``build_sft_example(...)[0][:start_i] == encode_state(state_i)``, and a probe's token ids
``encode_state(s) + generated_ids`` are laid out like SFT sequences.

Shapes: P = state (prompt) tokens, T = action tokens (including the eos ``<|im_end|>``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Sequence

from pivotrl.format import chat_format
from pivotrl.format.actions import format_action
from pivotrl.data.schema import Message, ToolSpec, Trajectory, TurnState
from pivotrl.core.errors import ConfigError, DataError, StateTooLongError
from pivotrl.format.tool_parsers import PythonicParser
from pivotrl.format.chatml import GENERATION_HEADER, IM_END, IM_START, check_chat_template, chatml_eos_id
from pivotrl.format.tool_render import (
    TOOL_STYLES, first_sentence, render_tools, split_tool_description, tool_signature, truncate_tool_output,
)

__all__ = [
    "ACTION_FORMAT_INSTRUCTION",
    "DEFAULT_MAX_TOOL_OUTPUT_CHARS",
    "DEFAULT_SYSTEM_PROMPT",
    "TOOL_STYLES",
    "build_sft_example",
    "build_sft_examples",
    "encode_action",
    "encode_state",
    "first_sentence",
    "render_prompt",
    "render_tools",
    "split_tool_description",
    "state_token_length",
    "tool_signature",
]


DEFAULT_MAX_TOOL_OUTPUT_CHARS = 2000
# Used only when a conversation has neither its own system message nor tools, so that no chat
# template can insert a model-specific default system prompt of its own.
DEFAULT_SYSTEM_PROMPT = "You are a helpful assistant."
ACTION_FORMAT_INSTRUCTION = PythonicParser.instruction

# --------------------------------------------------------------------------------------- pieces


@dataclass(frozen=True)
class _Piece:
    text: str
    is_action: bool  # the content of an assistant message (encoded with encode_action's rule)


def _system_text(own: str, tools: Sequence[ToolSpec], tool_style: str) -> str:
    parts = [own.strip()] if own.strip() else []
    if tools:
        parts.append(render_tools(tools, tool_style))
        parts.append(PythonicParser().instruction_for(tools))  # its example never names a tool of the state
    return "\n\n".join(parts) if parts else DEFAULT_SYSTEM_PROMPT


def _pieces(
    messages: Sequence[Message],
    tools: Sequence[ToolSpec],
    *,
    tool_style: str,
    max_tool_output_chars: int,
    where: str,
) -> list[_Piece]:
    """The prompt as alternating plain / action pieces, ending with the generation header."""
    if max_tool_output_chars < 1:
        raise ConfigError(f"max_tool_output_chars={max_tool_output_chars}: must be >= 1")
    msgs = list(messages)
    own_system = ""
    if msgs and msgs[0].role == "system":
        own_system = msgs[0].content
        msgs = msgs[1:]
    pieces: list[_Piece] = []
    buf = f"{IM_START}system\n{_system_text(own_system, tools, tool_style)}{IM_END}\n"
    for i, m in enumerate(msgs):
        if m.role == "assistant":
            buf += GENERATION_HEADER
            pieces.append(_Piece(buf, False))
            try:
                action = format_action(m)
            except DataError as e:
                raise DataError(f"{where}: assistant message {i}: {e}") from None
            pieces.append(_Piece(action, True))
            buf = f"{IM_END}\n"
        elif m.role == "tool":
            buf += f"{IM_START}tool\n{truncate_tool_output(m.content, max_tool_output_chars)}{IM_END}\n"
        else:
            buf += f"{IM_START}{m.role}\n{m.content}{IM_END}\n"
    pieces.append(_Piece(buf + GENERATION_HEADER, False))
    return pieces


def render_prompt(
    messages: Sequence[Message],
    tools: Sequence[ToolSpec],
    tokenizer: Any = None,
    *,
    tool_style: str = "compact",
    max_tool_output_chars: int = DEFAULT_MAX_TOOL_OUTPUT_CHARS,
) -> str:
    """Render a history as ChatML text ending with the generation header ``<|im_start|>assistant\\n``.

    Args:
        messages: the history before one model call (a TurnState's ``messages``). A leading system
            message is kept, with the tools section and the action format appended.
        tools: the tool schemas offered at this state.
        tokenizer: if given, its chat template must write ChatML exactly as this module does
            (checked once per template); ConfigError otherwise. May be None (no check).
        tool_style: see :func:`render_tools`.
        max_tool_output_chars: tool outputs longer than this are cut, with an explicit marker
            ``[... N more characters truncated]``.

    Assistant messages are written with ``pivotrl.format.actions.format_action``; tool messages as role
    ``tool``. Raises DataError for a message that cannot be rendered, ConfigError for bad options.
    """
    if tokenizer is not None:
        check_chat_template(tokenizer)
    pieces = _pieces(
        messages, tools, tool_style=tool_style, max_tool_output_chars=max_tool_output_chars, where="prompt"
    )
    return "".join(p.text for p in pieces)


# --------------------------------------------------------------------------------------- tokens


def _encode_text(text: str, tokenizer: Any) -> list[int]:
    return list(tokenizer(text, add_special_tokens=False)["input_ids"])


def _encode_pieces(pieces: Sequence[_Piece], tokenizer: Any) -> tuple[list[list[int]], int]:
    eos = chatml_eos_id(tokenizer)
    out = [encode_action(p.text, tokenizer)[:-1] if p.is_action else _encode_text(p.text, tokenizer) for p in pieces]
    return out, eos


def encode_action(text: str, tokenizer: Any) -> list[int]:
    """Token ids of one action: ``tokenizer(text)`` without special-token insertion, then eos.

    Returns a list of T ints whose last element is the id of ``<|im_end|>``. This is exactly how
    an action appears inside an SFT sequence (and how a sampled action ends). Raises ConfigError if
    the tokenizer's eos is not ``<|im_end|>``.
    """
    return _encode_text(text, tokenizer) + [chatml_eos_id(tokenizer)]


def encode_state(
    state: TurnState,
    tokenizer: Any,
    *,
    max_len: int,
    tool_style: str = "compact",
    max_tool_output_chars: int = DEFAULT_MAX_TOOL_OUTPUT_CHARS,
    format: str = "pythonic",
    tool_parser: str = "pythonic",
) -> list[int]:
    """Token ids (P ints) of a turn state's prompt, ending with the generation header.

    ``format``/``tool_parser``: the prompt format (``pythonic``, ``chat_template``, ``auto``) and
    tool-call parser, resolved per tokenizer by :func:`pivotrl.format.chat_format.resolve_format`.

    ``max_len`` is the most prompt tokens allowed; callers reserve room for the action (e.g.
    ``max_model_len - max_tokens``). Raises StateTooLongError (naming the state id, its length and
    ``max_len``) instead of truncating (spec: long states are skipped and counted).
    """
    ids = _state_ids(state, tokenizer, tool_style=tool_style, max_tool_output_chars=max_tool_output_chars,
                     format=format, tool_parser=tool_parser)
    if len(ids) > max_len:
        raise StateTooLongError(
            f"turn state {state.state_id!r}: prompt is {len(ids)} tokens, more than max_len={max_len}"
        )
    return ids


def state_token_length(
    state: TurnState,
    tokenizer: Any,
    *,
    tool_style: str = "compact",
    max_tool_output_chars: int = DEFAULT_MAX_TOOL_OUTPUT_CHARS,
    format: str = "pythonic",
    tool_parser: str = "pythonic",
) -> int:
    """Number of prompt tokens P of a state (as :func:`encode_state` would produce, without a limit)."""
    return len(_state_ids(state, tokenizer, tool_style=tool_style, max_tool_output_chars=max_tool_output_chars,
                          format=format, tool_parser=tool_parser))


def _state_ids(state: TurnState, tokenizer: Any, *, tool_style: str, max_tool_output_chars: int,
               format: str = "pythonic", tool_parser: str = "pythonic") -> list[int]:
    fmt = _resolved(tokenizer, format, tool_parser)
    if fmt is not None:
        return chat_format.state_ids(state, tokenizer, fmt, tool_style=tool_style,
                                     max_tool_output_chars=max_tool_output_chars)
    check_chat_template(tokenizer)
    pieces = _pieces(
        state.messages,
        state.tools,
        tool_style=tool_style,
        max_tool_output_chars=max_tool_output_chars,
        where=f"turn state {state.state_id!r}",
    )
    encoded, _ = _encode_pieces(pieces, tokenizer)
    return [t for seg in encoded for t in seg]


def _resolved(tokenizer: Any, format: str, tool_parser: str) -> Any:
    """The resolved chat-template format, or None for pivotrl's own pythonic ChatML renderer."""
    if format == "pythonic" and tool_parser == "pythonic":
        return None
    fmt = chat_format.resolve_format(tokenizer, format, tool_parser)
    return None if fmt.format == "pythonic" else fmt


def build_sft_examples(
    trajectory: Trajectory,
    tokenizer: Any,
    *,
    max_len: int,
    tool_style: str = "compact",
    max_tool_output_chars: int = DEFAULT_MAX_TOOL_OUTPUT_CHARS,
    format: str = "pythonic",
    tool_parser: str = "pythonic",
) -> tuple[list[tuple[list[int], list[int]]], bool]:
    """Supervised examples of one demonstration under the run's prompt format.

    Returns ``([(input_ids, loss_mask), ...], per_turn)``: for the pythonic format and for
    prefix-stable chat templates one example (:func:`build_sft_example`), ``per_turn`` False; for a
    template that re-renders earlier turns, one example per assistant turn (state + action ids),
    ``per_turn`` True (see :mod:`pivotrl.format.chat_format`). Raises StateTooLongError / DataError.
    """
    fmt = _resolved(tokenizer, format, tool_parser)
    if fmt is None:
        return [build_sft_example(trajectory, tokenizer, max_len=max_len, tool_style=tool_style,
                                  max_tool_output_chars=max_tool_output_chars)], False
    return chat_format.sft_examples(trajectory, tokenizer, fmt, max_len=max_len, tool_style=tool_style,
                                    max_tool_output_chars=max_tool_output_chars)


def build_sft_example(
    trajectory: Trajectory,
    tokenizer: Any,
    *,
    max_len: int,
    tool_style: str = "compact",
    max_tool_output_chars: int = DEFAULT_MAX_TOOL_OUTPUT_CHARS,
    truncate_at_turn: bool = False,
) -> tuple[list[int], list[int]]:
    """One supervised sequence for a whole demonstration, with its loss mask.

    Returns ``(input_ids, loss_mask)``, two lists of equal length L: the trajectory rendered up to
    and including its last assistant action's eos; ``loss_mask`` is 1 exactly on every assistant
    action's tokens and its eos ``<|im_end|>``, else 0 (tool outputs, user text and headers are
    inputs, never trained on; PivotRL §3). For every assistant turn ``i`` with first action token at
    ``start_i``, ``input_ids[:start_i] == encode_state(state_i)``.

    If L > ``max_len``: raise StateTooLongError naming the trajectory and lengths, or, with
    ``truncate_at_turn=True``, end the example after the last action that fits (StateTooLongError
    if not even the first one fits). DataError if the trajectory has no assistant message.
    """
    check_chat_template(tokenizer)
    # Drop everything after the last assistant message: it is never a target.
    msgs = list(trajectory.messages)
    last = max((i for i, m in enumerate(msgs) if m.role == "assistant"), default=-1)
    if last < 0:
        raise DataError(f"trajectory {trajectory.id!r}: no assistant message to train on")
    pieces = _pieces(
        msgs[: last + 1],
        trajectory.tools,
        tool_style=tool_style,
        max_tool_output_chars=max_tool_output_chars,
        where=f"trajectory {trajectory.id!r}",
    )
    encoded, eos = _encode_pieces(pieces[:-1], tokenizer)  # the final generation header is not needed
    input_ids: list[int] = []
    loss_mask: list[int] = []
    end_of_fitting_action = 0
    for piece, ids in zip(pieces, encoded):
        if piece.is_action:
            ids = ids + [eos]
            input_ids.extend(ids)
            loss_mask.extend([1] * len(ids))
            if len(input_ids) <= max_len:
                end_of_fitting_action = len(input_ids)
        else:
            if piece.text.startswith(IM_END):  # the eos closing the previous action is already there
                if not ids or ids[0] != eos:
                    raise ConfigError(f"tokenizer does not encode {IM_END!r} as one special token")
                ids = ids[1:]
            input_ids.extend(ids)
            loss_mask.extend([0] * len(ids))
    if len(input_ids) > max_len:
        if not truncate_at_turn or end_of_fitting_action == 0:
            raise StateTooLongError(
                f"trajectory {trajectory.id!r}: SFT example is {len(input_ids)} tokens, more than "
                f"max_len={max_len}" + (" (not even the first action fits)" if truncate_at_turn else "")
            )
        input_ids = input_ids[:end_of_fitting_action]
        loss_mask = loss_mask[:end_of_fitting_action]
    return input_ids, loss_mask


