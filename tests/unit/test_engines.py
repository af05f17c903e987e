"""Several rollout engines in training (rollout.num_engines): the batch split across engines, every
engine refreshed and verified each step, seeds by batch position (pivotrl.rollout.pool,
pivotrl.training.loop), on the transformers engine with a tiny random model."""

from __future__ import annotations

import math
import threading
from pathlib import Path
from types import SimpleNamespace

import pytest

from pivotrl.core.errors import TrainingError
from pivotrl.rollout import SamplingConfig
from pivotrl.rollout.hf import TransformersEngine
from pivotrl.rollout.pool import EnginePool, engine_cpus, split_positions
from pivotrl.testing import save_tiny_checkpoint
from pivotrl.training.loop import pivot_schedule, run_rl_loop
from pivotrl.verifiers import VerifierResult

PROMPTS = [[5, 17, 42, 9, 11], [7, 8, 9], [100, 3, 64, 2], [12, 13, 14, 15, 16, 17], [21, 22, 23]]
ACTION = [3, 4, 5, 6]  # the action whose log-probs show which weights an engine serves


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


def _settings(*overrides: str):
    """The run config the loop reads (the loop takes the validated RunConfig as it is)."""
    from pivotrl.config import load_config

    base = ["model.dtype=fp32", "run.seed=0", "rollout.max_tokens=6", "rollout.weight_sync=disk",
            "training.group_size=4", "training.checkpoint_every=10", "training.pivots_per_batch=5",
            "training.updates_per_batch=1", "training.eval_every=0"]
    return load_config(None, [*base, *overrides])


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
    # Counted by the engines: each was refreshed once per step; the check of step 2's weights came from
    # step 2's batch (each engine's sampling log-probs against the trainer's π_old), so each engine
    # scored the check group once, after the last refresh, which no batch samples.
    assert [e.refreshes for e in engines] == [2, 2] and [e.scores for e in engines] == [1, 1]
    assert [r["refresh_scored"] for r in rows] == [0.0, 1.0]
    assert rows[0]["refresh_max_abs_delta_e0"] == rows[0]["sampler_mismatch_max_abs_e0"]
    assert rows[0]["refresh_max_abs_delta_e1"] == rows[0]["sampler_mismatch_max_abs_e1"]
    # Engine 0 sampled at the first 2 states of each batch, engine 1 at the other 3 (fixed blocks).
    for step, order in enumerate(schedule):
        assert engines[0].prompts[step] == [tuple(PROMPTS[i]) for i in order[:2]]
        assert engines[1].prompts[step] == [tuple(PROMPTS[i]) for i in order[2:]]
    # Both engines serve the trained weights now: their log-probs equal the trainer's.
    want = trainer.old_policy_logprobs(PROMPTS[0], ACTION)
    for e in engines:
        got = TransformersEngine.score(e, [PROMPTS[0]], [ACTION])[0]
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
    assert _same_part(rows) == _same_part(rows1) and "engines" not in rows1[0]
    # A batch-read check's mean is the largest engine's (one engine: the batch's)
    assert rows[0]["refresh_mean_abs_delta"] == max(rows[0]["sampler_mismatch_mean_abs_e0"],
                                                    rows[0]["sampler_mismatch_mean_abs_e1"])
    assert rows1[0]["refresh_mean_abs_delta"] == rows1[0]["sampler_mismatch_mean_abs"]
    # one rank: the pool's generation counters are the single engine's (the same prompts, the same tokens)
    counts = ("gen_prompt_tokens", "gen_prefill_tokens", "gen_tokens", "gen_tflop")
    assert [[r[k] for k in counts] for r in rows] == [[r[k] for k in counts] for r in rows1]
    assert all(r["gen_tokens"] > 0 for r in rows)
    single.close()


def _same_part(rows: list[dict]) -> list[dict]:
    """The rows without times, the hardware used (threads × ranks), engine columns and the generation
    counters (``gen_*``: a rank counts its own engines' work only): what one engine or several must
    agree on."""
    skip = ("rollout_s", "step_time_s", "tokens_per_s", "trainer_s", "refresh_s", "gen_s", "mfu", "threads", "peak_gflops", "engines", "refresh_verified_engines", "_e0", "_e1",
            "refresh_mean_abs_delta")
    return [{k: v for k, v in r.items() if not k.endswith(skip) and not k.startswith("gen_")} for r in rows]


