"""Tests that read the pinned BFCL records (the data marker: the bfcl-eval wheel is downloaded once
into the cache): the load-time audit replays BFCL's gold calls and keeps the failing tasks out
(also on small hand-made tasks run in BFCL's simulators and checker);
BFCL's closing turns are stop decisions; out-of-domain categories load as states."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from pivotrl.config import load_config
from pivotrl.data.audit import is_flagged
from pivotrl.bfcl.data import load_bfcl
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
#: ... and those with a gold value the history does not hold (pivotrl.data.audit, "Not in the history"):
#: a receiver's user id never looked up (get_user_id is there), an order id never listed, file names
#: in a directory never listed.
NOT_IN_HISTORY = ["multi_turn_base_18", "multi_turn_base_20", "multi_turn_base_33", "multi_turn_base_48",
                  "multi_turn_base_62", "multi_turn_base_72", "multi_turn_base_91", "multi_turn_base_95",
                  "multi_turn_base_97", "multi_turn_base_111", "multi_turn_base_112", "multi_turn_base_115",
                  "multi_turn_base_131", "multi_turn_base_132", "multi_turn_base_134", "multi_turn_base_137",
                  "multi_turn_base_138", "multi_turn_base_141", "multi_turn_base_143", "multi_turn_base_145",
                  "multi_turn_base_173"]
#: ... and those whose free text contradicts what it says it is (pivotrl.data.claims), by kind: a tweet
#: of a tool output with its words reordered (4) or its quotes stripped (30), a message that drops a
#: word of the user's quote (168), a ticket that says 2023 where the user dictated 2026 (176), a
#: description without the support reply the user asked it to include (187).
CLAIMS = {"not_tool_output": ["multi_turn_base_4", "multi_turn_base_30"], "not_user_quote": ["multi_turn_base_168"],
          "not_dictated": ["multi_turn_base_176"], "not_included": ["multi_turn_base_187"]}
FLAGGED = sorted(set(FAILING) | set(NO_OP) | set(NOT_IN_HISTORY) | {i for ids in CLAIMS.values() for i in ids},
                 key=lambda i: int(i.rsplit("_", 1)[1]))
NO_CLAIMS = {"not_tool_output": 0, "not_user_quote": 0, "not_dictated": 0, "not_included": 0}


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
    assert c["trajectories_per_split"]["flagged"] == len(FLAGGED) == 45
    assert c["flags_by_kind"] == {"failing_call": 4, "no_op": 25, "not_reproduced": 0, "not_ground_truth": 0,
                                  "not_in_history": 27, "not_tool_output": 2, "not_user_quote": 1, "not_dictated": 1,
                                  "not_included": 1}
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
    from pivotrl.core.errors import ConfigError
    from pivotrl.evaluation.trust import out_of_domain_states

    cfg = load_config(None, ["quality.out_of_domain_limit=3"])
    states = out_of_domain_states(cfg, os.environ["PIVOTRL_CACHE_DIR"])
    assert [s.category for s in states] == ["parallel"] * 3
    assert {s.verifier_context["default_verifier"] for s in states} == {"arguments"}
    bad = load_config(None, ["quality.out_of_domain=[multiple]"])
    with pytest.raises(ConfigError, match=r"quality.out_of_domain = \['multiple'\]: \['multiple'\] also in data.sources"):
        out_of_domain_states(bad, os.environ["PIVOTRL_CACHE_DIR"])


def test_audit_counts_by_kind_on_all_200_multi_turn_tasks():
    """Every kind of flag over the 200 multi_turn_base tasks (printed, then checked): which tasks and
    how many flags. Every turn's replay reaches BFCL's own checker's ground-truth state and outputs
    (no ``not_ground_truth``); 21 tasks need a value the history does not hold; 5 have free text that
    contradicts what it says it is (4 of them flagged for nothing else)."""
    from collections import Counter

    from pivotrl.pipeline.demos import FLAG_KINDS, flag_kind

    trajs = load_bfcl(["multi_turn_base"], os.environ["PIVOTRL_CACHE_DIR"])
    assert len(trajs) == 200
    flags = Counter(flag_kind(f) for t in trajs for f in t.meta.get("audit_flags", []))
    tasks = {k: sorted({t.id for t in trajs for f in t.meta.get("audit_flags", []) if flag_kind(f) == k},
                       key=lambda i: int(i.rsplit("_", 1)[1])) for k in FLAG_KINDS}
    print({k: (flags[k], len(tasks[k])) for k in FLAG_KINDS}, f"{len(FLAGGED)} tasks flagged of 200")
    assert {k: flags[k] for k in FLAG_KINDS} == {"failing_call": 4, "no_op": 25, "not_reproduced": 0,
                                                 "not_ground_truth": 0, "not_in_history": 27, "not_tool_output": 2,
                                                 "not_user_quote": 1, "not_dictated": 1, "not_included": 1}
    assert {k: tasks[k] for k in CLAIMS} == CLAIMS
    assert tasks["failing_call"] == FAILING and tasks["not_in_history"] == NOT_IN_HISTORY
    assert set(tasks["no_op"]) == set(NO_OP) | {"multi_turn_base_153", "multi_turn_base_154"}
    assert tasks["not_reproduced"] == tasks["not_ground_truth"] == []
    assert sorted({t.id for t in trajs if is_flagged(t)}, key=lambda i: int(i.rsplit("_", 1)[1])) == FLAGGED


# ------------------------------------------------------------------------------- hand-made tasks

#: Small hand-made multi-turn tasks: (id, classes, initial_config, user turns, ground truth per turn).
HAND_MADE = [
    # BFCL evaluates ``('#a',)`` to a tuple and stores it; JSON (and so the demonstration) has a list,
    # so a model that writes the demonstration fails BFCL's state check.
    ("hand_tuple", ["TwitterAPI"], {"TwitterAPI": {"username": "ann", "password": "pw", "authenticated": True}},
     ["Post 'hi' tagged #a."], [["post_tweet(content='hi', tags=('#a',))"]]),
    ("hand_list", ["TwitterAPI"], {"TwitterAPI": {"username": "ann", "password": "pw", "authenticated": True}},
     ["Post 'hi' tagged #a."], [["post_tweet(content='hi', tags=['#a'])"]]),
    # Bob's user id is never shown to the model (get_user_id would give it).
    ("hand_id_unseen", ["MessageAPI"], {"MessageAPI": {"current_user": "USR001"}},
     ["Tell Bob 'hi'."], [["send_message(receiver_id='USR002', message='hi')"]]),
    ("hand_id_looked_up", ["MessageAPI"], {"MessageAPI": {"current_user": "USR001"}},
     ["Tell Bob 'hi'."], [["get_user_id(user='Bob')", "send_message(receiver_id='USR002', message='hi')"]]),
    # Two turns: the id is looked up in the first, used in the second; each turn reaches BFCL's state.
    ("hand_two_turns", ["MessageAPI"], {"MessageAPI": {"current_user": "USR001"}},
     ["Who is Catherine?", "Send her 'on my way'."],
     [["get_user_id(user='Catherine')"], ["send_message(receiver_id='USR003', message='on my way')"]]),
    # The message says another thing than the user's quote (pivotrl.data.claims).
    ("hand_misquoted", ["MessageAPI"], {"MessageAPI": {"current_user": "USR001"}},
     ["Text USR002 'see you at noon today'."],
     [["send_message(receiver_id='USR002', message='see you at noon tomorrow')"]]),
]


@pytest.fixture()
def hand_made_cache(tmp_path) -> Path:
    """A cache whose BFCL copy has the real simulators and tool schemas, and HAND_MADE as its
    multi_turn_base records and answers."""
    import importlib

    from pivotrl.bfcl.wheel import ensure_bfcl
    from pivotrl.bfcl.envs import BFCL_CLASSES, bfcl_class

    real = ensure_bfcl(os.environ["PIVOTRL_CACHE_DIR"])
    for c in BFCL_CLASSES:  # imported from the real copy, which outlives this test's
        bfcl_class(c, real)
    importlib.import_module("bfcl_eval.eval_checker.multi_turn_eval.multi_turn_checker")
    fake = tmp_path / "cache" / real.name
    (fake / "bfcl_eval" / "data" / "possible_answer").mkdir(parents=True)
    (fake / ".sha256").write_text((real / ".sha256").read_text())
    for child in (real / "bfcl_eval").iterdir():
        if child.name != "data":
            (fake / "bfcl_eval" / child.name).symlink_to(child)
    (fake / "bfcl_eval" / "data" / "multi_turn_func_doc").symlink_to(real / "bfcl_eval" / "data" / "multi_turn_func_doc")
    records = [{"id": i, "question": [[{"role": "user", "content": q}] for q in qs], "initial_config": cfg,
                "involved_classes": classes} for i, classes, cfg, qs, _ in HAND_MADE]
    answers = [{"id": i, "ground_truth": gt} for i, *_, gt in HAND_MADE]
    data = fake / "bfcl_eval" / "data"
    (data / "BFCL_v4_multi_turn_base.json").write_text("".join(json.dumps(r) + "\n" for r in records))
    (data / "possible_answer" / "BFCL_v4_multi_turn_base.json").write_text("".join(json.dumps(a) + "\n" for a in answers))
    return tmp_path / "cache"


def test_hand_made_tasks_that_contradict_bfcls_ground_truth_or_the_history_are_flagged(hand_made_cache):
    """A demonstration whose replay does not reach BFCL's own checker's state, one whose call needs
    an id the model was never shown, and one whose message misquotes the user are flagged; their
    twins that do not are not. (Before: no task here was flagged.)"""
    got = {t.id: t.meta.get("audit_flags", []) for t in load_bfcl(["multi_turn_base"], hand_made_cache)}
    assert got == {
        "hand_tuple": ["turn 0: not BFCL's ground truth: the replayed state differs in TwitterAPI.tweets"],
        "hand_list": [],
        "hand_id_unseen": [("turn 0 call 0 \"send_message(message='hi', receiver_id='USR002')\": not in the history: "
                            "receiver_id='USR002' (no 'USR002' in the user turns, earlier outputs and calls, or the "
                            "tool schemas)")],
        "hand_id_looked_up": [],
        "hand_two_turns": [],
        "hand_misquoted": [("turn 0 call 0 \"send_message(message='see you at noon tomorrow', receiver_id='USR002')\": "
                            "differs from the user's quote: message='see you at noon tomorrow', the user wrote "
                            "'see you at noon today'")],
    }
    # BFCL's checker keeps its instances in a module dict; the audit removes its own.
    from bfcl_eval.eval_checker.multi_turn_eval import multi_turn_utils

    assert not [k for k in vars(multi_turn_utils) if k.startswith("pivotrl_audit_")]


def test_hand_made_flags_are_counted_by_kind_and_kept_out_by_default(hand_made_cache, tmp_path, monkeypatch):
    monkeypatch.setenv("PIVOTRL_CACHE_DIR", str(hand_made_cache))
    cfg = _bfcl_config(tmp_path / "root")
    out = build_demonstrations(cfg, ArtifactStore(cfg.run.storage_root))
    c = out["counts"]
    assert (c["flagged_ids"], c["flagged_kept"]) == (["hand_id_unseen", "hand_misquoted", "hand_tuple"], False)
    assert c["flags_by_kind"] == {"failing_call": 0, "no_op": 0, "not_reproduced": 0, "not_ground_truth": 1,
                                  "not_in_history": 1, **NO_CLAIMS, "not_user_quote": 1}
    kept = build_demonstrations(_bfcl_config(tmp_path / "root", "quality.keep_flagged=true"),
                                ArtifactStore(cfg.run.storage_root))
    assert kept["counts"]["flagged_kept"] is True and "flagged" not in kept["counts"]["trajectories_per_split"]
