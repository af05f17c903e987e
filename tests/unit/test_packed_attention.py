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


def _groups() -> list[tuple[list[int], list[list[int]]]]:
    # different states, group sizes and action lengths; the middle group's actions are one token each
    return [(_ids(23, 5), [_ids(n, 50 + n) for n in (4, 7, 2)]),
            (_ids(11, 6), [_ids(1, 60 + i) for i in range(3)]),
            (_ids(31, 7), [_ids(n, 70 + n) for n in (9, 3)])]


def _weighted_grads(model: torch.nn.Module, results) -> dict[str, torch.Tensor]:
    model.zero_grad()
    total = sum((r.logprobs.sum(1) * torch.linspace(-1.0, 2.0, r.logprobs.shape[0], dtype=r.logprobs.dtype)).sum()
                for r in results)
    total.backward()
    grads = {n: p.grad.detach().clone() for n, p in model.named_parameters()}
    model.zero_grad()
    return grads


@pytest.mark.parametrize("packed_attention", [False, True], ids=["sdpa", "pivotrl_packed"])
@pytest.mark.parametrize("build", [lambda: tiny_llama(tiny_tokenizer(), seed=3).double(), lambda: _qwen2(kv_heads=2)],
                         ids=["llama", "qwen2-gqa"])
def test_groups_packed_into_one_forward_equal_each_group_alone(build, packed_attention, monkeypatch) -> None:
    from pivotrl.training.logprobs import compute_groups_logprobs

    model = build()
    if packed_attention:
        assert use_packed_attention(model)
    groups = _groups()
    alone = [compute_group_logprobs(model, p, a, with_entropy=True) for p, a in groups]
    g_alone = _weighted_grads(model, alone)
    forwards: list[int] = []
    model.register_forward_pre_hook(lambda *_: forwards.append(1))
    spy = _SdpaSpy(monkeypatch)
    together = compute_groups_logprobs(model, groups, with_entropy=True)
    assert len(forwards) == 1  # 3 groups, 23 + 3·6 + 11 + 0 + 31 + 2·8 = 99 tokens: one forward
    for a, b in zip(alone, together):
        assert b.shared_prefix and b.tokens_processed == a.tokens_processed
        assert (b.logit_positions, b.attention_pairs) == (a.logit_positions, a.attention_pairs)
        assert torch.equal(a.action_mask, b.action_mask)
        torch.testing.assert_close(b.logprobs, a.logprobs, rtol=0, atol=1e-9)
        torch.testing.assert_close(b.entropy, a.entropy, rtol=0, atol=1e-9)
    g_together = _weighted_grads(model, together)
    for name, g in g_alone.items():
        assert (g_together[name] - g).abs().max().item() <= 2e-6 * g.abs().max().item(), name
    per_layer = spy.calls[: len(spy.calls) // model.config.num_hidden_layers]
    if packed_attention:  # per group: the state causal without a mask, the action rows over the group's keys
        assert per_layer == [(23, 23, True, False), (18, 41, False, True), (11, 11, True, False),
                             (31, 31, True, False), (16, 47, False, True)]
    else:  # one masked call over the whole packed sequence
        assert per_layer == [(99, 99, False, True)]


def test_groups_are_packed_up_to_the_token_budget() -> None:
    from pivotrl.training.logprobs import compute_groups_logprobs

    model = tiny_llama(tiny_tokenizer(), seed=3).double()
    forwards: list[int] = []
    model.register_forward_pre_hook(lambda _m, _a, kw: forwards.append(kw["input_ids"].shape[1]), with_kwargs=True)
    groups = _groups()  # 41, 11 and 47 tokens
    alone = [compute_group_logprobs(model, p, a).logprobs for p, a in groups]
    forwards.clear()
    res = compute_groups_logprobs(model, groups, pack_tokens=52)
    assert forwards == [52, 47]  # the first two share a forward; the third would overflow it
    forwards.clear()
    compute_groups_logprobs(model, groups, pack_tokens=10)
    assert forwards == [41, 11, 47]  # each group longer than the budget runs alone
    for a, b in zip(alone, res):
        torch.testing.assert_close(b.logprobs, a, rtol=0, atol=1e-9)
