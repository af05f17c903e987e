"""The eight conformance cases of the PivotRL spec, with its exact numbers."""

from __future__ import annotations

import math

import pytest
import torch

from pivotrl.pivots.filter import is_pivot, pivot_decision, probe_stats
from pivotrl.objective import (
    KL_ESTIMATORS,
    action_ratios,
    clipped_surrogate,
    compute_advantages,
    pivotrl_loss,
)

F64 = torch.float64


# --- Case 1: pivot filtering, m = 4, λ_diff = 0.5 ------------------------------------------------


def test_case1_seed_candidate_is_kept():
    mu, var = probe_stats([1, 0, 0, 0])
    assert mu == 0.25
    assert var == pytest.approx((0.75**2 + 3 * 0.25**2) / 4, abs=0)
    assert var == 0.1875
    assert pivot_decision(mu, var, 0.5) == "kept"
    assert is_pivot(mu, var, 0.5)


@pytest.mark.parametrize(
    "probes, mu, var, decision",
    [
        ([1, 1, 1, 1], 1.0, 0.0, "all_pass"),
        ([0, 0, 0, 0], 0.0, 0.0, "all_fail"),
        ([1, 1, 0, 0], 0.5, 0.25, "above_threshold"),
    ],
)
def test_case1_dropped_candidates(probes, mu, var, decision):
    got_mu, got_var = probe_stats(probes)
    assert (got_mu, got_var) == (mu, var)
    assert pivot_decision(got_mu, got_var, 0.5) == decision
    assert not is_pivot(got_mu, got_var, 0.5)


# --- Case 2: one update on fresh rewards [1,1,0,0] ------------------------------------------------


def _case2_advantages() -> torch.Tensor:
    return compute_advantages(torch.tensor([[1.0, 1.0, 0.0, 0.0]], dtype=F64), "grpo", delta=1e-8).flatten()


def test_case2_advantages():
    adv = _case2_advantages()
    # R̄ = 0.5, σ_R = 0.5 (population): Â = ±0.5 / (0.5 + 1e-8)
    expected = torch.tensor([1.0, 1.0, -1.0, -1.0], dtype=F64) * (0.5 / (0.5 + 1e-8))
    torch.testing.assert_close(adv, expected, rtol=0, atol=1e-15)


@pytest.mark.parametrize("num_tokens", [1, 3])
def test_case2_loss_and_whole_action_gradients(num_tokens):
    adv = _case2_advantages()
    ratios = torch.tensor([1.1, 1.3, 0.9, 0.7], dtype=F64)
    # Leaf: each action's whole log-probability; π_old's whole log-prob is 0, so r = exp(lp − 0).
    action_lp = ratios.log().requires_grad_()
    old_action_lp = torch.zeros(4, dtype=F64)
    # Spread each whole log-prob over num_tokens tokens (plus one padding column) as a trainer would.
    weights = torch.tensor([0.5, 0.3, 0.2], dtype=F64)[:num_tokens]
    weights = weights / weights.sum()
    logprobs = torch.cat([action_lp[:, None] * weights, torch.full((4, 1), -7.0, dtype=F64)], dim=1)
    old_logprobs = torch.cat([old_action_lp[:, None] * weights, torch.full((4, 1), 3.0, dtype=F64)], dim=1)
    mask = torch.cat([torch.ones(4, num_tokens, dtype=torch.bool), torch.zeros(4, 1, dtype=torch.bool)], dim=1)

    loss, metrics = pivotrl_loss(
        logprobs, old_logprobs, old_logprobs.clone(), adv, mask, epsilon=0.2, beta=0.0
    )
    # J = (1.1 + 1.2 − 0.9 − 0.8) / 4 = 0.15
    assert loss.item() == pytest.approx(-0.15, abs=1e-6)
    assert metrics["surrogate"] == pytest.approx(0.15, abs=1e-6)
    assert metrics["clip_frac_high"] == 0.25 and metrics["clip_frac_low"] == 0.25
    assert metrics["ratio_max"] == pytest.approx(1.3) and metrics["ratio_min"] == pytest.approx(0.7)

    loss.backward()
    grad_j = -action_lp.grad  # ∂J/∂ log π_θ(a_i|s) = (1/4) r_i Â_i where unclipped
    assert grad_j[0].item() == pytest.approx(0.275, abs=1e-6)
    assert grad_j[2].item() == pytest.approx(-0.225, abs=1e-6)
    assert grad_j[1].item() == 0.0  # clipped above, Â > 0
    assert grad_j[3].item() == 0.0  # clipped below, Â < 0


