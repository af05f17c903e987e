"""Chat-template rendering: states and demonstrations → text pieces → token ids.

Used by :mod:`pivotrl.format.prompts` for ``prompt.format: chat_template`` (formats are chosen and checked
by :mod:`pivotrl.format.chat_format`).

Token-exact states: a state is rendered to text, then cut into *pieces* at the actions of earlier
assistant turns (found by rendering each prefix of the conversation); plain pieces are tokenised
as text, an action as ``tokenizer(action) + [end-of-turn id]``, exactly as a sampled action ends.
A template is *prefix-stable* when every state's rendering is a prefix of the next turn's, action
included; then one supervised sequence per trajectory holds every state as a token prefix. When
it is not (a template that re-renders earlier turns, e.g. dropping reasoning), each assistant turn
becomes its own example (state ids + action ids), so nothing is trained on a prompt the engine did
not see.

Shapes: P = state (prompt) tokens, T = action tokens (including the end-of-turn token).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Sequence

from pivotrl.data.schema import Message, ToolSpec, Trajectory, TurnState
from pivotrl.core.errors import DataError, StateTooLongError
from pivotrl.format.tool_parsers import get_tool_parser, instruction_for
from pivotrl.format.tool_render import render_tools, template_tools, truncate_tool_output

__all__ = ["render_state_text", "sft_examples", "state_ids"]

_TOOL_RESULT = "Tool result:\n"


@dataclass(frozen=True)
class _Piece:
    text: str
    end: str = ""  # for an action: the end-of-turn token that closes it ("" = plain text)


def _special_tokens(tokenizer: Any) -> list[str]:
    decoder = getattr(tokenizer, "added_tokens_decoder", {}) or {}
    names = {t.content for t in decoder.values() if getattr(t, "special", False)}
    names.update(getattr(tokenizer, "all_special_tokens", []) or [])
    return sorted(names, key=len, reverse=True)


def _convert(messages: Sequence[Message], tools: Sequence[ToolSpec], fmt: Any, *, tool_style: str,
             max_tool_output_chars: int) -> tuple[list[dict[str, Any]], list[dict[str, Any]] | None]:
    """OpenAI-style message dicts (and ``tools=``) as the template expects them."""
    if fmt.tools_in_template:
        out: list[dict[str, Any]] = []
        for m in messages:
            if m.role == "assistant" and m.tool_calls:
                calls = [{"type": "function", "id": c.id or f"call_{i}",
                          "function": {"name": c.name, "arguments": dict(c.arguments)}}
                         for i, c in enumerate(m.tool_calls)]
                out.append({"role": "assistant", "content": m.content or "", "tool_calls": calls})
            elif m.role == "tool":
                d = {"role": "tool", "content": truncate_tool_output(m.content, max_tool_output_chars)}
                if m.name:
                    d["name"] = m.name
                if m.tool_call_id:
                    d["tool_call_id"] = m.tool_call_id
                out.append(d)
            else:
                out.append({"role": m.role, "content": m.content})
        return out, template_tools(tools, tool_style)  # compact schemas unless tool_style is json
    parser = get_tool_parser(fmt.tool_parser)
    msgs = list(messages)
    own = msgs.pop(0).content.strip() if msgs and msgs[0].role == "system" else ""
    system = [own] if own else []
    if tools:
        system += [render_tools(tools, tool_style), instruction_for(parser, tools)]
    out = [{"role": "system", "content": "\n\n".join(system)}] if system else []
    for m in msgs:
        if m.role == "assistant":
            out.append({"role": "assistant", "content": parser.format(m)})
            continue
        text = _TOOL_RESULT + truncate_tool_output(m.content, max_tool_output_chars) if m.role == "tool" else m.content
        if out and out[-1]["role"] == "user":  # templates without a tool role want alternating turns
            out[-1] = {"role": "user", "content": out[-1]["content"] + "\n\n" + text}
        else:
            out.append({"role": "user", "content": text})
    return out, None


def _render(tokenizer: Any, conv: list[dict[str, Any]], tools: Any, gen: bool, where: str) -> str:
    try:
        return tokenizer.apply_chat_template(conv, tools=tools, tokenize=False, add_generation_prompt=gen)
    except Exception as e:  # noqa: BLE001 - a template error is the data's problem, named here
        raise DataError(f"{where}: the chat template cannot render this conversation: {type(e).__name__}: {e}") from None


def _action_at(tokenizer: Any, conv: list[dict[str, Any]], tools: Any, k: int, specials: Sequence[str],
               where: str) -> tuple[str, str, str] | None:
    """(state text before turn ``k``, the action text the template writes for it, its end token),
    or None if rendering turn ``k`` does not extend the state or has no end token."""
    head = _render(tokenizer, conv[:k], tools, True, where)
    with_action = _render(tokenizer, conv[: k + 1], tools, False, where)
    if not with_action.startswith(head):
        return None
    rest = with_action[len(head):]
    hits = [(rest.find(s), s) for s in specials if s in rest]
    if not hits:
        return None
    idx, end = min(hits, key=lambda h: (h[0], -len(h[1])))
    return head, rest[:idx], end


def _pieces(tokenizer: Any, conv: list[dict[str, Any]], tools: Any, *, gen: bool, where: str
            ) -> tuple[list[_Piece], bool]:
    """The rendering of ``conv`` as plain/action pieces, and whether it was prefix-stable.

    ``gen=True``: a state (ends with the generation header). ``gen=False``: a demonstration whose
    last message is an assistant turn; the pieces end with that action's end token.
    """
    full = _render(tokenizer, conv, tools, gen, where)
    specials = _special_tokens(tokenizer)
    pieces: list[_Piece] = []
    pos = 0
    stable = True
    for k, m in enumerate(conv):
        if m["role"] != "assistant":
            continue
        found = _action_at(tokenizer, conv, tools, k, specials, where)
        if found is None or len(found[0]) < pos or not full.startswith(found[0] + found[1] + found[2], 0):
            stable = False
            break
        head, action, end = found
        pieces.append(_Piece(full[pos:len(head)]))
        pieces.append(_Piece(action, end))
        pos = len(head) + len(action) + len(end)
    if not stable:
        return [_Piece(full)], False
    if gen:
        pieces.append(_Piece(full[pos:]))
    return [p for p in pieces if p.text or p.end], True


def _encode(pieces: Sequence[_Piece], tokenizer: Any) -> tuple[list[int], list[int]]:
    ids: list[int] = []
    mask: list[int] = []
    for p in pieces:
        seg = list(tokenizer(p.text, add_special_tokens=False)["input_ids"]) if p.text else []
        if p.end:
            seg.append(int(tokenizer.convert_tokens_to_ids(p.end)))
        ids.extend(seg)
        mask.extend([1 if p.end else 0] * len(seg))
    return ids, mask



def render_state_text(state_messages: Sequence[Message], tools: Sequence[ToolSpec], tokenizer: Any,
                      fmt: Any, *, tool_style: str, max_tool_output_chars: int) -> str:
    """The state's prompt text: ``apply_chat_template(..., add_generation_prompt=True)``."""
    conv, oai_tools = _convert(state_messages, tools, fmt, tool_style=tool_style,
                               max_tool_output_chars=max_tool_output_chars)
    return _render(tokenizer, conv, oai_tools, True, "prompt")


