"""Prompt formats: which renderer writes a state, which parser reads an action.

``prompt.format`` names one of:

``pythonic``
    pivotrl's own ChatML renderer (:mod:`pivotrl.format.prompts`): tools as Python signatures in the
    system prompt, actions as Python call lists. For ChatML models whose template ignores ``tools=``
    (SmolLM2). Its output does not depend on this module.
``chat_template``
    The tokenizer's own template: ``apply_chat_template(messages, tools=..., add_generation_prompt=True)``
    with OpenAI-style ``tool_calls`` and ``tool`` messages, so the model is trained in the format it
    is served in. A template that does not render tools (Gemma) gets the tool list and the
    parser's format in the system message instead, calls written by the parser as the assistant's
    text and tool results as user turns (``Tool result:\\n...``).
``auto``
    ``chat_template`` if the template renders tools; otherwise ``pythonic`` if the template is
    ChatML as pivotrl writes it; otherwise ``chat_template`` with tools in the system message.

``prompt.tool_parser`` names a parser of :mod:`pivotrl.format.tool_parsers`; ``auto`` takes ``pythonic``
for the pythonic format and, for a template, the first parser that reads back the calls the
template writes. :func:`resolve_format` checks this once per tokenizer (a probe conversation is
rendered and its calls parsed back) and raises ConfigError when the named parser cannot read them.

Rendering and token-exact encoding live in :mod:`pivotrl.format.chat_render`. :class:`ResolvedFormat` records the choice, the template's hash and the stability.
"""

from __future__ import annotations

import hashlib
import json
import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from pivotrl.format.chatml import check_chat_template
from pivotrl.format.chat_render import _convert, _pieces, render_state_text, sft_examples, state_ids
from pivotrl.data.schema import Message, ToolCall, ToolSpec
from pivotrl.core.errors import ActionParseError, ConfigError
from pivotrl.format.tool_parsers import TOOL_PARSERS, get_tool_parser

__all__ = ["PROMPT_FORMATS", "ResolvedFormat", "resolve_format", "render_state_text", "state_ids",
           "sft_examples", "template_hash", "stop_token_ids"]

log = logging.getLogger("pivotrl.format.prompts")

PROMPT_FORMATS = ("auto", "chat_template", "pythonic")
_PARSER_ORDER = ("hermes", "llama3_json", "pythonic")
_PROBE_TOOL = ToolSpec(
    name="pivotrl_probe_lookup",
    description="Look up a record.",
    parameters={"type": "object", "properties": {"key": {"type": "string"}, "limit": {"type": "integer"}},
                "required": ["key"]},
)


@dataclass(frozen=True)
class ResolvedFormat:
    """The prompt format in force for one tokenizer.

    Attributes:
        format: "pythonic" or "chat_template".
        tool_parser: name in :data:`pivotrl.format.tool_parsers.TOOL_PARSERS`.
        tools_in_template: the template renders ``tools=`` and ``tool_calls`` itself.
        prefix_stable: every state's rendering is a prefix of the next turn's (see module doc), on a
            probe conversation with and without a ``<think>`` block in an earlier answer (a template
            that drops earlier reasoning, as Qwen3's does, is not prefix-stable).
        template_hash: first 16 hex digits of sha256 of the chat template ("" hashed if none).
        stop_ids: token ids that end a turn (tokenizer eos + generation config eos).
    """

    format: str
    tool_parser: str
    tools_in_template: bool
    prefix_stable: bool
    template_hash: str
    stop_ids: tuple[int, ...]

    def to_dict(self) -> dict[str, Any]:
        return {"format": self.format, "tool_parser": self.tool_parser, "tools_in_template": self.tools_in_template,
                "prefix_stable": self.prefix_stable, "template_hash": self.template_hash,
                "stop_ids": list(self.stop_ids)}


def template_hash(tokenizer: Any) -> str:
    """sha256 (16 hex digits) of the tokenizer's chat template string (of "" when it has none)."""
    template = getattr(tokenizer, "chat_template", None) or ""
    if not isinstance(template, str):
        template = json.dumps(template, sort_keys=True)
    return hashlib.sha256(template.encode()).hexdigest()[:16]


