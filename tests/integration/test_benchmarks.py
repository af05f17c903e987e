"""The benchmark scripts run in their --quick mode on the tiny model and print well-formed tables."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "benchmarks"))

from _common import md_table, parse_md_tables  # noqa: E402

# Several processes each (launchers, stage subprocesses, benchmark scripts): not in `make test-fast`.
pytestmark = pytest.mark.integration


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory) -> Path:
    from pivotrl.testing import save_tiny_checkpoint

    return save_tiny_checkpoint(tmp_path_factory.mktemp("bench") / "tiny")


def _run(*args: str, timeout: int = 300) -> str:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false"}
    proc = subprocess.run([sys.executable, *args], cwd=str(REPO), env=env, capture_output=True, text=True,
                          timeout=timeout)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return proc.stdout


def _num(cell: str) -> float:
    return float(cell.rstrip("x"))


def test_md_table_round_trips_through_the_parser():
    text = "intro\n\n" + md_table(["a", "b"], [["x", 1.0], ["y", 2500.4]]) + "\n\nafter\n" + md_table(["c"], [[0.01234]])
    tables = parse_md_tables(text)
    assert tables == [[{"a": "x", "b": "1"}, {"a": "y", "b": "2500"}], [{"c": "0.012"}]]


def test_bench_trainer_quick(tiny_model):
    out = _run("benchmarks/bench_trainer.py", "--quick", "--model", str(tiny_model))
    groups, summary = parse_md_tables(out)
    assert list(groups[0]) == ["group", "P", "T_max", "K", "shared tokens", "naive tokens", "token ratio", "shared s",
                               "naive s", "speed-up", "shared tok/s", "naive tok/s", "load (shared)", "load (naive)"]
    assert len(groups) == 2
    for row in groups:
        p, t, k = int(row["P"]), int(row["T_max"]), int(row["K"])
        assert k == 4 and 64 <= p <= 128 and 3 <= t <= 12
        # tokens run through the model: P + K·(T_max−1) shared, K·(P+T_max−1) naive
        assert int(row["shared tokens"]) == p + k * (t - 1)
        assert int(row["naive tokens"]) == k * (p + t - 1)
        for col in ("shared s", "naive s", "speed-up", "shared tok/s", "naive tok/s"):
            assert _num(row[col]) > 0, col
    assert [r["mode"] for r in summary] == ["shared", "naive"]
    assert all(_num(r["s per group"]) > 0 and _num(r["processed tok/s"]) > 0 for r in summary)
    assert "naive/shared processed tokens (median)" in out


def test_bench_rollout_quick(tiny_model):
    out = _run("benchmarks/bench_rollout.py", "--quick", "--model", str(tiny_model))
    (table,) = parse_md_tables(out)
    assert list(table[0]) == ["engine", "dtype", "start s", "gen tokens", "wall s", "gen tok/s", "min tok/s",
                              "max tok/s", "speed-up vs transformers-noreuse", "load"]
    assert [r["engine"] for r in table] == ["transformers", "transformers-noreuse"]
    for row in table:
        # 2 prompts × n=4 samples × at most 8 tokens
        assert 0 < _num(row["gen tokens"]) <= 64
        assert _num(row["gen tok/s"]) > 0 and _num(row["wall s"]) > 0
    assert _num(table[1]["speed-up vs transformers-noreuse"]) == 1.0


def test_run_all_quick_trainer_writes_the_combined_file(tiny_model, tmp_path):
    out_file = tmp_path / "results.md"
    _run("benchmarks/run_all.py", "--quick", "--only", "trainer,trl", "--model", str(tiny_model),
         "--out", str(out_file), "--trl-python", "")
    text = out_file.read_text()
    assert text.startswith("# pivotrl benchmarks (quick)")
    assert "## Trainer: shared-prefix vs naive forward+backward" in text
    assert "## TRL comparison\n\nskipped" in text
    assert len(parse_md_tables(text)) == 2


@pytest.mark.integration
def test_bench_pipeline_quick():
    out = _run("benchmarks/bench_pipeline.py", "--quick", timeout=900)
    flows, tasks, memory = parse_md_tables(out)
    assert [r["flow run"] for r in flows] == ["cold", "re-run 1"]
    cold, rerun = flows
    assert 0 <= _num(cold["overhead fraction"]) < 1
    assert _num(rerun["wall / cold wall"]) > 0  # a speed claim belongs to benchmarks/RESULTS.md, not here
    assert {r["task"] for r in tasks} >= {"demonstrations", "reference", "probe", "train", "evaluate"}
    assert all(r["final state"] == "Completed" for r in tasks)
    assert {r["reused"] for r in tasks if r["flow run"] == "cold"} == {"no"}
    assert {r["reused"] for r in tasks if r["flow run"] == "re-run 1"} == {"yes"}
    assert {r["stage"] for r in memory} >= {"reference", "probe", "train", "evaluate"}
    assert all(_num(r["peak RSS MiB"]) > 0 for r in memory)


def test_packed_variant_equals_the_naive_computation():
    import random

    import torch

    from bench_trainer import packed_group_logprobs
    from pivotrl.testing import tiny_llama, tiny_tokenizer
    from pivotrl.training.logprobs import compute_group_logprobs

    model = tiny_llama(tiny_tokenizer(), seed=0).double()
    rng = random.Random(0)
    prompt = [rng.randrange(100) for _ in range(40)]
    actions = [[rng.randrange(100) for _ in range(n)] for n in (1, 7, 3, 5)]  # T_max = 7, one single-token action
    naive = compute_group_logprobs(model, prompt, actions, shared_prefix=False)
    packed, mask = packed_group_logprobs(model, prompt, actions)
    assert torch.equal(mask, naive.action_mask.float())
    assert torch.allclose(packed, naive.logprobs, atol=1e-5, rtol=0)
    naive.logprobs.sum().backward()
    expected = [p.grad.clone() for p in model.parameters()]
    model.zero_grad()
    packed.sum().backward()
    for want, got in zip(expected, (p.grad for p in model.parameters())):
        assert torch.allclose(got, want, atol=1e-5 * float(want.abs().max()) + 1e-12, rtol=0)


def test_e2e_signal_counts_groups_whose_episodes_differ_in_reward():
    from bench_e2e_signal import group_stats
    from pivotrl.training.e2e import E2E_REWARDS, Episode

    def ep(task: str, i: int, passed: int, action: list[int]) -> Episode:
        return Episode(task_id=task, index=i, calls=[([1, 2], action)], success=passed == 2, turns_passed=passed,
                       n_turns=2)

    same = [ep("a", i, 1, [5]) for i in range(4)]  # one text, one outcome: no signal under either reward
    mixed = [ep("b", 0, 2, [6]), ep("b", 1, 1, [7]), ep("b", 2, 1, [7]), ep("b", 3, 0, [8])]
    partial = [ep("c", 0, 1, [9]), ep("c", 1, 0, [9, 1]), ep("c", 2, 0, [9, 2]), ep("c", 3, 0, [9, 3])]
    s = group_stats([same, mixed, partial], E2E_REWARDS)
    assert (s["groups"], s["episodes"], s["model_calls"]) == (3, 12, 12)
    assert s["varied_full_task"] == 1  # only b has an episode that passed every turn
    assert s["varied_per_turn"] == 2  # b and c pass different numbers of turns
    assert s["mean_reward_full_task"] == 1 / 12
    assert s["mean_reward_per_turn"] == (0.5 * 4 + (1 + 0.5 + 0.5) + 0.5) / 12
    assert s["distinct_first_call"] == (1 + 3 + 4) / 3
    assert s["turns_passed"] == {0: 4, 1: 7, 2: 1}


def test_e2e_signal_tells_the_turns_without_calls_from_those_with_calls():
    from bench_e2e_signal import call_turns_passed
    from pivotrl.data.schema import Message, ToolCall, Trajectory
    from pivotrl.training.e2e import Episode

    def task(tid: str, first_turn_calls: bool) -> Trajectory:
        call = ToolCall(id="c1", name="ls", arguments={})
        turn1 = [Message(role="assistant", tool_calls=(call,)), Message(role="tool", content="x", tool_call_id="c1")]
        msgs = [Message(role="system", content="s"), Message(role="user", content="u1"),
                *(turn1 if first_turn_calls else [Message(role="assistant", content="which folder?")]),
                Message(role="user", content="u2"), Message(role="assistant", tool_calls=(call,))]
        return Trajectory(id=tid, messages=tuple(msgs), tools=())

    def eps(tid: str, passed: list[int]) -> list[Episode]:
        return [Episode(task_id=tid, index=i, calls=[], turns_passed=p, n_turns=2) for i, p in enumerate(passed)]

    tasks = [task("ask", False), task("call", True)]
    c = call_turns_passed([eps("ask", [1, 1, 1]), eps("call", [0, 1, 0])], tasks)
    assert c == {"tasks_first_turn_without_calls": 1, "tasks_first_turn_passed_by_all": 1, "of_those_without_calls": 1,
                 "episodes_passing_a_call_turn": 1, "episodes": 6}
    c = call_turns_passed([eps("ask", [2, 1, 0]), eps("call", [0, 0, 0])], tasks)
    assert c["tasks_first_turn_passed_by_all"] == 0 and c["episodes_passing_a_call_turn"] == 1  # "ask" passed turn 2
