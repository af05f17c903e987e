"""End-to-end RL baseline on the tiny model: the reward rises on a toy task, and the cost ledger
counts what was called (counted here independently, by wrapping the engine and the environment).

Here, not in tests/unit: the rise needs 16 RL steps of 32 episodes (about 40 s of CPU on the tiny
model); fewer steps, fewer episodes or a larger learning rate were tried and show no rise."""

from __future__ import annotations

from pathlib import Path
from typing import Any, Mapping, Sequence

import pytest

from pivotrl.data.schema import Message, ToolCall, ToolSpec, Trajectory
from pivotrl.core.errors import ConfigError
from pivotrl.format.prompts import build_sft_example
from pivotrl.rollout.hf import TransformersEngine
from pivotrl.testing import save_tiny_checkpoint, tiny_tokenizer
from pivotrl.training.e2e import E2ESettings, run_e2e
from pivotrl.training.pivotrl import PivotRLTrainer
from pivotrl.training.sft import run_sft

pytestmark = pytest.mark.integration

LS = ToolSpec(name="ls", description="List files.", parameters={"type": "object", "properties": {"a": {"type": "boolean"}}})
WARM_EPOCHS = 12  # SFT passes: the tiny model then makes a clean call in ≈ 1 of 5 episodes
STEPS = 16  # end-to-end RL steps
USERS = ("Please move the final report into the temp folder.", "What is the factorial of five?",
         "Show the files in the current folder.", "List all files please.")


class ToyEnv:
    """A live environment whose state never changes: a turn passes iff the policy executed a call."""

    executed: list[int] = []  # calls executed by every instance (class-wide, reset per test)

    def __init__(self, ctx: Mapping[str, Any]) -> None:
        self.policy = ctx is not None

    def execute_all(self, calls: Sequence[ToolCall]) -> list[str]:
        ToyEnv.executed.append(len(calls))
        return ["ok"] * len(calls)

    def snapshot(self) -> dict[str, Any]:
        return {"Toy": {"files": ["a", "b"]}}


def toy_task(i: int) -> Trajectory:
    return Trajectory(
        id=f"toy{i}", category="toy", tools=(LS,), env={"kind": "toy"},
        messages=(Message("system", "You are a helpful assistant that can call tools."), Message("user", USERS[i]),
                  Message("assistant", tool_calls=(ToolCall("ls", {"a": True}, id="c0"),)),
                  Message("tool", "ok", tool_call_id="c0", name="ls"), Message("assistant", "Done.")))


class CountingEngine:
    """Wraps a real engine and counts generate calls, generations and their tokens."""

    def __init__(self, inner: TransformersEngine) -> None:
        self.inner, self.generations, self.tokens = inner, 0, 0

    def generate(self, prompts, sampling):
        out = self.inner.generate(prompts, sampling)
        self.generations += sum(len(g) for g in out)
        self.tokens += sum(len(x.token_ids) for g in out for x in g)
        return out

    def load_weights(self, d):
        self.inner.load_weights(d)

    def update_weights(self, block, meta):
        self.inner.update_weights(block, meta)

    def score(self, prompts, actions):
        return self.inner.score(prompts, actions)


