"""Sharded probing through the real Prefect flow: a shard whose tool executions keep failing ends
Failed naming the states it could not decide, and the next run executes only that shard (and only
those states); on a real local Ray cluster (head + 2 one-CPU worker nodes on 127.0.0.1) the sharded
flow gives the in-process probe table and pivot set. With a policy that writes well-formed hermes
calls (pivotrl.testing.grammar), accepted and rejected by the verifier, the in-process, thread-sharded
and Ray-sharded runs give one non-empty pivot set."""

from __future__ import annotations

import asyncio
import json
import time
from pathlib import Path
from typing import Any

import pandas as pd
import pytest

from pivotrl.config import load_config
from pivotrl.pipeline import stages
from pivotrl.pipeline.results import ProbeResult
from pivotrl.pipeline.demos import build_demonstrations, read_trajectories
from pivotrl.runtime.ray_local import RayCluster
from pivotrl.storage import ArtifactStore
from pivotrl.testing import save_tiny_checkpoint

REPO = Path(__file__).resolve().parents[2]
#: The smoke config's one multi-turn trajectory in the pivot split: its calls run in the BFCL sandbox.
DRILL = "multi_turn_base_1"

pytestmark = pytest.mark.integration


def _overrides(root: Path, model: Path, *extra: str) -> list[str]:
    # No warm start: the reference is a tiny model that has memorised the multi-turn demonstration,
    # so its probes are real tool calls that the execution verifier runs in the sandbox.
    return [f"run.storage_root={root}", f"model.source={model}", "warm_start.enabled=false",
            "verifier.retries=1", *extra]


@pytest.fixture(scope="module")
def expert_model(tmp_path_factory) -> Path:
    from pivotrl.runtime.models import load_tokenizer
    from pivotrl.pipeline.common import prompt_kwargs
    from pivotrl.format.prompts import build_sft_examples
    from pivotrl.training.sft import run_sft

    tmp = tmp_path_factory.mktemp("expert")
    base = save_tiny_checkpoint(tmp / "tiny")
    cfg = load_config(str(REPO / "configs" / "smoke.yaml"), _overrides(tmp / "root", base))
    store = ArtifactStore(cfg.run.storage_root)
    demos = build_demonstrations(cfg, store)
    tok = load_tokenizer(base)
    trajs = [t for t in read_trajectories(store, demos["key"], split="pivot") if t.id == DRILL]
    examples = [ex for t in trajs for ex in build_sft_examples(t, tok, max_len=2048, **prompt_kwargs(cfg))[0]]
    run_sft(str(base), examples, str(tmp / "expert"), epochs=30, lr=3e-3, batch_size=1, dtype="float32",
            zero_stage=0, seed=0)
    return tmp / "expert"


@pytest.fixture(scope="module")
def clean_run(tmp_path_factory, expert_model):
    """The unsharded, fault-free probing stage run in this process: the reference result."""
    root = tmp_path_factory.mktemp("clean")
    cfg = load_config(str(REPO / "configs" / "smoke.yaml"), _overrides(root, expert_model))
    store = ArtifactStore(cfg.run.storage_root)
    demos = build_demonstrations(cfg, store)
    ref = stages.stage_reference(cfg, store, demos)
    probe = stages.stage_probe(cfg, store, demos, ref)
    probes = store.read_parquet(f"{probe.probes_key}/probes.parquet")
    # The drill needs real tool executions: the memorised trajectory's calls are verified in the sandbox.
    drill = probes[probes["trajectory_id"] == DRILL]
    assert any("match" in json.loads(r) for r in drill["reasons"])
    return store, probe


def _tables(store: ArtifactStore, probe: Any) -> tuple[pd.DataFrame, pd.DataFrame]:
    probe = ProbeResult.of(probe)  # a stage's result, or its dict from a flow
    return (store.read_parquet(f"{probe.probes_key}/probes.parquet"),
            store.read_parquet(f"{probe.pivots_key}/pivots.parquet"))


