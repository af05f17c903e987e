"""Statistics for reports: intervals on rates and paired tests between policies (pure Python).

* :func:`wilson_interval` - Wilson score interval for a proportion k/n (Wilson 1927). Used for every
  rate over independent units (tasks, greedy states).
* :func:`bootstrap_mean_interval` - percentile bootstrap over units for a mean (or a ratio of sums,
  e.g. turns passed / turns over tasks), resampling whole units (tasks), seeded.
* :func:`bootstrap_difference_interval` - the same for the difference of the means of two
  independent samples (each resampled on its own).
* :func:`mcnemar_exact` - exact (binomial) McNemar test on paired binary outcomes: with b = pairs
  where only A succeeds and c = pairs where only B does, p = min(1, 2·P[X ≤ min(b, c)]),
  X ~ Binomial(b + c, 1/2); p = 1 when b + c = 0.
* :func:`paired_difference_interval` - Newcombe's hybrid score interval for the difference of two
  paired proportions (Newcombe 1998, "Improved confidence intervals for the difference between
  binomial proportions based on paired data", method 10): Wilson intervals of both rates combined
  with the phi correlation of the paired 2×2 table. Reported beside every exact McNemar test.
* :func:`paired_bootstrap` - the mean difference of per-unit values with a paired bootstrap
  interval and the two-sided p of the paired sign-flip (permutation) test, :func:`sign_flip_p`.

All intervals are two-sided at ``confidence`` (default 0.95). Empty inputs give NaN bounds.
"""

from __future__ import annotations

import math
import random
from dataclasses import dataclass
from statistics import NormalDist
from typing import Any, Sequence

from pivotrl.core.errors import ConfigError

__all__ = [
    "PAIRED_TEST",
    "PairedResult",
    "bootstrap_difference_interval",
    "bootstrap_mean_interval",
    "mcnemar_exact",
    "paired_binary",
    "paired_bootstrap",
    "paired_difference_interval",
    "sign_flip_p",
    "wilson_interval",
]


def _z(confidence: float) -> float:
    if not 0.0 < confidence < 1.0:
        raise ConfigError(f"confidence={confidence!r}: must be in (0, 1)")
    return NormalDist().inv_cdf(0.5 + confidence / 2)


def wilson_interval(k: int, n: int, confidence: float = 0.95) -> tuple[float, float]:
    """Wilson score interval ``(low, high)`` for k successes in n trials; ``(nan, nan)`` when n = 0.

    low/high = (p̂ + z²/2n ∓ z·sqrt(p̂(1-p̂)/n + z²/4n²)) / (1 + z²/n). Raises ConfigError unless
    0 ≤ k ≤ n.
    """
    if not (isinstance(k, int) and isinstance(n, int)) or k < 0 or n < 0 or k > n:
        raise ConfigError(f"wilson_interval: need integers 0 <= k <= n, got k={k!r}, n={n!r}")
    if n == 0:
        return float("nan"), float("nan")
    z = _z(confidence)
    p = k / n
    denom = 1 + z * z / n
    centre = (p + z * z / (2 * n)) / denom
    half = z * math.sqrt(p * (1 - p) / n + z * z / (4 * n * n)) / denom
    return max(0.0, centre - half), min(1.0, centre + half)


def bootstrap_mean_interval(
    values: Sequence[float],
    weights: Sequence[float] | None = None,
    *,
    n_boot: int = 2000,
    seed: int = 0,
    confidence: float = 0.95,
    proportion: bool = False,
) -> tuple[float, float, float]:
    """``(estimate, low, high)``: percentile bootstrap over units of a (weighted) mean.

    With ``weights`` the statistic is Σ values / Σ weights over the resampled units (a ratio of
    sums: pass ``turns_passed`` as values and ``n_turns`` as weights for turns passed / turns).
    Units are resampled with replacement ``n_boot`` times from ``random.Random(seed)``.

    A percentile bootstrap collapses to a zero-width interval when every unit has the same rate
    (e.g. no turn passed on any task: 0.000–0.000), which would claim certainty. With
    ``proportion=True`` (a rate: 0 ≤ value ≤ weight per unit) and every unit at the rate 0 or 1, the
    Wilson interval over the units (n = number of units, the conservative effective sample size of
    clustered data) is returned instead. Not for differences (a paired Δ of 0 everywhere keeps its
    zero-width bootstrap).
    """
    n = len(values)
    if weights is not None and len(weights) != n:
        raise ConfigError(f"bootstrap_mean_interval: {n} values but {len(weights)} weights")
    if n == 0:
        return float("nan"), float("nan"), float("nan")
    w = [1.0] * n if weights is None else [float(x) for x in weights]
    v = [float(x) for x in values]

    def stat(idx: Sequence[int]) -> float:
        den = sum(w[i] for i in idx)
        return sum(v[i] for i in idx) / den if den else float("nan")

    est = stat(range(n))
    if proportion and est in (0.0, 1.0) and all(0.0 <= v[i] <= w[i] for i in range(n)) and \
            all(w[i] == 0 or v[i] / w[i] == est for i in range(n)):
        lo, hi = wilson_interval(int(est) * n, n, confidence)
        return est, lo, hi
    rng = random.Random(seed)
    boots = sorted(s for s in (stat([rng.randrange(n) for _ in range(n)]) for _ in range(n_boot)) if s == s)
    if not boots:
        return est, float("nan"), float("nan")
    alpha = (1 - confidence) / 2
    lo = boots[min(len(boots) - 1, int(math.floor(alpha * len(boots))))]
    hi = boots[min(len(boots) - 1, int(math.ceil((1 - alpha) * len(boots))) - 1)]
    return est, lo, hi


