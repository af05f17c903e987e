"""The probe stage: plan → probe each shard → merge → pivot set, one implementation at any scale.

The pivot-candidate states (:func:`probe_candidates`: the pivot split, the candidate kinds of
``quality.include_stop_decisions``, at most ``probing.max_states``) are cut into shards of
``scale_out.probe_shard_size`` whole trajectories — one shard when it is null, which is the
one-machine run — each probed on its own (:func:`probe_shard`: its own content key, retried on
its own), then merged into the run's probe table and filtered into the pivot set
(:func:`merge_probe_shards`). :func:`stage_probe` runs the three steps in one process; the
sharded flow (``pivotrl.tasks.shards``) runs the same three functions as Prefect tasks, a shard per
task run, on threads or Ray workers. Each state's m samples are seeded by (``probing.seed``,
state id) (:func:`pivotrl.pipeline.probe.state_seed`) and every shard builds its verifier with
:func:`pivotrl.pipeline.common.make_verifier` (the run's tool-call parser), so a state probes the
same in any shard, batch or worker, and the merged table is the same whatever the shard size.

Artifacts:
- ``probes/shards/<key>/probes.parquet``: the probe rows of one shard (the probe table's columns),
  written only once every state of the shard is decided. ``<key>`` is the content address of the
  shard's candidate rows and of everything else a probe table depends on (reference, probing,
  verifier, prompt, engine settings, code).
- ``probes/shards/<key>/partial.parquet`` and ``failed.json``: the decided rows of a shard that
  could not finish (a tool environment kept failing) and the undecided state ids; the next attempt
  probes only those states.
- ``probes/<pkey>/probes.parquet``: the merged probe table; ``pivots/<pkey>-<λ>/pivots.parquet``,
  ``stats.json`` and ``summary.md``: the pivot set (see :mod:`pivotrl.pipeline.probe`).
"""

from __future__ import annotations

import hashlib
import logging
import time
from typing import Any, Mapping

import pandas as pd

from pivotrl.config import RunConfig
from pivotrl.bfcl.wheel import ensure_bfcl
from pivotrl.data.states import candidate_kinds_for_pivots, expand_candidates, frame_to_states
from pivotrl.core.errors import VerifierError
from pivotrl.provenance.fingerprints import capture_hashes
from pivotrl.runtime.models import load_tokenizer
from pivotrl.pipeline.common import close_quietly, make_verifier, prompt_kwargs, sampling_for
from pivotrl.pipeline.demos import cache_dir, read_histories
from pivotrl.pipeline.probe import (
    PROBE_COLUMNS, apply_pivot_filter, pivot_set_key, pivot_stats, probe_states, probe_table_key, select_candidates,
    stats_markdown,
)
from pivotrl.pipeline.reference import reference_dir
from pivotrl.pipeline.results import ProbeResult, ReferenceResult
from pivotrl.pipeline.warm_engine import shard_engine
from pivotrl.runtime.precision import with_resolved_dtype
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


def probe_candidates(cfg: RunConfig, store: ArtifactStore, demos: Mapping[str, Any],
                     table: pd.DataFrame | None = None) -> pd.DataFrame:
    """The candidate rows this run probes: the pivot split, of the candidate kinds
    ``quality.include_stop_decisions`` admits, a seeded sample of ``probing.max_states`` (sorted by
    state id). Every shard and the merge select with this one function. ``table``: the demonstrations'
    ``candidates.parquet`` already read (:func:`stage_probe` reads it once), else it is read here."""
    table = table if table is not None else store.read_parquet(f"{demos['key']}/candidates.parquet")
    return select_candidates(table, "pivot",
                             cfg.probing.max_states, cfg.probing.seed,
                             kinds=candidate_kinds_for_pivots(cfg.quality.include_stop_decisions))


def merged_probe_key(cfg: RunConfig, store: ArtifactStore, demos: Mapping[str, Any], ref: Any) -> str:
    """The key of the whole probe table (``probes/<16 hex>``): :func:`probe_table_key` of the
    candidates table's content hash."""
    return probe_table_key(cfg, store.read_manifest(f"{demos['key']}/candidates.parquet").sha256, ref)


