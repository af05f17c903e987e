"""Unit tests of pivotrl.objective: hand values, loop-vs-vectorised, invariances, validation."""

from __future__ import annotations

import math

import pytest
import torch

from pivotrl.core.errors import ConfigError, TrainingError
from pivotrl.objective import (
    ADVANTAGE_ESTIMATORS,
    KL_ESTIMATORS,
    RATIO_TYPES,
    action_ratios,
    clamp_log_ratio,
    compute_advantages,
    k3_value,
    kl_terms,
    pivotrl_loss,
)

F64 = torch.float64


def _batch(b: int, t: int, seed: int, *, spread: float = 0.3):
    """Random (B, T) log-probs with ragged action masks (every row has ≥ 1 action token)."""
    g = torch.Generator().manual_seed(seed)
    logprobs = -torch.rand(b, t, generator=g, dtype=F64) * 3
    old = logprobs + spread * torch.randn(b, t, generator=g, dtype=F64)
    ref = logprobs + spread * torch.randn(b, t, generator=g, dtype=F64)
    lengths = torch.randint(1, t + 1, (b,), generator=g)
    mask = torch.arange(t)[None, :] < lengths[:, None]
    adv = torch.randn(b, generator=g, dtype=F64)
    return logprobs, old, ref, adv, mask


def _loop_loss(logprobs, old, ref, adv, mask, *, epsilon, beta, kl_estimator, ratio_type, num_actions, clamp=20.0):
    """Straightforward per-action, per-token reference implementation of the PivotRL loss."""
    total = logprobs.new_zeros(())
    for i in range(logprobs.shape[0]):
        idx = [t for t in range(logprobs.shape[1]) if bool(mask[i, t])]
        d = [logprobs[i, t] - old[i, t] for t in idx]
        k = [logprobs[i, t] - ref[i, t] for t in idx]
        a = adv[i]
        if ratio_type == "token":
            terms = []
            for dt in d:
                r = torch.exp(dt.clamp(-clamp, clamp))
                terms.append(torch.minimum(r * a, r.clamp(1 - epsilon, 1 + epsilon) * a))
            surr = sum(terms) / len(terms)
        else:
            s = sum(d)
            if ratio_type == "geometric_mean":
                s = s / len(d)
            r = torch.exp(s.clamp(-clamp, clamp))
            surr = torch.minimum(r * a, r.clamp(1 - epsilon, 1 + epsilon) * a)
        ell = sum(k)
        if kl_estimator == "squared_log_ratio":
            kl = 0.5 * ell**2
        elif kl_estimator == "k1":
            kl = ell
        else:
            kl = sum(torch.exp(-kt) + kt - 1 for kt in k)
        total = total - surr / num_actions + beta * kl / num_actions
    return total


@pytest.mark.parametrize("ratio_type", ["sequence", "geometric_mean", "token"])
@pytest.mark.parametrize("kl_estimator", ["squared_log_ratio", "k1", "k3_per_token"])
@pytest.mark.parametrize("b, t, seed", [(1, 1, 0), (3, 5, 1), (8, 4, 2), (6, 9, 3)])
def test_loop_and_vectorised_agree(ratio_type, kl_estimator, b, t, seed):
    logprobs, old, ref, adv, mask = _batch(b, t, seed)
    lp_vec = logprobs.clone().requires_grad_()
    lp_loop = logprobs.clone().requires_grad_()
    loss, _ = pivotrl_loss(lp_vec, old, ref, adv, mask, epsilon=0.2, beta=0.3,
                           kl_estimator=kl_estimator, ratio_type=ratio_type)
    expected = _loop_loss(lp_loop, old, ref, adv, mask, epsilon=0.2, beta=0.3,
                          kl_estimator=kl_estimator, ratio_type=ratio_type, num_actions=b)
    torch.testing.assert_close(loss, expected, rtol=1e-12, atol=1e-12)
    loss.backward()
    expected.backward()
    torch.testing.assert_close(lp_vec.grad, lp_loop.grad, rtol=1e-10, atol=1e-12)


