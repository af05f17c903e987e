"""Full-task evaluation on real BFCL multi_turn_base tasks, and local accuracy.

The judging logic is tested with a scripted policy (``ScriptedEngine``: a real class whose
``generate`` returns predetermined action texts, chosen per task) against BFCL's real simulators;
the end-to-end path with the real ``TransformersEngine`` on the tiny random model.
"""

from __future__ import annotations

import dataclasses
import os
from typing import Callable, Sequence

import pandas as pd
import pytest

from pivotrl.format.actions import format_action, format_call
from pivotrl.bfcl.data import load_bfcl
from pivotrl.bfcl.multi_turn import CLOSING_TEXT
from pivotrl.bfcl.wheel import ensure_bfcl
from pivotrl.data.schema import Trajectory, TurnState
from pivotrl.data.states import extract_turn_states
from pivotrl.core.errors import ConfigError
from pivotrl.evaluation.full_task import (
    SANDBOX_FUNCTIONS,
    evaluate_full_tasks,
    missing_outputs,
    public_state,
    sandbox_executor,
    split_user_turns,
)
from pivotrl.evaluation.local import evaluate_local, evaluate_local_groups
from pivotrl.format.prompts import encode_state
from pivotrl.rollout.base import Generation, SamplingConfig
from pivotrl.testing import tiny_llama, tiny_tokenizer
from pivotrl.verifiers import get_verifier

# Needs the pinned BFCL data (downloaded once into the cache): not in `make test-fast`.
pytestmark = pytest.mark.data

BIG_CONTEXT = 1 << 16
GREEDY = SamplingConfig(n=1, temperature=0.0, max_tokens=32)


@pytest.fixture(scope="module")
def bfcl_root():
    return ensure_bfcl(os.environ["PIVOTRL_CACHE_DIR"])


@pytest.fixture(scope="module")
def tasks(bfcl_root) -> list[Trajectory]:
    return load_bfcl(["multi_turn_base"], os.environ["PIVOTRL_CACHE_DIR"], limit_per_category=8)


@pytest.fixture(scope="module")
def tok():
    return tiny_tokenizer()


class ScriptedEngine:
    """A scripted policy: for the task whose first user message a prompt contains, it answers
    with the next text of that task's script (or ``fallback`` once the script is used up)."""

    def __init__(self, tokenizer, scripts: dict[str, tuple[str, list[str]]], fallback: str = "Done.") -> None:
        self.tokenizer = tokenizer
        self.scripts = {key: list(texts) for key, (_, texts) in scripts.items()}
        self.markers = {key: marker for key, (marker, _) in scripts.items()}
        self.fallback = fallback
        self.batch_sizes: list[int] = []
        self.prompts: dict[str, list[list[int]]] = {key: [] for key in scripts}

    def _task_of(self, text: str) -> str:
        found = [key for key, marker in self.markers.items() if marker in text]
        if len(found) != 1:
            raise AssertionError(f"prompt matches {len(found)} scripted tasks")
        return found[0]

    def generate(self, prompts: Sequence[list[int]], sampling: SamplingConfig) -> list[list[Generation]]:
        self.batch_sizes.append(len(prompts))
        out = []
        for ids in prompts:
            key = self._task_of(self.tokenizer.decode(ids))
            self.prompts[key].append(list(ids))
            text = self.scripts[key].pop(0) if self.scripts[key] else self.fallback
            token_ids = self.tokenizer(text, add_special_tokens=False)["input_ids"] + [self.tokenizer.eos_token_id]
            out.append([Generation(token_ids=token_ids, text=text, rollout_logprobs=[0.0] * len(token_ids), finish_reason="stop")])
        return out


def first_user(traj: Trajectory) -> str:
    return next(m.content for m in traj.messages if m.role == "user")


def script(tasks: list[Trajectory], make: Callable[[Trajectory], list[str]]) -> dict[str, tuple[str, list[str]]]:
    return {t.id: (first_user(t), make(t)) for t in tasks}


def demo_actions(traj: Trajectory) -> list[str]:
    """The demonstration's own assistant messages as action texts, in order."""
    return [format_action(m) for m in traj.messages if m.role == "assistant"]


