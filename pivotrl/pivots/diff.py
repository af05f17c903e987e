"""Why two pivot sets differ: :func:`diff_pivots` compares two ``pivots.parquet`` state by state.

For every state that entered or left, each reason found is given (PivotRL §3.2: a state is a pivot
iff σ̂² > 0 and μ̂ < λ_diff); the reasons are listed in :mod:`pivotrl.provenance.lineage`. Everything here reads
manifests and small payloads through an :class:`~pivotrl.storage.ArtifactStore`; nothing is recomputed.

This module never imports prefect, vllm, deepspeed or torch.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Any, Mapping

from pivotrl.core.hashing import content_hash
from pivotrl.core.errors import StorageError
from pivotrl.storage import ArtifactStore, open_artifact

__all__ = ["PivotChange", "PivotDiff", "config_value", "diff_pivots", "render_diff", "short_value", "verifier_label"]


def config_value(obj: Any, path: str) -> Any:
    """The value at the dotted ``path`` (``"probing.lambda_diff"``) of a nested mapping, else None."""
    for part in path.split("."):
        if not isinstance(obj, Mapping) or part not in obj:
            return None
        obj = obj[part]
    return obj


def verifier_label(name: Any, config: Mapping[str, Any] | None) -> str | None:
    """``"<name>"`` or ``"<name>@<8 hex of its config>"`` when the verifier section was recorded."""
    section = (config or {}).get("verifier")
    if isinstance(section, Mapping):
        return f"{name or section.get('name')}@{content_hash(dict(section))[:8]}"
    return None if name is None else str(name)


def short_value(v: Any) -> str:
    """``v`` as text, a hex digest of 40 or more digits cut to its first 12."""
    if isinstance(v, str) and re.fullmatch(r"[0-9a-f]{40,}", v):
        return v[:12]
    return str(v)


@dataclass(frozen=True)
class PivotChange:
    """One state that entered (``"+"``) or left (``"-"``) the pivot set, with every reason found.

    ``mu_a``/``mu_b``: μ̂ of the state in the probes of A and B (None when not probed there).
    """

    state_id: str
    change: str
    reasons: tuple[str, ...]
    mu_a: float | None = None
    mu_b: float | None = None
    detail: str = ""


@dataclass(frozen=True)
class PivotDiff:
    """Result of :func:`diff_pivots`: the two sets' facts and the per-state changes (sorted by id)."""

    a: dict[str, Any]
    b: dict[str, Any]
    kept: int
    changes: list[PivotChange] = field(default_factory=list)

    @property
    def entered(self) -> list[PivotChange]:
        return [c for c in self.changes if c.change == "+"]

    @property
    def left(self) -> list[PivotChange]:
        return [c for c in self.changes if c.change == "-"]


def _side(store: ArtifactStore, key: str) -> dict[str, Any]:
    """Facts and tables of one pivot set: its manifest, its probes and candidates (by state id)."""
    m = store.read_manifest(key)
    if m.kind != "pivots":
        raise StorageError(f"{m.uri} is a {m.kind!r} artifact, not a pivot set (kind 'pivots')")
    pivots = store.read_parquet(key)
    if "state_id" not in pivots.columns:
        raise StorageError(f"{m.uri}: no state_id column (columns: {', '.join(map(str, pivots.columns))})")
    lam = (m.config or {}).get("lambda_diff", config_value(m.config or {}, "probing.lambda_diff"))
    side: dict[str, Any] = {
        "uri": m.uri, "sha256": m.sha256, "lambda_diff": lam,
        "reference_hash": m.extra.get("reference_hash"), "verifier": m.extra.get("verifier"),
        "pivots": set(map(str, pivots["state_id"])), "probes": None, "candidates": None,
    }
    for name in ("probes", "candidates"):
        uri = (m.inputs.get(name) or {}).get("uri")
        df = _read_input(store, uri) if uri else None
        if df is not None and "state_id" in df.columns:
            side[name] = df
    probes = side["probes"]
    side["probe_rows"] = _probe_rows(probes) if probes is not None else {}
    side["mu"] = _mu(probes) if probes is not None else {}
    pm = store.read_manifest_url(m.inputs["probes"]["uri"]) if "probes" in m.inputs else None
    if pm is not None:  # the probes record the reference and the whole verifier section
        side["reference_hash"] = side["reference_hash"] or pm.extra.get("reference_hash")
        side["verifier"] = verifier_label(side["verifier"] or pm.extra.get("verifier"), pm.config)
    cand = side["candidates"]
    side["candidate_ids"] = set(map(str, cand["state_id"])) if cand is not None else None
    side["candidate_hash"] = (m.inputs.get("candidates") or {}).get("sha256")
    return side


def _read_input(store: ArtifactStore, uri: str) -> Any:
    """The Parquet table at an input URI (in ``store`` or elsewhere); None if it cannot be read."""
    prefix = store.root_url + "/"
    try:
        if uri.startswith(prefix):
            return store.read_parquet(uri[len(prefix):])

        other, key = open_artifact(uri)
        return other.read_parquet(key)
    except StorageError:
        return None


#: Probe-table columns that hold what the probes produced (the rest describe the state).
_OUTCOME_COLS = ("rewards", "reward", "mu", "var", "samples", "status")


