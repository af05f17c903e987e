"""Sharded probing: the pivot-candidate states cut into shards by trajectory, each probed on its own
(its own content key, retried on its own), then merged into the same probe table and pivot set as
one unsharded probing run.

A shard holds whole trajectories, so an engine's prefix cache sees every turn of a trajectory
together. Each state's m samples are seeded by (``probing.seed``, state id) (see
:func:`pivotrl.pipeline.probe.state_seed`), so a state probes the same in any shard, batch or
worker, and the merged table equals the unsharded one.

Artifacts:
- ``probes/shards/<key>/probes.parquet``: the probe rows of one shard (the probe table's columns),
  written only once every state of the shard is decided. ``<key>`` is the content address of the
  shard's candidate rows and of everything else a probe table depends on (reference, probing,
  verifier, prompt, engine settings, code): a trajectory probed on an earlier night is not probed
  again, whichever shard it falls into... as long as the shard holds the same trajectories.
- ``probes/shards/<key>/partial.parquet``: the decided rows of a shard that could not finish (a
  tool environment kept failing); the next attempt probes only the other states.
- the merged ``probes/<pkey>/probes.parquet`` and the pivot set, exactly as
  :func:`pivotrl.pipeline.probe.stage_probe` writes them (which then filters them).

The functions here are the pure pipeline; ``pivotrl.tasks.shards`` wraps them as Prefect tasks.
"""

from __future__ import annotations

import hashlib
import logging
import time
from pathlib import Path
from typing import Any

import pandas as pd

from pivotrl.config import RunConfig
from pivotrl.errors import VerifierError
from pivotrl.pipeline.results import ReferenceResult
from pivotrl.storage import ArtifactStore

log = logging.getLogger("pivotrl.pipeline")

SHARDS_PREFIX = "probes/shards"


class ShardIncomplete(VerifierError):
    """A shard ended with states its verifier could not decide (tool executions kept failing).

    ``state_ids``: those states. Transient: a retry (or the next run) probes exactly those again.
    """

    def __init__(self, message: str, state_ids: list[str] | tuple[str, ...] = ()) -> None:
        super().__init__(message)
        self.state_ids = list(state_ids)

    def __reduce__(self) -> tuple[Any, ...]:  # crosses process boundaries (Ray workers) intact
        return (type(self), (str(self), self.state_ids))


def merged_probe_key(cfg: RunConfig, store: ArtifactStore, demos: dict[str, Any], ref: dict[str, Any]) -> str:
    """The key of the whole probe table (``probes/<16 hex>``), the one ``stage_probe`` uses."""
    from pivotrl.pipeline.probe import probe_table_key

    return probe_table_key(cfg, store.read_manifest(f"{demos['key']}/candidates.parquet").sha256, ref)


def _selected(cfg: RunConfig, store: ArtifactStore, demos: dict[str, Any]) -> pd.DataFrame:
    from pivotrl.pipeline.probe import select_candidates

    return select_candidates(store.read_parquet(f"{demos['key']}/candidates.parquet"), "pivot",
                             cfg.probing.max_states, cfg.probing.seed)


def plan_probe_shards(cfg: RunConfig, store: ArtifactStore, demos: dict[str, Any],
                      ref: dict[str, Any]) -> dict[str, Any]:
    """Cut the selected pivot candidates into shards of ``scale_out.probe_shard_size`` trajectories
    (sorted by trajectory id; null = one shard).

    Returns {"probes_key", "done" (the merged table exists), "shards": [{"index", "key",
    "trajectories", "states"}]} — small JSON, one entry per shard.
    """
    from pivotrl.pipeline.probe import probe_table_key

    pkey = merged_probe_key(cfg, store, demos, ref)
    cand = _selected(cfg, store, demos)
    trajs = sorted(cand["trajectory_id"].astype(str).unique())
    size = cfg.scale_out.probe_shard_size or max(1, len(trajs))
    shards = []
    for i in range(0, len(trajs), size):
        part = trajs[i : i + size]
        rows = cand[cand["trajectory_id"].astype(str).isin(part)]
        digest = hashlib.sha256(rows.to_json(orient="records").encode()).hexdigest()
        key = probe_table_key(cfg, digest, ref).replace("probes/", f"{SHARDS_PREFIX}/", 1)
        shards.append({"index": len(shards), "key": key, "trajectories": part, "states": int(len(rows))})
    return {"probes_key": pkey, "done": store.exists(f"{pkey}/probes.parquet"), "shards": shards}


# One warm engine per worker process (a Ray worker probes many shards): (model dir, settings) → engine.
_WARM: dict[str, Any] = {}
# Keys of warm engines that hold other weights than their model dir's (an evaluation shard swapped them).
_SWAPPED: set[str] = set()