def per_turn_lists(traj: Trajectory) -> list[str]:
    """Each turn's demo calls as one parallel call list, then the closing text."""
    out: list[str] = []
    for turn in split_user_turns(traj)[1]:
        if turn.demo_calls:
            out.append("[" + ", ".join(format_call(c) for c in turn.demo_calls) + "]")
        out.append(CLOSING_TEXT)
    return out


def run(engine, tok, trajs, bfcl_root, **kw):
    opts = dict(bfcl_root=bfcl_root, sampling=GREEDY, max_context=BIG_CONTEXT, max_steps_per_turn=16)
    opts.update(kw)
    return evaluate_full_tasks(engine, tok, trajs, **opts)


# ------------------------------------------------------------------------------------- unit rules


def test_missing_outputs_is_a_multiset_subset_check():
    assert missing_outputs(["a", "b"], ["b", "x", "a"]) == []
    assert missing_outputs(["a", "a"], ["a"]) == ["a"]
    assert missing_outputs(["a", "a"], ["a", "a", "a"]) == []
    assert missing_outputs([], []) == []
    assert missing_outputs(["None"], []) == ["None"]


def test_public_state_drops_private_attributes():
    snap = {"GorillaFileSystem": {"root": {"name": "r"}, "_current_dir": "r/a"}, "MathAPI": {}}
    assert public_state(snap) == {"GorillaFileSystem": {"root": {"name": "r"}}, "MathAPI": {}}


def test_split_user_turns_matches_bfcl_ground_truth(tasks):
    for traj in tasks:
        system, turns = split_user_turns(traj)
        assert system == ()
        assert len(turns) == len(traj.meta["ground_truth"])
        assert [len(t.demo_calls) for t in turns] == [len(g) for g in traj.meta["ground_truth"]]
    turns0 = split_user_turns(tasks[0])[1]  # multi_turn_base_0
    assert [format_call(c) for c in turns0[1].demo_calls] == [
        "cd(folder='temp')",
        "grep(file_name='final_report.pdf', pattern='budget analysis')",
    ]


# ------------------------------------------------------------------------ scripted policies, real tasks


def test_demonstration_actions_succeed_on_every_turn(tasks, tok, bfcl_root):
    engine = ScriptedEngine(tok, script(tasks, demo_actions), fallback="unused")
    df, summary = run(engine, tok, tasks, bfcl_root)
    assert df["success"].all(), df[["task_id", "reason", "detail"]].to_string()
    assert (df["turns_passed"] == df["n_turns"]).all()
    assert df["first_failed_turn"].isna().all() and (df["reason"] == "").all()
    for traj, row in zip(tasks, df.itertuples()):
        n_assistant = sum(m.role == "assistant" for m in traj.messages)
        n_calls = sum(len(m.tool_calls) for m in traj.messages)
        assert (row.task_id, row.model_calls, row.tool_calls, row.format_errors) == (traj.id, n_assistant, n_calls, 0)
        assert engine.scripts[traj.id] == []  # every scripted action was used, none more
    assert summary["n_tasks"] == 8 and summary["n_success"] == 8 and summary["success_rate"] == 1.0
    assert summary["turn_pass_rate"] == 1.0 and summary["failure_reasons"] == {}
    # All 8 tasks are generated for together at the first step (the engine batches).
    assert engine.batch_sizes[0] == 8 and sum(engine.batch_sizes) == int(df["model_calls"].sum())


def test_history_grows_with_real_tool_outputs(tasks, tok, bfcl_root):
    traj = tasks[0]  # multi_turn_base_0
    engine = ScriptedEngine(tok, script([traj], demo_actions))
    run(engine, tok, [traj], bfcl_root)
    prompts = engine.prompts[traj.id]
    assert all(len(a) < len(b) for a, b in zip(prompts, prompts[1:]))
    # The policy's own history, rendered at its last call, is byte-identical to the demonstration's
    # state before its last assistant message (whose tool outputs come from the real simulator).
    last = max(i for i, m in enumerate(traj.messages) if m.role == "assistant")
    state = TurnState("s", traj.id, 0, traj.messages[:last], traj.tools, traj.messages[last])
    assert prompts[-1] == encode_state(state, tok, max_len=BIG_CONTEXT)
    text = tok.decode(prompts[-1])
    assert "<|im_start|>tool\n{\"current_working_directory\": \"document\"}<|im_end|>" in text
    assert "'final_report.pdf' moved to 'temp/final_report.pdf'" in text
    # The second prompt is the first one + the action + its real output + a new generation header.
    second = tok.decode(prompts[1])
    assert second.endswith(
        "<|im_start|>assistant\n[cd(folder='document')]<|im_end|>\n"
        "<|im_start|>tool\n{\"current_working_directory\": \"document\"}<|im_end|>\n<|im_start|>assistant\n"
    )


