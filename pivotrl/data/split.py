"""Seeded, stable split of demonstrations into warm-start (SFT), pivot (RL) and held-out sets.

Each trajectory is placed by a hash of ``(seed, category, id)`` alone: ``u = sha256(...) / 2**256``
in ``[0, 1)`` falls into one of the intervals ``[0, f_w)``, ``[f_w, f_w + f_p)``, ``[f_w + f_p, 1)``.
Consequences:

* adding or removing trajectories never moves any other trajectory to another side;
* a trajectory id is on exactly one side (duplicate ids are rejected);
* every category is split on its own with the same fractions (stratified in expectation: the
  per-category counts follow a binomial law around ``n · f``, e.g. 400 records at 0.2 → 80 ± 8).
"""

from __future__ import annotations

import hashlib
import math
from typing import Sequence

from pivotrl.data.schema import Trajectory
from pivotrl.core.errors import ConfigError, DataError

__all__ = ["SPLIT_NAMES", "split_trajectories", "split_of"]

#: The three sides, in the order of ``fractions``.
SPLIT_NAMES: tuple[str, str, str] = ("warm_start", "pivot", "heldout")


def _check_fractions(fractions: Sequence[float]) -> tuple[float, float, float]:
    if len(fractions) != 3:
        raise ConfigError(f"fractions={tuple(fractions)!r}: need three values (warm_start, pivot, heldout)")
    fr = tuple(float(f) for f in fractions)
    if any(not math.isfinite(f) or f < 0 for f in fr) or abs(sum(fr) - 1.0) > 1e-9:
        raise ConfigError(f"fractions={fr!r}: must be non-negative and sum to 1")
    return fr  # type: ignore[return-value]


def _unit(seed: int, category: str, trajectory_id: str) -> float:
    digest = hashlib.sha256(f"{seed}\x1f{category}\x1f{trajectory_id}".encode("utf-8")).digest()
    return int.from_bytes(digest[:8], "big") / 2.0**64


def split_of(trajectory: Trajectory, fractions: Sequence[float], seed: int) -> str:
    """The side (one of :data:`SPLIT_NAMES`) of one trajectory; ConfigError for bad fractions."""
    fr = _check_fractions(fractions)
    u = _unit(seed, trajectory.category, trajectory.id)
    side = 0 if u < fr[0] else 1 if u < fr[0] + fr[1] else 2
    while fr[side] == 0.0:  # rounding of the sum may leave a sliver for an empty side
        side -= 1
    return SPLIT_NAMES[side]


def split_trajectories(
    trajs: Sequence[Trajectory],
    fractions: Sequence[float] = (0.5, 0.3, 0.2),
    seed: int = 0,
) -> dict[str, list[Trajectory]]:
    """Split trajectories into ``{"warm_start": [...], "pivot": [...], "heldout": [...]}``.

    ``fractions`` (warm_start, pivot, heldout) are non-negative and sum to 1. Each list keeps the
    input order. Raises ConfigError for bad fractions, DataError for a duplicate trajectory id.
    """
    fr = _check_fractions(fractions)
    out: dict[str, list[Trajectory]] = {name: [] for name in SPLIT_NAMES}
    seen: set[str] = set()
    for t in trajs:
        if t.id in seen:
            raise DataError(f"trajectory {t.id!r}: duplicate id (a trajectory must be on one side only)")
        seen.add(t.id)
        out[split_of(t, fr, seed)].append(t)
    return out