def stop_token_ids(tokenizer: Any) -> tuple[int, ...]:
    """Ids that end generation: the tokenizer's eos and ``eos_token_id`` of the checkpoint's
    ``generation_config.json`` (an int or a list), when the tokenizer was loaded from a directory."""
    ids: list[int] = []
    if getattr(tokenizer, "eos_token_id", None) is not None:
        ids.append(int(tokenizer.eos_token_id))
    path = Path(str(getattr(tokenizer, "name_or_path", "") or "")) / "generation_config.json"
    if path.is_file():
        try:
            value = json.loads(path.read_text()).get("eos_token_id")
        except (OSError, ValueError) as e:
            raise ConfigError(f"{path}: cannot read eos_token_id: {e}") from None
        for v in value if isinstance(value, list) else [value]:
            if isinstance(v, int) and v not in ids:
                ids.append(v)
    return tuple(ids)


# ------------------------------------------------------------------------------------ resolving

_RESOLVED: dict[tuple[Any, ...], ResolvedFormat] = {}


def _probe_messages() -> list[Message]:
    call = lambda k, n: Message(role="assistant", tool_calls=(ToolCall(_PROBE_TOOL.name, {"key": k, "limit": n}),))  # noqa: E731
    return [Message(role="system", content="S"), Message(role="user", content="U1"), call("a", 1),
            Message(role="tool", content="R1", name=_PROBE_TOOL.name), Message(role="assistant", content="A1"),
            Message(role="user", content="U2"), call("b", 2), Message(role="tool", content="R2", name=_PROBE_TOOL.name),
            Message(role="assistant", content="A2")]


#: The reasoning block the prefix-stability probe puts in an earlier assistant turn.
_PROBE_THINKING = "<think>\nP1\n</think>\n\n"


def _reasoning_probe_messages() -> list[Message]:
    """The probe conversation with a reasoning block in the answer before the second user turn:
    a template that drops earlier turns' ``<think>`` blocks (Qwen3's) re-renders that turn once a
    later user turn follows, so it is not prefix-stable."""
    msgs = _probe_messages()
    return [Message(role="assistant", content=_PROBE_THINKING + m.content) if m.content == "A1" else m for m in msgs]


def _renders_tools(tokenizer: Any) -> bool:
    try:
        text = tokenizer.apply_chat_template([{"role": "user", "content": "U"}], tools=[_PROBE_TOOL.to_dict()],
                                             tokenize=False, add_generation_prompt=True)
    except Exception:  # noqa: BLE001 - a template that fails on tools= does not render them
        return False
    return _PROBE_TOOL.name in text


def _probe(tokenizer: Any, fmt: ResolvedFormat) -> tuple[bool, str]:
    """(prefix-stable, "" or why the parser failed) for the probe conversation under ``fmt``.

    Prefix-stable: both the probe conversation and the same with a reasoning block in an earlier
    answer (:func:`_reasoning_probe_messages`) render every turn as a prefix of the next."""
    msgs = _probe_messages()
    conv, tools = _convert(msgs, [_PROBE_TOOL], fmt, tool_style="compact", max_tool_output_chars=10_000)
    pieces, stable = _pieces(tokenizer, conv, tools, gen=False, where="chat template probe")
    if not stable:
        return False, ""
    thinking, _ = _convert(_reasoning_probe_messages(), [_PROBE_TOOL], fmt, tool_style="compact",
                           max_tool_output_chars=10_000)
    stable = _pieces(tokenizer, thinking, tools, gen=False, where="chat template probe")[1]
    parser = get_tool_parser(fmt.tool_parser)
    demos = [m for m in msgs if m.role == "assistant"]
    actions = [p for p in pieces if p.end]
    for demo, piece in zip(demos, actions):
        try:
            got = parser.parse(piece.text, [_PROBE_TOOL])
        except ActionParseError as e:
            return stable, f"{piece.text!r}: {e}"
        want = tuple(ToolCall(c.name, dict(c.arguments)) for c in demo.tool_calls)
        if tuple(ToolCall(c.name, dict(c.arguments)) for c in got.tool_calls) != want or (
                not want and got.content != demo.content):
            return stable, f"{piece.text!r} parsed as {got.to_dict() if hasattr(got, 'to_dict') else got}"
    return stable, ""


