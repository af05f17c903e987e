"""The PivotRL loop without a store: the transformers engine on a tiny random model, a real trainer
and a toy verifier (pivotrl.training.loop), and the one undecided-state policy of sample → score
(pivotrl.rollout.scoring) as probing, training and local evaluation see it."""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace

import pytest

from pivotrl.core.errors import TrainingError, VerifierError
from pivotrl.rollout import SamplingConfig, make_engine
from pivotrl.rollout.scoring import sample_and_score
from pivotrl.testing import save_tiny_checkpoint
from pivotrl.training.loop import LoopHooks, pivot_schedule, run_rl_loop
from pivotrl.training.refresh_check import check_refresh
from pivotrl.verifiers import VerifierResult


class ToyVerifier:
    """Accepts an action whose text has an even number of characters; cannot decide at "undecided"
    states (a sandbox that keeps failing); returns one result too few at "partial" states."""

    def __init__(self) -> None:
        self.calls: list[str] = []

    def score(self, state, actions):
        self.calls.append(state.state_id)
        if state.state_id.startswith("undecided"):
            raise VerifierError(f"turn state {state.state_id!r}: sandbox crashed after 2 retries")
        out = [VerifierResult.accept() if len(a) % 2 == 0 else VerifierResult.reject("odd") for a in actions]
        return out[:-1] if state.state_id.startswith("partial") else out


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return save_tiny_checkpoint(tmp_path_factory.mktemp("tiny") / "model")


@pytest.fixture()
def engine(ckpt: Path):
    eng = make_engine("transformers", str(ckpt), dtype="fp32", max_model_len=256)
    yield eng
    eng.close()


def _states(*names: str):
    return [SimpleNamespace(state_id=n) for n in names]


PROMPTS = [[5, 17, 42, 9, 11], [7, 8, 9], [100, 3, 64, 2], [12, 13, 14, 15, 16, 17]]


def test_sample_and_score_returns_undecided_states_counted_never_scored(engine) -> None:
    states = _states("a", "undecided-1", "partial-1", "b")
    got = sample_and_score(engine, ToyVerifier(), states, PROMPTS, SamplingConfig(n=3, max_tokens=6, seed=1))
    assert [g.state.state_id for g in got] == ["a", "undecided-1", "partial-1", "b"]
    assert [g.decided for g in got] == [True, False, False, True]
    assert all(len(g.samples) == 3 for g in got)  # the samples are kept, also of undecided states
    assert "sandbox crashed" in got[1].error and "2 results for 3 actions" in got[2].error
    assert got[0].rewards == [1.0 if len(x.text) % 2 == 0 else 0.0 for x in got[0].samples]
    with pytest.raises(ValueError, match="undecided-1"):
        got[1].rewards
    with pytest.raises(ValueError, match="4 states, 3 prompts"):
        sample_and_score(engine, ToyVerifier(), states, PROMPTS[:3], SamplingConfig(n=1))


def _prompted_states(monkeypatch, ids: list[str]) -> list[SimpleNamespace]:
    """Turn states whose prompts are given directly (the renderer is tested on its own; engine and
    scoring are real): the i-th id gets ``PROMPTS[i]``."""
    import pivotrl.evaluation.local as local

    prompts = dict(zip(ids, PROMPTS))
    monkeypatch.setattr(local, "encode_state", lambda state, tokenizer, max_len, **kw: prompts[state.state_id])
    return [SimpleNamespace(state_id=sid, trajectory_id="t", turn_index=i, category="c") for i, sid in enumerate(ids)]


def test_local_evaluation_counts_an_undecided_state_instead_of_failing(engine, ckpt: Path, monkeypatch) -> None:
    from transformers import AutoTokenizer

    import pivotrl.evaluation.local as local

    tok = AutoTokenizer.from_pretrained(str(ckpt))
    states = _prompted_states(monkeypatch, ["a", "undecided-1"])
    df, summ = local.evaluate_local(engine, tok, states, ToyVerifier(),
                                    sampling=SamplingConfig(n=2, max_tokens=6, seed=0), max_context=256)
    assert list(df["status"]) == ["ok", "verifier_error"]
    assert summ["n_states"] == 1 and summ["n_verifier_error"] == 1 and summ["n_samples"] == 2