def test_parallel_call_lists_per_turn_succeed(tasks, tok, bfcl_root):
    engine = ScriptedEngine(tok, script(tasks[:4], per_turn_lists))
    df, summary = run(engine, tok, tasks[:4], bfcl_root, max_steps_per_turn=2)
    assert df["success"].all(), df[["task_id", "reason", "detail"]].to_string()
    assert list(df["model_calls"]) == [2 * n for n in df["n_turns"]]


def _without(traj: Trajectory, drop: str) -> list[str]:
    return [a for a in demo_actions(traj) if a != drop]


def test_skipping_a_state_changing_call_fails_that_turn_on_state(tasks, tok, bfcl_root):
    traj = tasks[0]  # turn 0: cd(document), mkdir(temp), mv(final_report.pdf → temp)
    engine = ScriptedEngine(tok, script([traj], lambda t: _without(t, "[mkdir(dir_name='temp')]")))
    df, summary = run(engine, tok, [traj], bfcl_root)
    row = df.iloc[0]
    # Without mkdir, mv renames the file to 'temp': the file system differs from the ground truth.
    assert (bool(row.success), row.turns_passed, row.first_failed_turn, row.reason) == (False, 0, 0, "state_mismatch")
    assert "GorillaFileSystem.root" in row.detail
    assert row.model_calls == 3 and row.tool_calls == 2  # cd, mv, then "Done."
    assert summary["failure_reasons"] == {"state_mismatch": 1}


def test_skipping_a_read_only_call_fails_that_turn_on_response(tasks, tok, bfcl_root):
    traj = tasks[0]  # turn 1: cd(temp), grep(final_report.pdf, 'budget analysis') — grep changes nothing
    grep = "[grep(file_name='final_report.pdf', pattern='budget analysis')]"
    engine = ScriptedEngine(tok, script([traj], lambda t: _without(t, grep)))
    df, _ = run(engine, tok, [traj], bfcl_root)
    row = df.iloc[0]
    assert (bool(row.success), row.turns_passed, row.first_failed_turn, row.reason) == (False, 1, 1, "response_mismatch")
    assert "1 ground-truth output(s) missing" in row.detail and "budget analysis" in row.detail
    # Evaluation stopped at the failing turn: turn 0 (3 calls + Done) and turn 1 (cd + Done).
    assert (row.model_calls, row.tool_calls) == (6, 4)


def test_a_call_made_one_turn_early_still_counts(tasks, tok, bfcl_root):
    # BFCL's response check looks at the outputs of all turns so far: moving turn 1's cd(temp)
    # into turn 0 (the current directory is private, so turn 0's state check still passes) passes.
    traj = tasks[0]
    actions = demo_actions(traj)
    i_done = actions.index(CLOSING_TEXT)
    actions.remove("[cd(folder='temp')]")
    actions.insert(i_done, "[cd(folder='temp')]")
    engine = ScriptedEngine(tok, script([traj], lambda t: actions))
    df, _ = run(engine, tok, [traj], bfcl_root)
    assert bool(df.iloc[0].success), df.iloc[0].detail


def test_text_only_policy_fails_every_task_at_turn_zero(tasks, tok, bfcl_root):
    engine = ScriptedEngine(tok, script(tasks, lambda t: []), fallback="I cannot do that.")
    df, summary = run(engine, tok, tasks, bfcl_root)
    assert not df["success"].any()
    assert (df["reason"] == "empty_turn").all() and (df["first_failed_turn"] == 0).all()
    assert (df["model_calls"] == 1).all() and (df["tool_calls"] == 0).all() and (df["format_errors"] == 0).all()
    assert summary["success_rate"] == 0.0 and summary["failure_reasons"] == {"empty_turn": 8}
    assert summary["model_calls"] == 8 and engine.batch_sizes == [8]


