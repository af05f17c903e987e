"""Stage 1: demonstrations → trajectories, split, turn-state candidates.

Outputs (under ``demos/<key>/``):
- ``trajectories.parquet``: one row per trajectory (id, source, category, split, record JSON);
- ``quarantine.jsonl``: skipped invalid records (only when ``data.on_invalid = "quarantine"``);
- ``flagged.jsonl``: tasks the data audit flagged (``pivotrl.data.audit``: failing gold calls,
  no-op gold calls, replays that do not reproduce, turns that do not reach BFCL's ground truth,
  gold values the history does not hold, gold text that contradicts what it says it is; counted
  by kind in ``counts["flags_by_kind"]``, :func:`flag_kind`), one ``{"id", "category", "flags"}``
  per line (only when some are); unless ``quality.keep_flagged`` they get the split "flagged", so
  no warm start, pivot or evaluation ever sees them;
- ``candidates.parquet``: one row per assistant turn, with its split, in the candidates form of
  ``pivotrl.data.states`` (``history_len`` refers to the trajectory's messages in
  ``trajectories.parquet``; no history is copied per state, so the table, and the memory of this
  stage, grow linearly with a trajectory's length). :func:`read_histories` gives the messages
  that ``frame_to_states`` and ``expand_candidates`` need to rebuild states from it.
"""

from __future__ import annotations

import json
import logging
import os
from collections import Counter
from pathlib import Path
from typing import Any

import pandas as pd

from pivotrl.config import RunConfig
from pivotrl.data.schema import Message, Trajectory
from pivotrl.core.hashing import canonical_json, content_hash
from pivotrl.core.errors import DataError, StorageError
from pivotrl.storage import ArtifactStore

DATA_FORMAT_VERSION = 2  # 2: candidates refer to their trajectory's history (history_len)


log = logging.getLogger(__name__)


def cache_dir(cfg: RunConfig) -> Path:
    """The local download/conversion cache (env ``PIVOTRL_CACHE_DIR`` overrides the config)."""
    return cfg.run.local_cache()


def demos_key(cfg: RunConfig) -> str:
    """Content address of the demonstration artifacts: data section, the identity (size, mtime,
    ETag) of every demonstration file, format version, and the loaders' and environments' code."""
    from pivotrl.provenance.code_digest import stage_code_digest
    from pivotrl.provenance.fingerprints import inputs_fingerprint

    # The files behind the URLs count, not just the URLs: a demonstration file replaced in place
    # gives a new key.
    return "demos/" + content_hash(
        {"data": cfg.data.model_dump(mode="json"), "files": inputs_fingerprint(cfg)["data"],
         "version": DATA_FORMAT_VERSION, "keep_flagged": cfg.quality.keep_flagged,
         "code": stage_code_digest("demonstrations")}
    )[:16]


#: What a record without a category is counted under (``counts``, ``pivotrl demos --lengths``).
NO_CATEGORY = "(none)"


def category_name(category: Any) -> str:
    """The name a category is counted under: :data:`NO_CATEGORY` for a record without one."""
    return str(category) if category not in (None, "") else NO_CATEGORY


#: The kinds of audit flags, in the order ``counts["flags_by_kind"]`` lists them.
FLAG_KINDS = ("failing_call", "no_op", "not_reproduced", "not_ground_truth", "not_in_history", "not_tool_output",
              "not_user_quote", "not_dictated", "not_included")


def flag_kind(flag: str) -> str:
    """The kind of one audit flag (:mod:`pivotrl.data.audit`): ``failing_call`` (an error or failure
    status), ``no_op`` (a gold call that changes nothing where it should), ``not_reproduced`` (a
    second replay differs), ``not_ground_truth`` (a turn whose replay does not reach the state or
    outputs of BFCL's checker on the ground truth), ``not_in_history`` (a gold value the history
    does not hold), or a gold text that contradicts what it says it is (:mod:`pivotrl.data.claims`):
    ``not_tool_output``, ``not_user_quote``, ``not_dictated``, ``not_included``."""
    from pivotrl.data import claims
    from pivotrl.data.audit import GROUND_TRUTH_MARK, NOT_IN_HISTORY_MARK

    if ": no-op: " in flag:
        return "no_op"
    if flag.startswith("replay does not reproduce"):
        return "not_reproduced"
    if GROUND_TRUTH_MARK in flag:
        return "not_ground_truth"
    if NOT_IN_HISTORY_MARK in flag:
        return "not_in_history"
    for kind, mark in (("not_tool_output", claims.NOT_TOOL_OUTPUT_MARK), ("not_user_quote", claims.NOT_USER_QUOTE_MARK),
                       ("not_dictated", claims.NOT_DICTATED_MARK), ("not_included", claims.NOT_INCLUDED_MARK)):
        if mark in flag:
            return kind
    return "failing_call"