def plan_probe_shards(cfg: RunConfig, store: ArtifactStore, demos: Mapping[str, Any], ref: Any, *,
                      candidates: pd.DataFrame | None = None) -> dict[str, Any]:
    """Cut the selected pivot candidates into shards of ``scale_out.probe_shard_size`` trajectories
    (sorted by trajectory id; null = one shard).

    Returns {"probes_key", "done" (the merged table exists), "shards": [{"index", "key",
    "trajectories", "states"}]} — small JSON, one entry per shard.
    """
    cfg = with_resolved_dtype(cfg)
    pkey = merged_probe_key(cfg, store, demos, ref)
    cand = probe_candidates(cfg, store, demos, candidates)
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


def cached_probe_shard(store: ArtifactStore, shard: Mapping[str, Any]) -> dict[str, Any] | None:
    """The result of :func:`probe_shard` if the shard's table exists under its content key, else None."""
    key = shard["key"]
    if not store.exists(f"{key}/probes.parquet"):
        return None
    df = store.read_parquet(f"{key}/probes.parquet")
    return {"index": shard["index"], "key": key, "uri": store.url(f"{key}/probes.parquet"), "probed": 0,
            "engine_reused": False, "states": int(len(df)), "status_counts": _counts(df)}


def probe_shard(cfg: RunConfig, store: ArtifactStore, demos: Mapping[str, Any], ref: Any,
                shard: Mapping[str, Any], *, warm_engine: bool = False,
                candidates: pd.DataFrame | None = None) -> dict[str, Any]:
    """Probe the states of one shard (an entry of :func:`plan_probe_shards`) and write its table.

    A shard already written is not probed again; of a shard that failed before, only the states
    it could not decide are. ``warm_engine``: keep the engine in this process for the next shard.
    Returns {"index", "key", "uri", "states", "probed" (states probed now), "engine_reused" (the
    warm engine of an earlier shard served this one), "status_counts"}.
    Raises ShardIncomplete naming the states whose verifier failed after its retries (the decided
    rows are kept in ``partial.parquet``, the undecided ids in ``failed.json``).
    """
    cfg = with_resolved_dtype(cfg)
    key = shard["key"]
    out = {"index": shard["index"], "key": key, "uri": store.url(f"{key}/probes.parquet"), "probed": 0,
           "engine_reused": False}
    hit = cached_probe_shard(store, shard)
    if hit is not None:
        return hit
    cand = probe_candidates(cfg, store, demos, candidates)
    cand = cand[cand["trajectory_id"].astype(str).isin(shard["trajectories"])].reset_index(drop=True)
    done = store.read_parquet(f"{key}/partial.parquet") if store.exists(f"{key}/partial.parquet") else None
    decided = set(done["state_id"]) if done is not None else set()
    todo = frame_to_states(cand[~cand["state_id"].isin(decided)], read_histories(store, demos["key"], shard["trajectories"]))
    frames = [done] if done is not None else []
    wall_s = 0.0
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
                verifier = make_verifier(cfg, bfcl_root, tok, fail_tools=fail_tools)
                try:
                    frames.append(probe_states(
                        engine, tok, group, verifier, num_probes=cfg.probing.num_probes, sampling=sampling,
                        max_context=cfg.model.max_context, max_tokens=cfg.rollout.max_tokens,
                        prompt_kwargs=prompt_kwargs(cfg), progress=cfg.scale_out.probe_shard_size is None,
                        cache_dir=str(cfg.run.local_cache())))
                finally:
                    close_quietly(verifier)
        finally:
            if not warm_engine:
                engine.close()
        wall_s = time.time() - t0
        log.info("probe shard %d: %d states in %.1f s", shard["index"], len(todo), wall_s)
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
                         extra={"shard": shard["index"], "trajectories": list(shard["trajectories"]),
                                "wall_s": round(wall_s, 2),
                                "reference_hash": ReferenceResult.of(ref).ref_hash})
    for leftover in ("partial.parquet", "failed.json"):
        if store.exists(f"{key}/{leftover}"):
            store.delete(f"{key}/{leftover}")
    return {**out, "states": int(len(df)), "status_counts": _counts(df)}


