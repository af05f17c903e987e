"""The trainer's unit of data: one pivot state, its K sampled actions and their verifier rewards."""

from __future__ import annotations

import json
import math
import os
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Mapping, Sequence

from pivotrl.core.errors import DataError

__all__ = ["Group", "check_groups", "read_batches"]


@dataclass(frozen=True)
class Group:
    """One pivot state and the K actions sampled from π_old there, with their verifier rewards."""

    state_id: str
    prompt_ids: list[int]  # (P,) the rendered state, ending with the assistant generation header
    actions: list[list[int]]  # K × (T_i,) action token ids, each ending with the end-of-turn token
    rewards: list[float]  # (K,) R(s, a_i) from the verifier
    # (K,) precomputed Â_i, or None (computed from ``rewards`` with the advantage estimator). Set by
    # callers whose advantage is not a group statistic of this state, e.g. end-to-end RL, where every
    # model call of an episode carries the episode's group-normalised advantage (pivotrl.training.e2e);
    # such a group may hold any number ≥ 1 of actions.
    advantages: list[float] | None = None
    # K × (T_i,) the rollout engine's log-probs of each action's tokens (temperature 1, the sampler's
    # own numbers), or None: for the sampler–trainer mismatch metrics and ``training.tis_cap``.
    sampler_logprobs: list[list[float]] | None = None
    # Which rollout engine sampled the actions: its index in a pool, or the host rank's index among
    # the engine-owning ranks (pivotrl.training.rank_engines); 0 with one engine. The refresh check
    # reads the sampler–trainer mismatch per engine (pivotrl.training.loop).
    engine: int = 0

    def to_dict(self) -> dict[str, Any]:
        """JSON-able dict with the fields (the record format of a batches file)."""
        d = asdict(self)
        for optional in ("advantages", "sampler_logprobs"):
            if d[optional] is None:
                del d[optional]
        if not d["engine"]:
            del d["engine"]
        return d

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> Group:
        """Build from a JSON-like mapping; DataError naming the missing key."""
        try:
            return cls(
                state_id=str(d["state_id"]),
                prompt_ids=[int(x) for x in d["prompt_ids"]],
                actions=[[int(x) for x in a] for a in d["actions"]],
                rewards=[float(x) for x in d["rewards"]],
                advantages=None if d.get("advantages") is None else [float(x) for x in d["advantages"]],
                sampler_logprobs=None if d.get("sampler_logprobs") is None
                else [[float(x) for x in a] for a in d["sampler_logprobs"]],
                engine=int(d.get("engine", 0)),
            )
        except KeyError as err:
            raise DataError(f"group record {d.get('state_id', '?')!r} lacks key {err}") from None


def read_batches(path: str | os.PathLike[str]) -> list[list[Group]]:
    """Read a JSON Lines file of ``{"groups": [...]}`` batches; DataError naming the line."""
    batches = []
    for n, line in enumerate(Path(path).read_text().splitlines(), start=1):
        if not line.strip():
            continue
        try:
            rec = json.loads(line)
            batches.append([Group.from_dict(g) for g in rec["groups"]])
        except (json.JSONDecodeError, KeyError, TypeError) as err:
            raise DataError(f"{path}:{n}: not a batch record ({err})") from None
    return batches


def check_groups(groups: Sequence[Group], group_size: int) -> None:
    """DataError naming the group unless every group is well formed: K = ``group_size`` actions and
    rewards (or matching precomputed advantages), a non-empty prompt, non-empty actions, finite values."""
    k = group_size
    if len(groups) == 0:
        raise DataError("train_step needs at least one group")
    for g in groups:
        if g.advantages is not None:
            if not (len(g.actions) == len(g.rewards) == len(g.advantages) >= 1):
                raise DataError(
                    f"group {g.state_id!r}: {len(g.actions)} actions, {len(g.rewards)} rewards and "
                    f"{len(g.advantages)} advantages; with precomputed advantages all three must match (>= 1)"
                )
            if not all(math.isfinite(a) for a in g.advantages):
                raise DataError(f"group {g.state_id!r}: advantages must be finite, got {g.advantages}")
        elif len(g.actions) != k or len(g.rewards) != k:
            raise DataError(
                f"group {g.state_id!r}: {len(g.actions)} actions and {len(g.rewards)} rewards, "
                f"expected group_size={k} of each"
            )
        if len(g.prompt_ids) == 0:
            raise DataError(f"group {g.state_id!r}: prompt_ids is empty")
        for i, a in enumerate(g.actions):
            if len(a) == 0:
                raise DataError(f"group {g.state_id!r}: action {i} has no tokens")
            if g.sampler_logprobs is not None and (len(g.sampler_logprobs) != len(g.actions)
                                                   or len(g.sampler_logprobs[i]) != len(a)):
                raise DataError(f"group {g.state_id!r}: action {i} has {len(a)} tokens but its sampler log-probs "
                                "do not match (one per token of every action)")
        if not all(math.isfinite(r) for r in g.rewards):
            raise DataError(f"group {g.state_id!r}: rewards must be finite, got {g.rewards}")
