"""``pivotrl pivots export``: a pivot set as NeMo Gym PivotRL rows, after the checks NVIDIA's recipe
leaves to its user.

Checks, each failing with a DataError that names the pivots concerned (and the fix):

1. **More than one possible reward per pivot**: the pivot's m probe rewards under π_ref are not
   all equal (σ̂² > 0) — a pivot with one outcome gives every GRPO group a zero advantage.
2. **Online verifier = profiling verifier**: the hash of the verifier configured now (name, config
   section, verifier code) equals the one recorded in the probe table's manifest.
3. **Same chat template as at capture**: the hash of the chat template of the model to be trained
   (``model.source`` of the config, or ``--tokenizer``) and the prompt settings equals the one
   recorded when the pivots were probed.
4. **No rows sampled from the policy being trained**: every expected action is the
   demonstration's own action (the trajectory's message at that turn), and no trajectory is marked
   ``meta.sampled_from`` the model being trained or its reference.
5. **No stop decisions unless asked**: a pivot whose expected action is the demonstration's
   closing text (``candidate_kind`` "stop", kept with ``quality.include_stop_decisions``) is refused
   unless ``allow_stop_decisions`` (``--allow-stop-decisions``): NeMo Gym's default single-step
   tool-use agent compares function calls, and would read such a row as a call the model must not make.

Before any check, every input the export reads (the pivot set, the probe table, the candidate table,
the trajectories) must hash to the sha256 its manifest records: a table edited after it was written
(by hand, or half copied) is refused with a one-line DataError naming it.
"""

from __future__ import annotations

import json
from typing import Any, Mapping

from pivotrl.core.errors import DataError
from pivotrl.provenance.fingerprints import chat_template_hash, verifier_hash
from pivotrl.data.nemo import DEFAULT_AGENT, pivot_row

__all__ = ["export_pivots", "check_pivots"]

_SHOWN = 10


def _names(ids: list[str]) -> str:
    shown = ", ".join(repr(i) for i in ids[:_SHOWN])
    return shown + (f" and {len(ids) - _SHOWN} more" if len(ids) > _SHOWN else "")


def _open(uri: str) -> tuple[Any, str]:
    """(store, key) of the artifact at ``uri`` wherever it lives (its manifest sits beside it)."""
    from pivotrl.provenance.lineage import open_artifact

    return open_artifact(uri)


def _inputs(store: Any, uri: str, name: str, where: str) -> str:
    s, k = _open(uri)
    m = s.read_manifest(k)
    if name not in m.inputs:
        raise DataError(f"{where}: its manifest records no {name!r} input; re-run `pivotrl probe` to rebuild it")
    return str(m.inputs[name]["uri"])


def _verified(store: Any, key: str, what: str) -> Any:
    """The manifest of the artifact at ``key``, after checking that its bytes hash to the sha256 the
    manifest records. Raises DataError (one line) naming the artifact when they differ."""
    m = store.read_manifest(key)
    actual = store.sha256(key)
    if actual != m.sha256:
        raise DataError(f"{store.url(key)}: the {what}'s content (sha256 {actual[:12]}…) is not the one its "
                        f"manifest records ({str(m.sha256)[:12]}…): it was changed after it was written; "
                        "rebuild it (pivotrl probe) instead of editing it")
    return m


