"""Lineage trees and pivot-set diffs on small synthetic artifacts written with ArtifactStore."""

from __future__ import annotations

import json
from pathlib import Path

import pandas as pd
import pytest
from typer.testing import CliRunner

from pivotrl.core.hashing import content_hash
from pivotrl.core.errors import StorageError
from pivotrl.flows.cli import app
from pivotrl.provenance.lineage import asset_key, diff_pivots, lineage_tree, open_artifact, render_diff, render_tree
from pivotrl.storage import ArtifactStore

M = 4  # probes per state

#: state → binary rewards of its m = 4 probes in the baseline set A
BASE = {"s1": [1, 0, 0, 0], "s2": [1, 1, 0, 0], "s3": [1, 0, 0, 0], "s4": [0, 0, 0, 0]}


def _verifier_cfg(name: str) -> dict:
    return {"name": name, "timeout_s": 10}


def _write_set(store: ArtifactStore, name: str, rewards: dict[str, list[int]], *, lam: float = 0.5,
               reference: str = "a" * 64, verifier: str = "arguments") -> str:
    """demos → candidates → probes → pivots under ``<name>/``; returns the pivots key.

    μ̂ = mean reward, σ̂² = μ̂(1 − μ̂); pivots = σ̂² > 0 and μ̂ < λ_diff (PivotRL §3.2).
    """
    traj = store.write_artifact(f"{name}/trajectories.parquet", pd.DataFrame({"id": sorted(rewards)}),
                                kind="trajectories",
                                inputs={"source[0]": {"uri": "pypi:bfcl-eval==2026.3.23#simple", "sha256": "c" * 64}})
    cand_df = pd.DataFrame({"state_id": sorted(rewards), "split": "pivot"})
    cand = store.write_artifact(f"{name}/candidates.parquet", cand_df, kind="candidates",
                                inputs={"trajectories": traj.uri}, extra={"seed": 0})
    ref_dir = store.root_url + f"/{name}/reference"
    rows = []
    for sid, r in sorted(rewards.items()):
        mu = sum(r) / len(r)
        rows.append({"state_id": sid, "rewards": json.dumps(r), "mu": mu, "var": mu * (1 - mu), "decision": ""})
    probes = store.write_artifact(
        f"{name}/probes.parquet", pd.DataFrame(rows), kind="probes",
        inputs={"candidates": cand.uri, "reference": ref_dir},
        config={"probing": {"num_probes": M, "seed": 3, "lambda_diff": lam}, "verifier": _verifier_cfg(verifier)},
        extra={"reference_hash": reference, "verifier": verifier},
    )
    kept = [r["state_id"] for r in rows if r["var"] > 0 and r["mu"] < lam]
    pivots = cand_df[cand_df["state_id"].isin(kept)].reset_index(drop=True)
    store.write_artifact(
        f"{name}/pivots.parquet", pivots, kind="pivots",
        inputs={"probes": probes.uri, "candidates": cand.uri},
        config={"lambda_diff": lam, "probing": {"num_probes": M, "lambda_diff": lam}},
        extra={"reference_hash": reference, "verifier": verifier, "num_pivots": len(pivots)},
    )
    return f"{name}/pivots.parquet"


@pytest.fixture
def store(tmp_path) -> ArtifactStore:
    return ArtifactStore(str(tmp_path / "runs"))


def _reference_checkpoint(store: ArtifactStore, tmp_path: Path, name: str) -> str:
    """A published π_ref directory and the manifest beside it that names it (extra.checkpoint)."""
    src = tmp_path / "ckpt"
    src.mkdir()
    (src / "model.safetensors").write_bytes(b"\x01\x02" * 10)
    url = store.put_dir(src, f"{name}/reference")
    store.write_artifact(f"{name}/reference.sft.json", {"examples": 3}, kind="reference_checkpoint",
                         inputs={"base_model": "models/tiny#" + "b" * 64},
                         extra={"checkpoint": url, "checkpoint_hash": "a" * 64})
    return url