# --- Case 3: all-equal groups ----------------------------------------------------------------------


@pytest.mark.parametrize("value", [0.0, 1.0])
@pytest.mark.parametrize("estimator", ["grpo", "dr_grpo", "rloo"])
def test_case3_all_equal_group_has_zero_advantage(value, estimator):
    adv = compute_advantages(torch.full((1, 4), value), estimator)
    assert torch.equal(adv, torch.zeros(1, 4))


@pytest.mark.parametrize("value", [0.0, 1.0])
def test_case3_no_task_gradient_but_kl_gradient(value):
    adv = compute_advantages(torch.full((1, 4), value, dtype=F64)).flatten()
    torch.manual_seed(3)
    logprobs = (-torch.rand(4, 5, dtype=F64)).requires_grad_()
    old = logprobs.detach() + 0.3 * torch.randn(4, 5, dtype=F64)  # ratios ≠ 1, some outside the clip
    ref = logprobs.detach() - 0.5 * torch.rand(4, 5, dtype=F64)  # π_θ ≠ π_ref
    mask = torch.ones(4, 5, dtype=torch.bool)

    loss, _ = pivotrl_loss(logprobs, old, ref, adv, mask, epsilon=0.2, beta=0.0)
    (grad,) = torch.autograd.grad(loss, logprobs)
    assert torch.equal(grad, torch.zeros_like(grad))
    assert loss.item() == 0.0

    loss, _ = pivotrl_loss(logprobs, old, ref, adv, mask, epsilon=0.2, beta=0.1)
    (grad,) = torch.autograd.grad(loss, logprobs)
    # Only the KL term remains: ∂/∂lp_t of (β/B)·½ℓ² = (β/B)·ℓ for every token of the action.
    ell = (logprobs.detach() - ref).sum(dim=1, keepdim=True)
    torch.testing.assert_close(grad, (0.1 / 4) * ell.expand(4, 5))
    assert grad.abs().min().item() > 0.0


# --- Case 4: advantage estimators on [0, 0, 1, 3] -----------------------------------------------

SCORES = torch.tensor([[0.0, 0.0, 1.0, 3.0]], dtype=F64)


@pytest.mark.parametrize(
    "estimator, expected",
    [
        ("reinforce", [0.0, 0.0, 1.0, 3.0]),
        ("rloo", [-4 / 3, -4 / 3, 0.0, 8 / 3]),
        ("dr_grpo", [-1.0, -1.0, 0.0, 2.0]),
        ("grpo", [-0.816, -0.816, 0.0, 1.633]),
    ],
)
def test_case4_estimator_values(estimator, expected):
    adv = compute_advantages(SCORES, estimator, delta=1e-6).flatten()
    tol = 5e-4 if estimator == "grpo" else 1e-12  # the spec prints GRPO to 3 decimals
    torch.testing.assert_close(adv, torch.tensor(expected, dtype=F64), rtol=0, atol=tol)


def test_case4_grpo_exact_std():
    adv = compute_advantages(SCORES, "grpo", delta=1e-6).flatten()
    expected = torch.tensor([-1.0, -1.0, 0.0, 2.0], dtype=F64) / (math.sqrt(1.5) + 1e-6)
    torch.testing.assert_close(adv, expected, rtol=0, atol=1e-14)


def test_case4_proportionality():
    dr = compute_advantages(SCORES, "dr_grpo")
    torch.testing.assert_close(compute_advantages(SCORES, "rloo"), dr * 4 / 3, rtol=0, atol=1e-14)
    torch.testing.assert_close(
        compute_advantages(SCORES, "grpo", delta=1e-12), dr / math.sqrt(1.5), rtol=0, atol=1e-10
    )


# --- Case 5: the clip plateau ----------------------------------------------------------------------