def mcnemar_exact(b: int, c: int) -> float:
    """Two-sided exact McNemar p-value for b and c discordant pairs (see the module docstring)."""
    if b < 0 or c < 0:
        raise ConfigError(f"mcnemar_exact: counts must be >= 0, got b={b}, c={c}")
    n = b + c
    if n == 0:
        return 1.0
    tail = sum(math.comb(n, i) for i in range(min(b, c) + 1)) / 2 ** n
    return min(1.0, 2 * tail)


@dataclass(frozen=True)
class PairedResult:
    """A paired comparison of policy A against policy B on the same n units.

    ``difference`` = mean(A) - mean(B); ``low``/``high`` its interval (Newcombe's for McNemar,
    the paired bootstrap's otherwise);
    ``b``/``c`` = units where only A / only B succeeded and ``both`` where both did (McNemar only);
    ``p_value`` two-sided;
    ``test`` = "exact McNemar" or :data:`PAIRED_TEST`; ``significant`` = p < 1 - confidence.
    """

    n: int
    difference: float
    p_value: float
    test: str
    significant: bool
    low: float = float("nan")
    high: float = float("nan")
    b: int | None = None
    c: int | None = None
    both: int | None = None

    @property
    def verdict(self) -> str:
        """"A better" / "B better" when significant, else "no significant difference"."""
        if not self.significant:
            return "no significant difference"
        return "A better" if self.difference > 0 else "B better"


def paired_difference_interval(both: int, only_a: int, only_b: int, neither: int,
                               confidence: float = 0.95) -> tuple[float, float]:
    """Newcombe's interval ``(low, high)`` for p_A − p_B from a paired 2×2 table of counts (units
    where both, only A, only B, neither succeeded); ``(nan, nan)`` for no units.

    With p_A = (both + only_a)/n, p_B = (both + only_b)/n, (l_A, u_A), (l_B, u_B) their Wilson
    intervals and φ = C / sqrt(product of the four margins) (0 when a margin is empty), where
    C = both·neither − only_a·only_b, less n/2 when it exceeds n/2, 0 when between 0 and n/2:
    low = Δ − sqrt((p_A − l_A)² − 2φ(p_A − l_A)(u_B − p_B) + (u_B − p_B)²),
    high = Δ + sqrt((u_A − p_A)² − 2φ(u_A − p_A)(p_B − l_B) + (p_B − l_B)²), clipped to [−1, 1].
    """
    counts = (both, only_a, only_b, neither)
    if any(not isinstance(x, int) or x < 0 for x in counts):
        raise ConfigError(f"paired_difference_interval: counts must be integers >= 0, got {counts}")
    n = sum(counts)
    if n == 0:
        return float("nan"), float("nan")
    pa, pb = (both + only_a) / n, (both + only_b) / n
    la, ua = wilson_interval(both + only_a, n, confidence)
    lb, ub = wilson_interval(both + only_b, n, confidence)
    margins = (both + only_a) * (only_b + neither) * (both + only_b) * (only_a + neither)
    cross = both * neither - only_a * only_b  # Newcombe's φ: a positive cross term less n/2, not below 0
    cross = cross - n / 2 if cross > n / 2 else min(cross, 0)
    phi = cross / math.sqrt(margins) if margins else 0.0
    d = pa - pb
    low = d - math.sqrt(max(0.0, (pa - la) ** 2 - 2 * phi * (pa - la) * (ub - pb) + (ub - pb) ** 2))
    high = d + math.sqrt(max(0.0, (ua - pa) ** 2 - 2 * phi * (ua - pa) * (pb - lb) + (pb - lb) ** 2))
    return max(-1.0, low), min(1.0, high)


def paired_binary(a: Sequence[bool], b: Sequence[bool], confidence: float = 0.95) -> PairedResult:
    """Exact McNemar test on paired 0/1 outcomes (``a[i]``, ``b[i]`` on the same unit i), with
    Newcombe's interval on the difference (:func:`paired_difference_interval`)."""
    if len(a) != len(b):
        raise ConfigError(f"paired_binary: {len(a)} outcomes for A but {len(b)} for B (must be paired)")
    only_a = sum(1 for x, y in zip(a, b) if x and not y)
    only_b = sum(1 for x, y in zip(a, b) if y and not x)
    both = sum(1 for x, y in zip(a, b) if x and y)
    n = len(a)
    p = mcnemar_exact(only_a, only_b)
    diff = (only_a - only_b) / n if n else float("nan")
    low, high = paired_difference_interval(both, only_a, only_b, n - both - only_a - only_b, confidence)
    return PairedResult(n, diff, p, "exact McNemar", p < 1 - confidence, low=low, high=high, b=only_a, c=only_b,
                        both=both)


