"""Sampler–trainer mismatch and truncated importance sampling against the sampler (training.tis_cap):
the free functions by hand, the weighted loss by hand, and the trainer's metrics and loss on a tiny
model whose groups carry sampler log-probs shifted from the trainer's by known amounts."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch

from pivotrl.core.errors import ConfigError, DataError
from pivotrl.objective import pivotrl_loss, sampler_mismatch, truncated_is_weights
from pivotrl.testing import save_tiny_checkpoint
from pivotrl.training.groups import Group, check_groups

OLD = torch.tensor([[-1.0, -2.0, 0.0], [-0.5, 0.0, 0.0]])
SAMPLER = torch.tensor([[-1.5, -1.0, 9.0], [-0.25, 9.0, 9.0]])  # 9.0: padding, ignored
MASK = torch.tensor([[1, 1, 0], [1, 0, 0]], dtype=torch.bool)


def test_mismatch_by_hand():
    m = sampler_mismatch(OLD, SAMPLER, MASK)
    # Δ = old − sampler on action tokens: row 0 [0.5, −1.0], row 1 [−0.25].
    assert m == pytest.approx({"abs_sum": 1.75, "tokens": 3.0, "max_abs": 1.0, "log_ratio_sum": -0.75, "actions": 2.0})


def test_truncated_weights_by_hand():
    w = truncated_is_weights(OLD, SAMPLER, MASK, cap=0.7)
    assert w.tolist() == pytest.approx([math.exp(-0.5), 0.7])  # exp(−0.25) = 0.7788 is cut at C = 0.7
    w2 = truncated_is_weights(OLD, SAMPLER - 1.0, MASK, cap=2.5)  # Σ Δ: row 0 1.5 (e^1.5 = 4.48), row 1 0.75
    assert w2.tolist() == pytest.approx([2.5, math.exp(0.75)])
    with pytest.raises(ConfigError, match="tis_cap"):
        truncated_is_weights(OLD, SAMPLER, MASK, cap=0.0)
    with pytest.raises(ValueError, match="shape"):
        truncated_is_weights(OLD, SAMPLER[:, :2], MASK, cap=1.0)


def test_the_weighted_surrogate_by_hand():
    # log π_θ = π_old: ratio 1, surrogate_i = Â_i; weighted by w = [e^−0.5, 0.7]; β = 0.
    lp = OLD.clone().requires_grad_(True)
    w = truncated_is_weights(OLD, SAMPLER, MASK, cap=0.7)
    loss, m = pivotrl_loss(lp, OLD, OLD, torch.tensor([1.0, -1.0]), MASK, epsilon=0.2, beta=0.0, action_weights=w)
    assert float(loss.detach()) == pytest.approx(-(math.exp(-0.5) * 1.0 + 0.7 * -1.0) / 2)
    plain, _ = pivotrl_loss(lp, OLD, OLD, torch.tensor([1.0, -1.0]), MASK, epsilon=0.2, beta=0.0)
    assert float(plain) == pytest.approx(0.0)
    with pytest.raises(ValueError, match="action_weights"):
        pivotrl_loss(lp, OLD, OLD, torch.tensor([1.0, -1.0]), MASK, epsilon=0.2, beta=0.0, action_weights=w[:1])


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory) -> Path:
    return save_tiny_checkpoint(tmp_path_factory.mktemp("tis") / "model")


SHIFT = [0.0, 0.1, 0.2, 0.3]  # per token, action i: log π_sampler = log π_old − SHIFT[i]


def _groups(trainer, shifted: bool = True):
    prompt = [5, 17, 42, 9, 11]
    actions = [[3, 4, 1], [6, 1], [7, 8, 9, 1], [10, 1]]
    lps = [[x - (SHIFT[i] if shifted else 0.0) for x in trainer.old_policy_logprobs(prompt, a)]
           for i, a in enumerate(actions)]
    return [Group("s0", prompt, actions, [1.0, 0.0, 1.0, 0.0], sampler_logprobs=lps)], actions


def test_the_trainer_reports_the_mismatch_and_weights_the_surrogate_with_tis(ckpt: Path):
    from pivotrl.training.pivotrl import PivotRLTrainer

    kw = dict(group_size=4, dtype="float32", lr=1e-3, beta=0.0, seed=0)
    plain = PivotRLTrainer.build(ckpt, **kw)
    groups, actions = _groups(plain)
    m = plain.train_step(groups)
    lengths = [len(a) for a in actions]
    assert m["sampler_mismatch_mean_abs"] == pytest.approx(sum(s * t for s, t in zip(SHIFT, lengths)) / sum(lengths),
                                                           abs=1e-5)
    assert m["sampler_log_ratio_mean"] == pytest.approx(sum(s * t for s, t in zip(SHIFT, lengths)) / 4, abs=1e-5)
    assert "tis_weight_mean" not in m and m["loss"] == pytest.approx(0.0, abs=1e-5)  # Σ Â = 0, ratio 1

    tis = PivotRLTrainer.build(ckpt, tis_cap=1.5, **kw)
    groups, _ = _groups(tis)
    m = tis.train_step(groups)
    w = [min(math.exp(s * t), 1.5) for s, t in zip(SHIFT, lengths)]  # 1, e^0.2, e^0.8 → 1.5, e^0.6
    a = 0.5 / (0.5 + 1e-6)  # GRPO: (R − R̄)/(σ + δ), R̄ = 0.5, population σ = 0.5
    adv = [a, -a, a, -a]
    assert m["tis_weight_mean"] == pytest.approx(sum(w) / 4, rel=1e-5)
    assert m["loss"] == pytest.approx(-sum(wi * a for wi, a in zip(w, adv)) / 4, rel=1e-4)


def test_tis_without_sampler_logprobs_is_refused_and_bad_ones_are_named(ckpt: Path):
    from pivotrl.training.pivotrl import PivotRLTrainer

    tis = PivotRLTrainer.build(ckpt, group_size=4, dtype="float32", lr=1e-3, beta=0.0, tis_cap=2.0, seed=0)
    groups, _ = _groups(tis)
    bare = [Group(g.state_id, g.prompt_ids, g.actions, g.rewards) for g in groups]
    with pytest.raises(DataError, match="tis_cap is set but group 's0' has no sampler log-probs"):
        tis.train_step(bare)
    short = [Group("s0", groups[0].prompt_ids, groups[0].actions, groups[0].rewards,
                   sampler_logprobs=[lp[:-1] for lp in groups[0].sampler_logprobs])]
    with pytest.raises(DataError, match="sampler log-probs"):
        check_groups(short, 4)
    assert Group.from_dict(groups[0].to_dict()) == groups[0]
