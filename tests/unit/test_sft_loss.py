"""The warm start's loss computes the output layer only where a loss token is predicted: same
loss and gradients as the full computation over every position."""

from __future__ import annotations

import torch

from pivotrl.testing import tiny_llama, tiny_tokenizer
from pivotrl.training.sft import _collate, sft_batch_loss


def _full_loss(model, examples, num_tokens):
    ids, attn, mask = _collate(examples, torch.device("cpu"))
    logits = model(input_ids=ids, attention_mask=attn, use_cache=False).logits[:, :-1]  # (B, L-1, V)
    lp = torch.log_softmax(logits.double(), dim=-1).gather(-1, ids[:, 1:].unsqueeze(-1)).squeeze(-1)
    return -(lp * mask[:, 1:].double()).sum() / num_tokens


def test_loss_on_loss_positions_only_equals_the_full_loss_and_gradients():
    torch.manual_seed(0)
    model = tiny_llama(tiny_tokenizer()).double()
    examples = [([5, 6, 7, 8, 9, 10, 11, 12], [0, 0, 0, 1, 1, 0, 1, 1]),  # two actions
                ([5, 6, 7, 9, 9], [0, 0, 1, 1, 1])]  # shorter: right-padded in the batch
    loss, nll = sft_batch_loss(model, examples, num_tokens=8)
    loss.backward()
    fast = [p.grad.clone() for p in model.parameters()]
    model.zero_grad()
    ref = _full_loss(model, examples, 8)
    ref.backward()
    assert abs(float(loss) - float(ref)) < 1e-6 and abs(nll - 8 * float(ref)) < 1e-5
    for a, b in zip(fast, (p.grad for p in model.parameters())):
        assert torch.allclose(a.double(), b, atol=1e-6)