async def _shard_runs(flow: str = "pivotrl-probe-shards", task: str = "probe-shard") -> dict[str, list[Any]]:
    """Task runs of a shard task, by the sharded (sub)flow run they belong to (oldest first)."""
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import FlowFilter, FlowFilterName

    async with get_client() as client:
        subflows = await client.read_flow_runs(flow_filter=FlowFilter(name=FlowFilterName(any_=[flow])))
        runs = [r for r in await client.read_task_runs() if r.name.startswith(task)]
    order = sorted(subflows, key=lambda r: r.created)
    return {str(f.id): [r for r in runs if r.flow_run_id == f.id] for f in order}


def test_failed_shard_is_failed_then_retried_alone(expert_model, clean_run, tmp_path, monkeypatch):
    from prefect.testing.utilities import prefect_test_harness

    from pivotrl.flows.nightly import probe_only

    clean_store, clean_probe = clean_run
    root = tmp_path / "root"
    monkeypatch.setenv("PREFECT_HOME", str(tmp_path / "prefect"))
    sharded = ["scale_out.probe_shard_size=4", "scale_out.shard_retries=1"]
    with prefect_test_harness(server_startup_timeout=120):
        with pytest.raises(Exception) as failed:
            probe_only(config_path=str(REPO / "configs" / "smoke.yaml"), overrides=_overrides(
                root, expert_model, *sharded, f"faults.tool_failure_trajectories=[{DRILL}]"))
        first = list(asyncio.run(_shard_runs()).values())[0]
        # Two shards of 4 trajectories; the drill's shard ran twice (a retry) and ended Failed.
        assert sorted(r.state.name for r in first) == ["Completed", "Failed"]
        bad = next(r for r in first if r.state.name == "Failed")
        assert bad.run_count == 2
        assert "could not decide" in bad.state.message and f"{DRILL}#0" in bad.state.message
        assert "1 of 2 probe shards failed" in str(failed.value) and f"{DRILL}#0" in str(failed.value)
        undecided = [s for s in bad.state.message.split(": ")[-1].split(". ")[0].split(", ")]
        assert undecided and all(s.startswith(f"{DRILL}#") for s in undecided)

        # Faults off: the rerun executes only the failed shard, and in it only the undecided states.
        out = probe_only(config_path=str(REPO / "configs" / "smoke.yaml"),
                         overrides=_overrides(root, expert_model, *sharded))
        second = list(asyncio.run(_shard_runs()).values())[1]
        assert sorted(r.state.name for r in second) == ["Completed", "Completed"]
        # The shard artifacts: the failed run published only its finished shard (1); the rerun both,
        # shard 1 reused from the store (no process) and shard 0 computed again.
        rows = asyncio.run(_shard_rows("probe"))
        assert [r["index"] for r in rows[:1]] == [1] and len(rows) == 3
        assert sorted((r["index"], r["reused"]) for r in rows[1:]) == [(0, False), (1, True)]
        result = next(r for r in rows[1:] if r["index"] == 0)
        assert result["probed"] == len(undecided)  # the drill's trajectory sorts first
    store = ArtifactStore(str(root))
    probes, pivots = _tables(store, out)
    clean_probes, clean_pivots = _tables(clean_store, clean_probe)
    pd.testing.assert_frame_equal(probes, clean_probes)
    pd.testing.assert_frame_equal(pivots, clean_pivots)
    assert out["stats"] == clean_probe.stats


def test_a_sharded_run_reuses_the_unsharded_probe_table_without_shard_runs(expert_model, clean_run, tmp_path,
                                                                            monkeypatch):
    """The unsharded run's probe table is the merged table of a sharded run of the same settings
    (one content key): the sharded flow on that root runs no shard task and gives the same pivots."""
    import shutil

    from prefect.testing.utilities import prefect_test_harness

    from pivotrl.flows.nightly import probe_only

    clean_store, clean_probe = clean_run
    root = tmp_path / "root"
    shutil.copytree(clean_store.root_url.removeprefix("file://"), root)
    monkeypatch.setenv("PREFECT_HOME", str(tmp_path / "prefect"))
    with prefect_test_harness(server_startup_timeout=120):
        out = probe_only(config_path=str(REPO / "configs" / "smoke.yaml"),
                         overrides=_overrides(root, expert_model, "scale_out.probe_shard_size=4"))
        runs = asyncio.run(_shard_runs())
    assert [len(shard_runs) for shard_runs in runs.values()] == [0]  # the sharded subflow ran, no shard in it
    probes, pivots = _tables(ArtifactStore(str(root)), out)
    clean_probes, clean_pivots = _tables(clean_store, clean_probe)
    pd.testing.assert_frame_equal(probes, clean_probes)
    pd.testing.assert_frame_equal(pivots, clean_pivots)