def resolve_format(tokenizer: Any, format: str = "auto", tool_parser: str = "auto") -> ResolvedFormat:
    """Decide and check the prompt format for ``tokenizer`` (cached per template and options).

    Raises ConfigError: unknown names; ``pythonic`` on a template that is not ChatML; a parser that
    does not read back the calls the template writes (naming both and the text); a template whose
    end-of-turn token is not a stop id of the model.
    """
    if format not in PROMPT_FORMATS:
        raise ConfigError(f"prompt.format = {format!r}: must be one of {', '.join(PROMPT_FORMATS)}")
    if tool_parser != "auto":
        TOOL_PARSERS.get(tool_parser)
    thash = template_hash(tokenizer)
    key = (thash, format, tool_parser, getattr(tokenizer, "name_or_path", ""), len(tokenizer),
           getattr(tokenizer, "eos_token", None))
    if key in _RESOLVED:
        return _RESOLVED[key]
    stops = stop_token_ids(tokenizer)
    has_template = bool(getattr(tokenizer, "chat_template", None))
    in_template = has_template and _renders_tools(tokenizer)
    chosen = format
    if format == "auto":
        chosen = "chat_template" if in_template else "pythonic"
        if chosen == "pythonic" and has_template:
            try:
                check_chat_template(tokenizer)
            except ConfigError:
                chosen = "chat_template"
    if chosen == "pythonic":
        if tool_parser not in ("auto", "pythonic"):
            raise ConfigError(f"prompt.tool_parser = {tool_parser!r}: the pythonic format writes pythonic calls; "
                              "use tool_parser: pythonic, or format: chat_template")
        try:
            check_chat_template(tokenizer)
        except ConfigError as e:
            if not has_template:
                raise ConfigError(f"the tokenizer has no chat template and is not ChatML ({e}): no prompt format "
                                  "can render for it; use a checkpoint whose tokenizer carries its chat template") from None
            raise ConfigError(f"prompt.format = pythonic writes ChatML, which this tokenizer does not speak ({e}); "
                              "use prompt.format: chat_template or auto") from None
        resolved = ResolvedFormat("pythonic", "pythonic", False, True, thash, stops)
    else:
        if not has_template:
            raise ConfigError("prompt.format = chat_template: the tokenizer has no chat template")
        candidates = _PARSER_ORDER if tool_parser == "auto" else (tool_parser,)
        if not in_template:
            candidates = ("pythonic",) if tool_parser == "auto" else candidates
        failures = []
        resolved = None
        for name in candidates:
            fmt = ResolvedFormat("chat_template", name, in_template, True, thash, stops)
            stable, why = _probe(tokenizer, fmt)
            if not why:
                resolved = ResolvedFormat("chat_template", name, in_template, stable, thash, stops)
                break
            failures.append(f"{name}: {why}")
        if resolved is None:
            raise ConfigError(
                f"prompt.tool_parser = {tool_parser!r}: no parser reads back the tool calls this chat template "
                f"writes ({'; '.join(failures)}); name the parser vLLM serves this model with")
        _check_end_tokens(tokenizer, resolved)
    if not resolved.prefix_stable:
        log.warning("chat template %s is not prefix-stable across turns: every assistant turn is trained as its "
                    "own example (state + action)", thash)
    _RESOLVED[key] = resolved
    return resolved


def _check_end_tokens(tokenizer: Any, fmt: ResolvedFormat) -> None:
    conv, tools = _convert(_probe_messages()[:3], [_PROBE_TOOL], fmt, tool_style="compact", max_tool_output_chars=100)
    pieces, _ = _pieces(tokenizer, conv, tools, gen=False, where="chat template probe")
    for p in pieces:
        if p.end and int(tokenizer.convert_tokens_to_ids(p.end)) not in fmt.stop_ids:
            raise ConfigError(
                f"the chat template ends a turn with {p.end!r}, which is not a stop token of the model "
                f"(eos ids {list(fmt.stop_ids)}): add its id to eos_token_id in generation_config.json")