# ------------------------------------------------------------------------------------ lineage
def test_lineage_of_a_pivot_set_reaches_the_sources(store, tmp_path):
    key = _write_set(store, "A", BASE)
    ref_url = _reference_checkpoint(store, tmp_path, "A")
    tree = lineage_tree(store, key)

    assert tree["kind"] == "pivots"
    assert tree["facts"] == {"reference_hash": "a" * 64, "verifier": "arguments", "num_pivots": 2,
                             "lambda_diff": 0.5, "num_probes": 4}
    probes = tree["inputs"]["probes"]
    assert probes["kind"] == "probes"
    label = "arguments@" + content_hash(_verifier_cfg("arguments"))[:8]
    assert probes["facts"] == {"reference_hash": "a" * 64, "verifier": label, "num_probes": 4, "seed": 3}
    ref = probes["inputs"]["reference"]
    assert ref["uri"] == ref_url and ref["kind"] == "reference_checkpoint"
    assert ref["sha256"] == store.dir_listing("A/reference")["tree_sha256"]
    assert ref["facts"] == {"checkpoint_hash": "a" * 64}
    assert ref["inputs"]["base_model"] == {"uri": "models/tiny#" + "b" * 64, "kind": "source", "source": True,
                                           "sha256": "b" * 64}
    traj = probes["inputs"]["candidates"]["inputs"]["trajectories"]
    assert traj["kind"] == "trajectories"
    assert traj["inputs"]["source[0]"]["kind"] == "source"
    assert not any(n.get("stale") for n in (tree, probes, traj))

    lines = render_tree(tree)
    u = store.root_url
    assert lines[0] == (f"[pivots] {u}/A/pivots.parquet  sha256:{tree['sha256'][:12]}  reference_hash=aaaaaaaaaaaa  "
                        "verifier=arguments  num_pivots=2  lambda_diff=0.5  num_probes=4")
    assert lines[1].startswith(f"├── candidates: [candidates] {u}/A/candidates.parquet")
    assert lines[2].startswith(f"│   └── trajectories: [trajectories] {u}/A/trajectories.parquet")
    assert lines[3] == "│       └── source[0]: [source] pypi:bfcl-eval==2026.3.23#simple  sha256:cccccccccccc"
    assert lines[4].startswith(f"└── probes: [probes] {u}/A/probes.parquet")
    assert lines[4].endswith(f"verifier={label}  num_probes=4  seed=3")
    assert lines[5].endswith("(inputs shown above)")  # candidates again, not expanded twice
    assert lines[6].startswith(f"    └── reference: [reference_checkpoint] {ref_url}  sha256:")
    assert lines[7] == f"        └── base_model: [source] models/tiny#{'b' * 64}  sha256:bbbbbbbbbbbb"
    assert len(lines) == 8


def test_lineage_flags_an_input_rewritten_after_use(store):
    key = _write_set(store, "A", BASE)
    store.write_artifact("A/candidates.parquet", pd.DataFrame({"state_id": ["s9"]}), kind="candidates")
    tree = lineage_tree(store, key)
    assert tree["inputs"]["candidates"]["stale"] is True
    assert tree["inputs"]["probes"]["inputs"]["candidates"]["stale"] is True
    assert tree["inputs"]["probes"]["stale"] is False
    assert any(line.endswith("STALE (changed since used)") for line in render_tree(tree))


def test_open_artifact_needs_a_manifest(store, tmp_path):
    key = _write_set(store, "A", BASE)
    opened, name = open_artifact(store.url(key))
    assert name == "pivots.parquet" and opened.read_manifest(name).kind == "pivots"
    missing = tmp_path / "nowhere" / "x.parquet"
    with pytest.raises(StorageError, match=r"x\.parquet has no manifest"):
        open_artifact(str(missing))
    assert not missing.parent.exists()  # nothing created on the way


# ---------------------------------------------------------------------------------- pivot diff
def _diff(store, a, b):
    return diff_pivots(store, a, store, b)


