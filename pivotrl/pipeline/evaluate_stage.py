"""The evaluate stage: plan → evaluate each shard → merge → report, one implementation at any scale.

The held-out tasks are cut into shards of ``scale_out.eval_shard_size`` whole tasks (sorted by id;
one shard when it is null, the one-machine run), each played from scratch by every policy on its
own (its own content key, retried on its own), plus one shard for the state-level measures; then
merged into the report. :func:`stage_evaluate` runs the three steps in one process (one engine,
kept warm across its shards); the sharded flow (``pivotrl.tasks.eval_shards``) runs the same three
functions as Prefect tasks on threads or Ray workers.

A shard covers all policies: its one engine is built on the base model and swaps weights per
policy (as the unsharded stage does), so a Ray worker keeps one engine warm across its shards;
a shard per (policy, shard) would rebuild or reload an engine for every task run. Full-task
evaluation is greedy by default and every engine seeds each prompt apart from the others, so a
task plays the same in any shard; the per-seed summaries are recomputed at the merge from the
per-task tables (:func:`pivotrl.pipeline.evaluate.full_task_runs`), as the unsharded stage does.

Artifacts (``<key>`` = a content address over the evaluation key, which covers the
demonstrations, base, π_ref, the trained policy, the evaluation/prompt/rollout/quality settings and
the code, plus the shard's task ids; the states shard adds the pivot set and probing settings):
- ``eval/shards/<key>/full_task.parquet``: one task shard's per-task rows, every (policy, seed);
- ``eval/shards/<key>/local.parquet``, ``pivots.parquet``, ``reprobe.parquet`` and, last,
  ``states.json``: the states shard (local accuracy on held-out states, stop decisions,
  out-of-domain states and the pivot set; the pivot set re-probed under the trained policy);
- ``eval/shards/by-policy/<key>/``: one policy's part of a shard (``full_task.parquet``, or the
  states tables and ``states.json``), under :func:`pivotrl.pipeline.evaluate.policy_part_key` (the
  policy's weights, the items, the evaluation settings and code; not the trained run): what a
  shard reuses of an earlier run's evaluation, e.g. the base model and π_ref after a training change;
- the merged report under ``eval/<ekey>/`` (:func:`pivotrl.pipeline.evaluate.write_report`).

The functions here are the pure pipeline; ``pivotrl.tasks.eval_shards`` wraps them as Prefect tasks.
"""

from __future__ import annotations

import json
import logging
import time
from pathlib import Path
from typing import Any, Mapping

import pandas as pd

from pivotrl.config import RunConfig
from pivotrl.bfcl.wheel import ensure_bfcl
from pivotrl.core.hashing import content_hash
from pivotrl.core.errors import StorageError
from pivotrl.runtime.models import load_tokenizer
from pivotrl.pipeline.common import close_quietly, make_verifier
from pivotrl.pipeline.demos import cache_dir
from pivotrl.pipeline.evaluate import (
    POLICIES, EvalStates, StateParts, eval_key, eval_policies, eval_result, heldout_tasks, policy_part_key,
    policy_state_results, policy_task_frames, policy_weights, reprobe_pivots, tokenizer_hash, write_report,
)
from pivotrl.pipeline.results import EvalResult, ProbeResult, ReferenceResult, TrainResult
from pivotrl.pipeline.warm_engine import close_warm_engines, shard_engine
from pivotrl.runtime.precision import with_resolved_dtype
from pivotrl.storage import ArtifactStore

log = logging.getLogger("pivotrl.pipeline")

SHARDS_PREFIX = "eval/shards"


def _typed(ref: Any, probe: Any, train: Any) -> tuple[ReferenceResult, ProbeResult, TrainResult]:
    return ReferenceResult.of(ref), ProbeResult.of(probe), TrainResult.of(train)


def plan_eval_shards(cfg: RunConfig, store: ArtifactStore, demos: Mapping[str, Any], ref: Any, probe: Any,
                     train: Any) -> dict[str, Any]:
    """Cut the held-out tasks into shards of ``scale_out.eval_shard_size`` tasks (sorted by id; null
    = one shard), then one states shard.

    Returns {"eval_key", "done" (the report exists), "shards": [{"index", "kind": "eval", "part":
    "tasks" | "states", "key", "tasks" (ids), "output" (the key written last)}]} — small JSON.
    """
    cfg = with_resolved_dtype(cfg)
    ref, probe, train = _typed(ref, probe, train)
    ekey = eval_key(cfg, demos, ref, train)
    ids = [t.id for t in heldout_tasks(cfg, store, demos)]
    size = cfg.scale_out.eval_shard_size or max(1, len(ids))
    shards = []
    for i in range(0, max(1, len(ids)), size):  # no task at all: one empty task shard (empty tables)
        part = ids[i : i + size]
        key = f"{SHARDS_PREFIX}/" + content_hash({"eval": ekey, "part": "tasks", "tasks": part})[:16]
        shards.append({"index": len(shards), "kind": "eval", "part": "tasks", "key": key, "tasks": part,
                       "output": f"{key}/full_task.parquet"})
    key = f"{SHARDS_PREFIX}/" + content_hash({"eval": ekey, "part": "states", "pivots": probe.pivots_key,
                                              "probing": cfg.probing.model_dump(mode="json")})[:16]
    shards.append({"index": len(shards), "kind": "eval", "part": "states", "key": key, "tasks": [],
                   "output": f"{key}/states.json"})
    return {"eval_key": ekey, "done": store.exists(f"{ekey}/report.json"), "shards": shards}


