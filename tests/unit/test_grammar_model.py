"""pivotrl.testing.grammar: the tiny Llama whose samples follow a small grammar of text fragments."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from pivotrl.testing import grammar_llama, save_grammar_checkpoint, tiny_chat_tokenizer

TEMPLATE = (Path(__file__).resolve().parents[1] / "fixtures" / "chat_templates" / "qwen2.5.jinja").read_text()
CALL = '<tool_call>\n{"name": "math.factorial", "arguments": {"number": '
CLOSE = "}}\n</tool_call>"
GRAMMAR = {"": {CALL: 3, "No tool applies.": 1}, CALL: {"5": 1, "6": 1}, "5": {CLOSE: 1}, "6": {CLOSE: 1}}


def _next(model, ids: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return torch.softmax(model(torch.tensor([ids])).logits[0, -1], dim=-1)


def test_each_fragment_is_one_token_followed_by_its_weighted_successors():
    tok = tiny_chat_tokenizer("qwen2.5", TEMPLATE)
    model = grammar_llama(tok, GRAMMAR)
    one = {f: tok.encode(f, add_special_tokens=False) for f in (CALL, "No tool applies.", "5", "6", CLOSE)}
    assert all(len(ids) == 1 for ids in one.values())
    text = tok.apply_chat_template([{"role": "user", "content": "What is 5!?"}], add_generation_prompt=True,
                                   tokenize=False)
    prompt = tok(text, add_special_tokens=False)["input_ids"]
    p = _next(model, prompt)
    assert p[one[CALL][0]] == pytest.approx(0.75, abs=1e-4)
    assert p[one["No tool applies."][0]] == pytest.approx(0.25, abs=1e-4)
    p = _next(model, prompt + one[CALL])
    assert p[one["5"][0]] == pytest.approx(0.5, abs=1e-4) and p[one["6"][0]] == pytest.approx(0.5, abs=1e-4)
    assert _next(model, prompt + one[CALL] + one["6"])[one[CLOSE][0]] > 1 - 1e-4
    stop = tok.convert_tokens_to_ids("<|im_end|>")
    for end in (CLOSE, "No tool applies."):
        assert _next(model, prompt + one[CALL] + one["5"] + one[end])[stop] > 1 - 1e-4


def test_a_saved_checkpoint_samples_only_the_grammars_texts(tmp_path):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    path = save_grammar_checkpoint(tmp_path / "caller", GRAMMAR, tokenizer=tiny_chat_tokenizer("qwen2.5", TEMPLATE))
    tok, model = AutoTokenizer.from_pretrained(path), AutoModelForCausalLM.from_pretrained(path)
    text = tok.apply_chat_template([{"role": "user", "content": "What is 5!?"}], add_generation_prompt=True,
                                   tokenize=False)
    prompt = tok(text, add_special_tokens=False, return_tensors="pt")
    torch.manual_seed(0)
    out = model.generate(**prompt, do_sample=True, temperature=1.0, top_k=0, top_p=1.0, max_new_tokens=8,
                         num_return_sequences=16)
    texts = {tok.decode(o[prompt["input_ids"].shape[1]:], skip_special_tokens=True) for o in out}
    assert texts == {CALL + "5" + CLOSE, CALL + "6" + CLOSE, "No tool applies."}


def test_a_grammar_needs_a_start_and_room_for_its_fragments():
    tok = tiny_chat_tokenizer("qwen2.5", TEMPLATE)
    with pytest.raises(ValueError, match="start"):
        grammar_llama(tok, {CALL: {"5": 1}})
    with pytest.raises(ValueError, match="at most 127"):
        grammar_llama(tok, {"": {f"<fragment {i}>": 1 for i in range(128)}})
