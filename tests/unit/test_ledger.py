"""The cost ledger: counting hooks, sums, serialisation, bad input; trainer groups with precomputed
advantages (the end-to-end RL path) give the same update as the estimator would."""

from __future__ import annotations

import time
from pathlib import Path

import pytest

from pivotrl.core.errors import DataError
from pivotrl.runtime.ledger import COUNTERS, CostLedger
from pivotrl.rollout.base import Generation
from pivotrl.training.e2e import E2ESettings, Episode, episode_groups


def test_counting_hooks_sum_and_round_trip():
    a = CostLedger(name="a")
    a.add_generations([Generation(token_ids=[1, 2, 3], text="x", rollout_logprobs=[0.0] * 3, finish_reason="stop"),
                       Generation(token_ids=[4], text="y", rollout_logprobs=[0.0], finish_reason="stop")])
    a.add(tool_executions=5, tool_retries=1)
    a.add_trainer_metrics({"updates": 2.0, "tokens": 100.0, "ref_tokens": 50.0}, naive_tokens=180)
    with a.stage("train"):
        time.sleep(0.01)
    assert (a.model_calls, a.generated_tokens, a.tool_executions, a.tool_retries) == (2, 4, 5, 1)
    assert (a.optimizer_steps, a.trainer_tokens, a.reference_tokens, a.trainer_tokens_naive) == (2, 100, 50, 180)
    assert a.wall_s["train"] >= 0.01 and a.peak_memory_bytes > 0
    b = CostLedger(name="b", model_calls=3, wall_s={"train": 1.0, "eval": 2.0}, peak_memory_bytes=1)
    t = CostLedger.total([a, b])
    assert t.model_calls == 5 and t.wall_s["eval"] == 2.0 and t.wall_s["train"] == pytest.approx(1.0 + a.wall_s["train"])
    assert t.peak_memory_bytes == a.peak_memory_bytes and t.name == "total"
    assert CostLedger.from_dict(t.to_dict()) == t
    assert set(COUNTERS) <= set(t.row())


def test_bad_counts_and_records_are_named():
    led = CostLedger(name="x")
    with pytest.raises(DataError, match="unknown counter 'calls'"):
        led.add(calls=1)
    with pytest.raises(DataError, match="never negative"):
        led.add(model_calls=-1)
    with pytest.raises(DataError, match="unknown field"):
        CostLedger.from_dict({"name": "x", "bogus": 1})
    with pytest.raises(DataError, match="non-numeric"):
        CostLedger.from_dict({"name": "x", "model_calls": "many"})


def test_every_model_call_carries_its_episodes_group_advantage():
    eps = [[Episode("t", 0, [([1, 2], [3]), ([1, 2, 3, 4], [5, 6])], reward=1.0),
            Episode("t", 1, [([1, 2], [7])], reward=0.0)]]
    groups = episode_groups(eps, E2ESettings(group_size=2))
    assert [g.state_id for g in groups] == ["t#e2e0/call0", "t#e2e0/call1", "t#e2e1/call0"]
    adv = [g.advantages[0] for g in groups]
    assert adv[0] == adv[1] == pytest.approx(1.0, abs=1e-5) and adv[2] == pytest.approx(-1.0, abs=1e-5)
    assert all(len(g.actions) == 1 and g.rewards == [e.reward] for g, e in zip(groups, [eps[0][0]] * 2 + [eps[0][1]]))


def test_precomputed_advantages_equal_the_estimators_update(tmp_path: Path):
    import torch

    from pivotrl.objective import compute_advantages
    from pivotrl.testing import save_tiny_checkpoint
    from pivotrl.training.pivotrl import Group, PivotRLTrainer

    ckpt = save_tiny_checkpoint(tmp_path / "m")
    prompt, acts, rewards = [5, 6, 7, 8], [[9, 10], [11], [12, 13, 14], [15]], [1.0, 0.0, 0.0, 1.0]
    adv = compute_advantages(torch.tensor([rewards], dtype=torch.float64), "grpo", 1e-6)[0].tolist()
    a = PivotRLTrainer.build(ckpt, group_size=4, dtype="float32", lr=1e-3, beta=0.0, seed=0)
    b = PivotRLTrainer.build(ckpt, group_size=4, dtype="float32", lr=1e-3, beta=0.0, seed=0)
    ma = a.train_step([Group("s", prompt, acts, rewards)])
    mb = b.train_step([Group("s", prompt, acts, rewards, advantages=adv)])
    assert ma["loss"] == pytest.approx(mb["loss"], abs=1e-7)
    for pa, pb in zip(a.engine.module.parameters(), b.engine.module.parameters()):
        assert torch.allclose(pa, pb, atol=1e-7)
    # One-action groups (one per model call) are accepted only with advantages; sizes must match.
    b.train_step([Group("c0", prompt, [[9]], [1.0], advantages=[0.5]), Group("c1", prompt, [[10, 11]], [0.0], advantages=[-0.5])])
    with pytest.raises(DataError, match="must match"):
        b.train_step([Group("c", prompt, [[9]], [1.0], advantages=[0.5, 0.1])])
    with pytest.raises(DataError, match="expected group_size=4"):
        b.train_step([Group("c", prompt, [[9]], [1.0])])
    assert Group.from_dict(Group("c", prompt, [[9]], [1.0], advantages=[0.5]).to_dict()).advantages == [0.5]
    assert "advantages" not in Group("c", prompt, [[9]], [1.0]).to_dict()