def _shard_out(store: ArtifactStore, shard: Mapping[str, Any]) -> dict[str, Any]:
    return {"index": shard["index"], "key": shard["key"], "part": shard["part"], "uri": store.url(shard["output"]),
            "tasks": len(shard["tasks"]), "evaluated": False, "engine_reused": False}


def cached_eval_shard(store: ArtifactStore, shard: Mapping[str, Any]) -> dict[str, Any] | None:
    """The result of :func:`eval_shard` if the shard's output (written last) exists, else None."""
    return _shard_out(store, shard) if store.exists(shard["output"]) else None


def cached_evaluate(cfg: RunConfig, store: ArtifactStore, demos: Mapping[str, Any], ref: Any,
                    train: Any) -> EvalResult | None:
    """The result of :func:`stage_evaluate` if its report exists under the stage's content key
    (:func:`~pivotrl.pipeline.evaluate.eval_key`), else None."""
    cfg = with_resolved_dtype(cfg)
    ekey = eval_key(cfg, demos, ReferenceResult.of(ref), TrainResult.of(train))
    return eval_result(store, ekey) if store.exists(f"{ekey}/report.json") else None


def eval_shard(cfg: RunConfig, store: ArtifactStore, demos: Mapping[str, Any], ref: Any, probe: Any, train: Any,
               shard: dict[str, Any], *, warm_engine: bool = False) -> dict[str, Any]:
    """Evaluate one shard (an entry of :func:`plan_eval_shards`) for every policy and write its
    tables; a shard whose output exists is not evaluated again. ``warm_engine``: keep the engine
    in this process for the next shard (Ray workers).

    Each policy's results on the shard's items are an artifact of their own under
    :func:`~pivotrl.pipeline.evaluate.policy_part_key` (the policy's weights, the items, the
    evaluation's settings and code, not the training settings): a policy whose part exists is read
    back and not evaluated again (e.g. the base model and π_ref after a change of training settings);
    a part computed now is written, then read back as a reused one is, so the shard's tables are
    the same either way. No engine is built when every policy's part exists.

    Returns {"index", "key", "part", "uri", "tasks" (count), "evaluated" (computed now),
    "engine_reused" (the warm engine of an earlier shard served this one), "policies" (name →
    {"part": its key, "computed": evaluated now, "requests": prompts the engine served for it, None
    without a generation meter, "weights": the policy's weights identity)}; ``policies`` is also
    in the output's manifest (``policy_parts``), which is the parts' lineage record.
    """
    cfg = with_resolved_dtype(cfg)
    ref, probe, train = _typed(ref, probe, train)
    hit = cached_eval_shard(store, shard)
    if hit is not None:
        return hit
    out = _shard_out(store, shard)
    t0 = time.time()
    work = _PolicyWork(cfg, store, demos, ref, probe, train, shard, warm_engine)
    frames: list[pd.DataFrame] = []
    parts = StateParts(work.states.counts() if work.states is not None else {})
    try:
        for name in work.policies:
            pkey = work.part_key(name)
            if not store.exists(f"{pkey}/{work.record}"):
                work.compute(name, pkey)
            if work.states is None:  # read back, computed now or reused: the same tables either way
                frames.append(store.read_parquet(f"{pkey}/full_task.parquet").assign(policy=name))
            else:
                mine = _read_states(store, pkey)
                parts.results[name] = next(iter(mine.results.values()))
                parts.local_frames += [f.assign(policy=name) for f in mine.local_frames]
                parts.pivot_frames += [f.assign(policy=name) for f in mine.pivot_frames]
                parts.reprobe = mine.reprobe if mine.reprobe is not None else parts.reprobe
    finally:
        work.close()
    out["engine_reused"], out["policies"] = work.engine_reused, work.done
    facts = {"shard": shard["index"], "part": shard["part"], "tasks": list(shard["tasks"]),
             "policies": sorted(work.policies), "train_key": train.train_key, "policy_parts": work.done}
    if work.states is None:
        store.write_artifact(shard["output"], pd.concat(frames, ignore_index=True), kind="eval_shard_tasks",
                             config={"evaluation": cfg.evaluation.model_dump(mode="json")}, extra=facts)
        done = f"{len(shard['tasks'])} tasks"
    else:
        _write_states(store, shard["key"], parts, cfg, facts)
        done = ", ".join(f"{v} {k.replace('_', ' ')}" for k, v in parts.counts.items()) or "no states"
    reused = [n for n, d in work.done.items() if not d["computed"]]
    log.info("evaluation shard %d (%s): %s in %.1f s%s", shard["index"], shard["part"], done, time.time() - t0,
             f" ({', '.join(reused)} reused from the store)" if reused else "")
    return {**out, "evaluated": True}


