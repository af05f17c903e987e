"""Lineage of artifacts: the provenance tree of one artifact, and why two pivot sets differ.

Everything here reads manifests (``<key>.manifest.json``, see :mod:`pivotrl.storage`) and small
payloads through an :class:`~pivotrl.storage.ArtifactStore`; nothing is recomputed.

* :func:`lineage_tree` walks an artifact's inputs back to the raw sources (demonstration files,
  the base model) and carries, per node, the facts a reader needs to trust it: kind, content hash,
  the reference model's hash and the verifier it was scored with (manifest ``extra``), the config
  values that decide the artifact (``lambda_diff``, ``num_probes``, ``seed``) and staleness.
* :func:`diff_pivots` (:mod:`pivotrl.pivots.diff`) compares two pivot sets (``pivots.parquet``) state by state and gives, for every
  state that entered or left, each reason found (PivotRL §3.2: a state is a pivot iff σ̂² > 0 and
  μ̂ < λ_diff):

  ``new_demonstration``   the state is a candidate of one side only (different demonstrations);
  ``reference_changed``   the two pivot sets were probed with different reference models;
  ``verifier_changed``    the two pivot sets were scored by different verifiers;
  ``mu_changed``          the state's probe rows differ, so μ̂ (and σ̂²) moved;
  ``threshold_changed``   λ_diff differs and the state's μ̂ lies between the two thresholds.

* :func:`asset_key` turns an artifact URI into a Prefect asset key (a URI with a lowercase scheme).

This module never imports prefect, vllm, deepspeed or torch.
"""

from __future__ import annotations

import os
import re
from typing import Any, Mapping

from pivotrl.core.errors import StorageError
from pivotrl.pivots.diff import PivotChange, PivotDiff, config_value, diff_pivots, render_diff, short_value, verifier_label
from pivotrl.storage import COMPLETE_MARKER, MANIFEST_SUFFIX, ArtifactStore, Manifest, open_artifact

__all__ = [
    "open_artifact", "lineage_tree", "render_tree", "diff_pivots", "render_diff", "PivotChange",
    "PivotDiff", "asset_key",
]

#: Manifest ``extra`` keys shown in a lineage tree (the versions that decide an artifact).
VERSION_KEYS = ("reference_hash", "verifier", "checkpoint_hash", "num_pivots", "seed")
#: Config values shown in a lineage tree, by dotted path inside the manifest's ``config``.
CONFIG_KEYS = ("lambda_diff", "probing.num_probes", "probing.lambda_diff", "probing.seed")

_SCHEME = re.compile(r"^([A-Za-z][A-Za-z0-9+.-]*)://")
_BARE_SCHEME = re.compile(r"^([A-Za-z][A-Za-z0-9+.-]*):(?!//)(.+)$")
_ASSET_FORBIDDEN = set("\n\r\t\0 #?&%\"'<>[]{}|\\^`")


# ----------------------------------------------------------------------------------- lineage


def _facts(m: Manifest) -> dict[str, Any]:
    facts = {k: m.extra[k] for k in VERSION_KEYS if k in m.extra}
    if "verifier" in facts or isinstance((m.config or {}).get("verifier"), Mapping):
        facts["verifier"] = verifier_label(facts.get("verifier"), m.config)
    for path in CONFIG_KEYS:
        value = config_value(m.config or {}, path)
        name = path.rsplit(".", 1)[-1]
        if name == "lambda_diff" and m.kind != "pivots":
            continue  # only the filter depends on λ_diff; probes are shared across thresholds
        if value is not None and name not in facts:
            facts[name] = value
    return facts


def lineage_tree(store: ArtifactStore, key: str) -> dict[str, Any]:
    """The provenance tree of ``key``, back to the raw sources.

    Each node: ``{"uri", "kind", "sha256", "created_at", "code_version", "facts", "stale", "inputs":
    {name: node}}`` where ``facts`` holds the reference hash, verifier, λ_diff, m (num_probes) and
    seeds recorded for the artifact. A published checkpoint directory (``_COMPLETE`` marker, no
    manifest of its own) is described by the manifest beside it whose ``extra.checkpoint`` names it;
    its ``sha256`` is the marker's tree hash. An input without a manifest (a demonstration source,
    the base model) is a leaf ``{"uri", "kind": "source", "sha256": <recorded, or the hex after '#'>,
    "source": True}``; ``stale`` is True when an input's current hash differs from the hash recorded
    when the artifact was made; a cycle ends in ``{"uri", "cycle": True}``.

    Raises StorageError if ``key`` has no manifest.
    """
    root = store.read_manifest(key)

    def node(m: Manifest, stack: tuple[str, ...], recorded: str | None, uri: str | None = None,
             sha256: str | None = None) -> dict[str, Any]:
        sha = sha256 or m.sha256
        out: dict[str, Any] = {
            "uri": uri or m.uri, "kind": m.kind, "sha256": sha, "created_at": m.created_at,
            "code_version": m.code_version, "facts": _facts(m),
            "stale": recorded is not None and recorded != sha, "inputs": {},
        }
        for name, rec in sorted(m.inputs.items()):
            child_uri = str(rec.get("uri", ""))
            if child_uri in stack:
                out["inputs"][name] = {"uri": child_uri, "cycle": True}
                continue
            child = store.read_manifest_url(child_uri)
            if child is not None:
                out["inputs"][name] = node(child, stack + (child_uri,), rec.get("sha256"))
                continue
            described = _checkpoint_manifest(store, child_uri)
            if described is not None:
                producer, tree_sha = described
                out["inputs"][name] = node(producer, stack + (child_uri, producer.uri), rec.get("sha256"),
                                           child_uri, tree_sha)
                continue
            out["inputs"][name] = {"uri": child_uri, "kind": "source", "source": True,
                                   "sha256": rec.get("sha256") or _fragment_hash(child_uri)}
        return out

    return node(root, (root.uri,), None)