def shard_failure(store: ArtifactStore, shard: Mapping[str, Any]) -> ShardIncomplete | None:
    """The ShardIncomplete of a shard's last failed attempt (from its ``failed.json``), else None."""
    if not store.exists(f"{shard['key']}/failed.json"):
        return None
    d = store.read_json(f"{shard['key']}/failed.json")
    return ShardIncomplete(d["message"], d["state_ids"])


def _counts(df: pd.DataFrame) -> dict[str, int]:
    return {str(k): int(v) for k, v in df["status"].value_counts().sort_index().items()}


def merge_probe_shards(cfg: RunConfig, store: ArtifactStore, demos: Mapping[str, Any], ref: Any,
                       plan: Mapping[str, Any], *, candidates: pd.DataFrame | None = None) -> ProbeResult:
    """Concatenate the shard tables (in the selection's state order) into the run's probe table
    (unless it exists), then select the pivot set with ``probing.lambda_diff`` (unless it exists).

    Raises VerifierError if a shard's table is missing.
    """
    cfg = with_resolved_dtype(cfg)
    rr = ReferenceResult.of(ref)
    pkey = plan["probes_key"]
    cand_uri = store.url(f"{demos['key']}/candidates.parquet")
    if not store.exists(f"{pkey}/probes.parquet"):
        missing = [s["index"] for s in plan["shards"] if not store.exists(f"{s['key']}/probes.parquet")]
        if missing:
            raise VerifierError(f"probe shards {missing} have no table yet; run them before merging")
        cand = probe_candidates(cfg, store, demos, candidates)
        order = {sid: i for i, sid in enumerate(cand["state_id"])}
        frames = [store.read_parquet(f"{s['key']}/probes.parquet") for s in plan["shards"]]
        df = pd.concat(frames, ignore_index=True) if frames else pd.DataFrame(columns=PROBE_COLUMNS)
        df = df.sort_values("state_id", key=lambda c: c.map(order)).reset_index(drop=True)[PROBE_COLUMNS]
        shard_manifests = [store.read_manifest(f"{s['key']}/probes.parquet") for s in plan["shards"]]
        tok = load_tokenizer(reference_dir(cfg, store, rr))
        store.write_artifact(
            f"{pkey}/probes.parquet", df, kind="probes",
            inputs={"candidates": cand_uri,
                    "reference": store.url(rr.ref_key) if rr.ref_key else f"{cfg.model.source}#{rr.base_hash}",
                    **{f"shard-{s['index']}": store.url(f"{s['key']}/probes.parquet") for s in plan["shards"]}},
            # λ_diff is not part of the probe table's identity (changing it only re-filters).
            config={**{k: getattr(cfg, k).model_dump(mode="json") for k in ("verifier", "prompt", "rollout", "model")},
                    "probing": cfg.probing.model_dump(mode="json", exclude={"lambda_diff"})},
            extra={"seed": cfg.probing.seed, "reference_hash": rr.ref_hash, "verifier": cfg.verifier.name,
                   "prompt_format": rr.prompt_format, "shards": len(plan["shards"]),
                   "wall_s": round(sum(float(m.extra.get("wall_s", 0.0)) for m in shard_manifests), 2),
                   **capture_hashes(cfg, tok)},
        )
    return select_pivot_set(cfg, store, demos, rr, pkey, candidates=candidates)