def shard_engine(cfg: RunConfig, model_dir: Path, warm: bool, *, any_weights: bool = False) -> tuple[Any, bool]:
    """``(engine, reused)``: the rollout engine on ``model_dir``; with ``warm``, the one this process
    keeps for its shards (built on first use; an engine on another model is closed first).

    ``any_weights``: the caller loads the weights it needs itself (evaluation shards swap policies),
    so a warm engine built on ``model_dir`` is reused whatever it holds, and is marked as holding
    other weights; without it such an engine is rebuilt (a probe shard never sees swapped weights).
    """
    from pivotrl.pipeline.common import make_rollout_engine

    if not warm:
        return make_rollout_engine(cfg, model_dir), False
    key = f"{Path(model_dir).resolve()}|{cfg.rollout.engine, cfg.rollout.max_tokens, cfg.model.dtype, cfg.model.max_context}|{cfg.rollout.kv_cache_gib}"
    if key in _WARM and (any_weights or key not in _SWAPPED):
        if any_weights:
            _SWAPPED.add(key)
        return _WARM[key], True
    for old in _WARM.values():  # a new reference: free the old engine first
        old.close()
    _WARM.clear()
    _SWAPPED.clear()
    _WARM[key] = make_rollout_engine(cfg, model_dir)
    if any_weights:
        _SWAPPED.add(key)
    return _WARM[key], False


def _verifier(cfg: RunConfig, bfcl_root: Path, *, fail_tools: bool) -> Any:
    """The run's verifier; ``fail_tools``: one whose every tool execution fails (the
    ``faults.tool_failure_trajectories`` drill; a real worker death per request)."""
    from pivotrl.faults import FaultInjector, fault_seed
    from pivotrl.pipeline.common import make_verifier
    from pivotrl.verifiers import get_verifier

    if not fail_tools:
        return make_verifier(cfg, bfcl_root)
    return get_verifier(cfg.verifier.name, timeout_s=cfg.verifier.timeout_s, retries=cfg.verifier.retries,
                        bfcl_root=str(bfcl_root), backoff_s=0.05,
                        faults=FaultInjector(1.0, 0.0, fault_seed(cfg.run.seed, "tools-drill")))


def probe_shard(cfg: RunConfig, store: ArtifactStore, demos: dict[str, Any], ref: dict[str, Any],
                shard: dict[str, Any], *, warm_engine: bool = False) -> dict[str, Any]:
    """Probe the states of one shard (an entry of :func:`plan_probe_shards`) and write its table.

    A shard already written is not probed again; of a shard that failed before, only the states
    it could not decide are. ``warm_engine``: keep the engine in this process for the next shard.
    Returns {"index", "key", "uri", "states", "probed" (states probed now), "engine_reused" (the
    warm engine of an earlier shard served this one), "status_counts"}.
    Raises ShardIncomplete naming the states whose verifier failed after its retries (the decided
    rows are kept in ``partial.parquet``, the undecided ids in ``failed.json``).
    """
    from pivotrl.data.bfcl import ensure_bfcl
    from pivotrl.data.states import frame_to_states
    from pivotrl.models import load_tokenizer
    from pivotrl.pipeline.common import prompt_kwargs, sampling_for
    from pivotrl.pipeline.demos import cache_dir, read_histories
    from pivotrl.pipeline.probe import PROBE_COLUMNS, probe_states
    from pivotrl.pipeline.reference import reference_dir

    key = shard["key"]
    out = {"index": shard["index"], "key": key, "uri": store.url(f"{key}/probes.parquet"), "probed": 0,
           "engine_reused": False}
    if store.exists(f"{key}/probes.parquet"):
        df = store.read_parquet(f"{key}/probes.parquet")
        return {**out, "states": int(len(df)), "status_counts": _counts(df)}
    cand = _selected(cfg, store, demos)
    cand = cand[cand["trajectory_id"].astype(str).isin(shard["trajectories"])].reset_index(drop=True)
    done = store.read_parquet(f"{key}/partial.parquet") if store.exists(f"{key}/partial.parquet") else None
    decided = set(done["state_id"]) if done is not None else set()
    todo = frame_to_states(cand[~cand["state_id"].isin(decided)], read_histories(store, demos["key"], shard["trajectories"]))
    frames = [done] if done is not None else []
    if todo:
        rdir = reference_dir(cfg, store, ref)
        tok = load_tokenizer(rdir)
        bfcl_root = ensure_bfcl(cache_dir(cfg))
        engine, out["engine_reused"] = shard_engine(cfg, rdir, warm_engine)
        drill = set(cfg.faults.tool_failure_trajectories)
        sampling = sampling_for(cfg, n=cfg.probing.num_probes, temperature=cfg.probing.temperature,
                                seed=cfg.probing.seed, top_p=cfg.probing.top_p, top_k=cfg.probing.top_k)
        t0 = time.time()
        try:
            for fail_tools in (False, True):
                group = [s for s in todo if (s.trajectory_id in drill) == fail_tools]
                if not group:
                    continue
                verifier = _verifier(cfg, bfcl_root, fail_tools=fail_tools)
                try:
                    frames.append(probe_states(
                        engine, tok, group, verifier, num_probes=cfg.probing.num_probes, sampling=sampling,
                        max_context=cfg.model.max_context, max_tokens=cfg.rollout.max_tokens,
                        prompt_kwargs=prompt_kwargs(cfg), progress=False))
                finally:
                    close = getattr(verifier, "close", None)
                    if callable(close):
                        close()
        finally:
            if not warm_engine:
                engine.close()
        log.info("probe shard %d: %d states in %.1f s", shard["index"], len(todo), time.time() - t0)
    order = {sid: i for i, sid in enumerate(cand["state_id"])}
    df = pd.concat([f for f in frames if len(f)], ignore_index=True) if any(len(f) for f in frames) \
        else pd.DataFrame(columns=PROBE_COLUMNS)
    df = df.sort_values("state_id", key=lambda c: c.map(order)).reset_index(drop=True)[PROBE_COLUMNS]
    failed = df[df["status"] == "verifier_error"]
    out["probed"] = len(todo)
    if len(failed):
        store.write_parquet(f"{key}/partial.parquet", df[df["status"] != "verifier_error"])
        ids = list(failed["state_id"])
        msg = (f"probe shard {shard['index']} ({key}): the verifier could not decide {len(ids)} of {len(df)} states "
               f"after {cfg.verifier.retries} retries (tool executions kept failing): {', '.join(ids)}. "
               f"Running the flow again probes exactly these states.")
        store.write_json(f"{key}/failed.json", {"state_ids": ids, "message": msg})
        raise ShardIncomplete(msg, ids)
    store.write_artifact(f"{key}/probes.parquet", df, kind="probe_shard",
                         inputs={"candidates": store.url(f"{demos['key']}/candidates.parquet")},
                         config={"probing": cfg.probing.model_dump(mode="json", exclude={"lambda_diff"})},
                         extra={"shard": shard["index"], "trajectories": shard["trajectories"],
                                "reference_hash": ReferenceResult.of(ref).ref_hash})
    for leftover in ("partial.parquet", "failed.json"):
        if store.exists(f"{key}/{leftover}"):
            store.delete(f"{key}/{leftover}")
    return {**out, "states": int(len(df)), "status_counts": _counts(df)}