def test_case5_clip_plateau():
    adv_value = 2 / math.sqrt(1.5)
    current = torch.tensor([0.20, 0.22, 0.26, 0.40], dtype=F64)
    logprobs = current.log()[:, None].requires_grad_()
    old_logprobs = torch.full((4, 1), math.log(0.2), dtype=F64)
    ratio, num_clamped = action_ratios(logprobs, old_logprobs, torch.ones(4, 1, dtype=torch.bool))
    torch.testing.assert_close(ratio.detach(), torch.tensor([1.0, 1.1, 1.3, 2.0], dtype=F64))
    assert num_clamped == 0

    adv = torch.full((4,), adv_value, dtype=F64)
    surrogate, high, low = clipped_surrogate(ratio, adv, 0.2)
    a = adv_value
    torch.testing.assert_close(surrogate.detach(), torch.tensor([1.0 * a, 1.1 * a, 1.2 * a, 1.2 * a], dtype=F64))
    assert surrogate[2].item() == pytest.approx(1.960, abs=5e-4)
    torch.testing.assert_close(ratio.detach() * adv, torch.tensor([1.0 * a, 1.1 * a, 1.3 * a, 2.0 * a], dtype=F64))
    assert high.tolist() == [False, False, True, True] and low.tolist() == [False] * 4

    surrogate.sum().backward()
    # On the plateau the gradient is exactly 0; below it, d(r·Â)/d log π = r·Â.
    torch.testing.assert_close(logprobs.grad.flatten()[:2], torch.tensor([1.0 * a, 1.1 * a], dtype=F64))
    assert logprobs.grad.flatten()[2:].tolist() == [0.0, 0.0]


# --- Case 6: the optimal policy π* ∝ π_ref · exp(R/β) ---------------------------------------------

REF_PROBS = torch.tensor([0.1, 0.3, 0.2, 0.2, 0.1, 0.1], dtype=F64)
ACCEPTED = torch.tensor([1.0, 1.0, 0.0, 0.0, 0.0, 0.0], dtype=F64)


def _optimal_policy(ref_probs: torch.Tensor, rewards: torch.Tensor, beta: float) -> torch.Tensor:
    w = ref_probs * torch.exp(rewards / beta)
    return w / w.sum()


def test_case6a_exact_objective_converges_to_optimal_policy():
    beta = 0.5
    logits = REF_PROBS.log().clone().requires_grad_()  # π_θ starts as a copy of π_ref
    for _ in range(300):
        pi = torch.softmax(logits, dim=0)
        kl = (pi * (pi.log() - REF_PROBS.log())).sum()  # exact reverse KL over the set
        objective = (pi * ACCEPTED).sum() - beta * kl
        (grad,) = torch.autograd.grad(objective, logits)
        with torch.no_grad():
            logits += 2.0 * grad  # plain gradient ascent
    pi = torch.softmax(logits.detach(), dim=0)
    target = _optimal_policy(REF_PROBS, ACCEPTED, beta)
    assert (pi - target).abs().max().item() < 1e-3
    # Every accepted action is scaled by e^{1/β}: their ratio is π_ref's.
    assert (pi[0] / pi[1]).item() == pytest.approx(1 / 3, rel=1e-3)


# (learning rate, steps): a fast phase (where the second update of a batch often clips), then two
# slower ones so that the end point is close to the stationary policy rather than to SGD noise.
SCHEDULE = ((2.0, 100), (0.3, 200), (0.05, 200))