def test_local_evaluation_counts_accepted_actions_that_are_not_the_demonstrated_calls(engine, ckpt: Path,
                                                                                    monkeypatch) -> None:
    """Held-out states scored by a verifier that accepts every action, some as equivalent to the
    demonstration rather than equal to it: the summary counts those, the report says how many of
    each policy's accepted actions they are."""
    from transformers import AutoTokenizer

    import pivotrl.evaluation.local as local
    from pivotrl.evaluation.report_data import policy_row
    from pivotrl.evaluation.report_markdown import _results_tables
    from pivotrl.verifiers.base import NOT_DEMONSTRATED

    class Equivalent:
        def score(self, state, actions):
            return [VerifierResult.accept(NOT_DEMONSTRATED if len(a) % 2 == 0 else "match") for a in actions]

    tok = AutoTokenizer.from_pretrained(str(ckpt))
    states = _prompted_states(monkeypatch, ["a", "b"])
    df, summ = local.evaluate_local(engine, tok, states, Equivalent(),
                                    sampling=SamplingConfig(n=4, max_tokens=6, seed=0, temperature=1.0), max_context=256)
    texts = [s["text"] for cell in df["samples"] for s in json.loads(cell)]
    even = sum(1 for t in texts if len(t) % 2 == 0)
    assert summ["n_accepted"] == len(texts) == 8
    assert summ["n_accepted_not_demonstrated"] == even and 0 < even < 8  # both kinds drawn at this seed
    rows = [policy_row("pivotrl", {"local": summ}), policy_row("base", {"local": {**summ, "n_accepted": 5,
                                                                                  "n_accepted_not_demonstrated": 0}})]
    text = "\n".join(_results_tables(rows, None))
    assert (f"not the demonstrated calls (the verifier found them equivalent by execution; imitation of the "
            f"demonstration never teaches them): pivotrl {even} of 8, base 0 of 5.") in text


def _settings(*overrides: str):
    """The run config the loop reads (the loop takes the validated RunConfig as it is)."""
    from pivotrl.config import load_config

    base = ["model.dtype=fp32", "run.seed=0", "rollout.max_tokens=6", "rollout.weight_sync=disk",
            "training.group_size=4", "training.checkpoint_every=2", "training.pivots_per_batch=2",
            "training.updates_per_batch=1", "training.eval_every=0"]
    return load_config(None, [*base, *overrides])


def test_the_loop_trains_refreshes_drops_undecided_pivots_and_checkpoints(engine, ckpt: Path, tmp_path: Path) -> None:
    from pivotrl.training.pivotrl import PivotRLTrainer

    trainer = PivotRLTrainer.build(ckpt, group_size=4, dtype="float32", lr=1e-3, beta=0.0, updates_per_batch=1, seed=0)
    pivots = _states("p0", "p1", "undecided-2", "p3")
    schedule = pivot_schedule(len(pivots), 2, 1, seed=0, max_steps=None)
    assert sorted(i for b in schedule for i in b) == [0, 1, 2, 3] and len(schedule) == 2
    events: list[tuple] = []
    hooks = LoopHooks(before_step=lambda s: events.append(("before", s)),
                      record_step=lambda s, scored, groups: events.append(("record", s, len(scored), len(groups))),
                      log_row=lambda row: events.append(("row", row["step"])),
                      save_checkpoint=lambda s, rows: events.append(("checkpoint", s, len(rows))))
    verifier = ToyVerifier()
    rows = run_rl_loop(trainer, engine, verifier, pivots, PROMPTS, schedule, _settings(), tmp_path / "work",
                       hooks=hooks, progress=False)
    assert [r["step"] for r in rows] == [1, 2]
    assert sum(r["dropped_groups"] for r in rows) == 1  # the undecided pivot, never a reward of 0
    assert sum(r["groups"] for r in rows) == 3 and all(r["pivots"] == 2 for r in rows)
    assert sorted(verifier.calls) == ["p0", "p1", "p3", "undecided-2"]
    # π_old refreshed in the engine every step: its log-probs match the trainer's (fp32). Step 1's
    # check is read from step 1's batch (the engine's sampling log-probs against the trainer's π_old);
    # the last refresh, which no batch samples, is checked by scoring.
    assert all(r["refresh_max_abs_delta"] <= 1e-4 for r in rows)
    assert [r["refresh_scored"] for r in rows] == [0.0, 1.0]
    assert rows[0]["refresh_mean_abs_delta"] == rows[0]["sampler_mismatch_mean_abs"]
    assert all(0.0 <= r["reward_mean"] <= 1.0 for r in rows if "reward_mean" in r)
    assert events[0] == ("before", 0) and ("checkpoint", 2, 2) in events and ("row", 2) in events
    assert [e for e in events if e[0] == "checkpoint"] == [("checkpoint", 2, 2)]  # every 2 steps, and the last
    assert {e[1] for e in events if e[0] == "record"} == {1, 2}

    # Resuming at step 1 with step 1's row runs step 2 only (the same pivot order).
    more = run_rl_loop(trainer, engine, ToyVerifier(), pivots, PROMPTS, schedule, _settings("training.checkpoint_every=1"),
                       tmp_path / "work2", start=1, rows=rows[:1], progress=False)
    # (a row's "step" is the trainer's own step counter: this trainer has already taken two)
    assert len(more) == 2 and more[0] == rows[0] and more[1]["step"] == 3.0
    assert more[1]["pivots"] == rows[1]["pivots"] and more[1]["groups"] == rows[1]["groups"]