def action_parser(tokenizer: Any, format: str = "pythonic", tool_parser: str = "pythonic") -> Any:
    """The tool-call parser in force for ``tokenizer`` under these options (see :func:`resolve_format`)."""
    if format == "pythonic" and tool_parser == "pythonic":
        return get_tool_parser("pythonic")
    return get_tool_parser(resolve_format(tokenizer, format, tool_parser).tool_parser)


def attach_chat_template(checkpoint: str | Path, template_file: str | Path, cache: str | Path) -> Path:
    """A copy of ``checkpoint`` whose tokenizer uses the chat template in ``template_file``.

    For models that ship without a template (a base model's GGUF) or with one to replace. The copy
    lives under ``<cache>/models/tmpl-<hash>`` (weights hard-linked where possible), keyed by the
    checkpoint's files and the template, and carries the template as ``chat_template.jinja``; the
    template's end-of-turn token is added to ``generation_config.json``'s ``eos_token_id`` so both
    engines stop there. Written to a temporary sibling and renamed. Returns the copy's directory.

    Raises ConfigError: the template file is missing, or it writes no end-of-turn special token.
    """
    import os
    import shutil

    from transformers import AutoTokenizer

    from pivotrl.storage.files import atomic_dir

    src, tpl = Path(checkpoint), Path(template_file).expanduser()
    if not tpl.is_file():
        raise ConfigError(f"prompt.chat_template = {str(template_file)!r}: no such file")
    template = tpl.read_text(encoding="utf-8")
    listing = sorted((p.name, p.stat().st_size, int(p.stat().st_mtime)) for p in src.iterdir() if p.is_file())
    key = hashlib.sha256(json.dumps([str(src.resolve()), listing, template]).encode()).hexdigest()[:16]
    target = Path(cache).expanduser() / "models" / f"tmpl-{key}"
    if (target / "config.json").is_file():
        return target
    # Another process may publish the same cache entry first; its copy is complete (renamed whole).
    with atomic_dir(target, already_published=lambda t: (t / "config.json").is_file()) as tmp:
        for p in src.iterdir():
            if p.is_file() and p.name != "chat_template.jinja":
                try:
                    os.link(p, tmp / p.name)
                except OSError:
                    shutil.copy2(p, tmp / p.name)
        cfg_path = tmp / "tokenizer_config.json"
        if cfg_path.is_file():
            tok_cfg = json.loads(cfg_path.read_text())
            if "chat_template" in tok_cfg:
                del tok_cfg["chat_template"]
                cfg_path.unlink()  # a hard link: never write through it
                cfg_path.write_text(json.dumps(tok_cfg, indent=2))
        (tmp / "chat_template.jinja").write_text(template, encoding="utf-8")
        tok = AutoTokenizer.from_pretrained(str(tmp))
        conv, tools = _convert(_probe_messages()[:3], [_PROBE_TOOL],
                               ResolvedFormat("chat_template", "pythonic", False, True, "", ()),
                               tool_style="compact", max_tool_output_chars=100)
        ends = [p.end for p in _pieces(tok, conv, tools, gen=False, where=str(tpl))[0] if p.end]
        if not ends:
            raise ConfigError(f"prompt.chat_template = {str(template_file)!r}: the template writes no end-of-turn "
                              "special token after an assistant turn")
        gen_path = tmp / "generation_config.json"
        gen = json.loads(gen_path.read_text()) if gen_path.is_file() else {}
        eos = gen.get("eos_token_id", tok.eos_token_id)
        eos = list(eos) if isinstance(eos, list) else ([eos] if eos is not None else [])
        end_id = int(tok.convert_tokens_to_ids(ends[0]))
        if end_id not in eos:
            gen["eos_token_id"] = eos + [end_id]
            if gen_path.exists():
                gen_path.unlink()
            gen_path.write_text(json.dumps(gen, indent=2))
    return target