def test_diff_threshold_change(store):
    a = _write_set(store, "A", BASE, lam=0.5)
    b = _write_set(store, "B", BASE, lam=0.75)
    d = _diff(store, a, b)
    assert d.kept == 2 and d.a["pivots"] == 2 and d.b["pivots"] == 3  # s1, s3 | s1, s2, s3
    assert [(c.state_id, c.change, c.reasons) for c in d.changes] == [("s2", "+", ("threshold_changed",))]
    assert (d.changes[0].mu_a, d.changes[0].mu_b) == (0.5, 0.5)
    assert d.changes[0].detail == "λ_diff 0.5 → 0.75 with μ̂ = 0.5"


def test_diff_moved_mu_and_new_demonstration(store):
    a = _write_set(store, "A", BASE)
    b = _write_set(store, "B", {**BASE, "s3": [0, 0, 0, 0], "s5": [0, 1, 0, 0]})
    d = _diff(store, a, b)
    assert [(c.state_id, c.change, c.reasons) for c in d.changes] == [
        ("s3", "-", ("mu_changed",)),        # μ̂ 0.25 → 0: σ̂² = 0, not a pivot any more
        ("s5", "+", ("new_demonstration",)),  # a candidate of B only
    ]
    assert d.changes[0].detail == "μ̂ 0.25 → 0 (probe rows differ)"
    assert d.changes[1].detail == "candidate in B only"
    assert d.a["candidate_hash"] != d.b["candidate_hash"]


def test_diff_reference_and_verifier_changes(store):
    a = _write_set(store, "A", BASE)
    b = _write_set(store, "B", {**BASE, "s4": [0, 0, 1, 0]}, reference="c" * 64)
    c = _write_set(store, "C", {**BASE, "s2": [1, 0, 0, 0]}, verifier="tool_name")
    d_ref = _diff(store, a, b)
    assert [(x.state_id, x.change, x.reasons) for x in d_ref.changes] == [
        ("s4", "+", ("reference_changed", "mu_changed"))]
    assert d_ref.changes[0].detail.startswith("reference aaaaaaaaaaaa → cccccccccccc; μ̂ 0 → 0.25")
    d_ver = _diff(store, a, c)
    assert [(x.state_id, x.change, x.reasons) for x in d_ver.changes] == [
        ("s2", "+", ("verifier_changed", "mu_changed"))]
    assert d_ver.b["verifier"] == "tool_name@" + content_hash(_verifier_cfg("tool_name"))[:8]


def test_diff_of_identical_sets_is_empty_and_rendered(store):
    a = _write_set(store, "A", BASE)
    b = _write_set(store, "B", BASE, lam=0.75)
    assert _diff(store, a, a).changes == []
    lines = render_diff(_diff(store, a, b))
    label = "arguments@" + content_hash(_verifier_cfg("arguments"))[:8]
    assert lines[0].startswith(f"A: {store.url(a)}  (2 pivots, λ_diff=0.5, reference=aaaaaaaaaaaa, verifier={label}")
    assert lines[2] == "unchanged: 2   entered: 1   left: 0"
    assert lines[3] == "+ s2  [threshold_changed]  λ_diff 0.5 → 0.75 with μ̂ = 0.5"


def test_diff_refuses_an_artifact_that_is_not_a_pivot_set(store):
    a = _write_set(store, "A", BASE)
    with pytest.raises(StorageError, match="is a 'probes' artifact, not a pivot set"):
        _diff(store, a, "A/probes.parquet")


