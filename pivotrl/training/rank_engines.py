"""Where the rollout engines of training live, and one step's rollout and refresh across them.

``rollout.engine_placement`` (:func:`engine_host_ranks`):

* ``rank0`` (default): rank 0 owns the engine (or an ``EnginePool`` of ``rollout.num_engines``,
  :mod:`pivotrl.rollout.pool`) and the verifier, samples and scores the whole batch, and
  broadcasts its groups; the other ranks wait for it.
* ``node``: one engine on each node's first rank (ranks 0, L, 2L, … for L ranks per node).
* ``ranks``: one engine on every ``rollout.ranks_per_engine``-th rank (ranks 0, N, 2N, …).

With engines on several ranks (the *host ranks* h_0 < h_1 < …, E of them) a step is:

1. **Rollout** (:func:`rollout_step`). Host j samples and scores block j of the batch positions
   (:func:`pivotrl.rollout.pool.split_positions`: contiguous, sizes within one), seeding each state
   by its position in the whole batch, so the samples are those one engine would draw for the whole
   batch. Every host has its own verifier. The hosts' groups are all-gathered and concatenated in
   host order, which is batch order: every rank trains on the same global batch, and no rank waits
   on one engine for all rollouts.
2. **Refresh** (:func:`refresh_step`). After the update every host writes its weights into its own
   shared-memory block (``rollout.weight_sync: memory``, ``shared_weights(writers=hosts)``) or its own
   HF export on its own disk (``disk``, ``export_hf(..., writers=hosts)``): a node never reads another
   node's memory or files; it reloads its engine from there. The next batch checks the refresh (each
   host's groups carry its index, ``Group.engine``, and the step's all-reduced metrics the mismatch
   per engine, ``pivotrl.training.loop``); after the last step each host scores the check actions
   with its engine against the trainer's log-probs, and the per-engine deltas are all-gathered, so
   every rank sees every engine's check and raises together.

Collectives go through ``torch.distributed`` object collectives (pickled Python objects: token ids,
rewards, verifier results); with one process nothing is sent. Pure of the pipeline: no Prefect,
no engine backend imported here.
"""

from __future__ import annotations

import logging
import os
import time
from dataclasses import dataclass, field
from typing import Any, Mapping, Sequence

from pivotrl.core.errors import ConfigError
from pivotrl.rollout.pool import refresh_delta, split_positions
from pivotrl.training.checkpoints import broadcast

log = logging.getLogger("pivotrl.training")

__all__ = ["Batch", "all_gather", "engine_host_ranks", "local_world_size", "refresh_delta", "refresh_step", "reload",
           "rollout_batch", "rollout_step"]

PLACEMENTS = ("rank0", "node", "ranks")


def local_world_size(env: Mapping[str, str] | None = None, default: int = 1) -> int:
    """Ranks on this node: ``LOCAL_WORLD_SIZE`` (torchrun), else ``LOCAL_SIZE`` (the DeepSpeed
    launcher), else ``default`` (the config's ``training.nproc_per_node``)."""
    env = os.environ if env is None else env
    for key in ("LOCAL_WORLD_SIZE", "LOCAL_SIZE"):
        if str(env.get(key, "")).isdigit() and int(env[key]) > 0:
            return int(env[key])
    return int(default)


def engine_host_ranks(placement: str, world: int, local_world: int, ranks_per_engine: int = 1) -> list[int]:
    """The ranks that own a rollout engine, ascending: ``[0]`` for ``rank0``; every
    ``local_world``-th rank for ``node``; every ``ranks_per_engine``-th rank for ``ranks``.

    Raises ConfigError for an unknown placement, or when the span does not divide the world size
    (or, for ``ranks``, the ranks of a node: an engine's ranks share one node).
    """
    if placement not in PLACEMENTS:
        raise ConfigError(f"rollout.engine_placement must be one of {', '.join(PLACEMENTS)}, got {placement!r}")
    if placement == "rank0" or world <= 1:
        return [0]
    span = local_world if placement == "node" else ranks_per_engine
    if span < 1 or world % span:
        raise ConfigError(f"rollout.engine_placement={placement}: an engine every {span} ranks does not divide "
                          f"the {world} trainer ranks")
    if placement == "ranks" and local_world % span:
        raise ConfigError(f"rollout.ranks_per_engine={span} does not divide the {local_world} ranks of a node: "
                          "an engine's ranks must share one node")
    return list(range(0, world, span))