def test_a_refresh_that_did_not_take_fails_loudly() -> None:
    check_refresh(1, 5e-5, 1e-5, 1e-4, "fp32")
    check_refresh(1, 0.4, 0.01, 0.3, "bf16")  # a bf16 max alone is kernel noise
    with pytest.raises(TrainingError, match="step 3"):
        check_refresh(3, 0.2, 0.2, 0.3, "bf16")
    with pytest.raises(TrainingError, match="π_old"):
        check_refresh(1, 2e-4, 1e-5, 1e-4, "fp32")


def test_the_refresh_check_reads_the_whole_group_so_one_noisy_action_does_not_fail_it() -> None:
    """bf16: one action of a group can differ by 0.11 nats per token between engine and trainer on
    the same weights (measured on multi-turn states); the check pools the tokens of the group's K
    actions in one scoring call, so that action alone no longer fails a refresh that took, while an
    engine left on other weights (every action off) still fails."""
    from pivotrl.rollout.pool import refresh_delta

    actions = [[10 + i, 20 + i, 30 + i, 40 + i, 50 + i] for i in range(8)]
    trainer_lps = [[-1.0 - 0.1 * t for t in range(5)] for _ in actions]

    class Engine:
        def __init__(self, off: list[float]) -> None:
            self.off, self.calls = off, []

        def score(self, prompts, acts):
            self.calls.append((len(prompts), [tuple(a) for a in acts]))
            return [[lp + self.off[actions.index(list(a))] for lp in trainer_lps[0]] for a in acts]

    noisy = Engine([0.113] + [0.01] * 7)  # one action off by 0.113 per token, the others by 0.01
    assert refresh_delta(noisy, [1, 2, 3], actions[:1], trainer_lps[:1]) == pytest.approx((0.113, 0.113))
    with pytest.raises(TrainingError):  # the former one-action check
        check_refresh(1, 0.113, 0.113, 0.3, "bf16")
    d_max, d_mean = refresh_delta(noisy, [1, 2, 3], actions, trainer_lps)
    assert noisy.calls[-1] == (8, [tuple(a) for a in actions])  # the group in one scoring call
    assert (d_max, d_mean) == pytest.approx((0.113, (0.113 + 7 * 0.01) / 8))
    check_refresh(1, d_max, d_mean, 0.3, "bf16")
    stale = Engine([0.2] * 8)
    with pytest.raises(TrainingError, match="step 2"):
        check_refresh(2, *refresh_delta(stale, [1, 2, 3], actions, trainer_lps), 0.3, "bf16")
    assert refresh_delta(stale, [1, 2, 3], [[], []], [[], []]) == (0.0, 0.0) and len(stale.calls) == 1
    # A repeated action is scored once and counts as often as it was sampled.
    twice = Engine([0.113] + [0.01] * 7)
    d_max, d_mean = refresh_delta(twice, [1, 2, 3], [actions[0], actions[1], actions[0], [], actions[1]],
                                  [trainer_lps[0], trainer_lps[1], trainer_lps[0], [], trainer_lps[1]])
    assert twice.calls == [(2, [tuple(actions[0]), tuple(actions[1])])]
    assert (d_max, d_mean) == pytest.approx((0.113, (2 * 0.113 + 2 * 0.01) / 4))