def test_loop_agreement_covers_clipping():
    # The spread of the random batches above makes the clip bind both ways.
    logprobs, old, ref, adv, mask = _batch(8, 4, 2)
    _, metrics = pivotrl_loss(logprobs, old, ref, adv, mask, epsilon=0.2, beta=0.3)
    assert metrics["clip_frac_high"] > 0 and metrics["clip_frac_low"] > 0


@pytest.mark.parametrize("ratio_type", ["sequence", "geometric_mean", "token"])
@pytest.mark.parametrize("kl_estimator", ["squared_log_ratio", "k1", "k3_per_token"])
def test_masked_positions_do_not_matter(ratio_type, kl_estimator):
    logprobs, old, ref, adv, mask = _batch(5, 6, 7)
    garbage = [float("nan"), float("inf"), -float("inf"), 123.0]

    def dirty(x, seed):
        y = x.clone()
        g = torch.Generator().manual_seed(seed)
        fill = torch.tensor(garbage, dtype=F64)[torch.randint(0, 4, x.shape, generator=g)]
        return torch.where(mask, y, fill)

    lp_clean = logprobs.clone().requires_grad_()
    lp_dirty = dirty(logprobs, 1).requires_grad_()
    kwargs = dict(epsilon=0.2, beta=0.1, kl_estimator=kl_estimator, ratio_type=ratio_type)
    clean, m_clean = pivotrl_loss(lp_clean, old, ref, adv, mask, **kwargs)
    noisy, m_noisy = pivotrl_loss(lp_dirty, dirty(old, 2), dirty(ref, 3), adv, mask, **kwargs)
    assert noisy.item() == clean.item()
    assert m_noisy == m_clean
    clean.backward()
    noisy.backward()
    assert torch.equal(lp_dirty.grad, lp_clean.grad)
    assert torch.equal(lp_dirty.grad[~mask], torch.zeros(int((~mask).sum()), dtype=F64))


@pytest.mark.parametrize("ratio_type", ["sequence", "token"])
def test_sharding_invariance(ratio_type):
    logprobs, old, ref, adv, mask = _batch(8, 5, 11)
    kwargs = dict(epsilon=0.2, beta=0.2, ratio_type=ratio_type)
    lp_full = logprobs.clone().requires_grad_()
    full, _ = pivotrl_loss(lp_full, old, ref, adv, mask, **kwargs)
    full.backward()

    lp_shard = logprobs.clone().requires_grad_()
    total = 0.0
    for rows in (slice(0, 3), slice(3, 8)):  # uneven shards, global num_actions = 8
        part, _ = pivotrl_loss(lp_shard[rows], old[rows], ref[rows], adv[rows], mask[rows], num_actions=8, **kwargs)
        part.backward()
        total = total + part.item()
    assert total == pytest.approx(full.item(), abs=1e-12)
    torch.testing.assert_close(lp_shard.grad, lp_full.grad, rtol=0, atol=1e-14)


def test_mean_over_pivots_of_minus_j():
    # Two pivots with K = 2 actions each: loss = mean over pivots of −J_s.
    logprobs, old, ref, adv, mask = _batch(4, 3, 5)
    loss, _ = pivotrl_loss(logprobs, old, ref, adv, mask, epsilon=0.2, beta=0.4)
    per_pivot = [
        pivotrl_loss(logprobs[i : i + 2], old[i : i + 2], ref[i : i + 2], adv[i : i + 2], mask[i : i + 2],
                     epsilon=0.2, beta=0.4)[0].item()
        for i in (0, 2)
    ]
    assert loss.item() == pytest.approx(sum(per_pivot) / 2, abs=1e-12)