@pytest.mark.integration
def test_an_engine_on_each_of_two_ranks_serves_its_block_and_is_refreshed_and_verified_every_step(
        ckpt: Path, tmp_path: Path) -> None:
    """rollout.engine_placement ranks: two trainer ranks (torchrun, gloo), each owning an engine and a
    verifier; each rank's engine samples its block of every batch, the groups are all-gathered, and
    both engines are refreshed from their own rank's export and checked every step. The run equals
    one process with one engine."""
    import json
    import subprocess
    import sys

    from pivotrl.training.deepspeed_utils import free_port
    from pivotrl.training.pivotrl import PivotRLTrainer

    out = tmp_path / "ranks"
    out.mkdir()
    worker = Path(__file__).resolve().parent / "engines_worker.py"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node=2", f"--master-port={free_port()}",
           str(worker), str(ckpt), str(out)]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=300, env={**__import__("os").environ,
                                                                                 "OMP_NUM_THREADS": "1"})
    assert done.returncode == 0, done.stderr[-3000:]
    ranks = [json.loads((out / f"rank{r}.json").read_text()) for r in (0, 1)]
    schedule = pivot_schedule(len(PROMPTS), 5, 2, seed=0, max_steps=None)
    assert [r["world"] for r in ranks] == [2, 2]
    # Each rank's engine sampled at its block of each batch (2 and 3 states), once per step, was
    # refreshed once per step, checked on step 2 by its own block of step 2's batch, and scored (the
    # check of the last refresh) once.
    for rank, block in ((0, slice(0, 2)), (1, slice(2, 5))):
        assert ranks[rank]["prompts"] == [[list(PROMPTS[i]) for i in order[block]] for order in schedule]
        assert (ranks[rank]["refreshes"], ranks[rank]["scores"]) == (2, 1)
    assert [r["refresh_scored"] for r in ranks[0]["rows"]] == [0.0, 1.0]
    assert _same_part(ranks[0]["rows"]) == _same_part(ranks[1]["rows"])  # the same batches and checks
    for r in ranks[0]["rows"]:
        assert r["engines"] == 2 and r["refresh_verified_engines"] == 2
        assert (r["rollout_states_e0"], r["rollout_states_e1"]) == (2, 3) and r["groups"] == 5
        assert r["refresh_max_abs_delta_e0"] <= 1e-4 and r["refresh_max_abs_delta_e1"] <= 1e-4
    # The same run in one process with one engine: the same rows, and both ranks' engines end on
    # the weights that run ends on.
    trainer = PivotRLTrainer.build(ckpt, group_size=4, dtype="float32", lr=1e-3, beta=0.0, updates_per_batch=1, seed=0)
    single = _engines(ckpt, 1)[0]
    pivots = [SimpleNamespace(state_id=f"p{i}") for i in range(len(PROMPTS))]
    rows1 = run_rl_loop(trainer, single, EvenVerifier(), pivots, PROMPTS, schedule, _settings(), tmp_path / "work1",
                        progress=False)
    # 2 ranks average their gradients: the same numbers up to float rounding (the refresh deltas
    # are float noise of their own).
    two, one = _same_part(ranks[0]["rows"]), _same_part(rows1)
    assert [r.keys() for r in two] == [r.keys() for r in one]
    for a, b in zip(two, one):
        for k in a:
            if not k.startswith("refresh_"):
                assert a[k] == pytest.approx(b[k], rel=1e-5, abs=1e-6), k
    want = trainer.old_policy_logprobs(PROMPTS[0], ACTION)
    for r in ranks:
        assert max(abs(x - y) for x, y in zip(r["final_logprobs"], want)) <= 1e-4
    # The rows' generation counters are both engines' together (not rank 0's block alone), the same
    # on both ranks: over the run, the sum of the two engines' meters; per step, what the one engine
    # of the one-process run counted for the whole batch.
    counts = ("gen_prompt_tokens", "gen_prefill_tokens", "gen_tokens")
    gen = [[{k: v for k, v in row.items() if k.startswith("gen_")} for row in r["rows"]] for r in ranks]
    assert gen[0] == gen[1]
    meters = [r["meter"] for r in ranks]
    for key, field in zip(counts, ("prompt_tokens", "prefill_tokens", "generated_tokens")):
        assert sum(row[key] for row in gen[0]) == sum(m[field] for m in meters) > 0, key
    assert sum(row["gen_tflop"] for row in gen[0]) == pytest.approx(sum(m["flops"] for m in meters) / 1e12)
    assert [[row[k] for k in counts] for row in gen[0]] == [[row[k] for k in counts] for row in rows1]
    assert [row["gen_tflop"] for row in gen[0]] == pytest.approx([row["gen_tflop"] for row in rows1])
    # side by side: the threads of both engines over the slower one's seconds
    assert all(row["gen_threads"] == sum(m["threads"] for m in meters) for row in gen[0])
    assert sum(row["gen_s"] for row in gen[0]) <= sum(m["seconds"] for m in meters)
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