def test_unparsable_output_is_a_format_error_that_ends_the_turn(tasks, tok, bfcl_root):
    traj = tasks[1]  # multi_turn_base_1, turn 0: ls(a=True)
    engine = ScriptedEngine(tok, script([traj], lambda t: ["[ls(a=True)", "[ls(a=True)]"]))
    df, summary = run(engine, tok, [traj], bfcl_root)
    row = df.iloc[0]
    assert (row.format_errors, row.model_calls, row.tool_calls, row.reason) == (1, 1, 0, "empty_turn")
    assert summary["format_error_rate"] == 1.0


def test_step_limit_quits_the_task_as_bfcl_does(tasks, tok, bfcl_root):
    # BFCL (base_handler.py): after each executing step count += 1; count > limit quits the task.
    # Turn 0 needs 3 calls: with a limit of 2 the third executing step quits; that turn is still
    # judged (it passes), and the task fails as force-terminated (BFCL's length check).
    traj = tasks[0]
    for judge in ("bfcl", "pivotrl"):
        engine = ScriptedEngine(tok, script([traj], demo_actions))
        df, _ = run(engine, tok, [traj], bfcl_root, max_steps_per_turn=2, judge=judge)
        row = df.iloc[0]
        assert (row.model_calls, row.tool_calls, row.reason, row.turns_passed) == (3, 3, "force_terminated", 1)


def test_context_overflow_ends_the_task(tasks, tok, bfcl_root):
    traj = tasks[0]
    p0 = len(encode_state(TurnState("s", traj.id, 0, traj.messages[:1], traj.tools, traj.messages[1]), tok, max_len=BIG_CONTEXT))
    engine = ScriptedEngine(tok, script([traj], demo_actions))
    # Room for the first prompt and 32 new tokens, but not for the second prompt.
    df, summary = run(engine, tok, [traj], bfcl_root, max_context=p0 + 32 + 5)
    row = df.iloc[0]
    assert (row.reason, row.model_calls, row.turns_passed, row.first_failed_turn) == ("context", 1, 0, 0)
    assert row.max_prompt_tokens == p0
    assert summary["failure_reasons"] == {"context": 1}


def test_bad_settings_are_rejected(tasks, tok, bfcl_root):
    engine = ScriptedEngine(tok, {})
    with pytest.raises(ConfigError, match="max_steps_per_turn"):
        run(engine, tok, tasks[:1], bfcl_root, max_steps_per_turn=0)
    with pytest.raises(ConfigError, match="sampling.n must be 1"):
        run(engine, tok, tasks[:1], bfcl_root, sampling=SamplingConfig(n=2))
    with pytest.raises(ConfigError, match="bfcl_root is required"):
        run(engine, tok, tasks[:1], None)


def test_sandboxed_execution_gives_the_same_results(tasks, tok, bfcl_root):
    from pivotrl.envs.sandbox import SandboxPool

    trajs = tasks[:2]
    with SandboxPool(num_workers=1, timeout_s=60, bfcl_root=bfcl_root, functions=SANDBOX_FUNCTIONS) as pool:
        engine = ScriptedEngine(tok, script(trajs, lambda t: _without(t, "[mkdir(dir_name='temp')]")))
        df, _ = run(engine, tok, trajs, bfcl_root, executor=sandbox_executor(pool))
    local_engine = ScriptedEngine(tok, script(trajs, lambda t: _without(t, "[mkdir(dir_name='temp')]")))
    expected, _ = run(local_engine, tok, trajs, bfcl_root)
    assert df.equals(expected)
    assert list(df["success"]) == [False, True]  # base_0 lost its mkdir; base_1 has none
    with pytest.raises(ConfigError, match="SANDBOX_FUNCTIONS"):
        sandbox_executor(SandboxPool(num_workers=1))


# ----------------------------------------------------------------------- real engine, tiny model