def test_hand_computed_loss_with_kl():
    # One action, two tokens: d = log-ratio to π_old, k = log-ratio to π_ref.
    logprobs = torch.tensor([[-1.0, -2.0]], dtype=F64, requires_grad=True)
    old = torch.tensor([[-1.1, -2.0]], dtype=F64)  # Σd = 0.1 → r = e^0.1 ≈ 1.105 (inside the clip)
    ref = torch.tensor([[-1.5, -1.5]], dtype=F64)  # ℓ = 0.5 − 0.5 = 0 → ½ℓ² = 0
    mask = torch.ones(1, 2, dtype=torch.bool)
    adv = torch.tensor([2.0], dtype=F64)
    loss, m = pivotrl_loss(logprobs, old, ref, adv, mask, epsilon=0.2, beta=0.5)
    assert loss.item() == pytest.approx(-2.0 * math.exp(0.1), abs=1e-12)
    # k3 per token: e^{−0.5} + 0.5 − 1 and e^{0.5} − 0.5 − 1
    assert m["kl"] == pytest.approx(math.exp(-0.5) - 0.5 + math.exp(0.5) - 1.5, abs=1e-12)
    assert m["kl_term"] == 0.0 and m["kl_penalty"] == 0.0
    loss.backward()
    # d(−r·Â)/d lp_t = −r·Â for each token; the KL gradient ℓ·1 is 0 here.
    torch.testing.assert_close(logprobs.grad, torch.full((1, 2), -2.0 * math.exp(0.1), dtype=F64))


def test_token_ratio_type_hand_value():
    logprobs = torch.tensor([[0.3, -0.1]], dtype=F64)
    zeros = torch.zeros(1, 2, dtype=F64)
    mask = torch.ones(1, 2, dtype=torch.bool)
    adv = torch.tensor([1.0], dtype=F64)
    token, m = pivotrl_loss(logprobs, zeros, zeros, adv, mask, epsilon=0.2, beta=0.0, ratio_type="token")
    # per-token ratios e^0.3 ≈ 1.35 (clipped to 1.2) and e^−0.1 ≈ 0.905; mean over the action's tokens
    assert token.item() == pytest.approx(-(1.2 + math.exp(-0.1)) / 2, abs=1e-12)
    assert m["clip_frac_high"] == 0.5 and m["ratio_max"] == pytest.approx(math.exp(0.3))
    seq, _ = pivotrl_loss(logprobs, zeros, zeros, adv, mask, epsilon=0.2, beta=0.0)
    assert seq.item() == pytest.approx(-1.2, abs=1e-12)  # e^0.2 ≈ 1.221 clipped to 1.2


def test_log_ratio_clamp_counts_and_blocks_overflow():
    logprobs = torch.tensor([[25.0, 0.0], [-30.0, 0.0], [0.5, 0.0]], dtype=F64, requires_grad=True)
    zeros = torch.zeros(3, 2, dtype=F64)
    mask = torch.tensor([[True, False], [True, False], [True, False]])
    ratio, n = action_ratios(logprobs, zeros, mask, log_ratio_clamp=20.0)
    torch.testing.assert_close(ratio.detach(), torch.tensor([math.exp(20), math.exp(-20), math.exp(0.5)], dtype=F64))
    assert n == 2
    clamped, n2 = clamp_log_ratio(torch.tensor([1.0, -3.0, 2.5]), 2.0)
    assert clamped.tolist() == [1.0, -2.0, 2.0] and n2 == 2
    adv = torch.tensor([-1.0, 1.0, 1.0], dtype=F64)  # clip does not bind on rows 0 and 1
    loss, m = pivotrl_loss(logprobs, zeros, zeros, adv, mask, epsilon=0.2, beta=0.0, log_ratio_clamp=20.0)
    assert m["log_ratio_clamped"] == 2.0
    loss.backward()
    assert logprobs.grad[0, 0].item() == 0.0 and logprobs.grad[1, 0].item() == 0.0


def test_kl_estimator_values():
    logprobs = torch.tensor([[math.log(0.5), math.log(0.2)]], dtype=F64)
    ref = torch.tensor([[math.log(0.25), math.log(0.4)]], dtype=F64)
    mask = torch.tensor([[True, True]])
    ell = math.log(2) + math.log(0.5)  # = 0
    assert kl_terms(logprobs, ref, mask, "k1").item() == pytest.approx(ell, abs=1e-15)
    assert kl_terms(logprobs, ref, mask, "squared_log_ratio").item() == pytest.approx(0.5 * ell**2, abs=1e-15)
    k3 = (0.5 - math.log(0.5) - 1) + (2.0 - math.log(2.0) - 1)
    assert kl_terms(logprobs, ref, mask, "k3_per_token").item() == pytest.approx(k3, abs=1e-12)
    one = torch.tensor([[True, False]])
    assert kl_terms(logprobs, ref, one, "squared_log_ratio").item() == pytest.approx(0.5 * math.log(2) ** 2)


