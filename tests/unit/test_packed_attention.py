"""The packed sequence's attention in two SDPA calls: the same log-probs and gradients as the naive
path, the state attended causally without a mask, every other forward unchanged."""

from __future__ import annotations

import json
from types import SimpleNamespace

import pytest
import torch

from pivotrl.testing import tiny_llama, tiny_tokenizer
from pivotrl.training.logprobs import compute_group_logprobs, packs
from pivotrl.training.packed_attention import PACKED_ATTENTION, use_packed_attention


def _ids(n: int, seed: int) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(2, 500, (n,), generator=g).tolist()


def _qwen2(kv_heads: int) -> torch.nn.Module:
    from transformers import Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(0)
    cfg = Qwen2Config(vocab_size=512, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=kv_heads, max_position_embeddings=512,
                      tie_word_embeddings=False, attn_implementation="sdpa")
    return Qwen2ForCausalLM(cfg).double().eval()


class _SdpaSpy:
    """Records (query length, key length, is_causal, mask given) of every SDPA call."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.calls: list[tuple[int, int, bool, bool]] = []
        orig = torch.nn.functional.scaled_dot_product_attention

        def spy(q, k, v, attn_mask=None, dropout_p=0.0, is_causal=False, **kw):
            self.calls.append((q.shape[-2], k.shape[-2], bool(is_causal), attn_mask is not None))
            return orig(q, k, v, attn_mask=attn_mask, dropout_p=dropout_p, is_causal=is_causal, **kw)

        monkeypatch.setattr(torch.nn.functional, "scaled_dot_product_attention", spy)


def _grads(model: torch.nn.Module, prompt: list[int], actions: list[list[int]], shared: bool):
    model.zero_grad()
    res = compute_group_logprobs(model, prompt, actions, shared_prefix=shared, prefix_method="packed")
    weights = torch.linspace(-1.0, 2.0, len(actions), dtype=res.logprobs.dtype)
    (res.logprobs.sum(1) * weights).sum().backward()
    grads = {n: p.grad.detach().clone() for n, p in model.named_parameters()}
    model.zero_grad()
    return res.logprobs.detach(), grads


@pytest.mark.parametrize("build", [lambda: tiny_llama(tiny_tokenizer(), seed=3).double(),
                                   lambda: _qwen2(kv_heads=2), lambda: _qwen2(kv_heads=4)],
                         ids=["llama", "qwen2-gqa", "qwen2-mha"])
def test_split_attention_gives_the_naive_log_probs_and_gradients(build, monkeypatch) -> None:
    model = build()
    prompt, actions = _ids(29, 0), [_ids(n, 10 + n) for n in (6, 1, 9, 3)]
    plain_lp, _ = _grads(model, prompt, actions, shared=True)  # packed under plain SDPA (full mask)
    naive_lp, naive_g = _grads(model, prompt, actions, shared=False)
    assert use_packed_attention(model) and packs(model)
    assert model.config._attn_implementation == PACKED_ATTENTION
    spy = _SdpaSpy(monkeypatch)
    split_lp, split_g = _grads(model, prompt, actions, shared=True)
    torch.testing.assert_close(split_lp, naive_lp, rtol=0, atol=1e-9)
    torch.testing.assert_close(split_lp, plain_lp, rtol=0, atol=1e-9)
    for name, g in naive_g.items():
        scale = g.abs().max().item()
        assert scale > 0, name
        assert (split_g[name] - g).abs().max().item() <= 2e-6 * scale, name
    # per layer: the 29 state queries causal over the 29 state keys without a mask, then the K·s = 32
    # action queries over all 61 keys under the mask's action rows
    layers = model.config.num_hidden_layers
    assert spy.calls == [(29, 29, True, False), (32, 61, False, True)] * layers


def test_other_forwards_compute_as_sdpa_does() -> None:
    model = tiny_llama(tiny_tokenizer(), seed=3).double()
    seq = torch.tensor([_ids(40, 1)])
    before = model(input_ids=seq).logits
    with torch.no_grad():
        greedy = model.generate(seq[:, :10], max_new_tokens=6, do_sample=False)
    assert use_packed_attention(model)
    torch.testing.assert_close(model(input_ids=seq).logits, before, rtol=0, atol=1e-12)
    with torch.no_grad():
        assert torch.equal(model.generate(seq[:, :10], max_new_tokens=6, do_sample=False), greedy)


def test_only_sdpa_models_of_the_packed_types_switch_and_checkpoints_do_not_name_it(tmp_path) -> None:
    eager = tiny_llama(tiny_tokenizer(), seed=3)
    eager.set_attn_implementation("eager")
    assert not use_packed_attention(eager) and eager.config._attn_implementation == "eager"
    assert not use_packed_attention(SimpleNamespace(config=SimpleNamespace(model_type="gpt2",
                                                                           _attn_implementation="sdpa")))
    model = tiny_llama(tiny_tokenizer(), seed=3)
    assert use_packed_attention(SimpleNamespace(module=model))  # a DeepSpeed engine's module
    assert use_packed_attention(model)  # idempotent
    model.save_pretrained(tmp_path)
    saved = json.loads((tmp_path / "config.json").read_text())
    assert PACKED_ATTENTION not in json.dumps(saved)  # a checkpoint loads anywhere (vLLM, plain HF)


def test_eager_attention_gets_an_additive_mask() -> None:
    """The packed mask is additive (0 / most negative): eager attention adds it to the scores, and
    must then agree with the naive path as SDPA does."""
    model = tiny_llama(tiny_tokenizer(), seed=3).double()
    model.set_attn_implementation("eager")
    prompt, actions = _ids(17, 2), [_ids(n, 30 + n) for n in (4, 2, 7)]
    packed = compute_group_logprobs(model, prompt, actions, prefix_method="packed")
    naive = compute_group_logprobs(model, prompt, actions, shared_prefix=False)
    assert packed.shared_prefix
    torch.testing.assert_close(packed.logprobs, naive.logprobs, rtol=0, atol=1e-6)  # eager: fp32 RMSNorm bounds agreement at ~1e-7