def state_ids(state: TurnState, tokenizer: Any, fmt: Any, *, tool_style: str,
              max_tool_output_chars: int) -> list[int]:
    """Token ids (P) of a state under a chat template, tokenised piecewise (see module doc)."""
    where = f"turn state {state.state_id!r}"
    conv, tools = _convert(state.messages, state.tools, fmt, tool_style=tool_style,
                           max_tool_output_chars=max_tool_output_chars)
    pieces, _ = _pieces(tokenizer, conv, tools, gen=True, where=where)
    return _encode(pieces, tokenizer)[0]


def sft_examples(trajectory: Trajectory, tokenizer: Any, fmt: Any, *, max_len: int, tool_style: str,
                 max_tool_output_chars: int) -> tuple[list[tuple[list[int], list[int]]], bool]:
    """Supervised examples of one demonstration: ``([(input_ids, loss_mask), ...], per_turn)``.

    Prefix-stable rendering: one example, the loss mask 1 on every action and its end token, and
    every turn's state ids a prefix of it. Otherwise one example per assistant turn (``per_turn``
    True), each ``state ids + action ids``; too-long turns are dropped. Raises StateTooLongError if
    nothing fits ``max_len``, DataError if there is no assistant message.
    """
    msgs = list(trajectory.messages)
    last = max((i for i, m in enumerate(msgs) if m.role == "assistant"), default=-1)
    if last < 0:
        raise DataError(f"trajectory {trajectory.id!r}: no assistant message to train on")
    where = f"trajectory {trajectory.id!r}"
    opts = {"tool_style": tool_style, "max_tool_output_chars": max_tool_output_chars}
    if fmt.prefix_stable:
        conv, tools = _convert(msgs[: last + 1], trajectory.tools, fmt, **opts)
        pieces, stable = _pieces(tokenizer, conv, tools, gen=False, where=where)
        if stable:
            ids, mask = _encode(pieces, tokenizer)
            if len(ids) > max_len:
                raise StateTooLongError(f"{where}: SFT example is {len(ids)} tokens, more than max_len={max_len}")
            return [(ids, mask)], False
    out = []
    for i in (i for i, m in enumerate(msgs[: last + 1]) if m.role == "assistant"):
        conv, tools = _convert(msgs[:i], trajectory.tools, fmt, **opts)
        head, _ = _encode(_pieces(tokenizer, conv, tools, gen=True, where=where)[0], tokenizer)
        conv_a, _ = _convert(msgs[: i + 1], trajectory.tools, fmt, **opts)
        found = _action_at(tokenizer, conv_a, tools, len(conv_a) - 1, _special_tokens(tokenizer), where)
        if found is None:
            raise DataError(f"{where}: assistant message {i}: the chat template writes no end-of-turn token after it")
        tail = _encode([_Piece(found[1], found[2])], tokenizer)[0]
        if len(head) + len(tail) <= max_len:
            out.append((head + tail, [0] * len(head) + [1] * len(tail)))
    if not out:
        raise StateTooLongError(f"{where}: no turn fits max_len={max_len}")
    return out, True

