"""Several rollout engines in training (rollout.num_engines): the batch split across engines, every
engine refreshed and verified each step, seeds by batch position (pivotrl.rollout.pool,
pivotrl.training.loop), on the transformers engine with a tiny random model."""

from __future__ import annotations

import math
import threading
from pathlib import Path
from types import SimpleNamespace

import pytest

from pivotrl.errors import TrainingError
from pivotrl.rollout import SamplingConfig
from pivotrl.rollout.hf import TransformersEngine
from pivotrl.rollout.pool import EnginePool, engine_cpus, split_positions
from pivotrl.testing import save_tiny_checkpoint
from pivotrl.training.loop import LoopSettings, pivot_schedule, run_rl_loop
from pivotrl.verifiers import VerifierResult

PROMPTS = [[5, 17, 42, 9, 11], [7, 8, 9], [100, 3, 64, 2], [12, 13, 14, 15, 16, 17], [21, 22, 23]]


class CountingEngine(TransformersEngine):
    """The real transformers engine, counting its own refreshes and refresh checks and recording
    the prompts it sampled at and the thread it sampled on."""

    def __init__(self, *args, skip_refresh: bool = False, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.refreshes = 0
        self.scores = 0
        self.prompts: list[list[tuple[int, ...]]] = []  # per generate call
        self.threads: set[str] = set()
        self.skip_refresh = skip_refresh

    def generate(self, prompts, sampling, **kw):
        self.prompts.append([tuple(p) for p in prompts])
        self.threads.add(threading.current_thread().name)
        return super().generate(prompts, sampling, **kw)

    def load_weights(self, checkpoint_dir) -> None:
        self.refreshes += 1
        if not self.skip_refresh:
            super().load_weights(checkpoint_dir)

    def score(self, prompts, actions):
        self.scores += 1
        return super().score(prompts, actions)


class EvenVerifier:
    def score(self, state, actions):
        return [VerifierResult.accept() if len(a) % 2 == 0 else VerifierResult.reject("odd") for a in actions]


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return save_tiny_checkpoint(tmp_path_factory.mktemp("tiny") / "model")


def _engines(ckpt: Path, n: int, **kw) -> list[CountingEngine]:
    return [CountingEngine(str(ckpt), dtype="fp32", max_model_len=256, **kw) for _ in range(n)]


def _settings(**kw) -> LoopSettings:
    base = dict(group_size=4, max_tokens=6, seed=0, checkpoint_every=10, dtype="fp32", refresh_tolerance=1e-4,
                pivots_per_batch=5, updates_per_batch=1)
    return LoopSettings(**{**base, **kw})


def test_split_and_cpus_are_fixed_blocks() -> None:
    assert split_positions(5, 2) == [range(0, 2), range(2, 5)]
    assert split_positions(1, 3) == [range(0, 0), range(0, 0), range(0, 1)]
    assert [engine_cpus(j, 2, allowed=[3, 1, 0, 2]) for j in range(2)] == [[0, 1], [2, 3]]
    assert [engine_cpus(j, 3, allowed=[0, 1]) for j in range(3)] == [[0], [1], [0]]


def test_a_pool_samples_what_one_engine_samples(ckpt: Path) -> None:
    one, (a, b) = _engines(ckpt, 1)[0], _engines(ckpt, 2)
    pool = EnginePool([a, b])
    sampling = SamplingConfig(n=3, max_tokens=6, seed=7)
    got, want = pool.generate(PROMPTS, sampling), one.generate(PROMPTS, sampling)
    assert [[g.token_ids for g in gs] for gs in got] == [[g.token_ids for g in gs] for gs in want]
    assert a.prompts == [[tuple(p) for p in PROMPTS[:2]]] and b.prompts == [[tuple(p) for p in PROMPTS[2:]]]
    assert pool.served == [[0, 1], [2, 3, 4]]
    assert len(a.threads | b.threads) == 2  # each engine on its own thread
    seeds = [11, 12, 13, 14, 15]  # per-prompt seeds (sharded probing) pass through to each block
    assert ([[g.token_ids for g in gs] for gs in pool.generate(PROMPTS, sampling, seeds=seeds)]
            == [[g.token_ids for g in gs] for gs in one.generate(PROMPTS, sampling, seeds=seeds)])
    pool.close()
    one.close()


def test_two_engines_serve_the_batch_and_are_refreshed_and_verified_every_step(ckpt: Path, tmp_path: Path) -> None:
    from pivotrl.training.pivotrl import PivotRLTrainer

    trainer = PivotRLTrainer.build(ckpt, group_size=4, dtype="float32", lr=1e-3, beta=0.0, updates_per_batch=1, seed=0)
    engines = _engines(ckpt, 2)
    pool = EnginePool(engines)
    pivots = [SimpleNamespace(state_id=f"p{i}") for i in range(len(PROMPTS))]
    schedule = pivot_schedule(len(pivots), 5, 2, seed=0, max_steps=None)  # 2 steps of all 5 pivots
    rows = run_rl_loop(trainer, pool, EvenVerifier(), pivots, PROMPTS, schedule, _settings(), tmp_path / "work",
                       progress=False)
    assert len(rows) == 2
    # Counted by the engines: each was refreshed and checked once per step.
    assert [e.refreshes for e in engines] == [2, 2] and [e.scores for e in engines] == [2, 2]
    # Engine 0 sampled at the first 2 states of each batch, engine 1 at the other 3 (fixed blocks).
    for step, order in enumerate(schedule):
        assert engines[0].prompts[step] == [tuple(PROMPTS[i]) for i in order[:2]]
        assert engines[1].prompts[step] == [tuple(PROMPTS[i]) for i in order[2:]]
    # Both engines serve the trained weights now: their log-probs equal the trainer's.
    action = [3, 4, 5, 6]
    want = trainer.old_policy_logprobs(PROMPTS[0], action)
    for e in engines:
        got = TransformersEngine.score(e, [PROMPTS[0]], [action])[0]
        assert max(abs(x - y) for x, y in zip(got, want)) <= 1e-4
    for r in rows:
        assert r["engines"] == 2 and r["refresh_verified_engines"] == 2
        assert (r["rollout_states_e0"], r["rollout_states_e1"]) == (2, 3)
        assert r["refresh_max_abs_delta_e0"] <= 1e-4 and r["refresh_max_abs_delta_e1"] <= 1e-4
        assert r["groups"] == 5 and all(math.isfinite(r[k]) for k in ("loss", "kl", "reward_mean", "grad_norm"))
    pool.close()

    # Reproducible across N: one engine, same seeds → the same rows but for the engine columns and times.
    trainer1 = PivotRLTrainer.build(ckpt, group_size=4, dtype="float32", lr=1e-3, beta=0.0, updates_per_batch=1, seed=0)
    single = _engines(ckpt, 1)[0]
    rows1 = run_rl_loop(trainer1, single, EvenVerifier(), pivots, PROMPTS, schedule, _settings(), tmp_path / "work1",
                        progress=False)
    skip = ("rollout_s", "step_time_s", "tokens_per_s", "engines", "refresh_verified_engines", "_e0", "_e1")

    def same_part(rs):
        return [{k: v for k, v in r.items() if not k.endswith(skip)} for r in rs]

    assert same_part(rows) == same_part(rows1) and "engines" not in rows1[0]
    single.close()


def test_one_engine_that_missed_its_refresh_fails_the_step_naming_it(ckpt: Path, tmp_path: Path) -> None:
    from pivotrl.training.pivotrl import PivotRLTrainer

    trainer = PivotRLTrainer.build(ckpt, group_size=4, dtype="float32", lr=1e-2, beta=0.0, updates_per_batch=1, seed=0)
    good, stale = _engines(ckpt, 1)[0], _engines(ckpt, 1, skip_refresh=True)[0]
    pivots = [SimpleNamespace(state_id=f"p{i}") for i in range(len(PROMPTS))]
    with pytest.raises(TrainingError, match="step 1 \\(rollout engine 1\\)"):
        run_rl_loop(trainer, EnginePool([good, stale]), EvenVerifier(), pivots, PROMPTS, [[0, 1, 2, 3, 4]],
                    _settings(), tmp_path / "work", progress=False)
    assert good.refreshes == stale.refreshes == 1


def test_the_pool_imports_without_prefect_vllm_deepspeed_or_torch() -> None:
    import subprocess
    import sys

    code = ("import sys\n"
            "for name in ('prefect', 'vllm', 'deepspeed', 'torch', 'pivotrl.pipeline'):\n"
            "    sys.modules[name] = None\n"
            "import pivotrl.rollout.pool\n"
            "print('ok')\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0 and out.stdout.strip() == "ok", out.stderr[-2000:]


def test_the_train_stage_builds_one_engine_or_a_pool_from_the_config(ckpt: Path) -> None:
    from pivotrl.config import RunConfig, load_config
    from pivotrl.pipeline.train import make_training_engines

    base = ["rollout.engine=transformers", "model.dtype=fp32"]
    one = make_training_engines(load_config(None, base), ckpt)
    assert isinstance(one, TransformersEngine)  # num_engines: 1 is the single engine, as before
    pool = make_training_engines(load_config(None, [*base, "rollout.num_engines=2"]), ckpt)
    assert isinstance(pool, EnginePool) and len(pool) == 2
    assert all(isinstance(e, TransformersEngine) for e in pool.engines) and pool.engines[0] is not pool.engines[1]
    one.close()
    pool.close()
    # The GPU cluster config keeps one engine on rank 0 and leaves the trainer room on its GPU.
    multi = load_config(str(Path(__file__).resolve().parents[2] / "configs" / "multinode-gpu.yaml"))
    assert (multi.rollout.num_engines, multi.rollout.gpu_memory_utilization) == (1, 0.35)
    assert (RunConfig().rollout.num_engines, RunConfig().rollout.gpu_memory_utilization) == (1, None)
