"""ChatML as pivotrl's pythonic prompt renderer writes it, and the check that a tokenizer's chat
template writes the same.

``<|im_start|>{role}\\n{content}<|im_end|>\\n`` per message, the generation header
``<|im_start|>assistant\\n``, and ``<|im_end|>`` as the end of every turn (the eos). The pythonic
renderer (:mod:`pivotrl.format.prompts`) writes this layout itself; a template-rendered run
(:mod:`pivotrl.format.chat_format`) checks a tokenizer's own template against it when it falls back to the
pythonic format. Pure core: no model, no template engine beyond the tokenizer's own.
"""

from __future__ import annotations

from typing import Any

from pivotrl.core.errors import ConfigError

__all__ = ["GENERATION_HEADER", "IM_END", "IM_START", "chatml_eos_id", "check_chat_template"]

IM_START = "<|im_start|>"
IM_END = "<|im_end|>"
GENERATION_HEADER = f"{IM_START}assistant\n"

_CHECKED_TEMPLATES: dict[str, None] = {}


def chatml_eos_id(tokenizer: Any) -> int:
    """The id of ``<|im_end|>``, the tokenizer's eos. Raises ConfigError when the eos is another token."""
    eos = getattr(tokenizer, "eos_token_id", None)
    if eos is None or tokenizer.convert_ids_to_tokens(eos) != IM_END:
        raise ConfigError(f"tokenizer: eos token must be {IM_END!r} (ChatML), got {tokenizer.eos_token!r}")
    return int(eos)


def check_chat_template(tokenizer: Any) -> None:
    """Raise ConfigError unless ``tokenizer``'s chat template writes ChatML as pivotrl.format.prompts does.

    Renders a small conversation (system, user, assistant, tool) with ``apply_chat_template`` and
    compares it with this module's layout. A tokenizer without a chat template passes if its eos is
    ``<|im_end|>``. Checked once per distinct template string.
    """
    chatml_eos_id(tokenizer)
    template = getattr(tokenizer, "chat_template", None)
    if not template or template in _CHECKED_TEMPLATES:
        return
    probe = [
        {"role": "system", "content": "S"},
        {"role": "user", "content": "U"},
        {"role": "assistant", "content": "[f(x=1)]"},
        {"role": "tool", "content": "T"},
    ]
    expected = "".join(f"{IM_START}{m['role']}\n{m['content']}{IM_END}\n" for m in probe) + GENERATION_HEADER
    try:
        got = tokenizer.apply_chat_template(probe, tokenize=False, add_generation_prompt=True)
    except Exception as e:  # noqa: BLE001 - any template failure means "not ChatML as expected"
        raise ConfigError(f"tokenizer chat template failed on a ChatML probe: {type(e).__name__}: {e}") from None
    if got != expected:
        raise ConfigError(
            "tokenizer chat template is not ChatML as pivotrl.format.prompts renders it: "
            f"expected {expected!r}, got {got!r}"
        )
    _CHECKED_TEMPLATES[template] = None