def test_an_engine_that_missed_a_refresh_fails_on_the_next_batch_before_any_scoring(ckpt: Path, tmp_path: Path) -> None:
    """The refresh after step 1 is checked by step 2's batch: the stale engine sampled it with step 0's
    weights, so its sampling log-probs differ from the trainer's π_old; the run stops at step 2 naming
    that engine and the batch check, and no engine ever ran a scoring pass."""
    from pivotrl.training.pivotrl import PivotRLTrainer

    trainer = PivotRLTrainer.build(ckpt, group_size=4, dtype="float32", lr=1e-2, beta=0.0, updates_per_batch=1, seed=0)
    good, stale = _engines(ckpt, 1)[0], _engines(ckpt, 1, skip_refresh=True)[0]
    pivots = [SimpleNamespace(state_id=f"p{i}") for i in range(len(PROMPTS))]
    with pytest.raises(TrainingError, match="step 2 \\(rollout engine 1\\): the engine's sampling log-probs"):
        run_rl_loop(trainer, EnginePool([good, stale]), EvenVerifier(), pivots, PROMPTS, [[0, 1, 2, 3, 4]] * 3,
                    _settings(), tmp_path / "work", progress=False)
    assert good.refreshes == stale.refreshes == 1 and good.scores == stale.scores == 0


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
    # The GPU cluster config puts one engine on each node's first rank and leaves the trainer room
    # on that GPU.
    multi = load_config(str(Path(__file__).resolve().parents[2] / "configs" / "multinode-gpu.yaml"))
    assert (multi.rollout.engine_placement, multi.rollout.gpu_memory_utilization) == ("node", 0.35)
    assert (RunConfig().rollout.num_engines, RunConfig().rollout.gpu_memory_utilization) == (1, None)


def test_engine_host_ranks_follow_the_placement() -> None:
    from pivotrl.core.errors import ConfigError
    from pivotrl.training.rank_engines import engine_host_ranks, local_world_size

    assert engine_host_ranks("rank0", 16, 8) == [0]
    assert engine_host_ranks("node", 16, 8) == [0, 8]
    assert engine_host_ranks("ranks", 16, 8, ranks_per_engine=2) == [0, 2, 4, 6, 8, 10, 12, 14]
    assert engine_host_ranks("ranks", 2, 2) == [0, 1] and engine_host_ranks("node", 1, 1) == [0]
    with pytest.raises(ConfigError, match="does not divide the 8 ranks of a node"):
        engine_host_ranks("ranks", 16, 8, ranks_per_engine=16)
    with pytest.raises(ConfigError, match="does not divide the 6 trainer ranks"):
        engine_host_ranks("ranks", 6, 6, ranks_per_engine=4)
    with pytest.raises(ConfigError, match="one of rank0, node, ranks"):
        engine_host_ranks("gpu", 2, 2)
    assert local_world_size({"LOCAL_WORLD_SIZE": "4"}) == 4 and local_world_size({"LOCAL_SIZE": "3"}) == 3
    assert local_world_size({}, default=8) == 8