def _fragment_hash(uri: str) -> str | None:
    frag = uri.rpartition("#")[2] if "#" in uri else ""
    return frag if re.fullmatch(r"[0-9a-f]{64}", frag) else None


def _checkpoint_manifest(store: ArtifactStore, uri: str) -> tuple[Manifest, str] | None:
    """(manifest describing the checkpoint directory at ``uri``, its tree hash), or None.

    The describing manifest sits in the directory's parent and names ``uri`` in ``extra.checkpoint``
    (``models/warm_start/<k>.sft.json`` for π_ref, ``train/<k>/summary.json`` for the policy).
    """
    import fsspec

    if "://" not in uri:
        return None
    options = store._options if uri.startswith(store.root_url.split("://")[0] + "://") else {}
    parent, _, name = uri.rstrip("/").rpartition("/")
    try:
        fs, marker = fsspec.core.url_to_fs(f"{uri}/{COMPLETE_MARKER}", **options)
        if not fs.exists(marker):
            return None
        where = ArtifactStore(parent, options)
        tree_sha = where.dir_listing(name).get("tree_sha256")
        parent_path = marker[: -len(f"/{name}/{COMPLETE_MARKER}")]
        siblings = sorted(str(p).rpartition("/")[2] for p in fs.ls(parent_path, detail=False))
    except Exception:  # unreadable or unknown location: the input stays a plain source
        return None
    for sibling in siblings:
        if not sibling.endswith(MANIFEST_SUFFIX):
            continue
        sibling = sibling[: -len(MANIFEST_SUFFIX)]
        try:
            m = where.read_manifest(sibling)
        except StorageError:
            continue
        if m.extra.get("checkpoint") == uri:
            return m, str(tree_sha)
    return None


def render_tree(tree: Mapping[str, Any]) -> list[str]:
    """Text lines of a :func:`lineage_tree`: one artifact per line, inputs indented below it.

    A line reads ``name: [kind] uri  sha256:<12 hex>  key=value ...`` with the node's facts, and
    ``STALE`` when its recorded hash no longer matches.
    """
    lines: list[str] = []
    shown: set[str] = set()

    def walk(n: Mapping[str, Any], name: str, prefix: str, last: bool, depth: int) -> None:
        branch = "" if depth == 0 else ("└── " if last else "├── ")
        label = f"{name}: " if name else ""
        if n.get("cycle"):
            lines.append(f"{prefix}{branch}{label}(cycle) {n['uri']}")
            return
        sha = (n.get("sha256") or "")[:12] or "unknown"
        facts = "  ".join(f"{k}={short_value(v)}" for k, v in (n.get("facts") or {}).items())
        stale = "  STALE (changed since used)" if n.get("stale") else ""
        text = f"{prefix}{branch}{label}[{n.get('kind')}] {n['uri']}  sha256:{sha}"
        children = list((n.get("inputs") or {}).items())
        if n["uri"] in shown and children:
            lines.append(text + "  (inputs shown above)" + stale)
            return
        shown.add(n["uri"])
        lines.append(text + (f"  {facts}" if facts else "") + stale)
        child_prefix = prefix + ("" if depth == 0 else ("    " if last else "│   "))
        for i, (child_name, child) in enumerate(children):
            walk(child, child_name, child_prefix, i == len(children) - 1, depth + 1)

    walk(tree, "", "", True, 0)
    return lines



# ------------------------------------------------------------------------------------ assets
def asset_key(uri: str) -> str | None:
    """A Prefect asset key for an artifact or source URI, or None if none can be formed.

    ``s3://b/p/x.parquet`` and ``file:///r/x`` stay as they are (a ``#fragment`` is dropped);
    ``pypi:bfcl-eval==1.0#cats`` becomes ``pypi://bfcl-eval==1.0``; a local path becomes
    ``file://<absolute path>``; a bare word (``"reference"``) has no key. Keys hold no character
    Prefect forbids and are at most 512 characters.
    """
    if not isinstance(uri, str) or not uri.strip():
        return None
    text = uri.strip().split("#", 1)[0]
    if m := _SCHEME.match(text):
        key = m.group(1).lower() + text[len(m.group(1)):]
    elif (m := _BARE_SCHEME.match(text)) and len(m.group(1)) > 1:
        key = f"{m.group(1).lower()}://{m.group(2)}"
    elif "/" in text or text.startswith("."):
        key = "file://" + os.path.abspath(os.path.expanduser(text))
    else:
        return None
    if any(ch in _ASSET_FORBIDDEN for ch in key) or len(key) > 512 or not re.match(r"^[a-z0-9]+://", key):
        return None
    return key