class _PolicyWork:
    """One shard's per-policy parts: their keys, and the evaluation of a policy whose part is
    missing (the engine, verifier and BFCL data made on first need)."""

    def __init__(self, cfg: RunConfig, store: ArtifactStore, demos: Mapping[str, Any], ref: ReferenceResult,
                 probe: ProbeResult, train: TrainResult, shard: Mapping[str, Any], warm: bool) -> None:
        self.cfg, self.store, self.warm = cfg, store, warm
        self.policies = eval_policies(cfg, store, ref, train)
        self.tok = load_tokenizer(self.policies["reference"])
        self.states: EvalStates | None = None
        self.tasks: list[Any] = []
        if shard["part"] == "tasks":
            by_id = {t.id: t for t in heldout_tasks(cfg, store, demos)}
            self.tasks = [by_id[i] for i in shard["tasks"]]
            items: dict[str, Any] = {"part": "tasks", "tasks": list(shard["tasks"])}
            self.record = "full_task.parquet"
        else:
            self.states = EvalStates.select(cfg, store, demos, probe)
            items = {"part": "states", "pivots": probe.pivots_key, "probing": cfg.probing.model_dump(mode="json"),
                     **{k: [s.state_id for s in getattr(self.states, k)] for k in ("local", "stop", "ood", "pivots")}}
            self.record = "states.json"
        tok_hash = tokenizer_hash(self.policies["reference"])
        self.weights = weights = policy_weights(ref, train)
        # The pivot set re-probed under the trained policy belongs to that policy's states part.
        self._keys = {name: policy_part_key(cfg, demos, ref, weights[name], {
            **items, "reprobe": self.states is not None and name == "pivotrl"}, tok_hash) for name in self.policies}
        self.done: dict[str, dict[str, Any]] = {n: {"part": k, "weights": weights[n], "computed": False,
                                                    "requests": 0} for n, k in self._keys.items()}
        self.engine: Any = None
        self.engine_reused, self._fresh = False, False
        self._verifier: Any = None
        self._bfcl: Path | None = None

    def part_key(self, name: str) -> str:
        return self._keys[name]

    def compute(self, name: str, pkey: str) -> None:
        """Evaluate policy ``name`` on the shard's items and write its part under ``pkey``."""
        from pivotrl.runtime.generation import snapshot

        cfg, mdir = self.cfg, self.policies[name]
        if self._bfcl is None:
            self._bfcl = ensure_bfcl(cache_dir(cfg))
        if self.engine is None:
            self.engine, self.engine_reused = shard_engine(cfg, self.policies["base"], self.warm, any_weights=True)
            self._fresh = not self.engine_reused  # built on the base model, nothing sampled yet
        if not (self._fresh and Path(mdir) == Path(self.policies["base"])):
            self.engine.load_weights(str(mdir))  # a warm engine holds the last shard's last policy
        self._fresh = False
        before = snapshot(self.engine)
        facts = {"policy": name, "weights": self.weights[name]}
        if self.states is None:
            df = pd.concat(policy_task_frames(cfg, self.engine, self.tok, self.tasks, self._bfcl, name),
                           ignore_index=True)
            self._note(name, before)
            self.store.write_parquet(f"{pkey}/full_task.parquet", df)
            return
        if self._verifier is None:
            self._verifier = make_verifier(cfg, self._bfcl, self.tok)
        mine = StateParts(self.states.counts())
        policy_state_results(cfg, self.engine, self.tok, self.states, self._verifier, name, mine)
        if name == "pivotrl":
            mine.reprobe = reprobe_pivots(cfg, self.engine, self.tok, self.states.pivots, self._verifier)
        self._note(name, before)
        _write_states(self.store, pkey, mine, cfg, {**facts, **self.done[name]}, manifest=False)

    def _note(self, name: str, before: Any) -> None:
        from pivotrl.runtime.generation import since

        gen = since(self.engine, before)
        self.done[name].update(computed=True, requests=None if gen is None else gen.requests)

    def close(self) -> None:
        if self.engine is not None and not self.warm:
            self.engine.close()
        close_quietly(self._verifier)


