"""Sharded probing (``scale_out``): shards by trajectory, merged into exactly the unsharded probe
table and pivot set; every sample kept so pass rates can be re-derived without new rollouts."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pandas as pd
import pytest

from pivotrl.pipeline import stages
from pivotrl.pipeline.results import ProbeResult
from pivotrl.pipeline.demos import build_demonstrations
from pivotrl.pipeline.probe import rederive_pivots
from pivotrl.pipeline.probe_stage import merge_probe_shards, plan_probe_shards, probe_shard
from pivotrl.storage import ArtifactStore

from smoke_runs import smoke_config


@pytest.fixture(scope="module")
def unsharded(smoke_run):
    """The session's smoke run (conftest.py): its demonstrations, reference and unsharded probing."""
    return smoke_run[:5]


def _tables(store: ArtifactStore, probe) -> tuple[pd.DataFrame, pd.DataFrame]:
    probe = ProbeResult.of(probe)  # a stage's result, or its dict from the merge
    return (store.read_parquet(f"{probe.probes_key}/probes.parquet"),
            store.read_parquet(f"{probe.pivots_key}/pivots.parquet"))


@pytest.mark.integration
@pytest.mark.parametrize("shard_size", [1, 2])
def test_sharded_probing_equals_the_unsharded_run(unsharded, tiny_model, tmp_path, shard_size):
    cfg0, store0, _, _, probe0 = unsharded
    # The demonstrations and the warm start as published by the unsharded run: only probing is new.
    for published in ("demos", "models"):
        shutil.copytree(Path(cfg0.run.storage_root) / published, tmp_path / published)
    cfg = smoke_config(tmp_path, tiny_model, f"scale_out.probe_shard_size={shard_size}")
    store = ArtifactStore(cfg.run.storage_root)
    demos = build_demonstrations(cfg, store)
    ref = stages.stage_reference(cfg, store, demos)
    plan = plan_probe_shards(cfg, store, demos, ref)
    trajs = [t for s in plan["shards"] for t in s["trajectories"]]
    assert len(trajs) == len(set(trajs)) and all(len(s["trajectories"]) <= shard_size for s in plan["shards"])
    assert sum(s["states"] for s in plan["shards"]) == probe0.stats["total"]["candidates"] == 17
    results = [probe_shard(cfg, store, demos, ref, s) for s in plan["shards"]]
    assert [r["probed"] for r in results] == [s["states"] for s in plan["shards"]]
    out = merge_probe_shards(cfg, store, demos, ref, plan)
    probes, pivots = _tables(store, out)
    probes0, pivots0 = _tables(store0, probe0)
    pd.testing.assert_frame_equal(probes, probes0)
    pd.testing.assert_frame_equal(pivots, pivots0)
    assert out.stats == probe0.stats and out.probes_key == probe0.probes_key
    # A second pass finds every shard's table: nothing is probed again.
    assert [probe_shard(cfg, store, demos, ref, s)["probed"] for s in plan["shards"]] == [0] * len(plan["shards"])


@pytest.mark.integration  # it reads the session's smoke run
def test_every_sample_is_kept_and_pass_rates_rederive_without_rollouts(unsharded):
    cfg, store, _, _, probe = unsharded
    df = store.read_parquet(f"{probe.probes_key}/probes.parquet")
    m = cfg.probing.num_probes
    ok = df[df["status"] == "ok"]
    for col in ("rewards", "reasons", "samples", "sample_tokens"):
        assert all(len(json.loads(v)) == m for v in ok[col]), col
    lengths = [json.loads(v) for v in ok["sample_tokens"]]
    assert all(1 <= n <= cfg.rollout.max_tokens for ls in lengths for n in ls)
    assert list(ok["action_tokens_mean"]) == pytest.approx([sum(ls) / m for ls in lengths])
    # Same m and λ: exactly the stored pivot set.
    again = rederive_pivots(df, cfg.probing.lambda_diff)
    pivots = store.read_parquet(f"{probe.pivots_key}/pivots.parquet")
    assert sorted(again.loc[again["decision"] == "kept", "state_id"]) == sorted(pivots["state_id"])
    # Another m: μ̂ from the first 2 samples of each state, by hand.
    two = rederive_pivots(df, 0.5, num_probes=2)
    for (_, a), (_, b) in zip(ok.iterrows(), two[two["status"] == "ok"].iterrows()):
        r = json.loads(a["rewards"])[:2]
        assert b["mu"] == pytest.approx(sum(r) / 2)
        assert b["var"] == pytest.approx(sum((x - sum(r) / 2) ** 2 for x in r) / 2)
        assert len(json.loads(b["samples"])) == 2
    assert set(two["decision"]) <= {"kept", "all_fail", "all_pass", "above_threshold"}
    with pytest.raises(ValueError, match="fewer than"):
        rederive_pivots(df, 0.5, num_probes=m + 1)


# ------------------------------------------------------------------ one implementation at any scale
TEMPLATES = Path(__file__).resolve().parents[1] / "fixtures" / "chat_templates"