def test_k3_value_has_no_gradient():
    logprobs = torch.tensor([[-1.0, -2.0]], requires_grad=True)
    # d = log π_θ − log π_ref = [0.5, −1.0]; k3 = e^{−d} + d − 1 per token
    value = k3_value(logprobs, torch.tensor([[-1.5, -1.0]]), torch.tensor([[1, 1]]))
    assert not value.requires_grad
    assert value.item() == pytest.approx((math.exp(-0.5) - 0.5) + (math.exp(1.0) - 1.0 - 1.0), rel=1e-6)


def test_bf16_inputs_compute_in_float32():
    logprobs, old, ref, adv, mask = _batch(4, 3, 9)
    lp16 = logprobs.to(torch.bfloat16).requires_grad_()
    loss, _ = pivotrl_loss(lp16, old.to(torch.bfloat16), ref.to(torch.bfloat16), adv.float(), mask,
                           epsilon=0.2, beta=0.1)
    assert loss.dtype == torch.float32
    loss.backward()
    assert lp16.grad.dtype == torch.bfloat16 and torch.isfinite(lp16.grad.float()).all()


def test_metrics_keys():
    logprobs, old, ref, adv, mask = _batch(3, 2, 4)
    loss, m = pivotrl_loss(logprobs, old, ref, adv, mask, epsilon=0.2, beta=0.1)
    assert set(m) == {
        "loss", "surrogate", "kl", "kl_term", "kl_penalty", "ratio_mean", "ratio_max", "ratio_min",
        "clip_frac_high", "clip_frac_low", "log_ratio_clamped", "advantage_mean", "num_actions",
    }
    assert all(isinstance(v, float) for v in m.values())
    assert m["loss"] == loss.item() and m["num_actions"] == 3.0
    assert m["kl_penalty"] == pytest.approx(0.1 * m["kl_term"])


def test_non_finite_loss_raises_training_error():
    logprobs, old, ref, adv, mask = _batch(3, 2, 4)
    logprobs[1, 0] = float("nan")  # an action token (every row has ≥ 1)
    with pytest.raises(TrainingError, match="non-finite"):
        pivotrl_loss(logprobs, old, ref, adv, mask, epsilon=0.2, beta=0.1)


# --- advantages ------------------------------------------------------------------------------------


@pytest.mark.parametrize("k", [2, 3, 8])
def test_advantage_invariances_on_random_groups(k):
    rewards = torch.rand(5, k, generator=torch.Generator().manual_seed(k), dtype=F64)
    dr = compute_advantages(rewards, "dr_grpo")
    torch.testing.assert_close(compute_advantages(rewards, "rloo"), dr * k / (k - 1))
    std = rewards.std(dim=1, keepdim=True, correction=0)
    torch.testing.assert_close(compute_advantages(rewards, "grpo", delta=1e-3) * (std + 1e-3), dr)
    # Loop version of RLOO: R_i minus the mean of the other K−1 rewards.
    loop = torch.tensor([[rewards[g, i] - (rewards[g].sum() - rewards[g, i]) / (k - 1) for i in range(k)]
                         for g in range(5)], dtype=F64)
    torch.testing.assert_close(compute_advantages(rewards, "rloo"), loop)


def test_advantages_accept_bool_and_one_group():
    adv = compute_advantages(torch.tensor([True, True, False, False]))
    assert adv.dtype == torch.get_default_dtype() and adv.shape == (4,)
    torch.testing.assert_close(adv, torch.tensor([1.0, 1.0, -1.0, -1.0]) * (0.5 / (0.5 + 1e-6)))