def test_launch_train_prepare_writes_the_nightly_flows_probe_table(expert_model, tmp_path, monkeypatch):
    """``infra/multinode/launch_train.py prepare`` (demonstrations, π_ref and probing in one process
    before a multi-node training) and the nightly cluster path (the sharded probe flow) on the same
    config — the default quality settings, shards of 4 trajectories — write the same probe table and
    pivot set under the same keys."""
    import subprocess
    import sys

    from prefect.testing.utilities import prefect_test_harness

    from pivotrl.flows.nightly import probe_only

    extra = ["scale_out.probe_shard_size=4", "quality.include_stop_decisions=false"]
    prepared = tmp_path / "prepared"
    sets = [a for o in _overrides(prepared, expert_model, *extra) for a in ("--set", o)]
    done = subprocess.run([sys.executable, str(REPO / "infra" / "multinode" / "launch_train.py"), "prepare",
                           "--config", str(REPO / "configs" / "smoke.yaml"), *sets],
                          capture_output=True, text=True, timeout=600, cwd=REPO)
    assert done.returncode == 0, done.stderr[-3000:]
    spec = json.loads(Path(done.stdout.strip().splitlines()[-1].removeprefix("file://")).read_text())
    flowed = tmp_path / "flow"
    monkeypatch.setenv("PREFECT_HOME", str(tmp_path / "prefect"))
    with prefect_test_harness(server_startup_timeout=120):
        out = probe_only(config_path=str(REPO / "configs" / "smoke.yaml"),
                         overrides=_overrides(flowed, expert_model, *extra))
    probe = ProbeResult.of(out)
    assert (spec["inputs"]["probe"]["probes_key"], spec["inputs"]["probe"]["pivots_key"]) == (probe.probes_key,
                                                                                              probe.pivots_key)
    a, b = _tables(ArtifactStore(str(prepared)), spec["inputs"]["probe"]), _tables(ArtifactStore(str(flowed)), out)
    pd.testing.assert_frame_equal(a[0], b[0])
    pd.testing.assert_frame_equal(a[1], b[1])


async def _shard_rows(stage: str) -> list[dict[str, Any]]:
    """The rows of the shard table artifacts ``<stage>-shard-<index>`` (one per shard task run:
    ``pivotrl.tasks.publish.shard``), oldest first."""
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import ArtifactFilter, ArtifactFilterKey

    async with get_client() as client:
        artifacts = await client.read_artifacts(
            artifact_filter=ArtifactFilter(key=ArtifactFilterKey(like_=f"{stage}-shard-")))
    return [row for a in sorted(artifacts, key=lambda a: a.created)
            for row in (json.loads(a.data) if isinstance(a.data, str) else a.data)]


@pytest.fixture(scope="module")
def ray_cluster():
    cluster = RayCluster(workers=2)
    try:
        yield cluster
    finally:
        cluster.stop()
        time.sleep(1)
        assert cluster.leftovers() == []


