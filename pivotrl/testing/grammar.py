"""A tiny Llama that writes from a small grammar: a test policy whose tool calls parse.

The tiny random Llama of :func:`pivotrl.testing.tiny_llama` never writes a well-formed tool call,
so every probe of it is rejected as text or as unparseable. :func:`grammar_llama` is the same
architecture with its weights set so that sampling at temperature 1 walks a small grammar of text
fragments, each fragment one token of the tokenizer (added to it if needed):

* both layers add nothing to the residual stream (``o_proj`` and ``down_proj`` are zero), so the
  next-token distribution depends on the current token alone (a bigram model);
* the input embedding maps each fragment's token to its own basis vector and every other token
  (whatever the prompt ends with) to the basis vector of the start state;
* the output rows give each state's successors the logits ``sharpness + log(weight / total)`` and
  every other token 0, so a token outside the grammar is sampled with probability ~e^-sharpness.

A grammar is ``{fragment: {next fragment: weight, ...}, ...}``: the key ``""`` is the start state
(after the prompt); a fragment without an entry of its own is followed by the tokenizer's first stop
token. A fragment has one set of successors, so a fragment reached from two places (a shared digit,
a shared closing block) continues the same way from both. For example, hermes calls of
``math.factorial`` with ``number`` 5 or 6 (each with probability 1/2)::

    call = '<tool_call>\\n{"name": "math.factorial", "arguments": {"number": '
    grammar = {"": {call: 1}, call: {"5": 1, "6": 1}, "5": {"}}\\n</tool_call>": 1},
               "6": {"}}\\n</tool_call>": 1}}
    save_grammar_checkpoint(tmp_path / "caller", grammar, tokenizer=tiny_chat_tokenizer("qwen2.5", template))

The checkpoint goes through any engine like another model: the engine samples the grammar's tokens
and the run's tool-call parser and verifier read the decoded text.
"""

from __future__ import annotations

import math
import os
from pathlib import Path
from typing import Any, Mapping

from pivotrl.storage.files import atomic_dir

#: The start state of a grammar (what follows the prompt).
START = ""

Grammar = Mapping[str, Mapping[str, float]]


def _fragments(grammar: Grammar) -> list[str]:
    """Every fragment of ``grammar`` (states and successors), in first-seen order, without the start."""
    if START not in grammar:
        raise ValueError("a grammar needs a start state (the key '')")
    seen: dict[str, None] = {}
    for state, succ in grammar.items():
        if not succ:
            raise ValueError(f"grammar state {state!r} has no successors (leave it out to end there)")
        for frag, weight in succ.items():
            if not frag:
                raise ValueError(f"grammar state {state!r}: an empty fragment")
            if not weight > 0:
                raise ValueError(f"grammar state {state!r}: weight of {frag!r} must be > 0, got {weight}")
        for frag in (state, *succ):
            if frag:
                seen.setdefault(frag, None)
    return list(seen)


def grammar_tokenizer(tokenizer: Any, grammar: Grammar) -> dict[str, int]:
    """Make every fragment of ``grammar`` one token of ``tokenizer`` (in place: a fragment that does
    not encode to a single token is added as a non-special token) and return ``{fragment: id}``."""
    from tokenizers import AddedToken

    ids: dict[str, int] = {}
    for frag in _fragments(grammar):
        enc = tokenizer.encode(frag, add_special_tokens=False)
        if len(enc) != 1 or tokenizer.decode(enc) != frag:
            tokenizer.add_tokens([AddedToken(frag, normalized=False, special=False)])
            enc = tokenizer.encode(frag, add_special_tokens=False)
        if len(enc) != 1 or tokenizer.decode(enc) != frag:
            raise ValueError(f"fragment {frag!r} does not become one token ({enc})")
        if enc[0] in ids.values():
            raise ValueError(f"fragment {frag!r} shares its token with another fragment")
        ids[frag] = enc[0]
    return ids