def flag_kinds(flagged: list[Any]) -> dict[str, int]:
    """How many audit flags of ``flagged`` trajectories are of each kind (:func:`flag_kind`)."""
    from pivotrl.data.audit import AUDIT_FLAGS_KEY

    kinds = Counter(flag_kind(f) for t in flagged for f in t.meta[AUDIT_FLAGS_KEY])
    return {k: kinds.get(k, 0) for k in FLAG_KINDS}


def bad_records(quarantine: list[dict[str, Any]]) -> int:
    """How many entries of ``quarantine`` are bad records: its notes (``"note": true``, one for each
    source that gave no trajectory, e.g. "data.sources[0] (a.parquet) gave no trajectories: ...")
    are not counted."""
    return sum(1 for q in quarantine if not q.get("note"))


def load_sources(cfg: RunConfig, quarantine: list[dict[str, Any]],
                 origins: dict[str, str] | None = None) -> list[Trajectory]:
    """Load every configured source; invalid records raise or go to ``quarantine``. ``origins``,
    when given, gets each trajectory id's source (``"data.sources[<i>] (<url or categories>)"``).

    A source that gives no trajectory (all its records bad, none at all, a file that cannot be read,
    a table without a required column) raises DataError; with ``data.on_invalid: quarantine`` it is
    a note in ``quarantine`` instead (``"record": "source"``, ``"note": true``, the reason as its
    ``error``) and the other sources go on. DataError naming every such source when none is left.
    """
    from pivotrl.core.retry import is_transient

    trajs: list[Trajectory] = []
    lost: list[str] = []
    for i, src in enumerate(cfg.data.sources):
        before, why = len(quarantine), ""
        name = f"bfcl categories {', '.join(src.categories)}" if src.kind == "bfcl" else src.url
        try:
            got = _load_source(cfg, src, quarantine)
        except (DataError, StorageError) as e:  # the source as a whole: unreadable, a column missing …
            if cfg.data.on_invalid != "quarantine" or is_transient(e):  # a retry may read it
                raise
            got, why = [], str(e)
        if not got:
            bad = bad_records(quarantine[before:])
            first = quarantine[before].get("error", "") if bad else ""
            why = why or (f"all {bad} records were invalid; the first: {first}" if bad else "the source is empty")
            problem = f"data.sources[{i}] ({name}) gave no trajectories: {why}"
            if cfg.data.on_invalid != "quarantine":
                raise DataError(problem)
            log.warning("%s", problem)  # reported (counts, quarantine.jsonl), not fatal
            quarantine.append({"source": name, "record": "source", "id": "", "field": "source", "note": True,
                               "error": problem})
            lost.append(problem)
            continue
        trajs += got
        if origins is not None:
            origins.update({t.id: f"data.sources[{i}] ({name})" for t in got})
    if not trajs:
        n_bad = bad_records(quarantine)
        head = (f"data.sources: nothing to train on, every source was quarantined ({n_bad} bad "
                f"record{'s' if n_bad != 1 else ''} in the quarantine)")
        raise DataError(f"{head}: {lost[0]}" if len(lost) == 1 else head + "\n  - " + "\n  - ".join(lost))
    seen: set[str] = set()
    for t in trajs:
        if t.id in seen:
            raise DataError(f"trajectory id {t.id!r} appears in more than one record")
        seen.add(t.id)
    return trajs


def _load_source(cfg: RunConfig, src: Any, quarantine: list[dict[str, Any]]) -> list[Trajectory]:
    from pivotrl.data.audit import audit_parser
    from pivotrl.bfcl.data import load_bfcl
    from pivotrl.data.sources import load_trajectories

    if src.kind == "bfcl":
        return load_bfcl(src.categories, cache_dir(cfg), limit_per_category=src.limit_per_category,
                         on_invalid=cfg.data.on_invalid, quarantine=quarantine)
    return load_trajectories(src.url, on_invalid=cfg.data.on_invalid, quarantine=quarantine,
                             tool_parser=audit_parser(cfg.prompt.tool_parser))


def cached_demonstrations(cfg: RunConfig, store: ArtifactStore) -> dict[str, Any] | None:
    """The result of :func:`build_demonstrations` if its artifacts exist under their content key
    (the candidates table and the counts, written last), else None. Reads only ``counts.json``."""
    key = demos_key(cfg)
    if store.exists(f"{key}/candidates.parquet") and store.exists(f"{key}/counts.json"):
        return _result(store, key, store.read_json(f"{key}/counts.json"))
    return None