# --------------------------------------------------------------------------------------- CLI
def test_cli_lineage_and_pivots_diff(store):
    a = _write_set(store, "A", BASE)
    b = _write_set(store, "B", {**BASE, "s3": [0, 0, 0, 0]}, lam=0.75)
    runner = CliRunner()
    out = runner.invoke(app, ["lineage", store.url(a)])
    assert out.exit_code == 0, out.output
    assert out.output.splitlines()[0].startswith(f"[pivots] {store.url(a)}")
    out = runner.invoke(app, ["pivots", "diff", store.url(a), store.url(b)])
    assert out.exit_code == 0, out.output
    assert "- s3  [mu_changed]  μ̂ 0.25 → 0 (probe rows differ)" in out.output.splitlines()
    assert "+ s2  [threshold_changed]  λ_diff 0.5 → 0.75 with μ̂ = 0.5" in out.output.splitlines()
    out = runner.invoke(app, ["pivots", "diff", "--json", store.url(a), store.url(b)])
    doc = json.loads(out.output)
    assert doc["unchanged"] == 1 and [c["state_id"] for c in doc["changes"]] == ["s2", "s3"]
    out = runner.invoke(app, ["lineage", store.url("A/none.parquet")])
    assert out.exit_code == 2 and "has no manifest" in out.output


def test_cli_lineage_accepts_the_report_and_policy_paths_a_run_prints(store, tmp_path):
    """`pivotrl run` prints report.md (no manifest of its own: report.json beside it describes it)
    and the policy checkpoint directory (described by train/<key>/summary.json)."""
    a = _write_set(store, "A", BASE)
    src = tmp_path / "policy"
    src.mkdir()
    (src / "model.safetensors").write_bytes(b"\x03" * 8)
    policy = store.put_dir(src, "train/k/policy")
    store.write_artifact("train/k/metrics.parquet", pd.DataFrame({"step": [1]}), kind="training_metrics",
                         inputs={"pivots": store.url(a)})
    store.write_artifact("train/k/summary.json", {"steps": 1}, kind="policy_checkpoint",
                         inputs={"pivots": store.url(a)}, extra={"checkpoint": policy})
    store.write_text("eval/e/report.md", "# report\n")
    store.write_artifact("eval/e/report.json", {"x": 1}, kind="report", inputs={"policy": policy})
    runner = CliRunner()
    for uri, kind in ((store.url("eval/e/report.md"), "report"), (policy, "policy_checkpoint"),
                      (policy.removeprefix("file://"), "policy_checkpoint")):
        out = runner.invoke(app, ["lineage", uri])
        assert out.exit_code == 0, out.output
        assert out.output.splitlines()[0].startswith(f"[{kind}]"), out.output
        assert "[pivots]" in out.output
    out = runner.invoke(app, ["lineage", store.url("train/k/none.bin")])
    assert out.exit_code == 2 and "has no manifest" in out.output


def test_bfcl_source_records_the_pinned_wheel_hash(tmp_path):
    from pivotrl.config import BFCLSource, ChatSource
    from pivotrl.bfcl.wheel import BFCL_WHEEL_SHA256
    from pivotrl.pipeline.demos import _source_uri

    rec = _source_uri(BFCLSource(kind="bfcl", categories=["simple_python"]))
    assert rec == {"uri": "pypi:bfcl-eval==2026.3.23#simple_python", "sha256": BFCL_WHEEL_SHA256}
    f = tmp_path / "demos.jsonl"
    f.write_text('{"messages": []}\n')
    import hashlib

    rec = _source_uri(ChatSource(kind="chat", url=str(f)))
    assert rec["sha256"] == hashlib.sha256(f.read_bytes()).hexdigest()


def test_version():
    out = CliRunner().invoke(app, ["--version"])
    assert out.exit_code == 0 and out.output.startswith("pivotrl 0.1.0")


# ------------------------------------------------------------------------------------- assets
def test_asset_keys():
    assert asset_key("s3://bucket/runs/pivots/ab-cd/pivots.parquet") == "s3://bucket/runs/pivots/ab-cd/pivots.parquet"
    assert asset_key("S3://bucket/x#frag") == "s3://bucket/x"
    assert asset_key("pypi:bfcl-eval==2026.3.23#simple_python,multiple") == "pypi://bfcl-eval==2026.3.23"
    assert asset_key("/models/tiny#" + "b" * 64) == "file:///models/tiny"
    assert asset_key("reference") is None
    assert asset_key("file:///a b") is None  # a space is not allowed in an asset key
    assert asset_key("s3://b/" + "x" * 600) is None