def test_the_loop_and_sample_and_score_import_without_prefect_vllm_deepspeed_or_the_pipeline() -> None:
    import subprocess
    import sys

    code = ("import sys\n"
            "for name in ('prefect', 'vllm', 'deepspeed', 'pivotrl.pipeline'):\n"
            "    sys.modules[name] = None\n"
            "import pivotrl.training.loop, pivotrl.training.checkpoints, pivotrl.rollout.scoring\n"
            "print('ok')\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0 and out.stdout.strip() == "ok", out.stderr[-2000:]


class PassVerifier(ToyVerifier):
    """Accepts every action at "easy" states (all-pass: out of the filter), else the toy rule."""

    def score(self, state, actions):
        if state.state_id.startswith("easy"):
            self.calls.append(state.state_id)
            return [VerifierResult.accept() for _ in actions]
        return super().score(state, actions)


def test_refilter_between_epochs_drops_pivots_that_left_the_filter(engine, ckpt: Path, tmp_path: Path) -> None:
    from pivotrl.training.pivotrl import PivotRLTrainer

    trainer = PivotRLTrainer.build(ckpt, group_size=4, dtype="float32", lr=1e-3, beta=0.0, updates_per_batch=1, seed=0)
    pivots = _states("p0", "easy-1", "p2", "undecided-3")
    schedule = pivot_schedule(len(pivots), 2, 2, seed=0, max_steps=None)  # 2 epochs of 2 batches
    rf = ("training.refilter_between_epochs=true", "probing.num_probes=8", "probing.temperature=1.0",
          "probing.top_p=1.0", "probing.top_k=0", "probing.seed=0", "probing.lambda_diff=0.5")
    verifier = PassVerifier()
    rows = run_rl_loop(trainer, engine, verifier, pivots, PROMPTS, schedule, _settings(*rf),
                       tmp_path / "work", progress=False)
    assert [r["step"] for r in rows] == [1, 2, 3, 4]
    assert all("refilter_active" not in r for r in rows[:2]) and all("refilter_active" not in r for r in rows[3:])
    boundary = rows[2]
    active = __import__("json").loads(boundary["refilter_active"])
    # the all-pass pivot left the filter; the undecided one stays; p0/p2 stay or leave by their μ̂
    assert 1 not in active and 3 in active and boundary["refilter_all_pass"] == 1
    assert boundary["refilter_undecided"] == 1
    counted = sum(boundary[f"refilter_{k}"] for k in ("kept", "all_pass", "all_fail", "above_threshold", "undecided"))
    assert counted == 4
    # epoch 2 trains only the active pivots
    epoch2 = [i for s in schedule[2:] for i in s if i in active]
    assert sum(r["pivots"] for r in rows[2:]) == len(epoch2)
    easy_calls = verifier.calls.count("easy-1")
    assert easy_calls == 2  # its epoch-1 group and the re-probe; never trained in epoch 2

    # a resumed run takes the re-filter decision from its rows (no new re-probe before step 4)
    v2 = PassVerifier()
    more = run_rl_loop(trainer, engine, v2, pivots, PROMPTS, schedule, _settings(*rf), tmp_path / "work2",
                       start=3, rows=rows[:3], progress=False)
    assert len(more) == 4 and more[3]["pivots"] == rows[3]["pivots"] and "easy-1" not in v2.calls


def test_refilter_that_cannot_run_within_the_first_epoch_is_warned_once(engine, ckpt: Path, tmp_path: Path,
                                                                        caplog) -> None:
    import logging

    from pivotrl.training.loop import refilter_unused
    from pivotrl.training.pivotrl import PivotRLTrainer

    rf = ("training.refilter_between_epochs=true", "probing.num_probes=4", "probing.lambda_diff=0.5")
    # off, or an epoch boundary is reached (4 pivots, 2 per batch: epochs of 2 steps)
    assert refilter_unused(_settings(), 4, 1) is None and refilter_unused(_settings(*rf), 4, 3) is None
    assert "the run has 2 step(s) and its first epoch has 2" in refilter_unused(_settings(*rf), 4, 2)
    trainer = PivotRLTrainer.build(ckpt, group_size=4, dtype="float32", lr=1e-3, beta=0.0, updates_per_batch=1, seed=0)
    pivots = _states("p0", "p1", "p2", "p3")
    schedule = pivot_schedule(len(pivots), 2, 2, seed=0, max_steps=1)  # training.max_steps = 1 of 2 epochs × 2
    with caplog.at_level(logging.WARNING, logger="pivotrl.training"):
        rows = run_rl_loop(trainer, engine, ToyVerifier(), pivots, PROMPTS, schedule, _settings(*rf),
                           tmp_path / "work", progress=False)
    assert len(rows) == 1 and "refilter_active" not in rows[0]
    warned = [r.getMessage() for r in caplog.records if "refilter_between_epochs" in r.getMessage()]
    assert len(warned) == 1 and "will not run: the run has 1 step(s) and its first epoch has 2" in warned[0]


def test_anchor_schedule_appends_a_seeded_cycle_of_every_anchor_to_each_batch() -> None:
    from pivotrl.training.loop import anchor_schedule

    base = pivot_schedule(4, 2, 3, seed=0, max_steps=None)  # 6 batches of pivots 0..3
    got = anchor_schedule(base, 4, 3, 2, seed=7)
    assert [b[:2] for b in got] == base  # the pivots' order is untouched
    extra = [b[2:] for b in got]
    assert all(len(e) == 2 and len(set(e)) == 2 and set(e) <= {4, 5, 6} for e in extra)
    flat = [a for e in extra for a in e]
    assert sorted(flat[:3]) == [4, 5, 6]  # every anchor once before any twice
    assert got == anchor_schedule(base, 4, 3, 2, seed=7) and got != anchor_schedule(base, 4, 3, 2, seed=8)
    assert anchor_schedule(base, 4, 0, 2, seed=0) == base == anchor_schedule(base, 4, 3, 0, seed=0)
    # more per batch than anchors: each anchor once per batch
    assert all(sorted(b[2:]) == [4, 5] for b in anchor_schedule(base, 4, 2, 5, seed=0))


def test_anchor_states_train_beside_the_pivots_are_never_refiltered_and_are_counted_apart(engine, ckpt: Path,
                                                                                         tmp_path: Path) -> None:
    """Two pivots and two anchors (states the verifier accepts every action at), one anchor per
    batch, re-filter on: the anchors' groups reach the trainer, the rows count them apart with their
    reward, and the re-filter (which would drop an all-pass pivot) leaves them in."""
    from pivotrl.evaluation.learning_curve import learning_curve, pivotrl_step_turns
    from pivotrl.training.loop import anchor_schedule
    from pivotrl.training.pivotrl import PivotRLTrainer

    trainer = PivotRLTrainer.build(ckpt, group_size=4, dtype="float32", lr=1e-3, beta=0.1, updates_per_batch=1, seed=0)
    states = _states("p0", "p1", "easy-a", "easy-b")
    schedule = anchor_schedule(pivot_schedule(2, 2, 2, seed=0, max_steps=None), 2, 2, 1, seed=0)
    rf = ("training.refilter_between_epochs=true", "probing.num_probes=4", "probing.temperature=1.0",
          "probing.top_p=1.0", "probing.top_k=0", "probing.seed=0", "probing.lambda_diff=1.0")
    verifier = PassVerifier()
    rows = run_rl_loop(trainer, engine, verifier, states, PROMPTS, schedule, _settings(*rf), tmp_path / "work",
                       progress=False, num_pivots=2)
    assert len(rows) == 2
    assert [r["anchors"] for r in rows] == [1, 1] and [r["anchor_reward_mean"] for r in rows] == [1.0, 1.0]
    assert rows[1]["refilter_all_pass"] + rows[1]["refilter_kept"] + rows[1]["refilter_all_fail"] \
        + rows[1]["refilter_above_threshold"] + rows[1]["refilter_undecided"] == 2  # the pivots only
    # both anchors trained once (a cycle), never re-probed: one group of K = 4 each
    assert sorted(s for s in verifier.calls if s.startswith("easy")) == ["easy-a", "easy-b"]
    for r in rows:
        assert r["groups"] == r["pivots"] + r["anchors"] and r["actions"] == 4 * r["groups"]
        assert pivotrl_step_turns(r, 4, 4) >= 4 * r["groups"]  # the anchors' samples are rollout turns
    import pandas as pd

    curve = learning_curve(pd.DataFrame(rows))
    assert [(a["step"], a["anchors"], a["reward_mean"]) for a in curve["anchors"]] == [(1, 1, 1.0), (2, 1, 1.0)]
    plain = run_rl_loop(trainer, engine, ToyVerifier(), states[:2], PROMPTS, pivot_schedule(2, 2, 1, 0, None),
                        _settings(), tmp_path / "work2", progress=False)
    assert "anchors" not in plain[0] and learning_curve(pd.DataFrame(plain))["anchors"] == []