def test_ray_task_runner_gives_the_in_process_probe_table_and_report(ray_cluster, tmp_path, monkeypatch):
    """The smoke config's probing on the real cluster through prefect-ray's RayTaskRunner: 4 shards
    over 2 one-CPU workers; the probe table and pivot set equal the in-process unsharded run's. Then
    its evaluation (a shard per held-out task and the states shard) on the same workers: the
    in-process report; deleting one shard's output, the rerun executes only that shard."""
    import shutil

    from prefect.testing.utilities import prefect_test_harness

    from pivotrl.flows.nightly import probe_only
    from pivotrl.flows.shards import evaluate_stage
    from pivotrl.testing import comparable_report

    tiny = save_tiny_checkpoint(tmp_path / "tiny")
    smoke = [f"model.source={tiny}"]
    cfg = load_config(str(REPO / "configs" / "smoke.yaml"), [f"run.storage_root={tmp_path / 'local'}", *smoke])
    store0 = ArtifactStore(cfg.run.storage_root)
    demos = build_demonstrations(cfg, store0)
    ref = stages.stage_reference(cfg, store0, demos)
    probe0 = stages.stage_probe(cfg, store0, demos, ref)
    train0 = stages.stage_train(cfg, store0, probe0, ref)
    ev0 = stages.stage_evaluate(cfg, store0, demos, ref, probe0, train0)
    # The evaluation's root: the in-process run's, without its evaluation (same content keys).
    eval_root = tmp_path / "ray-eval"
    shutil.copytree(tmp_path / "local", eval_root, ignore=lambda d, names: ["eval", "logs"] if d == str(tmp_path / "local") else [])
    ray = ["scale_out.task_runner=ray", f"scale_out.ray_address={ray_cluster.address}", "scale_out.ray_cpus_per_shard=1"]
    eval_config = load_config(str(REPO / "configs" / "smoke.yaml"), [
        f"run.storage_root={eval_root}", *smoke, *ray, "scale_out.eval_shard_size=1"]).model_dump(mode="json")
    eval_inputs = {"demos": demos, "reference": ref.to_dict(), "probe": probe0.to_dict(), "train": train0.to_dict()}

    root = tmp_path / "ray"
    monkeypatch.setenv("PREFECT_HOME", str(tmp_path / "prefect"))
    with prefect_test_harness(server_startup_timeout=120):
        out = probe_only(config_path=str(REPO / "configs" / "smoke.yaml"), overrides=[
            f"run.storage_root={root}", *smoke, "scale_out.task_runner=ray", f"scale_out.ray_address={ray_cluster.address}",
            "scale_out.probe_shard_size=2", "scale_out.ray_cpus_per_shard=1"])
        probe_rows = asyncio.run(_shard_rows("probe"))
        ev = evaluate_stage(None, eval_config, eval_inputs)
        first = asyncio.run(_shard_rows("eval"))
        ArtifactStore(str(eval_root)).delete(next(s["key"] for s in first if s["index"] == 0))  # one task shard's output
        ArtifactStore(str(eval_root)).delete(ev["eval_key"])
        ev_again = evaluate_stage(None, eval_config, eval_inputs)
        reruns = list(asyncio.run(_shard_runs("pivotrl-eval-shards", "eval-shard")).values())
        again = asyncio.run(_shard_rows("eval"))[len(first):]
    roots = [tmp_path / "local", eval_root]
    assert comparable_report(ev, roots) == comparable_report(ev_again, roots) == comparable_report(ev0.to_dict(), roots)
    assert [sorted(r.state.name for r in runs) for runs in reruns] == [["Completed", "Completed"]] * 2
    assert sorted((s["index"], s["part"], s["reused"]) for s in first) == [(0, "tasks", False), (1, "states", False)]
    assert sorted((s["index"], s["reused"]) for s in again) == [(0, False), (1, True)]  # only the deleted shard ran
    workers = {n["NodeID"] for n in ray_cluster.nodes() if n["Resources"].get("CPU") == 1}
    assert {s["worker_node"] for s in first + again if not s["reused"]} <= workers
    store = ArtifactStore(str(root))
    probes, pivots = _tables(store, out)
    probes0, pivots0 = _tables(store0, probe0)
    pd.testing.assert_frame_equal(probes, probes0)
    pd.testing.assert_frame_equal(pivots, pivots0)
    assert out["stats"] == probe0.stats
    shards = probe_rows
    assert sorted((s["index"], s["reused"]) for s in shards) == [(i, False) for i in range(4)]
    # The shards ran on both worker nodes (never on the CPU-less head), one engine per worker process,
    # kept warm for that worker's next shard.
    nodes = {n["NodeID"]: n for n in ray_cluster.nodes()}
    used = {s["worker_node"] for s in shards}
    assert len(used) == 2 and all(nodes[n]["Resources"].get("CPU") == 1 for n in used)
    per_pid: dict[int, list[bool]] = {}
    for s in sorted(shards, key=lambda s: s["index"]):
        per_pid.setdefault(s["worker_pid"], []).append(s["engine_reused"])
    assert sum(not r for rs in per_pid.values() for r in rs) == len(per_pid)  # one engine built per process
    assert sum(r for rs in per_pid.values() for r in rs) == 4 - len(per_pid) >= 1