def select_pivot_set(cfg: RunConfig, store: ArtifactStore, demos: Mapping[str, Any], ref: ReferenceResult,
                     pkey: str, *, candidates: pd.DataFrame | None = None) -> ProbeResult:
    """Apply the pivot rule (σ̂² > 0 and μ̂ < ``probing.lambda_diff``) to the probe table under
    ``pkey`` and write the pivot set, its statistics and summary (unless they exist)."""
    lam = cfg.probing.lambda_diff
    vkey = pivot_set_key(pkey, lam)
    probes_uri = store.url(f"{pkey}/probes.parquet")
    if not store.exists(f"{vkey}/pivots.parquet"):
        df = apply_pivot_filter(store.read_parquet(f"{pkey}/probes.parquet"), lam)
        stats = pivot_stats(df, lam)
        cand = candidates if candidates is not None else store.read_parquet(f"{demos['key']}/candidates.parquet")
        kept = df[df["decision"] == "kept"][["state_id", "mu", "var"]]
        pivots = cand.merge(kept, on="state_id", how="inner").sort_values("state_id").reset_index(drop=True)
        pivots = expand_candidates(pivots, read_histories(store, demos["key"], pivots["trajectory_id"]))
        store.write_json(f"{vkey}/stats.json", stats)
        store.write_text(f"{vkey}/summary.md", stats_markdown(stats))
        store.write_artifact(
            f"{vkey}/pivots.parquet", pivots, kind="pivots",
            inputs={"probes": probes_uri, "candidates": store.url(f"{demos['key']}/candidates.parquet")},
            config={"lambda_diff": lam, "probing": cfg.probing.model_dump(mode="json")},
            extra={"reference_hash": ref.ref_hash, "verifier": cfg.verifier.name, "num_pivots": len(pivots),
                   "prompt_format": ref.prompt_format},
        )
    return _probe_result(store, pkey, vkey)


def _probe_result(store: ArtifactStore, pkey: str, vkey: str) -> ProbeResult:
    return ProbeResult(pkey, store.url(f"{pkey}/probes.parquet"), vkey, store.url(f"{vkey}/pivots.parquet"),
                       store.read_json(f"{vkey}/stats.json"), store.read_text(f"{vkey}/summary.md"))


def cached_probe(cfg: RunConfig, store: ArtifactStore, demos: Mapping[str, Any], ref: Any) -> ProbeResult | None:
    """The result of :func:`stage_probe` if the probe table and the pivot set exist under their
    content keys (:func:`~pivotrl.pipeline.probe.probe_table_key`, that key and λ_diff), else None.
    Reads the candidates' manifest, the pivot set's statistics and summary only."""
    cfg = with_resolved_dtype(cfg)
    pkey = merged_probe_key(cfg, store, demos, ref)
    vkey = pivot_set_key(pkey, cfg.probing.lambda_diff)
    if store.exists(f"{pkey}/probes.parquet") and store.exists(f"{vkey}/pivots.parquet"):  # written last
        return _probe_result(store, pkey, vkey)
    return None


def stage_probe(cfg: RunConfig, store: ArtifactStore, demos: Mapping[str, Any], ref: Any) -> ProbeResult:
    """The probe stage in one process: :func:`plan_probe_shards`, :func:`probe_shard` for each
    shard whose table is missing, :func:`merge_probe_shards`. The probe table is reused under its
    content key (:func:`pivotrl.pipeline.probe.probe_table_key`), the pivot set under that key and
    λ_diff. The demonstrations' candidate table is read once and passed to the three steps."""
    hit = cached_probe(cfg, store, demos, ref)
    if hit is not None:
        return hit
    table = store.read_parquet(f"{demos['key']}/candidates.parquet")
    plan = plan_probe_shards(cfg, store, demos, ref, candidates=table)
    if not plan["done"]:
        for shard in plan["shards"]:
            probe_shard(cfg, store, demos, ref, shard, candidates=table)
    return merge_probe_shards(cfg, store, demos, ref, plan, candidates=table)


__all__ = ["SHARDS_PREFIX", "ShardIncomplete", "cached_probe", "cached_probe_shard", "merge_probe_shards",
           "plan_probe_shards", "probe_candidates", "probe_shard", "select_pivot_set", "shard_failure", "stage_probe"]