def _train_sampled(beta: float, schedule=SCHEDULE, *, groups: int = 8, group_size: int = 8, seed: int = 0):
    """Train a softmax policy over 6 actions with the project's sampled loss: groups sampled from
    π_θ, GRPO advantages, clipped whole-action ratios, two updates per batch (so the clip can bind).
    Returns the final policy and the summed clip fractions."""
    torch.manual_seed(seed)
    ref_lp = REF_PROBS.float().log()
    accepted = ACCEPTED.float()
    logits = ref_lp.clone().requires_grad_()  # π_θ starts as a copy of π_ref
    mask = torch.ones(groups * group_size, 1, dtype=torch.bool)
    clipped = 0.0
    for lr, steps in schedule:
        for _ in range(steps):
            with torch.no_grad():  # π_old := π_θ, refreshed every batch
                actions = torch.multinomial(torch.softmax(logits, 0), groups * group_size, replacement=True)
                old = torch.log_softmax(logits, 0)[actions][:, None]
            adv = compute_advantages(accepted[actions].view(groups, group_size)).flatten()
            for _ in range(2):
                logprobs = torch.log_softmax(logits, 0)[actions][:, None]
                loss, metrics = pivotrl_loss(
                    logprobs, old, ref_lp[actions][:, None], adv, mask, epsilon=0.2, beta=beta
                )
                clipped += metrics["clip_frac_high"] + metrics["clip_frac_low"]
                (grad,) = torch.autograd.grad(loss, logits)
                with torch.no_grad():
                    logits -= lr * grad  # plain SGD
    return torch.softmax(logits.detach(), 0), clipped


def test_case6b_sampled_loss_raises_accepted_mass_and_keeps_their_ratio():
    pi, clipped = _train_sampled(beta=0.5)
    ref_mass = REF_PROBS[:2].sum().item()  # 0.4
    assert pi[:2].sum().item() > 0.9 > ref_mass
    ref_ratio = (REF_PROBS[0] / REF_PROBS[1]).item()
    assert abs((pi[0] / pi[1]).item() / ref_ratio - 1.0) < 0.10
    assert clipped > 0.0  # the second update of each batch does clip


def test_case6b_without_kl_the_ratio_is_not_kept():
    # Contrast: with β = 0 the policy gradient favours the likelier accepted action ("rich get richer").
    pi, _ = _train_sampled(beta=0.0, schedule=((2.0, 100),))
    ref_ratio = (REF_PROBS[0] / REF_PROBS[1]).item()
    assert (pi[0] / pi[1]).item() / ref_ratio < 0.5


# --- Case 7: whole-action ratio ---------------------------------------------------------------------


def test_case7_sequence_ratio_sums_token_log_ratios():
    d = torch.tensor([[0.1, -0.3, 0.5]], dtype=F64)
    old = torch.tensor([[-1.0, -2.0, -0.5]], dtype=F64)
    mask = torch.ones(1, 3, dtype=torch.bool)
    ratio, _ = action_ratios(old + d, old, mask)
    assert ratio.item() == pytest.approx(math.exp(0.3), abs=1e-12)  # exp(Σ d_t)
    assert abs(ratio.item() - math.exp(0.1)) > 0.2  # not exp(mean d_t)
    geo, _ = action_ratios(old + d, old, mask, ratio_type="geometric_mean")
    assert geo.item() == pytest.approx(math.exp(0.1), abs=1e-12)  # the separately named GSPO variant


# --- Case 8: the KL estimator's gradient ------------------------------------------------------------

VOCAB = 3


class TwoTokenPolicy:
    """π(x, y) = π1(x) · π2(y | x) over VOCAB² sequences; ``factorised`` makes π2 ignore x."""

    def __init__(self, seed: int, factorised: bool) -> None:
        g = torch.Generator().manual_seed(seed)
        self.factorised = factorised
        self.z1 = torch.randn(VOCAB, generator=g, dtype=F64)
        self.z2 = torch.randn(1 if factorised else VOCAB, VOCAB, generator=g, dtype=F64)

    def params(self) -> list[torch.Tensor]:
        return [self.z1, self.z2]

    def token_logprobs(self, x: int, y: int) -> torch.Tensor:
        """(1, 2) per-token log-probabilities of the sequence (x, y)."""
        row = 0 if self.factorised else x
        return torch.stack([torch.log_softmax(self.z1, 0)[x], torch.log_softmax(self.z2[row], 0)[y]])[None]

    def sequences(self) -> list[tuple[int, int]]:
        return [(x, y) for x in range(VOCAB) for y in range(VOCAB)]

    def seq_logprobs(self) -> torch.Tensor:
        return torch.cat([self.token_logprobs(x, y).sum(1) for x, y in self.sequences()])  # (V²,)


def _flat_grad(value: torch.Tensor, params: list[torch.Tensor]) -> torch.Tensor:
    return torch.cat([g.flatten() for g in torch.autograd.grad(value, params)])