def build_demonstrations(cfg: RunConfig, store: ArtifactStore) -> dict[str, Any]:
    """Load, validate, split and extract candidates; write the three artifacts.

    Returns ``{"key", "trajectories", "candidates", "quarantine", "counts"}`` (URIs and counts).
    Reuses the artifacts if they already exist under the content-addressed key.
    """
    from pivotrl.data.audit import AUDIT_FLAGS_KEY, is_flagged
    from pivotrl.data.split import split_trajectories
    from pivotrl.data.states import candidates_frame, extract_turn_states
    from pivotrl.data.text_rules import candidate_kind

    key = demos_key(cfg)
    hit = cached_demonstrations(cfg, store)
    if hit is not None:
        return hit

    quarantine: list[dict[str, Any]] = []
    origins: dict[str, str] = {}
    trajs = load_sources(cfg, quarantine, origins)
    sp = cfg.data.split
    n_bad = bad_records(quarantine)
    splits = split_trajectories(trajs, (sp.warm_start, sp.pivot, sp.heldout), sp.seed)
    split_of = {t.id: name for name, ts in splits.items() for t in ts}
    flagged = [t for t in trajs if is_flagged(t)]
    if not cfg.quality.keep_flagged:
        split_of.update({t.id: "flagged" for t in flagged})

    traj_df = pd.DataFrame(
        {
            "id": [t.id for t in trajs],
            "source": [t.source for t in trajs],
            "category": [t.category for t in trajs],
            "split": [split_of[t.id] for t in trajs],
            "record": [_record_json(t, origins.get(t.id, "")) for t in trajs],
        }
    )
    states: list[Any] = []
    too_long = 0
    for t in trajs:
        kept, skipped = _fitting_states(t, extract_turn_states(t), cfg.model.max_context)
        states += kept
        too_long += skipped
    cand_df = candidates_frame(states)
    cand_df["split"] = [split_of[s.trajectory_id] for s in states]
    kinds = [candidate_kind(s) for s in states]

    counts = {
        "trajectories": len(trajs),
        "trajectories_per_split": dict(Counter(split_of.values())),
        "trajectories_per_category": dict(Counter(category_name(t.category) for t in trajs)),
        "user_turns": sum(1 for t in trajs for m in t.messages if m.role == "user"),
        "assistant_turns": len(states) + too_long,
        # States whose history has more messages than model.max_context has tokens: they can never
        # fit (every message renders to at least one token), so they are not stored or probed.
        "skipped_too_long": too_long,
        "candidates_per_category": dict(Counter(category_name(s.category) for s in states)),
        "candidates_per_split": dict(Counter(cand_df["split"])),
        "quarantined": n_bad,  # bad records only (a source's note is no record)
        "quarantined_sources": len(quarantine) - n_bad,  # sources that gave no trajectory (quarantine mode)
        "flagged": len(flagged),
        "flagged_ids": sorted(t.id for t in flagged),
        "flagged_kept": bool(cfg.quality.keep_flagged),
        "flags_by_kind": flag_kinds(flagged),
        "candidates_per_kind": dict(Counter(kinds)),
        "text_turns_skipped_no_rule": kinds.count("text_no_rule"),
    }
    config = {"data": cfg.data.model_dump(mode="json")}
    inputs = {f"source[{i}]": _source_uri(s) for i, s in enumerate(cfg.data.sources)}
    store.write_artifact(f"{key}/trajectories.parquet", traj_df, kind="trajectories", inputs=inputs, config=config,
                         extra={"seed": sp.seed})
    if quarantine:
        payload = "".join(json.dumps(q, ensure_ascii=False, default=str) + "\n" for q in quarantine).encode()
        store.write_artifact(f"{key}/quarantine.jsonl", payload, kind="quarantine", inputs=inputs, config=config)
    if flagged:
        payload = "".join(json.dumps({"id": t.id, "category": t.category, "flags": t.meta[AUDIT_FLAGS_KEY]},
                                     ensure_ascii=False) + "\n" for t in flagged).encode()
        store.write_artifact(f"{key}/flagged.jsonl", payload, kind="flagged", inputs=inputs, config=config,
                             extra={"kept": bool(cfg.quality.keep_flagged)})
    store.write_artifact(
        f"{key}/candidates.parquet", cand_df, kind="candidates",
        inputs={"trajectories": store.url(f"{key}/trajectories.parquet")}, config=config, extra={"seed": sp.seed},
    )
    store.write_json(f"{key}/counts.json", counts)
    # As a later run reads them back from counts.json (write_json sorts keys): one order either way.
    return _result(store, key, json.loads(json.dumps(counts, sort_keys=True)))