def test_transformers_engine_end_to_end(tasks, tok, bfcl_root):
    from pivotrl.rollout.hf import TransformersEngine

    engine = TransformersEngine(tiny_llama(tok, seed=0), tok, max_model_len=2048)
    trajs = [tasks[1], tasks[3]]  # 18 tools each: ≈1,150 prompt tokens with the tiny tokenizer
    sampling = SamplingConfig(n=1, temperature=1.0, max_tokens=24)
    df, summary = evaluate_full_tasks(
        engine, tok, trajs, bfcl_root=bfcl_root, sampling=sampling, seed=3, max_context=2048, max_steps_per_turn=2
    )
    assert list(df["task_id"]) == [t.id for t in trajs]
    assert not df["success"].any()  # a random model does not solve BFCL tasks
    for row in df.itertuples():
        assert row.reason in ("empty_turn", "state_mismatch", "response_mismatch", "context")
        assert 1 <= row.model_calls <= 2 * (row.turns_passed + 1)
        assert row.format_errors <= row.model_calls
        assert row.model_calls <= row.tokens_generated <= 24 * row.model_calls
        assert row.turns_passed == row.first_failed_turn
    assert summary["model_calls"] == int(df["model_calls"].sum())
    assert summary["tokens_generated"] == int(df["tokens_generated"].sum())
    assert sum(summary["failure_reasons"].values()) == 2


# ---------------------------------------------------------------------------------- local accuracy


def test_local_accuracy_counts_accepted_actions(tasks, tok):
    states = extract_turn_states(tasks[0])[:3]  # demo actions: cd, mkdir, mv
    verifier = get_verifier("tool_name")
    marker = {s.state_id: s for s in states}
    # A policy that answers cd(...) at every state: right at state 0 only; and one unparsable answer.
    texts = {states[0].state_id: "[cd(folder='x')]", states[1].state_id: "[cd(folder='y')]", states[2].state_id: "[mv("}

    class PerStateEngine:
        def generate(self, prompts, sampling):
            out = []
            for ids in prompts:
                key = next(k for k, s in marker.items() if ids == encode_state(s, tok, max_len=BIG_CONTEXT))
                ids_out = tok(texts[key], add_special_tokens=False)["input_ids"]
                out.append([Generation(ids_out, texts[key], [0.0] * len(ids_out), "stop")] * sampling.n)
            return out

    df, summary = evaluate_local(PerStateEngine(), tok, states, verifier, sampling=GREEDY, n=2, max_context=BIG_CONTEXT)
    assert list(df["n_accepted"]) == [2, 0, 0] and list(df["accuracy"]) == [1.0, 0.0, 0.0]
    assert list(df["parse_errors"]) == [0, 0, 2]
    assert list(df["reasons"]) == [{"match": 2}, {"wrong_tool": 2}, {"parse_error": 2}]
    assert summary["n_samples"] == 6 and summary["n_accepted"] == 2
    assert summary["accuracy"] == pytest.approx(1 / 3) and summary["any_accepted_rate"] == pytest.approx(1 / 3)
    assert summary["parse_error_rate"] == pytest.approx(1 / 3)
    # A state too long for the context is skipped and counted, not truncated.
    short = len(encode_state(states[0], tok, max_len=BIG_CONTEXT))
    df2, s2 = evaluate_local(PerStateEngine(), tok, states, verifier, sampling=GREEDY, max_context=short + 32)
    assert list(df2["status"]) == ["ok", "too_long", "too_long"]
    assert (s2["n_states"], s2["n_too_long"], s2["n_samples"], s2["accuracy"]) == (1, 2, 1, 1.0)

    # Several measures at once: one engine call for all of them (batches of batch_size prompts,
    # each with its job's sampling), the same tables and summaries as one evaluate_local each.
    class GroupEngine(PerStateEngine):
        calls: list[list[tuple[int, int]]] = []

        def generate_groups(self, groups):
            self.calls.append([(len(p), s.n) for p, s in groups])
            return [self.generate(p, s) for p, s in groups]

    eng = GroupEngine()
    jobs = [(states, GREEDY), (states, dataclasses.replace(GREEDY, n=3)), (states[:1], GREEDY), ([], GREEDY)]
    together = evaluate_local_groups(eng, tok, jobs, verifier, max_context=BIG_CONTEXT, batch_size=2)
    assert eng.calls == [[(2, 1), (1, 1), (2, 3), (1, 3), (1, 1)]]
    for (frame, summ), (chosen, samp) in zip(together, jobs):
        alone_df, alone = evaluate_local(PerStateEngine(), tok, chosen, verifier, sampling=samp, max_context=BIG_CONTEXT)
        pd.testing.assert_frame_equal(frame, alone_df)
        assert summ == pytest.approx(alone, nan_ok=True)
    assert [s["n_samples"] for _, s in together] == [3, 9, 1, 0]