def _estimator_gradients(theta: TwoTokenPolicy, ref: TwoTokenPolicy, kl_estimator: str) -> torch.Tensor:
    """(V², P) gradient of the estimator's loss term for each possible on-policy sequence."""
    params = [p.requires_grad_() for p in theta.params()]
    mask = torch.ones(1, 2, dtype=torch.bool)
    rows = []
    for x, y in theta.sequences():
        lp = theta.token_logprobs(x, y)
        ref_lp = ref.token_logprobs(x, y).detach()
        # β = 1, Â = 0: the loss is exactly this action's KL term.
        loss, _ = pivotrl_loss(lp, lp.detach(), ref_lp, torch.zeros(1, dtype=F64), mask,
                               epsilon=0.2, beta=1.0, kl_estimator=kl_estimator)
        rows.append(_flat_grad(loss, params))
    return torch.stack(rows)


def _exact_kl_gradient(theta: TwoTokenPolicy, ref: TwoTokenPolicy, direction: str) -> torch.Tensor:
    params = [p.requires_grad_() for p in theta.params()]
    lp = theta.seq_logprobs()
    ref_lp = ref.seq_logprobs().detach()
    if direction == "reverse":  # KL(π_θ ‖ π_ref)
        kl = (lp.exp() * (lp - ref_lp)).sum()
    else:  # KL(π_ref ‖ π_θ)
        kl = (ref_lp.exp() * (ref_lp - lp)).sum()
    return _flat_grad(kl, params)


def _monte_carlo(theta: TwoTokenPolicy, per_seq_grads: torch.Tensor, n: int, seed: int):
    probs = theta.seq_logprobs().detach().exp()
    g = torch.Generator().manual_seed(seed)
    idx = torch.multinomial(probs, n, replacement=True, generator=g)
    samples = per_seq_grads[idx]  # (n, P) one gradient per on-policy sample
    return samples.mean(0), samples.std(0) / math.sqrt(n), probs


@pytest.mark.parametrize("factorised", [True, False])
def test_case8_default_estimator_gradient_is_reverse_kl_gradient(factorised):
    theta, ref = TwoTokenPolicy(1, factorised), TwoTokenPolicy(2, factorised)
    grads = _estimator_gradients(theta, ref, "squared_log_ratio")
    exact = _exact_kl_gradient(theta, ref, "reverse")
    mean, se, probs = _monte_carlo(theta, grads, n=20000, seed=0)
    assert ((mean - exact).abs() <= 4 * se + 1e-12).all(), (mean, exact, se)
    # Its exact expectation over the enumerable sequence set equals the reverse-KL gradient.
    torch.testing.assert_close(probs @ grads, exact, rtol=0, atol=1e-12)
    assert exact.abs().max().item() > 0.05  # the check is not vacuous


def test_case8_per_token_k3_follows_forward_kl():
    theta, ref = TwoTokenPolicy(1, True), TwoTokenPolicy(2, True)
    grads = _estimator_gradients(theta, ref, "k3_per_token")
    reverse = _exact_kl_gradient(theta, ref, "reverse")
    forward = _exact_kl_gradient(theta, ref, "forward")
    mean, se, probs = _monte_carlo(theta, grads, n=20000, seed=0)
    assert ((mean - forward).abs() <= 4 * se + 1e-12).all()
    assert ((mean - reverse).abs() / se).max().item() > 10.0  # not the reverse-KL gradient
    torch.testing.assert_close(probs @ grads, forward, rtol=0, atol=1e-12)


def test_case8_k1_has_zero_expected_gradient():
    theta, ref = TwoTokenPolicy(1, False), TwoTokenPolicy(2, False)
    grads = _estimator_gradients(theta, ref, "k1")
    probs = theta.seq_logprobs().detach().exp()
    torch.testing.assert_close(probs @ grads, torch.zeros(grads.shape[1], dtype=F64), rtol=0, atol=1e-12)
    assert _exact_kl_gradient(theta, ref, "reverse").abs().max().item() > 0.05


def test_case8_every_registered_estimator_is_classified():
    # A new estimator must come with its own gradient test above.
    assert KL_ESTIMATORS.names() == ["k1", "k3_per_token", "squared_log_ratio"]