def _record_json(traj: Trajectory, origin: str) -> str:
    """The trajectory table's ``record`` cell; DataError naming the record and its source if it
    passes ``pivotrl.data.sources.MAX_RECORD_BYTES`` (a record the loader could not measure before
    reading it: nested Parquet values, BFCL)."""
    from pivotrl.data.sources import MAX_RECORD_BYTES

    text = canonical_json(traj.to_dict())
    if len(text) > MAX_RECORD_BYTES:
        raise DataError(
            f"trajectory {traj.id!r}{f' of {origin}' if origin else ''}: the record is {len(text) / 2**20:.0f} MiB "
            f"of JSON ({len(traj.messages)} messages), more than the {MAX_RECORD_BYTES / 2**20:.0f} MiB one "
            "demonstration may hold; split it into shorter trajectories")
    return text


def _fitting_states(traj: Trajectory, states: list[Any], max_context: int) -> tuple[list[Any], int]:
    """The states of ``traj`` whose history could fit ``max_context`` tokens, and how many could not:
    a state with more messages than ``max_context`` can never fit (every message renders to at
    least one token), so it is skipped before anything is serialised."""
    kept = [s for s in states if len(s.messages) <= max_context]
    return kept, len(states) - len(kept)


def read_histories(store: ArtifactStore, key: str, ids: Any = None) -> dict[str, tuple[Message, ...]]:
    """Trajectory id → messages, from ``<key>/trajectories.parquet``: what the rows of
    ``candidates.parquet`` refer to (``frame_to_states(cand, histories)``). ``ids``: only these
    trajectories (an iterable of ids, e.g. a selection's ``trajectory_id`` column); None = all.
    Raises DataError naming the table and the record of an unreadable one.
    """
    df = store.read_parquet(f"{key}/trajectories.parquet")
    if ids is not None:
        df = df[df["id"].isin({str(i) for i in ids})]
    out: dict[str, tuple[Message, ...]] = {}
    for tid, rec in zip(df["id"], df["record"]):
        where = f"{store.url(f'{key}/trajectories.parquet')} record {tid!r}"
        try:
            d = json.loads(rec)
        except (TypeError, json.JSONDecodeError) as e:
            raise DataError(f"{where}: not a JSON string ({e})") from None
        msgs = d.get("messages") if isinstance(d, dict) else None
        if not isinstance(msgs, list):
            raise DataError(f"{where}.messages: missing")
        out[str(tid)] = tuple(Message.from_dict(m, f"{where}.messages[{i}]") for i, m in enumerate(msgs))
    return out


def _source_uri(src: Any) -> dict[str, Any]:
    """A source as a manifest input: its URI and content hash (the pinned wheel's sha256 for BFCL,
    the sha256 of the file — or of the sorted file hashes of a directory — for anything else)."""
    from pivotrl.bfcl.wheel import BFCL_VERSION, BFCL_WHEEL_SHA256

    if src.kind == "bfcl":
        return {"uri": f"pypi:bfcl-eval=={BFCL_VERSION}#{','.join(src.categories)}", "sha256": BFCL_WHEEL_SHA256}
    try:
        return {"uri": src.url, "sha256": _url_sha256(src.url)}
    except OSError:  # gone or unreadable: the source was quarantined (data.on_invalid), nothing was read
        return {"uri": src.url, "sha256": None}


def _url_sha256(url: str) -> str:
    import hashlib

    import fsspec

    fs, path = fsspec.core.url_to_fs(os.path.expanduser(url))

    def one(p: str) -> str:
        with fs.open(p, "rb") as f:
            return hashlib.file_digest(f, "sha256").hexdigest()

    if fs.isdir(path):
        files = sorted(fs.find(path))
        return content_hash({p[len(path.rstrip("/")) + 1:]: one(p) for p in files})
    return one(path)


def _result(store: ArtifactStore, key: str, counts: dict[str, Any]) -> dict[str, Any]:
    return {
        "key": key,
        "trajectories": store.url(f"{key}/trajectories.parquet"),
        "candidates": store.url(f"{key}/candidates.parquet"),
        "quarantine": (store.url(f"{key}/quarantine.jsonl")
                       if counts.get("quarantined") or counts.get("quarantined_sources") else None),
        "flagged": store.url(f"{key}/flagged.jsonl") if counts.get("flagged") else None,
        "counts": counts,
    }


def read_trajectories(store: ArtifactStore, key: str, split: str | None = None) -> list[Trajectory]:
    """Trajectories of ``<key>/trajectories.parquet``, optionally of one split."""
    df = store.read_parquet(f"{key}/trajectories.parquet")
    if split is not None:
        df = df[df["split"] == split]
    return [Trajectory.from_dict(json.loads(r)) for r in df["record"]]