def all_gather(obj: Any, world: int) -> list[Any]:
    """Every rank's ``obj``, in rank order, on every rank (``[obj]`` with one process)."""
    if world == 1:
        return [obj]
    import torch.distributed as dist

    out: list[Any] = [None] * world
    dist.all_gather_object(out, obj)
    return out


@dataclass
class Batch:
    """One step's rollouts: the trainer's groups, the groups dropped (undecided), the verifier's
    retries, and on rank 0 ``scored`` = ``[(state_id, generations, verifier results)]``."""

    groups: list = field(default_factory=list)
    dropped: int = 0
    retries: int = 0
    scored: list = field(default_factory=list)


def rollout_batch(engine: Any, verifier: Any, pivots: Sequence[Any], prompts: Sequence[list[int]], idx: list[int],
                  cfg: Any, step: int, positions: list[int] | None = None, engine_index: int | None = None) -> Batch:
    """Sample K = ``training.group_size`` actions of at most ``rollout.max_tokens`` at each pivot of
    ``idx`` (temperature 1, seed ``run.seed * 100_003 + step``; ``cfg`` the run's RunConfig), score
    them, and build the trainer's groups. ``positions``: the pivots' positions in the whole batch,
    when this engine samples a block of it. Each group's ``engine`` is the engine that sampled it:
    ``engine_index`` when given (a host rank's engine), else its block of a pool
    (:func:`~pivotrl.rollout.pool.split_positions`), else 0. A pivot the verifier cannot decide is
    dropped and counted (pivotrl.rollout.scoring)."""
    from pivotrl.rollout.base import SamplingConfig
    from pivotrl.rollout.scoring import sample_and_score, verifier_retries
    from pivotrl.training.pivotrl import Group

    sampling = SamplingConfig(n=cfg.training.group_size, temperature=1.0, top_p=1.0, top_k=0,
                              max_tokens=cfg.rollout.max_tokens, seed=cfg.run.seed * 100_003 + step)
    batch = Batch()
    retries0 = verifier_retries(verifier)
    n_engines = len(getattr(engine, "engines", ())) or 1
    owner = {p: j for j, block in enumerate(split_positions(len(idx), n_engines)) for p in block}
    for pos, g in enumerate(sample_and_score(engine, verifier, [pivots[i] for i in idx], [prompts[i] for i in idx],
                                             sampling, positions=positions)):
        if not g.decided:  # the whole group is dropped: never advantages from a partial group
            batch.dropped += 1
            log.warning("dropping pivot %s at step %d: %s", g.state.state_id, step, g.error)
            continue
        batch.groups.append(Group(state_id=g.state.state_id, prompt_ids=g.prompt_ids,
                                  actions=[list(x.token_ids) for x in g.samples], rewards=g.rewards,
                                  sampler_logprobs=_sampler_logprobs(g.samples),
                                  engine=owner[pos] if engine_index is None else engine_index))
        batch.scored.append((g.state.state_id, g.samples, g.results))
    batch.retries = verifier_retries(verifier) - retries0
    return batch


def _sampler_logprobs(samples: Sequence[Any]) -> list[list[float]] | None:
    """The engine's per-token log-probs of each sample (None unless one per token of every sample)."""
    out = [list(x.rollout_logprobs) for x in samples]
    return out if all(len(lp) == len(x.token_ids) for lp, x in zip(out, samples)) else None