def shard_failure(store: ArtifactStore, shard: dict[str, Any]) -> ShardIncomplete | None:
    """The ShardIncomplete of a shard's last failed attempt (from its ``failed.json``), else None."""
    if not store.exists(f"{shard['key']}/failed.json"):
        return None
    d = store.read_json(f"{shard['key']}/failed.json")
    return ShardIncomplete(d["message"], d["state_ids"])


def _counts(df: pd.DataFrame) -> dict[str, int]:
    return {str(k): int(v) for k, v in df["status"].value_counts().sort_index().items()}


def merge_probe_shards(cfg: RunConfig, store: ArtifactStore, demos: dict[str, Any], ref: dict[str, Any],
                       plan: dict[str, Any], shards: list[dict[str, Any]]) -> dict[str, Any]:
    """Concatenate the shard tables (in the unsharded table's state order) into the run's probe
    table, then select the pivot set as :func:`~pivotrl.pipeline.probe.stage_probe` does.

    Returns stage_probe's result as a dict (``ProbeResult.to_dict``). Raises VerifierError if a shard's table is missing.
    """
    from pivotrl.pipeline.probe import stage_probe

    rr = ReferenceResult.of(ref)
    pkey = plan["probes_key"]
    if not store.exists(f"{pkey}/probes.parquet"):
        missing = [s["index"] for s in plan["shards"] if not store.exists(f"{s['key']}/probes.parquet")]
        if missing:
            raise VerifierError(f"probe shards {missing} have no table yet; run them before merging")
        cand = _selected(cfg, store, demos)
        order = {sid: i for i, sid in enumerate(cand["state_id"])}
        frames = [store.read_parquet(f"{s['key']}/probes.parquet") for s in plan["shards"]]
        df = pd.concat(frames, ignore_index=True) if frames else pd.DataFrame()
        df = df.sort_values("state_id", key=lambda c: c.map(order)).reset_index(drop=True)
        store.write_artifact(
            f"{pkey}/probes.parquet", df, kind="probes",
            inputs={"candidates": store.url(f"{demos['key']}/candidates.parquet"),
                    "reference": store.url(rr.ref_key) if rr.ref_key else f"{cfg.model.source}#{rr.base_hash}",
                    **{f"shard-{s['index']}": store.url(f"{s['key']}/probes.parquet") for s in plan["shards"]}},
            config={**{k: getattr(cfg, k).model_dump(mode="json") for k in ("verifier", "prompt", "rollout", "model")},
                    "probing": cfg.probing.model_dump(mode="json", exclude={"lambda_diff"})},
            extra={"seed": cfg.probing.seed, "reference_hash": rr.ref_hash, "verifier": cfg.verifier.name,
                   "shards": len(plan["shards"])},
        )
    out = stage_probe(cfg, store, demos, ref)  # finds the table: filters only
    if out.probes_key != pkey:  # pragma: no cover - the two keys are built from the same settings
        raise RuntimeError(f"probe key mismatch: {out.probes_key} != {pkey}")
    return out.to_dict()
