from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from pivotrl.core.errors import DataError
from pivotrl.testing import tiny_llama, tiny_tokenizer
from pivotrl.training.logprobs import compute_group_logprobs, group_logprobs, processed_tokens


@pytest.fixture(scope="module")
def model() -> torch.nn.Module:
    # float64 weights; Llama's RMSNorm still computes in fp32, which bounds agreement at ~1e-7.
    return tiny_llama(tiny_tokenizer(), seed=3).double()


def _ids(n: int, seed: int) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(2, 500, (n,), generator=g).tolist()


def _reference(model: torch.nn.Module, prompt: list[int], action: list[int]) -> torch.Tensor:
    """log π(a_t | s, a_<t) from one unpadded forward of state + action: (T,)."""
    seq = torch.tensor([prompt + action])
    with torch.no_grad():
        logp = torch.log_softmax(model(input_ids=seq).logits[0].double(), -1)
    p = len(prompt)
    return torch.stack([logp[p - 1 + t, a] for t, a in enumerate(action)])


def _grads(model: torch.nn.Module, prompt: list[int], actions: list[list[int]], shared: bool,
           method: str = "packed") -> dict:
    model.zero_grad()
    lp = compute_group_logprobs(model, prompt, actions, shared_prefix=shared, prefix_method=method).logprobs
    weights = torch.linspace(-1.0, 2.0, len(actions), dtype=lp.dtype)
    (lp.sum(1) * weights).sum().backward()
    out = {n: p.grad.detach().clone() for n, p in model.named_parameters()}
    model.zero_grad()
    return out


@pytest.mark.parametrize("method", ["packed", "cache"])
@pytest.mark.parametrize("lens", [(5, 1, 9, 3), (4,), (1, 1, 1)])
def test_shared_equals_naive_and_reference(model: torch.nn.Module, lens: tuple[int, ...], method: str) -> None:
    prompt = _ids(23, 0)
    actions = [_ids(n, 10 + i) for i, n in enumerate(lens)]
    shared = compute_group_logprobs(model, prompt, actions, shared_prefix=True, with_entropy=True,
                                    prefix_method=method)
    if method == "packed":
        from pivotrl.training.logprobs import packs

        assert packs(model)  # the tiny Llama takes the packed path
    naive = compute_group_logprobs(model, prompt, actions, shared_prefix=False, with_entropy=True)
    assert shared.shared_prefix and not naive.shared_prefix
    assert shared.logprobs.shape == (len(lens), max(lens))
    assert torch.equal(shared.action_mask, naive.action_mask)
    assert shared.action_mask.sum(1).tolist() == [float(n) for n in lens]
    torch.testing.assert_close(shared.logprobs, naive.logprobs, rtol=0, atol=1e-9)
    torch.testing.assert_close(shared.entropy, naive.entropy, rtol=0, atol=1e-9)
    for i, a in enumerate(actions):
        ref = _reference(model, prompt, a)
        torch.testing.assert_close(shared.logprobs[i, : len(a)].detach(), ref, rtol=0, atol=1e-9)
        assert torch.all(shared.logprobs[i, len(a) :] == 0)
    # processed token counts: P + K·(T_max−1) vs K·(P + T_max−1)
    k, t = len(lens), max(lens)
    assert shared.tokens_processed == 23 + k * (t - 1)
    assert naive.tokens_processed == k * (23 + t - 1)


@pytest.mark.parametrize("method", ["packed", "cache"])
def test_parameter_gradients_agree(model: torch.nn.Module, method: str) -> None:
    prompt = _ids(31, 1)
    actions = [_ids(n, 20 + n) for n in (6, 2, 8)]
    g_shared = _grads(model, prompt, actions, True, method)
    g_naive = _grads(model, prompt, actions, False)
    for name, g in g_naive.items():
        scale = g.abs().max().item()
        assert scale > 0, name
        assert (g_shared[name] - g).abs().max().item() <= 2e-6 * scale, name


def test_padding_does_not_leak(model: torch.nn.Module) -> None:
    prompt = _ids(17, 2)
    short, other = _ids(3, 30), _ids(4, 31)
    alone, _ = group_logprobs(model, prompt, [short, other])
    with_long, _ = group_logprobs(model, prompt, [short, other, _ids(12, 32)])
    torch.testing.assert_close(with_long[:2, :4], alone, rtol=0, atol=1e-9)
    assert torch.all(with_long[:2, 4:] == 0)