def _probe_rows(df: Any) -> dict[str, str]:
    """state id → canonical text of all its probe outcomes (rewards, μ̂, σ̂², samples; order-free)."""
    from pivotrl.core.hashing import canonical_json

    cols = ["state_id"] + [c for c in _OUTCOME_COLS if c in df.columns]
    out: dict[str, list[str]] = {}
    for rec in df[cols].to_dict("records"):
        sid = str(rec["state_id"])
        out.setdefault(sid, []).append(canonical_json({k: _plain(v) for k, v in rec.items()}))
    return {sid: "\n".join(sorted(rows)) for sid, rows in out.items()}


def _plain(v: Any) -> Any:
    if hasattr(v, "tolist"):
        v = v.tolist()
    if isinstance(v, float) and v != v:
        return None
    if isinstance(v, (list, tuple)):
        return [_plain(x) for x in v]
    if isinstance(v, dict):
        return {str(k): _plain(x) for k, x in v.items()}
    return v


def _mu(df: Any) -> dict[str, float]:
    """state id → μ̂: the ``mu`` column when the table has one, else the mean of ``reward``."""
    if "mu" in df.columns:
        return {str(s): float(m) for s, m in df.groupby("state_id")["mu"].first().items()}
    if "reward" in df.columns:
        return {str(s): float(m) for s, m in df.groupby("state_id")["reward"].mean().items()}
    return {}


def diff_pivots(store_a: ArtifactStore, key_a: str, store_b: ArtifactStore, key_b: str) -> PivotDiff:
    """Which states entered or left between pivot set A and pivot set B, and why (see module doc).

    Inputs: the two ``pivots.parquet`` artifacts (kind ``pivots``) with their manifests; the probe
    and candidate tables are found through the manifests' ``inputs``. μ̂ comes from the probe table
    (its ``mu`` column, else the mean ``reward`` over the m probes of the state).

    Raises StorageError when either artifact is missing, has no manifest or is not a pivot set.
    """
    a, b = _side(store_a, key_a), _side(store_b, key_b)
    changes: list[PivotChange] = []
    for sid in sorted(a["pivots"] ^ b["pivots"]):
        entered = sid in b["pivots"]
        reasons: list[str] = []
        details: list[str] = []
        ca, cb = a["candidate_ids"], b["candidate_ids"]
        if ca is not None and cb is not None and (sid in ca) != (sid in cb):
            reasons.append("new_demonstration")
            details.append(f"candidate in {'B' if sid in cb else 'A'} only")
        if a["reference_hash"] != b["reference_hash"]:
            reasons.append("reference_changed")
            details.append(f"reference {short_value(a['reference_hash'])} → {short_value(b['reference_hash'])}")
        if a["verifier"] != b["verifier"]:
            reasons.append("verifier_changed")
            details.append(f"verifier {a['verifier']} → {b['verifier']}")
        ra, rb = a["probe_rows"].get(sid), b["probe_rows"].get(sid)
        mu_a, mu_b = a["mu"].get(sid), b["mu"].get(sid)
        if ra is not None and rb is not None and ra != rb:
            reasons.append("mu_changed")
            details.append(f"μ̂ {_fmt(mu_a)} → {_fmt(mu_b)} (probe rows differ)")
        la, lb = a["lambda_diff"], b["lambda_diff"]
        if la != lb and la is not None and lb is not None:
            mus = [m for m in (mu_a, mu_b) if m is not None]
            lo, hi = min(la, lb), max(la, lb)
            if any(lo <= m < hi for m in mus):
                reasons.append("threshold_changed")
                details.append(f"λ_diff {la} → {lb} with μ̂ = {_fmt(mus[-1])}")
        if not reasons:
            reasons.append("unexplained")
            details.append("same candidates, reference, verifier, probes and λ_diff")
        changes.append(PivotChange(sid, "+" if entered else "-", tuple(reasons), mu_a, mu_b, "; ".join(details)))
    facts = ("uri", "sha256", "lambda_diff", "reference_hash", "verifier", "candidate_hash")
    return PivotDiff(
        a={k: a[k] for k in facts} | {"pivots": len(a["pivots"])},
        b={k: b[k] for k in facts} | {"pivots": len(b["pivots"])},
        kept=len(a["pivots"] & b["pivots"]), changes=changes,
    )


def _fmt(x: float | None) -> str:
    return "n/a" if x is None else f"{x:.3g}"


def render_diff(diff: PivotDiff) -> list[str]:
    """Text lines of a :class:`PivotDiff`: the two sets' facts, then one line per changed state."""
    lines = []
    for name, side in (("A", diff.a), ("B", diff.b)):
        lines.append(
            f"{name}: {side['uri']}  ({side['pivots']} pivots, λ_diff={side['lambda_diff']}, "
            f"reference={short_value(side['reference_hash'])}, verifier={side['verifier']}, "
            f"candidates={short_value(side['candidate_hash'])})"
        )
    lines.append(f"unchanged: {diff.kept}   entered: {len(diff.entered)}   left: {len(diff.left)}")
    for c in diff.changes:
        lines.append(f"{c.change} {c.state_id}  [{', '.join(c.reasons)}]  {c.detail}")
    return lines
