"""Tests that read the pinned BFCL records (the data marker: the bfcl-eval wheel is downloaded once
into the cache): the load-time audit replays BFCL's gold calls and keeps the failing tasks out;
BFCL's closing turns are stop decisions; out-of-domain categories load as states."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from pivotrl.config import load_config
from pivotrl.data.audit import is_flagged
from pivotrl.data.bfcl import load_bfcl
from pivotrl.data.states import candidate_kinds_for_pivots, extract_turn_states, states_to_frame
from pivotrl.pipeline.demos import build_demonstrations
from pivotrl.pipeline.probe import candidate_kind_column, select_candidates
from pivotrl.storage import ArtifactStore
from pivotrl.verifiers import get_verifier

pytestmark = pytest.mark.data

#: multi_turn_base tasks whose gold calls report a failure when replayed (found by the audit).
FAILING = ["multi_turn_base_153", "multi_turn_base_154", "multi_turn_base_181", "multi_turn_base_188"]
#: ... and those with a no-op gold call: a call of a method that changes the state in other tasks'
#: gold but not here (logged in again, a stock already on the watchlist, the same budget, a retweet
#: already made, a parking brake already engaged).
NO_OP = ["multi_turn_base_5", "multi_turn_base_8", "multi_turn_base_72", "multi_turn_base_86", "multi_turn_base_103",
         "multi_turn_base_111", "multi_turn_base_135", "multi_turn_base_137", "multi_turn_base_139",
         "multi_turn_base_142", "multi_turn_base_143", "multi_turn_base_166", "multi_turn_base_168",
         "multi_turn_base_170", "multi_turn_base_171", "multi_turn_base_173", "multi_turn_base_174",
         "multi_turn_base_182", "multi_turn_base_185", "multi_turn_base_188", "multi_turn_base_192",
         "multi_turn_base_195"]
FLAGGED = sorted(set(FAILING) | set(NO_OP), key=lambda i: int(i.rsplit("_", 1)[1]))


def test_bfcl_gold_is_replayed_and_failing_tasks_are_flagged():
    trajs = load_bfcl(["multi_turn_base"], os.environ["PIVOTRL_CACHE_DIR"])
    flagged = [t for t in trajs if is_flagged(t)]
    assert [t.id for t in flagged] == FLAGGED
    t188 = next(t for t in flagged if t.id == "multi_turn_base_188")
    assert t188.meta["audit_flags"] == [
        "turn 4 call 0 \"authenticate_twitter(password='michael_cant_smith_smith', username='michael_smith')\": "
        "failure status: authentication_status=false",
        "turn 1 call 0 \"set_budget_limit(access_token='abc123xyz', budget_limit=10000.0)\": no-op: set_budget_limit "
        "changes the environment in other gold replays, not here (output: {\"budget_limit\": 10000.0})"]
    t195 = next(t for t in flagged if t.id == "multi_turn_base_195")
    assert t195.meta["audit_flags"][-1] == ("turn 3 call 0 'retweet(tweet_id=1)': no-op: retweet changes the "
                                            "environment in other gold replays, not here (output: "
                                            "{\"retweet_status\": \"Already retweeted\"})")
    # A no-op is decided against the whole file, whatever the limit keeps.
    (t5,) = [t for t in load_bfcl(["multi_turn_base"], os.environ["PIVOTRL_CACHE_DIR"], limit_per_category=6)
             if t.id == "multi_turn_base_5"]
    assert t5.meta["audit_flags"] == next(t for t in flagged if t.id == "multi_turn_base_5").meta["audit_flags"]


def _bfcl_config(root: Path, *extra: str):
    return load_config(None, [f"run.storage_root={root}", "data.sources=[{kind: bfcl, categories: [multi_turn_base]}]",
                              *extra])


def test_flagged_tasks_are_counted_recorded_and_kept_out_unless_asked(tmp_path):
    cfg = _bfcl_config(tmp_path / "root")
    store = ArtifactStore(cfg.run.storage_root)
    out = build_demonstrations(cfg, store)
    c = out["counts"]
    assert (c["flagged"], c["flagged_ids"], c["flagged_kept"]) == (len(FLAGGED), sorted(FLAGGED), False)
    assert c["trajectories_per_split"]["flagged"] == len(FLAGGED) == 25
    assert c["flags_by_kind"] == {"failing_call": 4, "no_op": 25, "not_reproduced": 0}
    traj_df = store.read_parquet(f"{out['key']}/trajectories.parquet")
    cand = store.read_parquet(f"{out['key']}/candidates.parquet")
    assert set(traj_df[traj_df["id"].isin(FLAGGED)]["split"]) == {"flagged"}
    # No warm-start, pivot or held-out row comes from a flagged task.
    in_use = cand[cand["split"].isin(["warm_start", "pivot", "heldout"])]
    assert not in_use["trajectory_id"].isin(FLAGGED).any() and len(in_use) == len(cand) - (cand["split"] == "flagged").sum()
    # Recorded in lineage: an artifact with a manifest, listing each task and its flags.
    assert store.read_manifest(f"{out['key']}/flagged.jsonl").kind == "flagged"
    lines = [json.loads(x) for x in store.read_bytes(f"{out['key']}/flagged.jsonl").decode().splitlines()]
    assert [x["id"] for x in lines] == FLAGGED and all(x["flags"] for x in lines)
    # The setting keeps them (a different demonstrations key: nothing is reused across the two).
    kept_cfg = _bfcl_config(tmp_path / "root", "quality.keep_flagged=true")
    kept = build_demonstrations(kept_cfg, store)
    assert kept["key"] != out["key"] and kept["counts"]["flagged_kept"] is True
    assert "flagged" not in kept["counts"]["trajectories_per_split"]


def test_bfcl_closing_turns_are_stop_decisions_kept_out_of_pivots_by_default():
    (traj,) = load_bfcl(["multi_turn_base"], os.environ["PIVOTRL_CACHE_DIR"], limit_per_category=1)
    states = extract_turn_states(traj)
    kinds = [s.verifier_context["candidate_kind"] for s in states]
    assert {k for k, s in zip(kinds, states) if not s.demo_action.tool_calls} == {"stop"}
    assert kinds.count("stop") == sum(1 for m in traj.messages if m.role == "user")
    frame = states_to_frame(states).assign(split="pivot")
    assert list(candidate_kind_column(frame)) == kinds
    default = select_candidates(frame, "pivot", None, 0, kinds=candidate_kinds_for_pivots())
    assert len(default) == kinds.count("call")
    assert len(select_candidates(frame, "pivot", None, 0, kinds=candidate_kinds_for_pivots(True))) == len(states)
    stop = states[kinds.index("stop")]
    verdicts = get_verifier("tool_name").score(stop, ["Done.", "All set, anything else?", "[ls()]"])
    assert [(v.reward, v.reason) for v in verdicts] == [(1.0, "stop"), (1.0, "stop"), (0.0, "wrong_kind")]


def test_out_of_domain_categories_must_be_unseen_and_load_as_states():
    from pivotrl.errors import ConfigError
    from pivotrl.evaluation.trust import out_of_domain_states

    cfg = load_config(None, ["quality.out_of_domain_limit=3"])
    states = out_of_domain_states(cfg, os.environ["PIVOTRL_CACHE_DIR"])
    assert [s.category for s in states] == ["parallel"] * 3
    assert {s.verifier_context["default_verifier"] for s in states} == {"arguments"}
    bad = load_config(None, ["quality.out_of_domain=[multiple]"])
    with pytest.raises(ConfigError, match=r"quality.out_of_domain = \['multiple'\]: \['multiple'\] also in data.sources"):
        out_of_domain_states(bad, os.environ["PIVOTRL_CACHE_DIR"])