def test_advantages_validation():
    with pytest.raises(ConfigError, match="group_size"):
        compute_advantages(torch.ones(3, 1))
    with pytest.raises(ValueError, match="group_size"):
        compute_advantages(torch.ones(3, 1))
    with pytest.raises(ConfigError, match="delta"):
        compute_advantages(torch.ones(1, 4), delta=0.0)
    with pytest.raises(ValueError, match="NaN"):
        compute_advantages(torch.tensor([[1.0, float("nan")]]))
    with pytest.raises(ValueError, match="shape"):
        compute_advantages(torch.ones(2, 2, 2))


# --- registries and settings -----------------------------------------------------------------------


@pytest.mark.parametrize(
    "registry, names",
    [
        (ADVANTAGE_ESTIMATORS, ["dr_grpo", "grpo", "reinforce", "rloo"]),
        (RATIO_TYPES, ["geometric_mean", "sequence", "token"]),
        (KL_ESTIMATORS, ["k1", "k3_per_token", "squared_log_ratio"]),
    ],
)
def test_registry_lookup_lists_valid_names(registry, names):
    assert registry.names() == names
    with pytest.raises(ConfigError) as err:
        registry.get("nope")
    assert all(name in str(err.value) for name in names) and "'nope'" in str(err.value)


def test_unknown_names_in_entry_points():
    logprobs, old, ref, adv, mask = _batch(2, 2, 0)
    with pytest.raises(ConfigError, match="squared_log_ratio"):
        pivotrl_loss(logprobs, old, ref, adv, mask, epsilon=0.2, beta=0.1, kl_estimator="k2")
    with pytest.raises(ConfigError, match="geometric_mean"):
        pivotrl_loss(logprobs, old, ref, adv, mask, epsilon=0.2, beta=0.1, ratio_type="gspo")
    with pytest.raises(ConfigError, match="rloo"):
        compute_advantages(torch.ones(1, 4), "ppo")


@pytest.mark.parametrize(
    "override, key",
    [
        ("training.epsilon=0.0", "training.epsilon"),
        ("training.epsilon=1.0", "training.epsilon"),
        ("training.epsilon=nan", "training.epsilon"),
        ("training.beta=-0.01", "training.beta"),
        ("training.kl_estimator=k2", "training.kl_estimator"),
        ("training.ratio_type=gspo", "training.ratio_type"),
    ],
)
def test_bad_settings_are_the_config_schemas_to_refuse_once(override, key):
    """The loss settings' bounds are checked where a config is loaded, once, naming the key;
    pivotrl_loss does not check them again on every step (issue 12: no bound in two places)."""
    from pivotrl.config import load_config

    with pytest.raises(ConfigError, match=key):
        load_config(None, [override])


def test_bad_inputs():
    logprobs, old, ref, adv, mask = _batch(3, 4, 0)
    kw = dict(epsilon=0.2, beta=0.1)
    with pytest.raises(ValueError, match="old_logprobs"):
        pivotrl_loss(logprobs, old[:, :3], ref, adv, mask, **kw)
    with pytest.raises(ValueError, match="advantages"):
        pivotrl_loss(logprobs, old, ref, adv[:2], mask, **kw)
    empty = mask.clone()
    empty[1] = False
    with pytest.raises(ValueError, match=r"row\(s\) \[1\]"):
        pivotrl_loss(logprobs, old, ref, adv, empty, **kw)
    with pytest.raises(ValueError, match="0 and 1"):
        pivotrl_loss(logprobs, old, ref, adv, mask.long() * 2, **kw)
    with pytest.raises(ConfigError, match="num_actions"):
        pivotrl_loss(logprobs, old, ref, adv, mask, num_actions=2, **kw)
    with pytest.raises(ConfigError, match="num_actions"):
        pivotrl_loss(logprobs, old, ref, adv, mask, num_actions=3.0, **kw)
    with pytest.raises(ValueError, match="advantages contain NaN"):
        pivotrl_loss(logprobs, old, ref, torch.tensor([0.0, float("nan"), 1.0], dtype=F64), mask, **kw)