def _memorised_model(tmp: Path, *overrides: str, family: str | None = None) -> Path:
    """A tiny model that has memorised the pivot split's demonstrations under the run's prompt
    format, so its probes are real tool calls (in that format) that the verifier must parse."""
    from pivotrl.core.errors import StateTooLongError
    from pivotrl.runtime.models import load_tokenizer
    from pivotrl.pipeline.common import prompt_kwargs
    from pivotrl.pipeline.demos import read_trajectories
    from pivotrl.format.prompts import build_sft_examples
    from pivotrl.testing import save_tiny_checkpoint, tiny_chat_tokenizer
    from pivotrl.training.sft import run_sft

    tok = tiny_chat_tokenizer(family, (TEMPLATES / f"{family}.jinja").read_text()) if family else None
    base = save_tiny_checkpoint(tmp / "tiny", tokenizer=tok)
    cfg = smoke_config(tmp / "root", base, *overrides)
    store = ArtifactStore(cfg.run.storage_root)
    demos = build_demonstrations(cfg, store)
    tok = load_tokenizer(base)
    examples = []
    for traj in read_trajectories(store, demos["key"], split="pivot"):
        try:
            examples += build_sft_examples(traj, tok, max_len=2048, **prompt_kwargs(cfg))[0]
        except StateTooLongError:  # a multi-turn task under a template that writes every tool's schema
            continue
    run_sft(str(base), examples, str(tmp / "expert"), epochs=30, lr=3e-3, batch_size=1, dtype="float32",
            zero_stage=0, seed=0)
    return tmp / "expert"


HERMES = ("prompt.format=chat_template", "prompt.tool_parser=hermes", "rollout.max_tokens=96")


@pytest.mark.integration
@pytest.mark.parametrize("case", ["default quality settings", "hermes"])
def test_one_shard_and_many_shards_write_one_table(tmp_path, case):
    """The probe stage with one shard (the one-machine run) and with a shard per trajectory gives
    the same probe table and pivot set under the same key: the same candidates (the default
    ``quality.include_stop_decisions: false`` leaves stop decisions out of both) and the same
    verifier (a hermes run parses ``<tool_call>`` blocks in every shard)."""
    from pivotrl.data.states import candidate_kinds_for_pivots
    from pivotrl.pipeline.probe import candidate_kind_column
    from pivotrl.pipeline.probe_stage import stage_probe

    overrides = ["warm_start.enabled=false", "quality.include_stop_decisions=false", "probing.lambda_diff=1.0",
                 *(HERMES if case == "hermes" else ())]
    model = _memorised_model(tmp_path / "model", *overrides, family="qwen2.5" if case == "hermes" else None)
    results = {}
    for shards in ("null", "1"):
        cfg = smoke_config(tmp_path / f"root-{shards}", model, *overrides, f"scale_out.probe_shard_size={shards}")
        store = ArtifactStore(cfg.run.storage_root)
        demos = build_demonstrations(cfg, store)
        ref = stages.stage_reference(cfg, store, demos)
        plan = plan_probe_shards(cfg, store, demos, ref)
        probe = stage_probe(cfg, store, demos, ref)
        results[shards] = (plan, probe, *_tables(store, probe))
        results["demos"] = demos
    (plan1, probe1, probes1, pivots1), (plan_n, probe_n, probes_n, pivots_n) = results["null"], results["1"]
    assert len(plan1["shards"]) == 1 and len(plan_n["shards"]) == len(set(probes1["trajectory_id"])) > 1
    assert probe1.probes_key == probe_n.probes_key and probe1.pivots_key == probe_n.pivots_key
    pd.testing.assert_frame_equal(probes1, probes_n)
    pd.testing.assert_frame_equal(pivots1, pivots_n)
    assert probe1.stats == probe_n.stats
    # No stop decision was probed; the memorised calls were read by the run's parser and accepted.
    store, demos = ArtifactStore(str(tmp_path / "root-null")), results["demos"]
    cand = store.read_parquet(f"{demos['key']}/candidates.parquet").set_index("state_id")
    probed_kinds = set(candidate_kind_column(cand.loc[list(probes1["state_id"])]))
    assert probed_kinds <= set(candidate_kinds_for_pivots(False)) and "stop" not in probed_kinds
    assert (candidate_kind_column(cand[cand["split"] == "pivot"]) == "stop").any()  # there were some to leave out
    pairs = [(t, r) for ts, rs in zip(probes1["samples"], probes1["reasons"]) for t, r in zip(json.loads(ts), json.loads(rs))]
    if case == "hermes":  # a <tool_call> block is read as a tool call (malformed or not), never as text
        tagged = [r for t, r in pairs if t.startswith("<tool_call>")]
        assert tagged and "wrong_kind" not in tagged and "parse_error" in tagged
    else:  # the memorised multi-turn demonstration: some probes are the demonstrated calls, accepted
        assert sum(r == "match" for _, r in pairs) >= 1