def test_engines_of_two_ray_workers_bind_to_different_cpus(ray_cluster, tmp_path):
    """Ray does not restrict a worker process's CPU affinity (a Ray CPU is a count), so each engine
    used to bind its one OpenMP thread (``rollout.num_threads=1``) to the first CPU it may run on:
    both on CPU 0 (benchmarks/RESULTS.md §7b). Engines claim their CPUs machine-wide
    (``pivotrl.runtime.cpu_claims``) through ``pivotrl.rollout.vllm_placement.engine_cpu_bind``, called here in two
    concurrent tasks on the cluster's two worker nodes as ``VLLMEngine`` calls it before its engine
    starts (test_rollout.py checks that a vLLM model worker runs on its bind list's CPUs)."""
    import os

    import ray

    if len(os.sched_getaffinity(0)) < 2:
        pytest.skip("needs two CPUs")
    ready = tmp_path / "ready"
    ready.mkdir()
    env = {"env_vars": {"PIVOTRL_CPU_CLAIMS_DIR": str(tmp_path / "claims")}}
    ray.init(address=ray_cluster.address, logging_level="ERROR", ignore_reinit_error=True)
    try:
        @ray.remote(num_cpus=1, runtime_env=env)
        def bind(ready_dir: str) -> dict:
            from pivotrl.rollout.vllm_placement import engine_cpu_bind

            cpus, claim = engine_cpu_bind(1, {})
            Path(ready_dir, f"ready-{os.getpid()}").touch()  # both hold their claim together, as warm engines do
            deadline = time.time() + 120
            while len(list(Path(ready_dir).glob("ready-*"))) < 2 and time.time() < deadline:
                time.sleep(0.2)
            claim.release()
            return {"bind": cpus, "pid": os.getpid(), "affinity": sorted(os.sched_getaffinity(0))}

        out = ray.get([bind.remote(str(ready)), bind.remote(str(ready))], timeout=300)
    finally:
        ray.shutdown()
    allowed = sorted(os.sched_getaffinity(0))
    assert out[0]["pid"] != out[1]["pid"]  # two worker processes
    assert all(o["affinity"] == allowed for o in out)  # Ray left each worker the whole machine
    assert sorted(o["bind"] for o in out) == [str(c) for c in allowed[:2]]  # one CPU each, different ones