def test_the_engine_layout_is_checked_against_the_trainer_ranks() -> None:
    from pivotrl.config import load_config
    from pivotrl.core.errors import ConfigError

    multi = str(Path(__file__).resolve().parents[2] / "configs" / "multinode-gpu.yaml")
    cfg = load_config(multi, ["rollout.engine_placement=node"])  # 2 nodes × 8 GPUs: 2 engines
    assert (cfg.rollout.engine_placement, cfg.rollout.num_engines) == ("node", 1)
    assert load_config(multi, ["rollout.engine_placement=node", "rollout.num_engines=2"]).rollout.num_engines == 2
    with pytest.raises(ConfigError, match="rollout.num_engines.*gives 2 engine"):
        load_config(multi, ["rollout.engine_placement=node", "rollout.num_engines=3"])
    with pytest.raises(ConfigError, match="rollout.ranks_per_engine.*must divide training.nproc_per_node = 8"):
        load_config(multi, ["rollout.engine_placement=ranks", "rollout.ranks_per_engine=3"])
    with pytest.raises(ConfigError, match="rollout.tensor_parallel_size.*≤ the 2 GPUs"):
        load_config(multi, ["rollout.engine_placement=ranks", "rollout.ranks_per_engine=2",
                            "rollout.tensor_parallel_size=4"])
    assert load_config(multi, ["rollout.engine_placement=ranks", "rollout.ranks_per_engine=4",
                               "rollout.tensor_parallel_size=4", "rollout.num_engines=4"]).rollout.num_engines == 4


def test_an_engine_on_a_rank_sees_only_its_own_gpus() -> None:
    from pivotrl.core.errors import ConfigError
    from pivotrl.rollout.vllm_placement import visible_devices

    assert visible_devices([3], {}) == "3" and visible_devices([2, 3], {}) == "2,3"
    assert visible_devices([1], {"CUDA_VISIBLE_DEVICES": "4,5,6"}) == "5"
    with pytest.raises(ConfigError, match="sees 2 GPU"):
        visible_devices([2], {"CUDA_VISIBLE_DEVICES": "0,1"})


def test_the_step_log_line_says_how_many_engines_were_verified() -> None:
    from pivotrl.tasks.publish import _engines_note

    row = {"engines": 2.0, "refresh_verified_engines": 1.0, "rollout_states_e0": 2.0, "rollout_states_e1": 3.0}
    assert _engines_note(row) == ", engines verified 1/2 (states per engine 2/3)"
    assert _engines_note({"engines": float("nan")}) == _engines_note({}) == ""  # one engine: nothing added


def test_a_train_stage_over_several_nodes_is_not_run_as_one_machines_ranks(tmp_path):
    """``training.nnodes > 1``: the train stage never starts one machine's ranks as if they were all.
    With ``node_launch: ray`` (the default) the config must name the Ray cluster that places the
    nodes; with ``manual`` the stage names the per-node launch."""
    from pivotrl.config import load_config
    from pivotrl.core.errors import ConfigError
    from pivotrl.pipeline.results import ProbeResult, ReferenceResult
    from pivotrl.pipeline.train import _launch_ranks
    from pivotrl.storage import ArtifactStore

    REPO = Path(__file__).resolve().parents[2]
    nodes = [f"run.storage_root={tmp_path / 'root'}", f"run.cache_dir={tmp_path / 'cache'}",
             "training.launcher=torchrun", "training.nnodes=2", "training.nproc_per_node=1", "training.world_size=2"]
    with pytest.raises(ConfigError, match=r"scale_out.ray_address = null: training.nnodes = 2 with node_launch 'ray'"):
        load_config(str(REPO / "configs" / "smoke.yaml"), nodes)
    with pytest.raises(ConfigError, match=r"training.launcher = 'deepspeed': node_launch 'ray' starts each node's ranks "
                                          r"with torchrun"):
        load_config(str(REPO / "configs" / "smoke.yaml"), [*nodes, "training.launcher=deepspeed",
                                                            "training.hostfile=hosts", "scale_out.ray_address=auto"])
    cfg = load_config(str(REPO / "configs" / "smoke.yaml"), [*nodes, "training.node_launch=manual"])
    probe = ProbeResult(probes_key="probes/x", probes="", pivots_key="pivots/x", pivots="", stats={}, summary_md="")
    ref = ReferenceResult(base_dir=str(tmp_path), base_hash="h", ref_key=None, ref_hash="h")
    with pytest.raises(ConfigError, match=r"training.nnodes = 2 with node_launch 'manual': .*infra/multinode/launch_train.py"):
        _launch_ranks(cfg, ArtifactStore(str(tmp_path / "root")), probe, ref, threads=2)