def test_token_counts_formula() -> None:
    assert processed_tokens(1000, [30, 20, 25], shared_prefix=True) == 1000 + 3 * 29
    assert processed_tokens(1000, [30, 20, 25], shared_prefix=False) == 3 * 1029


def test_bad_inputs_raise(model: torch.nn.Module) -> None:
    with pytest.raises(DataError, match="prompt_ids"):
        group_logprobs(model, [], [[3]])
    with pytest.raises(DataError, match="actions is empty"):
        group_logprobs(model, [3], [])
    with pytest.raises(DataError, match="action 1 has no tokens"):
        group_logprobs(model, [3], [[4], []])


class _BigramLM(torch.nn.Module):
    """A real causal LM without a key/value cache: next-token logits from the current token only."""

    def __init__(self, vocab: int = 50) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.table = torch.nn.Embedding(vocab, vocab)

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None, **_: object):
        return SimpleNamespace(logits=self.table(input_ids))


def test_model_without_cache_falls_back_to_naive() -> None:
    lm = _BigramLM()
    prompt, actions = [3, 4, 5], [[6, 7], [8]]
    res = compute_group_logprobs(lm, prompt, actions, shared_prefix=True)
    assert not res.shared_prefix
    assert res.tokens_processed == 2 * (3 + 1)
    logp = torch.log_softmax(lm.table.weight.detach(), -1)
    expected = torch.tensor([[logp[5, 6], logp[6, 7]], [logp[5, 8], 0.0]])
    torch.testing.assert_close(res.logprobs.detach(), expected)


def test_packed_path_serves_the_listed_model_types_only() -> None:
    from pivotrl.training.logprobs import PACKED_MODEL_TYPES, packs

    def fake(model_type: str, impl: str = "sdpa") -> SimpleNamespace:
        return SimpleNamespace(config=SimpleNamespace(model_type=model_type, _attn_implementation=impl))

    assert {"llama", "qwen2"} <= PACKED_MODEL_TYPES
    assert packs(fake("llama")) and packs(fake("qwen2", "eager"))
    assert not packs(fake("gpt2")) and not packs(fake("llama", "flash_attention_2"))
    assert not packs(SimpleNamespace())  # no config: the cache (or naive) path
    with pytest.raises(ValueError, match="prefix_method"):
        compute_group_logprobs(SimpleNamespace(), [1], [[2]], prefix_method="other")


def test_packed_equals_naive_on_qwen2() -> None:
    from transformers import Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(0)
    cfg = Qwen2Config(vocab_size=512, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                      num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=512,
                      tie_word_embeddings=False)
    model = Qwen2ForCausalLM(cfg).double().eval()
    prompt = _ids(19, 4)
    actions = [_ids(n, 40 + n) for n in (3, 7, 1)]
    packed = compute_group_logprobs(model, prompt, actions, prefix_method="packed")
    naive = compute_group_logprobs(model, prompt, actions, shared_prefix=False)
    assert packed.shared_prefix
    torch.testing.assert_close(packed.logprobs, naive.logprobs, rtol=0, atol=1e-9)


def test_auto_packs_in_every_dtype(monkeypatch) -> None:
    import pivotrl.training.logprobs as lp

    calls: list[int] = []
    orig = lp._packed_logits
    monkeypatch.setattr(lp, "_packed_logits", lambda *a: (calls.append(1), orig(*a))[1])
    m = tiny_llama(tiny_tokenizer(), seed=3)
    fp32 = compute_group_logprobs(m, [5, 6, 7], [[8, 9], [10]])  # auto: packed
    cache = compute_group_logprobs(m, [5, 6, 7], [[8, 9], [10]], prefix_method="cache")
    assert calls == [1] and fp32.shared_prefix and cache.shared_prefix
    torch.testing.assert_close(fp32.logprobs, cache.logprobs, rtol=0, atol=1e-5)
    bf16 = compute_group_logprobs(m.to(torch.bfloat16), [5, 6, 7], [[8, 9], [10]])  # auto: packed
    assert calls == [1, 1] and bf16.shared_prefix
    torch.testing.assert_close(bf16.logprobs, fp32.logprobs, rtol=0, atol=0.1)