def check_pivots(store: Any, pivots_key: str, cfg: Any, tokenizer: Any,
                 allow_stop_decisions: bool = False) -> dict[str, Any]:
    """Run the checks of the module docstring on the pivot set at ``pivots_key``; returns what the
    rows need (pivots frame, probe rows by state, probe manifest, trajectories by id). Raises
    DataError: one line for an input whose content is not its manifest's, else every failed check."""
    from pivotrl.data.schema import Message
    from pivotrl.data.states import frame_to_states

    where = store.url(pivots_key)
    pm = _verified(store, pivots_key, "pivot set")
    probes_uri = _inputs(store, pm.uri, "probes", where)
    ps, pk = _open(probes_uri)
    probes_m, probes = _verified(ps, pk, "probe table"), ps.read_parquet(pk)
    by_state = {r["state_id"]: r for r in probes.to_dict("records")}
    pivots_df = store.read_parquet(pivots_key)
    states = frame_to_states(pivots_df)
    problems: list[str] = []

    one_outcome = [s.state_id for s in states
                   if len(set(json.loads(by_state.get(s.state_id, {}).get("rewards") or "[]"))) < 2]
    if one_outcome:
        problems.append(f"pivot(s) {_names(one_outcome)}: fewer than two distinct probe rewards (σ̂² = 0); "
                        "every group on them would have zero advantage. Rebuild the pivot set (pivotrl probe).")

    rec_v = probes_m.extra.get("verifier_hash")
    now_v = verifier_hash(cfg.verifier.model_dump(mode="json"))
    if rec_v != now_v:
        problems.append(f"pivot(s) {_names([s.state_id for s in states])}: profiled with verifier hash {rec_v} "
                        f"({probes_m.extra.get('verifier')}), but the online verifier "
                        f"is {cfg.verifier.name} with hash {now_v}; export with the verifier settings the "
                        "pivots were probed with, or re-probe.")

    rec_t = probes_m.extra.get("chat_template_hash")
    now_t = chat_template_hash(tokenizer, cfg.prompt.model_dump(mode="json"))
    if rec_t != now_t:
        problems.append(f"pivot(s) {_names([s.state_id for s in states])}: captured with chat template hash "
                        f"{rec_t}, but the model to be trained renders with {now_t}; the states would not be "
                        "the ones profiled. Use the same tokenizer and prompt settings, or re-probe.")

    stops = [s.state_id for s in states if (s.verifier_context or {}).get("candidate_kind") == "stop"]
    if stops and not allow_stop_decisions:
        problems.append(f"pivot(s) {_names(stops)}: stop decisions (the expected action is the demonstration's "
                        "closing text, not a call); NeMo Gym's tool-use agent compares calls. Export them only "
                        "for an agent that scores text: --allow-stop-decisions (allow_stop_decisions=True).")

    cand_uri = _inputs(store, pm.uri, "candidates", where)
    cs, ck = _open(cand_uri)
    _verified(cs, ck, "candidate table")
    traj_uri = _inputs(store, cand_uri, "trajectories", cand_uri)
    ts, tk = _open(traj_uri)
    _verified(ts, tk, "trajectory table")
    trajs = ts.read_parquet(tk)
    records = {str(i): json.loads(r) for i, r in zip(trajs["id"], trajs["record"])}
    trained = {cfg.model.source, probes_m.extra.get("reference_hash")} - {None}
    sampled: list[str] = []
    for s in states:
        rec = records.get(s.trajectory_id)
        if rec is None:
            sampled.append(s.state_id)
            continue
        turns = [m for m in rec["messages"] if m.get("role") == "assistant"]
        demo = turns[s.turn_index] if s.turn_index < len(turns) else None
        if demo is None or Message.from_dict(demo) != s.demo_action or (rec.get("meta") or {}).get("sampled_from") in trained:
            sampled.append(s.state_id)
    if sampled:
        problems.append(f"pivot(s) {_names(sampled)}: the expected action is not the demonstration's own action "
                        "(or the trajectory was sampled from the policy being trained); only expert actions may "
                        "be exported.")
    if problems:
        raise DataError(f"cannot export {where}:\n  - " + "\n  - ".join(problems))
    return {"states": states, "pivots": pivots_df, "probes": by_state, "probes_manifest": probes_m,
            "records": records, "pivots_manifest": pm}


def export_pivots(store: Any, pivots_key: str, cfg: Any, tokenizer: Any, out_url: str,
                  agent: str = DEFAULT_AGENT, allow_stop_decisions: bool = False) -> dict[str, Any]:
    """Check the pivot set at ``pivots_key`` (see the module docstring; stop-decision pivots only with
    ``allow_stop_decisions``) and write it as JSONL rows to ``out_url`` (atomically, with a manifest
    beside it). Returns ``{"uri", "rows"}``. Raises DataError."""
    c = check_pivots(store, pivots_key, cfg, tokenizer, allow_stop_decisions)
    pm, probes_m = c["pivots_manifest"], c["probes_manifest"]
    lam = (pm.config or {}).get("lambda_diff")
    rows = []
    for s in c["states"]:
        p = c["probes"][s.state_id]
        rewards = json.loads(p["rewards"])
        rec = c["records"].get(s.trajectory_id) or {}
        profiling: Mapping[str, Any] = {
            "num_probes": len(rewards), "rewards": rewards, "mean_reward": float(p["mu"]),
            "reward_variance": float(p["var"]), "lambda_diff": lam, "verifier": (probes_m.extra or {}).get("verifier"),
            "verifier_hash": probes_m.extra.get("verifier_hash"),
            "chat_template_hash": probes_m.extra.get("chat_template_hash"),
            "reference_hash": probes_m.extra.get("reference_hash"), "pivots_sha256": pm.sha256}
        rows.append(pivot_row(s, profiling, env=rec.get("env"), meta=rec.get("meta"), agent=agent))
    payload = "".join(json.dumps(r, ensure_ascii=False) + "\n" for r in rows).encode("utf-8")
    import os

    from pivotrl.storage import ArtifactStore

    parent, _, name = os.path.expanduser(out_url).rstrip("/").rpartition("/")
    if not name:
        raise DataError(f"{out_url}: not a file path (expected <directory>/<name>.jsonl)")
    m = ArtifactStore(parent or ".").write_artifact(name, payload, kind="nemo_pivot_rows", inputs={"pivots": pm.uri},
                                                    extra={"rows": len(rows), "agent": agent})
    return {"uri": m.uri, "rows": len(rows)}