def _with_json(df: pd.DataFrame, to: Any) -> pd.DataFrame:
    # ``reasons`` holds {reason: count} dicts, which Parquet would widen into one struct.
    return df.assign(reasons=df["reasons"].map(to)) if "reasons" in df else df


def _write_states(store: ArtifactStore, key: str, parts: StateParts, cfg: RunConfig, facts: dict[str, Any], *,
                  manifest: bool = True) -> None:
    """The states shard's (or one policy's part's) tables, then ``states.json`` (its completion
    record) with a manifest; a policy's part (``manifest`` False) keeps ``facts`` in the record
    instead (the shard's manifest names its parts)."""
    store.write_parquet(f"{key}/local.parquet", _with_json(pd.concat(parts.local_frames), json.dumps))
    if parts.pivot_frames:
        store.write_parquet(f"{key}/pivots.parquet", _with_json(
            pd.concat([f.assign(_frame=i) for i, f in enumerate(parts.pivot_frames)]), json.dumps))
    if parts.reprobe is not None:
        store.write_parquet(f"{key}/reprobe.parquet", parts.reprobe)
    record = {"counts": parts.counts, "results": parts.results, "pivot_frames": len(parts.pivot_frames),
              "reprobe": parts.reprobe is not None}
    if not manifest:
        store.write_bytes(f"{key}/states.json", json.dumps({**record, "facts": facts}).encode())
        return
    store.write_artifact(f"{key}/states.json", json.dumps(record).encode(), kind="eval_shard_states",  # NaN stays NaN
                         config={"evaluation": cfg.evaluation.model_dump(mode="json")}, extra=facts)


def _read_states(store: ArtifactStore, key: str) -> StateParts:
    record = json.loads(store.read_bytes(f"{key}/states.json"))
    parts = StateParts(record["counts"], record["results"])
    parts.local_frames = [_with_json(store.read_parquet(f"{key}/local.parquet"), json.loads)]
    if record["pivot_frames"]:
        df = _with_json(store.read_parquet(f"{key}/pivots.parquet"), json.loads)
        parts.pivot_frames = [df[df["_frame"] == i].drop(columns="_frame") for i in range(record["pivot_frames"])]
    parts.reprobe = store.read_parquet(f"{key}/reprobe.parquet") if record["reprobe"] else None
    return parts


def merge_eval_shards(cfg: RunConfig, store: ArtifactStore, demos: Mapping[str, Any], ref: Any, probe: Any,
                      train: Any, plan: dict[str, Any]) -> dict[str, Any]:
    """Build the report from the shards' tables (:func:`pivotrl.pipeline.evaluate.write_report`; a
    report already written is returned as it is).

    Returns the EvalResult as a dict. Raises StorageError naming the shards without output.
    """
    cfg = with_resolved_dtype(cfg)
    ref, probe, train = _typed(ref, probe, train)
    ekey = plan["eval_key"]
    if store.exists(f"{ekey}/report.json"):
        return eval_result(store, ekey).to_dict()
    missing = [s["index"] for s in plan["shards"] if not store.exists(s["output"])]
    if missing:
        raise StorageError(f"evaluation shards {missing} have no output yet; run them before merging")
    tables = [store.read_parquet(s["output"]) for s in plan["shards"] if s["part"] == "tasks"]
    task_frames = {p: [pd.concat([t[(t["policy"] == p) & (t["seed"] == seed)] for t in tables], ignore_index=True)
                       for seed in cfg.evaluation.seeds] for p in POLICIES}
    states = next(s for s in plan["shards"] if s["part"] == "states")
    out = write_report(cfg, store, ekey, demos, ref, probe, train, heldout_tasks(cfg, store, demos), task_frames,
                       _read_states(store, states["key"]))
    return out.to_dict()


def stage_evaluate(cfg: RunConfig, store: ArtifactStore, demos: Mapping[str, Any], ref: Any, probe: Any,
                   train: Any) -> EvalResult:
    """The evaluate stage in one process: base, π_ref and the PivotRL policy with the same seeds on
    the held-out tasks from scratch and on held-out states, the pivot set and out-of-domain states
    (:func:`plan_eval_shards`, :func:`eval_shard` for each shard whose output is missing, one engine
    kept warm across them, :func:`merge_eval_shards`). A report already written is returned
    (:func:`cached_evaluate`)."""
    hit = cached_evaluate(cfg, store, demos, ref, train)
    if hit is not None:
        return hit
    plan = plan_eval_shards(cfg, store, demos, ref, probe, train)
    if not plan["done"]:
        try:
            for shard in plan["shards"]:
                eval_shard(cfg, store, demos, ref, probe, train, shard, warm_engine=True)
        finally:
            close_warm_engines()
    return EvalResult.of(merge_eval_shards(cfg, store, demos, ref, probe, train, plan))