def rollout_step(engine: Any, verifier: Any, pivots: Sequence[Any], prompts: Sequence[list[int]], idx: list[int],
                 cfg: Any, step: int, *, rank: int, world: int, hosts: Sequence[int] = (0,)
                 ) -> tuple[Batch, list[int]]:
    """The batch ``idx`` rolled out on the host ranks' engines → (the merged :class:`Batch` on every
    rank, ``scored`` filled on rank 0 only; states each engine sampled at, engine order).

    ``hosts == [0]``: rank 0's engine (or pool) rolls out everything and broadcasts; the per-engine
    counts are a pool's (empty for one engine). Otherwise host j rolls out block j (see the module
    docstring) and the blocks are all-gathered.
    """
    hosts = list(hosts)
    if hosts == [0]:
        batch = rollout_batch(engine, verifier, pivots, prompts, idx, cfg, step) if rank == 0 else Batch()
        served = [len(b) if idx else 0 for b in getattr(engine, "served", [])] if rank == 0 else []
        groups, dropped, retries, served = broadcast((batch.groups, batch.dropped, batch.retries, served), world)
        return Batch(groups, dropped, retries, batch.scored), served
    blocks = split_positions(len(idx), len(hosts))
    part = Batch()
    if rank in hosts:
        block = list(blocks[hosts.index(rank)])
        if block:
            part = rollout_batch(engine, verifier, pivots, prompts, [idx[i] for i in block], cfg, step,
                                 positions=block, engine_index=hosts.index(rank))
    parts = all_gather(part, world)
    mine = [parts[h] for h in hosts]
    merged = Batch(groups=[g for p in mine for g in p.groups], dropped=sum(p.dropped for p in mine),
                   retries=sum(p.retries for p in mine),
                   scored=[s for p in mine for s in p.scored] if rank == 0 else [])
    return merged, [len(b) for b in blocks]


def reload(engine: Any, source: Any) -> None:
    """Give ``engine`` new weights from ``source``: an HF export directory (``load_weights``, the
    ``disk`` path) or a shared-memory block ``(name, metadata)`` (``update_weights``, the ``memory``
    path, :mod:`pivotrl.rollout.weight_sync`)."""
    if isinstance(source, (str, os.PathLike)):
        engine.load_weights(str(source))
    else:
        block, meta = source
        engine.update_weights(block, meta)


def refresh_step(engine: Any, export_dir: Any, prompt: list[int] | None, actions: Sequence[list[int]],
                 trainer_lps: Sequence[Sequence[float]], *, rank: int, world: int, hosts: Sequence[int] = (0,),
                 timing: dict[str, float] | None = None
                 ) -> tuple[float, float, list[tuple[float, float] | None]]:
    """Reload every engine from ``export_dir`` (each host its own export there; or, for
    ``rollout.weight_sync: memory``, its shared-memory block ``(name, metadata)``: :func:`reload`)
    and check it on ``actions`` after ``prompt`` against the trainer's ``trainer_lps``
    (:func:`refresh_delta`); ``timing["reload_s"]`` receives this rank's reload seconds →
    ``(max |Δ|, max mean |Δ| over the engines, per-engine (max, mean) or None without an action)``
    on every rank. The per-engine list is empty for one engine on rank 0 (``hosts == [0]`` and no
    pool). The caller raises on a failed check (``pivotrl.training.refresh_check.check_refresh``)."""
    hosts = list(hosts)
    per_engine: list[tuple[float, float] | None] = []
    d_max = d_mean = 0.0
    if hosts == [0]:
        if rank == 0:
            t0 = time.perf_counter()
            reload(engine, export_dir)
            if timing is not None:
                timing["reload_s"] = time.perf_counter() - t0
            if hasattr(engine, "refresh_deltas") and len(getattr(engine, "engines", ())) > 1:
                per_engine = engine.refresh_deltas(prompt, actions, trainer_lps)
                d_max = max((d[0] for d in per_engine if d), default=0.0)
                d_mean = max((d[1] for d in per_engine if d), default=0.0)
            else:
                d_max, d_mean = refresh_delta(engine, prompt, actions, trainer_lps)
        return broadcast((d_max, d_mean, per_engine), world)
    mine: tuple[float, float] | None = None
    if rank in hosts:
        t0 = time.perf_counter()
        reload(engine, export_dir)
        if timing is not None:
            timing["reload_s"] = time.perf_counter() - t0
        mine = refresh_delta(engine, prompt, actions, trainer_lps) if any(actions) else None
    gathered = all_gather(mine, world)
    per_engine = [gathered[h] for h in hosts]
    d_max = max((d[0] for d in per_engine if d), default=0.0)
    d_mean = max((d[1] for d in per_engine if d), default=0.0)
    return d_max, d_mean, per_engine