def sign_flip_p(d: Sequence[float], *, n_draws: int = 2000, seed: int = 0) -> float:
    """Two-sided p-value of the paired sign-flip (permutation) test of mean(d) = 0: the share of
    sign assignments of the differences whose |mean| reaches the observed |mean(d)|. Exact over
    all 2^k assignments of the k non-zero differences when k ≤ 12, else (hits + 1)/(n_draws + 1)
    over ``n_draws`` random assignments from ``random.Random(seed)``. 1 when every d is 0; with
    one unit it is 1 (the two assignments tie)."""
    nz = [float(x) for x in d if x != 0]
    if not nz:
        return 1.0
    obs = abs(sum(nz)) - 1e-12 * max(1.0, sum(abs(x) for x in nz))
    k = len(nz)
    if k <= 12:
        hits = 0
        for mask in range(1 << k):
            total = sum(-x if mask >> i & 1 else x for i, x in enumerate(nz))
            hits += abs(total) >= obs
        return hits / (1 << k)
    rng = random.Random(seed)
    hits = sum(abs(sum(x if rng.random() < 0.5 else -x for x in nz)) >= obs for _ in range(n_draws))
    return (hits + 1) / (n_draws + 1)


def paired_bootstrap(
    a: Sequence[float], b: Sequence[float], *, n_boot: int = 2000, seed: int = 0, confidence: float = 0.95
) -> PairedResult:
    """mean(a − b) over paired units: its percentile-bootstrap interval (``n_boot`` resamples of
    the units) and the sign-flip test's two-sided p (:func:`sign_flip_p`).

    No interval (NaN bounds) with fewer than two units or when every unit has the same difference:
    the bootstrap would return that one value as a zero-width interval, a certainty it does not
    have. (A bootstrap p-value was used before: it was 0 whenever every difference had the same
    sign, even for one unit.)"""
    if len(a) != len(b):
        raise ConfigError(f"paired_bootstrap: {len(a)} values for A but {len(b)} for B (must be paired)")
    d = [float(x) - float(y) for x, y in zip(a, b)]
    n = len(d)
    if n == 0:
        return PairedResult(0, float("nan"), 1.0, PAIRED_TEST, False)
    est, lo, hi = bootstrap_mean_interval(d, n_boot=n_boot, seed=seed, confidence=confidence)
    if n < 2 or all(x == d[0] for x in d):
        lo = hi = float("nan")
    p = sign_flip_p(d, n_draws=n_boot, seed=seed + 1)
    return PairedResult(n, est, p, PAIRED_TEST, p < 1 - confidence, low=lo, high=hi)


#: The name of :func:`paired_bootstrap`'s test in reports.
PAIRED_TEST = "paired sign-flip test (bootstrap interval)"


def bootstrap_difference_interval(
    a: Sequence[float], b: Sequence[float], *, n_boot: int = 2000, seed: int = 0, confidence: float = 0.95
) -> tuple[float, float, float]:
    """``(mean(a) − mean(b), low, high)`` for two independent samples (e.g. the training steps of the
    last and the first quarter of a run): a percentile bootstrap that resamples ``a`` and ``b``
    separately, ``n_boot`` times from ``random.Random(seed)``.

    NaN bounds when either sample has fewer than two units, or when every unit of both samples has
    the same value (the bootstrap would return a zero-width interval, a certainty it does not have);
    NaN for everything when either sample is empty.
    """
    va, vb = [float(x) for x in a], [float(x) for x in b]
    if not va or not vb:
        return float("nan"), float("nan"), float("nan")
    est = sum(va) / len(va) - sum(vb) / len(vb)
    if len(va) < 2 or len(vb) < 2 or len(set(va) | set(vb)) == 1:
        return est, float("nan"), float("nan")
    _z(confidence)  # validates confidence
    rng = random.Random(seed)
    boots = sorted(sum(rng.choice(va) for _ in va) / len(va) - sum(rng.choice(vb) for _ in vb) / len(vb)
                   for _ in range(n_boot))
    alpha = (1 - confidence) / 2
    lo = boots[min(n_boot - 1, int(math.floor(alpha * n_boot)))]
    hi = boots[min(n_boot - 1, int(math.ceil((1 - alpha) * n_boot)) - 1)]
    return est, lo, hi


def finite_or_none(x: Any) -> float | None:
    """``x`` as a float when it is a finite number, else None (text, None, NaN, ±inf)."""
    try:
        v = float(x)
    except (TypeError, ValueError):
        return None
    return v if math.isfinite(v) else None