@pytest.fixture(scope="module")
def warm(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny model after a short SFT on the toy demonstrations: it makes the call sometimes."""
    root = tmp_path_factory.mktemp("e2e")
    base = save_tiny_checkpoint(root / "base")
    tok = tiny_tokenizer()
    examples = [build_sft_example(toy_task(i), tok, max_len=2048) for i in range(4)]
    run_sft(str(base), examples, str(root / "warm"), epochs=WARM_EPOCHS, lr=3e-3, batch_size=4, dtype="float32", seed=0)
    return root / "warm"



def test_reward_rises_and_the_ledger_counts_the_calls(warm: Path, tmp_path: Path) -> None:
    ToyEnv.executed = []
    tok = tiny_tokenizer()
    engine = CountingEngine(TransformersEngine(str(warm), dtype="fp32"))
    trainer = PivotRLTrainer.build(warm, group_size=2, dtype="float32", lr=1e-3, beta=0.0, micro_batch_groups=8, pivots_per_batch=8, seed=0)
    calls = {"train_step": 0, "updates": 0}
    inner_step = trainer.train_step

    def counted(groups):
        calls["train_step"] += 1
        m = inner_step(groups)
        calls["updates"] += int(m["updates"])
        calls["naive"] = calls.get("naive", 0) + sum(len(g.prompt_ids) + len(a) for g in groups for a in g.actions)
        return m

    trainer.train_step = counted
    settings = E2ESettings(group_size=8, tasks_per_batch=4, max_steps=STEPS, reward="full_task", temperature=1.0,
                           max_tokens=16, max_steps_per_turn=1, max_context=2048, judge="pivotrl", seed=0,
                           weight_sync="memory")
    history, ledger = run_e2e(trainer, engine, tok, [toy_task(i) for i in range(4)], settings, executor=ToyEnv,
                              work_dir=tmp_path)
    # π_old reached the engine in memory every step (nothing exported) and the check held in fp32.
    assert not list(tmp_path.glob("policy-*"))
    assert all(h["refresh_max_abs_delta"] <= 1e-4 for h in history if h["train_updates"]), history
    rewards = [h["reward_mean"] for h in history]
    # Reward rises: the policy learns to call the tool from the first user turn.
    assert sum(rewards[-4:]) / 4 > sum(rewards[:4]) / 4 + 0.15, rewards
    # Ledger counts equal the independently counted calls.
    assert ledger.model_calls == engine.generations == sum(h["model_calls"] for h in history)
    assert ledger.generated_tokens == engine.tokens
    # Policy executions only: the ground-truth environment replays the demo calls too (one per turn).
    policy_exec = sum(ToyEnv.executed) - len(history) * 4 * 8
    assert ledger.tool_executions == policy_exec
    assert ledger.optimizer_steps == calls["updates"] == calls["train_step"] == len(history)
    assert ledger.trainer_tokens_naive == calls["naive"]
    assert 0 < ledger.trainer_tokens <= ledger.trainer_tokens_naive
    assert set(ledger.wall_s) == {"rollout", "train", "refresh"} and ledger.peak_memory_bytes > 0



def test_a_wall_time_budget_stops_at_the_first_step_past_it(warm: Path, tmp_path: Path) -> None:
    tok = tiny_tokenizer()
    engine = TransformersEngine(str(warm), dtype="fp32")
    trainer = PivotRLTrainer.build(warm, group_size=2, dtype="float32", lr=1e-3, beta=0.0, micro_batch_groups=8,
                                   pivots_per_batch=8, seed=0)
    settings = E2ESettings(group_size=2, tasks_per_batch=1, max_steps=50, reward="full_task", max_tokens=8,
                           max_steps_per_turn=1, max_context=2048, judge="pivotrl", seed=0, max_wall_s=1e-3,
                           weight_sync="disk")
    history, ledger = run_e2e(trainer, engine, tok, [toy_task(0)], settings, executor=ToyEnv, work_dir=tmp_path)
    assert len(history) == 1 and ledger.model_calls > 0  # the first step already passed 1 ms of 50 allowed
    if history[0].get("train_updates"):  # the disk path's refresh is checked the same way (after an update)
        assert history[0]["refresh_max_abs_delta"] <= 1e-4
    # the bounds of the settings are the config schema's, checked once when the config is validated
    from pivotrl.config import load_config

    with pytest.raises(ConfigError, match=r"rollout\.weight_sync"):
        load_config(None, ["rollout.weight_sync=nccl"])
    with pytest.raises(ConfigError, match=r"compare\.e2e_group_size"):
        load_config(None, ["compare.e2e_group_size=1"])


def test_a_rollout_turn_budget_and_the_held_out_curve_every_n_steps(warm: Path, tmp_path: Path) -> None:
    """``max_model_calls``: the loop stops at the first step whose episodes' model calls so far reach
    it; the held-out curve hook runs before the first step, every ``eval_every`` steps and after the
    last (which the budget decides), and every row carries the rollout turns so far."""
    import pandas as pd

    from pivotrl.evaluation.learning_curve import learning_curve

    tok = tiny_tokenizer()
    engine = TransformersEngine(str(warm), dtype="fp32")
    trainer = PivotRLTrainer.build(warm, group_size=2, dtype="float32", lr=1e-3, beta=0.0, micro_batch_groups=8,
                                   pivots_per_batch=8, seed=0)
    seen: list[int] = []

    def evaluate(step: int) -> dict[str, float]:
        seen.append(step)
        return {"heldout_n": 4.0, "heldout_accepted": float(min(step, 4)), "heldout_accuracy": min(step, 4) / 4}

    settings = E2ESettings(group_size=2, tasks_per_batch=1, max_steps=50, reward="full_task", max_tokens=8,
                           max_steps_per_turn=1, max_context=2048, judge="pivotrl", seed=0, weight_sync="memory",
                           max_model_calls=5, eval_every=2)
    history, ledger = run_e2e(trainer, engine, tok, [toy_task(0)], settings, executor=ToyEnv, work_dir=tmp_path,
                              evaluate=evaluate)
    turns = [h["rollout_turns"] for h in history]
    assert turns == [sum(h["model_calls"] for h in history[: i + 1]) for i in range(len(history))]
    assert turns[-1] == ledger.model_calls >= 5 > turns[-2]  # the first step at or past the budget
    last = len(history)
    assert seen == sorted({0, *range(2, last + 1, 2), last})
    curve = learning_curve(pd.DataFrame(history))["heldout"]
    assert [p["step"] for p in curve] == seen and curve[0]["rollout_turns"] == 0
    assert [p["rollout_turns"] for p in curve[1:]] == [int(turns[s - 1]) for s in seen[1:]]