def test_losing_the_drivers_own_raylet_reruns_the_lost_shards_then_fails_naming_them(tmp_path, monkeypatch):
    """The flow owns its Ray instance (``ray_address`` null: one local node, the driver's own
    raylet). The ``faults.ray_node_loss_shards`` drill SIGKILLs that raylet while shard 0 runs:
    every shard in flight ends Crashed (NodeDiedError). With ``shard_retries=1`` the flow shuts the
    dead instance down, starts a fresh local one and reruns only the lost shards; the run completes
    with every shard. With ``shard_retries=0`` it fails naming shard 0 and what happened to it.
    (Before: the first loss failed the flow, ``shard_retries`` unused.)"""
    from prefect.testing.utilities import prefect_test_harness

    from pivotrl.flows.nightly import probe_only
    from pivotrl.tasks.shards import ShardsFailed

    tiny = save_tiny_checkpoint(tmp_path / "tiny")
    ray = ["scale_out.task_runner=ray", "scale_out.ray_cpus_per_shard=1", "scale_out.probe_shard_size=4",
           "faults.ray_node_loss_shards=[0]", f"model.source={tiny}"]
    monkeypatch.setenv("PREFECT_HOME", str(tmp_path / "prefect"))
    monkeypatch.setenv("RAY_USAGE_STATS_ENABLED", "0")
    with prefect_test_harness(server_startup_timeout=120):
        with pytest.raises(ShardsFailed) as lost:
            probe_only(config_path=str(REPO / "configs" / "smoke.yaml"), overrides=[
                f"run.storage_root={tmp_path / 'once'}", *ray, "scale_out.shard_retries=0"])
        before = len(asyncio.run(_shard_rows("probe")))
        out = probe_only(config_path=str(REPO / "configs" / "smoke.yaml"), overrides=[
            f"run.storage_root={tmp_path / 'retried'}", *ray, "scale_out.shard_retries=1"])
        rounds = asyncio.run(_shard_runs())
        retried = asyncio.run(_shard_rows("probe"))[before:]
    assert 0 in lost.value.lost and lost.value.failed == []
    assert "lost their Ray worker or node in each of 1 rounds" in str(lost.value)
    assert "shard 0 (" in str(lost.value) and "Crashed" in str(lost.value)
    drill = json.loads(next((tmp_path / "retried").rglob("node-loss-drill.json")).read_text())
    assert not Path(f"/proc/{drill['raylet']}").exists()  # the first round's raylet was killed
    # both shards computed, shard 0 in the second round (shard 1, finished in the first, reused there)
    assert sorted(s["index"] for s in retried if not s["reused"]) == [0, 1]
    assert len(rounds) == 3  # one subflow run for the failed run, two (a rerun) for the retried one
    probes, pivots = _tables(ArtifactStore(str(tmp_path / "retried")), out)
    assert len(probes) > 0 and set(probes["trajectory_id"]) >= set(pivots["trajectory_id"])


# ------------------------------------------------------------------ a pivot set of parsed tool calls
#: Hermes calls from a small grammar (pivotrl.testing.grammar): ``math.factorial`` or
#: ``triangle_properties.get`` (1/2 each) with a last argument of 5 or 6 (1/2 each). The pivot split's
#: ``simple_python_1`` (factorial of 5) and ``multiple_0`` (sides 5, 4, 3) accept a quarter of them,
#: the other states none; their trajectories fall in different shards.
_FACTORIAL = '<tool_call>\n{"name": "math.factorial", "arguments": {"number": '
_TRIANGLE = '<tool_call>\n{"name": "triangle_properties.get", "arguments": {"side2": 4, "side3": 3, "side1": '
_CLOSE = "}}\n</tool_call>"
CALL_GRAMMAR = {"": {_FACTORIAL: 1, _TRIANGLE: 1}, _FACTORIAL: {"5": 1, "6": 1}, _TRIANGLE: {"5": 1, "6": 1},
                "5": {_CLOSE: 1}, "6": {_CLOSE: 1}}
#: The hermes format under Qwen2.5's template; 8 probes a state so that both accepting states mix.
HERMES_CALLS = ("prompt.format=chat_template", "prompt.tool_parser=hermes", "probing.num_probes=8",
                "quality.include_stop_decisions=false")


@pytest.fixture(scope="module")
def hermes_caller(tmp_path_factory) -> Path:
    """The tiny Llama that writes :data:`CALL_GRAMMAR`, with a Qwen2.5-like tokenizer and template."""
    from pivotrl.testing import save_grammar_checkpoint, tiny_chat_tokenizer

    template = (REPO / "tests" / "fixtures" / "chat_templates" / "qwen2.5.jinja").read_text()
    return save_grammar_checkpoint(tmp_path_factory.mktemp("caller") / "hermes", CALL_GRAMMAR,
                                   tokenizer=tiny_chat_tokenizer("qwen2.5", template))