def _stop_id(tokenizer: Any) -> int:
    stops = getattr(tokenizer, "generation_stop_ids", None) or [tokenizer.eos_token_id]
    return int(stops[0])


def grammar_llama(tokenizer: Any, grammar: Grammar, *, sharpness: float = 50.0, seed: int = 0) -> Any:
    """A 2-layer ``LlamaForCausalLM`` (the :func:`~pivotrl.testing.tiny_llama` architecture, untied
    embeddings) whose samples follow ``grammar`` (module docstring). Every fragment is made one token
    of ``tokenizer`` first (:func:`grammar_tokenizer`, in place: save that tokenizer with the model).
    At most hidden size − 1 (127) fragments."""
    import torch

    from pivotrl.testing import tiny_llama

    ids = grammar_tokenizer(tokenizer, grammar)
    stop = _stop_id(tokenizer)
    if stop in ids.values():
        raise ValueError("a fragment is the stop token")
    overrides: dict[str, Any] = {"tie_word_embeddings": False, "vocab_size": len(tokenizer)}
    if getattr(tokenizer, "generation_stop_ids", None):
        overrides["eos_token_id"] = list(tokenizer.generation_stop_ids)
    model = tiny_llama(tokenizer, seed=seed, **overrides)
    hidden = model.config.hidden_size
    if len(ids) >= hidden:
        raise ValueError(f"{len(ids)} fragments: at most {hidden - 1} fit a hidden size of {hidden}")
    state = {START: 0, **{frag: i for i, frag in enumerate(ids, 1)}}
    # RMSNorm turns a basis vector into basis * 1/sqrt(1/hidden + eps); the output rows undo that.
    scale = math.sqrt(1.0 / hidden + model.config.rms_norm_eps)
    with torch.no_grad():
        for layer in model.model.layers:
            layer.self_attn.o_proj.weight.zero_()
            layer.mlp.down_proj.weight.zero_()
        embed = torch.zeros_like(model.model.embed_tokens.weight)
        embed[:, state[START]] = 1.0
        for frag, tok in ids.items():
            embed[tok] = 0.0
            embed[tok, state[frag]] = 1.0
        model.model.embed_tokens.weight.copy_(embed)
        model.model.norm.weight.fill_(1.0)
        head = torch.zeros_like(model.lm_head.weight)
        for frag, s in state.items():
            succ = grammar.get(frag) or {}
            total = float(sum(succ.values()))
            for nxt, weight in (succ.items() if succ else [(None, 1.0)]):
                tok = stop if nxt is None else ids[nxt]
                head[tok, s] = (sharpness + math.log(weight / (total or 1.0))) * scale
        model.lm_head.weight.copy_(head)
    return model.eval()


def save_grammar_checkpoint(directory: str | os.PathLike[str], grammar: Grammar, *, tokenizer: Any = None,
                            sharpness: float = 50.0) -> Path:
    """Save :func:`grammar_llama` and its tokenizer (``tokenizer`` with the grammar's fragments
    added; default :func:`~pivotrl.testing.tiny_tokenizer`) to ``directory`` as an HF checkpoint,
    atomically. Raises FileExistsError if ``directory`` exists and is not empty."""
    from pivotrl.testing import tiny_tokenizer

    target = Path(directory)
    if target.exists() and any(target.iterdir()):
        raise FileExistsError(f"checkpoint directory {target} exists and is not empty")
    target.parent.mkdir(parents=True, exist_ok=True)
    tok = tiny_tokenizer() if tokenizer is None else tokenizer
    model = grammar_llama(tok, grammar, sharpness=sharpness)
    with atomic_dir(target) as tmp:
        model.save_pretrained(tmp, safe_serialization=True)
        tok.save_pretrained(tmp)
    return target


__all__ = ["START", "Grammar", "grammar_llama", "grammar_tokenizer", "save_grammar_checkpoint"]