def test_parsed_calls_give_one_pivot_set_in_process_on_threads_and_on_ray(hermes_caller, ray_cluster, tmp_path,
                                                                          monkeypatch):
    """Probing whose samples are well-formed hermes calls, accepted or rejected by the argument
    verifier: the in-process unsharded stage, the sharded flow on threads (2 shards, each in a child
    process) and on the Ray cluster (4 shards over its 2 workers) write the same probe table (rows,
    samples, rewards, μ̂, σ̂²) and the same non-empty pivot set, under the same keys."""
    import shutil

    from prefect.testing.utilities import prefect_test_harness

    from pivotrl.flows.nightly import probe_only
    from pivotrl.pipeline.probe_stage import plan_probe_shards

    def overrides(root: Path, *extra: str) -> list[str]:
        return _overrides(root, hermes_caller, *HERMES_CALLS, *extra)

    cfg = load_config(str(REPO / "configs" / "smoke.yaml"), overrides(tmp_path / "local"))
    store0 = ArtifactStore(cfg.run.storage_root)
    demos = build_demonstrations(cfg, store0)
    ref = stages.stage_reference(cfg, store0, demos)
    probe0 = stages.stage_probe(cfg, store0, demos, ref)
    probes0, pivots0 = _tables(store0, probe0)
    ok = probes0[probes0["status"] == "ok"]
    rewards = [r for rs in ok["rewards"] for r in json.loads(rs)]
    reasons = {r for rs in ok["reasons"] for r in json.loads(rs)}
    samples = [s for ss in ok["samples"] for s in json.loads(ss)]
    assert all(s.startswith("<tool_call>\n{") and s.endswith(_CLOSE) for s in samples)  # the grammar's calls
    assert 1.0 in rewards and 0.0 in rewards and {"match", "wrong_tool"} <= reasons
    assert any(r.startswith("wrong_value") for r in reasons)  # a well-formed call with a wrong argument
    assert len(pivots0) >= 2 and (pivots0["var"] > 0).all() and (pivots0["mu"] < 1).all()

    runs = {"threads": ["scale_out.probe_shard_size=4", "scale_out.max_parallel_shards=2"],
            "ray": ["scale_out.probe_shard_size=2", "scale_out.task_runner=ray", "scale_out.ray_cpus_per_shard=1",
                    f"scale_out.ray_address={ray_cluster.address}"]}
    for name in runs:  # the demonstrations and the reference as published in-process: only probing runs
        for published in ("demos", "reference"):
            shutil.copytree(tmp_path / "local" / published, tmp_path / name / published)
    monkeypatch.setenv("PREFECT_HOME", str(tmp_path / "prefect"))
    with prefect_test_harness(server_startup_timeout=120):
        outs = {name: probe_only(config_path=str(REPO / "configs" / "smoke.yaml"),
                                 overrides=overrides(tmp_path / name, *extra)) for name, extra in runs.items()}
    for name, out in outs.items():
        probe = ProbeResult.of(out)
        assert (probe.probes_key, probe.pivots_key) == (probe0.probes_key, probe0.pivots_key), name
        store = ArtifactStore(str(tmp_path / name))
        probes, pivots = _tables(store, out)
        pd.testing.assert_frame_equal(probes, probes0)
        pd.testing.assert_frame_equal(pivots, pivots0)
        assert out["stats"] == probe0.stats, name
        # Every shard of the plan wrote its own table under this flow's root (its manifest names the
        # shard and its trajectories), and the pivots came from more than one shard.
        cfg_n = load_config(str(REPO / "configs" / "smoke.yaml"), overrides(tmp_path / name, *runs[name]))
        plan = plan_probe_shards(cfg_n, store, demos, ref)
        assert len(plan["shards"]) == {"threads": 2, "ray": 4}[name]
        for shard in plan["shards"]:
            manifest = store.read_manifest(f"{shard['key']}/probes.parquet")
            assert (manifest.extra["shard"], manifest.extra["trajectories"]) == (shard["index"], shard["trajectories"])
        holding = {s["index"] for s in plan["shards"] for t in pivots0["trajectory_id"] if t in s["trajectories"]}
        assert len(holding) >= 2, name
