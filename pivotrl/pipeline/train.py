"""The train stage: keys and I/O around the PivotRL loop (:mod:`pivotrl.training.loop`).

``stage_train(cfg, store, probe, ref) -> TrainResult`` keys the run by its pivot set, π_ref,
settings and code; reuses a finished run; otherwise reads the pivots, builds the trainer, the
rollout engine and the verifier, resumes from the latest complete checkpoint under
``train/<key>/checkpoints`` (:mod:`pivotrl.training.checkpoints`), runs the loop and publishes
``metrics.parquet``, ``summary.json`` and the policy (``train/<key>/policy``).
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import signal
import tempfile
from pathlib import Path
from typing import Any, Mapping, Sequence

import pandas as pd

from pivotrl.provenance.code_digest import stage_code_digest
from pivotrl.config import RunConfig
from pivotrl.core.hashing import content_hash
from pivotrl.core.errors import ConfigError, TrainingError
from pivotrl.pipeline.common import close_quietly, make_rollout_engine, make_verifier, prompt_kwargs
from pivotrl.pipeline.demos import cache_dir
from pivotrl.pipeline.reference import prompt_identity, reference_dir
from pivotrl.pipeline.results import ProbeResult, ReferenceResult, TrainResult
from pivotrl.runtime.precision import with_resolved_dtype
from pivotrl.storage import ArtifactStore

log = logging.getLogger("pivotrl.pipeline")


def train_key(cfg: RunConfig, store: ArtifactStore, probe: ProbeResult, ref: ReferenceResult) -> str:
    """``train/<16 hex>``: content hash of the pivot set, π_ref, the training, rollout, verifier and
    prompt settings, the dtype, the seed and the train stage's code (pivotrl.provenance.code_digest);
    with ``training.anchors_per_batch`` also of the probe table the anchor states come from."""
    tr = cfg.training
    anchors = ({"anchors": store.read_manifest(f"{probe.probes_key}/probes.parquet").sha256}
               if tr.anchors_per_batch else {})
    return "train/" + content_hash({"pivots": store.read_manifest(f"{probe.pivots_key}/pivots.parquet").sha256,
                                    **anchors,
                                    "reference": ref.ref_hash, "training": tr.model_dump(mode="json"),
                                    "rollout": cfg.rollout.model_dump(mode="json"),
                                    "verifier": cfg.verifier.model_dump(mode="json"),
                                    "prompt": prompt_identity(cfg, ref), "dtype": cfg.model.dtype,
                                    "seed": cfg.run.seed, "code": stage_code_digest("train")})[:16]


def _launch_ranks(cfg: RunConfig, store: ArtifactStore, probe: ProbeResult, ref: ReferenceResult,
                  threads: int) -> TrainResult:
    """Run the train stage as a process group (:mod:`pivotrl.training.launch`, entry ``rl_stage``)
    and return rank 0's result.

    One machine (``training.nnodes == 1``): ``nproc_per_node`` ranks here under
    ``training.launcher``, their output on this process's, ``threads // nproc_per_node`` (≥ 1)
    OpenMP threads each. Several (``node_launch: ray``): the launch spec is published to the run's
    storage (``launch/rl_stage-<hash>.json``, as ``infra/multinode/launch_train.py prepare`` does)
    and one torchrun per node is placed on the Ray cluster of ``scale_out.ray_address``
    (:mod:`pivotrl.training.ray_nodes`: a lost node restarts the group from the latest checkpoint).

    Raises ConfigError for ``node_launch: manual`` with ``nnodes > 1``: those nodes are started by
    hand (``infra/multinode/launch_train.py``), and a later run finds the trained policy.
    Raises TrainingError when the ranks fail.
    """
    from pivotrl.training.launch import LaunchConfig, launch

    tr = cfg.training
    spec = {"config": cfg.model_dump(mode="json"), "inputs": {"probe": probe.to_dict(), "reference": ref.to_dict()}}
    if tr.nnodes > 1 and tr.node_launch == "manual":
        raise ConfigError(
            f"training.nnodes = {tr.nnodes} with node_launch 'manual': the train stage runs on every node, started "
            "there (infra/multinode/launch_train.py prepare, then node on each; see infra/README.md); a run after "
            "that finds the trained policy. Set training.node_launch: ray to let the run start the nodes.")
    if tr.nnodes > 1:
        from pivotrl.training.ray_nodes import launch_on_ray

        spec["config"] = _node_paths(cfg, store).model_dump(mode="json")
        key = f"launch/rl_stage-{content_hash(spec)[:16]}.json"
        store.write_json(key, spec)
        log.info("train: launch spec %s; placing %d nodes on the Ray cluster %s", store.url(key), tr.nnodes,
                 cfg.scale_out.ray_address)
        per_rank = max(1, int(tr.ray_cpus_per_node) // tr.nproc_per_node)
        return TrainResult.of(launch_on_ray(
            address=str(cfg.scale_out.ray_address), nnodes=tr.nnodes, nproc_per_node=tr.nproc_per_node,
            cpus_per_node=tr.ray_cpus_per_node, gpus_per_node=tr.ray_gpus_per_node, spec_root=store.root_url,
            spec_key=key, storage_options=dict(cfg.run.storage_options), omp_num_threads=per_rank,
            retries=tr.node_failure_retries))
    lc = LaunchConfig.of(tr, omp_num_threads=max(1, threads // tr.nproc_per_node))
    log.info("train: starting %d ranks with %s", tr.nproc_per_node, tr.launcher)
    with tempfile.TemporaryDirectory(prefix=f"pivotrl-ranks-p{os.getpid()}-", dir=cache_dir(cfg)) as tmp:
        out = Path(tmp) / "result.json"
        launch(lc, entry="rl_stage", spec={**spec, "output": str(out)}, workdir=tmp, stream=True)
        return TrainResult.of(json.loads(out.read_text()))


def _node_paths(cfg: RunConfig, store: ArtifactStore) -> RunConfig:
    """``cfg`` as another node reads it: a local storage root and local paths of the model and the chat
    template made absolute (a node resolves a relative path against its own working directory, where
    they are not). None of these is part of the train key."""
    def local(path: str | None) -> str | None:
        if path is None or "://" in path or path.startswith("pypi:") or not Path(path).expanduser().exists():
            return path
        return str(Path(path).expanduser().resolve())

    root = store.root_url if store.root_url.startswith("file://") else cfg.run.storage_root
    return cfg.model_copy(update={
        "run": cfg.run.model_copy(update={"storage_root": root}),
        "model": cfg.model.model_copy(update={"source": local(cfg.model.source)}),
        "prompt": cfg.prompt.model_copy(update={"chat_template": local(cfg.prompt.chat_template)})})


def cached_train(cfg: RunConfig, store: ArtifactStore, probe: ProbeResult | Mapping[str, Any],
                 ref: ReferenceResult | Mapping[str, Any]) -> TrainResult | None:
    """The train stage's result if its summary and metrics table (written last) exist under its
    content key, else None; loads no model."""
    tkey = train_key(cfg, store, ProbeResult.of(probe), ReferenceResult.of(ref))
    if not (store.exists(f"{tkey}/summary.json") and store.exists(f"{tkey}/metrics.parquet")):
        return None
    summary = store.read_json(f"{tkey}/summary.json")
    return TrainResult(tkey, f"{tkey}/policy" if summary["steps"] else None, store.url(f"{tkey}/metrics.parquet"),
                       summary)


def stage_train(cfg: RunConfig, store: ArtifactStore, probe: ProbeResult | Mapping[str, Any],
                ref: ReferenceResult | Mapping[str, Any]) -> TrainResult:
    """Local GRPO on the pivot set (PivotRL §3 stage 2), with π_old refreshed in the rollout engine
    after every batch and the refresh verified against the trainer's log-probs.

    Resumes from the latest complete checkpoint under ``train/<key>/checkpoints`` and consumes the
    same pivot order as an uninterrupted run. A storage failure while looking for that checkpoint
    raises (StorageError), never restarts from step 0.
    """
    configured = cfg
    cfg = with_resolved_dtype(cfg)  # model.dtype: auto → bf16 | fp32 on this hardware
    probe, ref = ProbeResult.of(probe), ReferenceResult.of(ref)
    from pivotrl.bfcl.wheel import ensure_bfcl
    from pivotrl.data.states import frame_to_states
    from pivotrl.runtime.models import load_tokenizer
    from pivotrl.format.prompts import encode_state
    from pivotrl.provenance.rollouts import record_train_step
    from pivotrl.tracking.live import step_logger
    from pivotrl.training.checkpoints import fetch_checkpoint, latest_checkpoint, rank_and_world, save_checkpoint
    from pivotrl.training.loop import LoopHooks, anchor_schedule, pivot_schedule, refilter_unused, run_rl_loop
    from pivotrl.training.rank_engines import engine_host_ranks, local_world_size
    from pivotrl.training.pivotrl import PivotRLTrainer

    tr = cfg.training
    if (hit := cached_train(cfg, store, probe, ref)) is not None:
        return hit
    tkey = train_key(cfg, store, probe, ref)
    final_key = f"{tkey}/policy"
    metrics_uri = store.url(f"{tkey}/metrics.parquet")

    pivot_frame = store.read_parquet(f"{probe.pivots_key}/pivots.parquet")
    if pivot_frame.empty:
        check_pivot_set(cfg, probe, 0)  # raises unless training.allow_empty_pivots
        return _empty(cfg, store, probe, tkey)
    if tr.launcher != "inprocess" and "RANK" not in os.environ:  # this process starts the ranks
        return _launch_ranks(configured, store, probe, ref, threads=int(os.environ.get("OMP_NUM_THREADS", "1")))
    cache = cache_dir(cfg)
    pivots = frame_to_states(pivot_frame)
    num_pivots = len(pivots)
    if tr.anchors_per_batch:  # states π_ref solves, trained beside the pivots (training.anchors_per_batch)
        pivots += (anchors := anchor_states(cfg, store, probe))
        log.info("anchor states: %d of the probed states (every probe accepted), %d per batch", len(anchors),
                 min(tr.anchors_per_batch, len(anchors)))
    rdir = reference_dir(cfg, store, ref)
    tok = load_tokenizer(rdir)
    prompts = [encode_state(s, tok, max_len=cfg.model.max_context - cfg.rollout.max_tokens, **prompt_kwargs(cfg))
               for s in pivots]
    schedule = anchor_schedule(pivot_schedule(num_pivots, tr.pivots_per_batch, tr.epochs, cfg.run.seed, tr.max_steps),
                               num_pivots, len(pivots) - num_pivots, tr.anchors_per_batch, cfg.run.seed)
    # Named by this process (pivotrl.pipeline.tempdirs.remove_stale_tempdirs: a later stage removes
    # it if this one is killed before it does).
    work = Path(tempfile.mkdtemp(prefix=f"pivotrl-train-p{os.getpid()}-", dir=cache))
    trainer = PivotRLTrainer.for_run(cfg, str(rdir))
    # Data parallel: every rank trains; the host ranks (rank 0 alone by default) own the rollout
    # engines and the verifiers (rollout.engine_placement, pivotrl.training.rank_engines).
    rank, world = rank_and_world()
    lead = rank == 0
    hosts = engine_host_ranks(cfg.rollout.engine_placement, world, local_world_size(default=tr.nproc_per_node),
                              cfg.rollout.ranks_per_engine)
    host = rank in hosts
    start, rows = 0, []
    latest = latest_checkpoint(store, f"{tkey}/checkpoints")
    policy_dir = rdir
    if latest is not None:
        step_dir = fetch_checkpoint(store, latest, cache, rank)
        state = trainer.load_checkpoint(str(step_dir))
        start = int(state["step"])
        rows = pd.read_parquet(step_dir / "metrics.parquet").to_dict("records")
        policy_dir = step_dir / "hf"
        log.info("resuming PivotRL training from %s (step %d)", latest, start)
    verifier = make_verifier(cfg, ensure_bfcl(cache), tokenizer=tok) if host else None
    engine = make_training_engines(cfg, policy_dir, hosts=hosts, rank=rank) if host else None
    from pivotrl.pipeline.curve import heldout_curve_hook

    curve = heldout_curve_hook(cfg, store, probe, tok, engine, verifier) if lead else None  # the learning curve
    hooks = LoopHooks(
        evaluate=curve or (lambda step: {}),
        before_step=lambda step: _maybe_kill(cfg, store, tkey, step),
        record_step=lambda step, scored, groups: record_train_step(
            store, tkey, step, scored, trainer, groups, world, tr.advantage_estimator, tr.delta),
        log_row=(live := step_logger(cfg, store, tkey)),  # to the tracker, live, off this thread (no-op unless on)
        save_checkpoint=lambda step, rows_so_far: save_checkpoint(
            store, trainer, f"{tkey}/checkpoints/step-{step:06d}", rows_so_far, work, rank, world))
    try:
        rows = run_rl_loop(trainer, engine, verifier, pivots, prompts, schedule, cfg, work,
                           start=start, rows=rows, hooks=hooks, rank=rank, world=world, hosts=hosts,
                           num_pivots=num_pivots)
    finally:
        if engine is not None:
            engine.close()
        close_quietly(verifier)
        if hasattr(live, "close"):
            live.close()  # at most a few seconds: the tracker never holds the stage up
    if not lead:
        shutil.rmtree(work, ignore_errors=True)
        return TrainResult(tkey, final_key, metrics_uri, None)
    from pivotrl.evaluation.learning_curve import with_rollout_turns
    from pivotrl.pipeline.curve import probe_turns

    # The rollout turns sampled to each step, the probe's included (the curve's x in turns).
    rows = with_rollout_turns(rows, probe_turns(store, probe.probes_key), tr.group_size, cfg.probing.num_probes)
    metrics_df = pd.DataFrame(rows)
    last = latest_checkpoint(store, f"{tkey}/checkpoints")
    final = fetch_checkpoint(store, last, cache, 0) / "hf"
    store.put_dir(str(final), final_key)
    inputs = {"pivots": probe.pivots, "reference": store.url(ref.ref_key) if ref.ref_key else ref.base_dir}
    store.write_artifact(f"{tkey}/metrics.parquet", metrics_df, kind="training_metrics", inputs=inputs,
                         config={"training": tr.model_dump(mode="json")}, extra={"seed": cfg.run.seed})
    summary = {"steps": len(rows), "pivots": num_pivots, **({"anchors": len(pivots) - num_pivots}
                                                             if tr.anchors_per_batch else {}), "final_reward_mean": float(metrics_df["reward_mean"].iloc[-1])
               if "reward_mean" in metrics_df and len(metrics_df) else None,
               "policy": store.url(final_key)}
    from pivotrl.runtime.mfu import summarize

    speed = summarize(rows)  # the stage's trainer time, model FLOPs, tokens/s and MFU over all steps
    if speed:
        summary.update(speed)
    note = refilter_unused(cfg, num_pivots, len(schedule))
    if note:  # also logged by the loop; here it reaches the summary, the Prefect UI and the console line
        summary["warnings"] = [note]
    store.write_artifact(f"{tkey}/summary.json", summary, kind="policy_checkpoint", inputs=inputs,
                         config={"training": tr.model_dump(mode="json")}, extra={"checkpoint": store.url(final_key),
                                                                         "prompt_format": ref.prompt_format})
    shutil.rmtree(work, ignore_errors=True)
    return TrainResult(tkey, final_key, metrics_uri, summary)


def anchor_states(cfg: RunConfig, store: ArtifactStore, probe: ProbeResult) -> list[Any]:
    """The anchor states of ``training.anchors_per_batch``: the probed states of ``probe``'s table on
    which all of π_ref's m probes were accepted (decision ``all_pass``, :func:`apply_pivot_filter`),
    as turn states in state-id order, from the candidates the pivot set was probed from
    (:func:`pivotrl.pipeline.curve.pivot_candidates_key`); [] if none.
    Raises DataError when that candidates table is not in this store."""
    from pivotrl.core.errors import DataError
    from pivotrl.data.states import expand_candidates, frame_to_states
    from pivotrl.pipeline.curve import pivot_candidates_key
    from pivotrl.pipeline.demos import read_histories
    from pivotrl.pipeline.probe import apply_pivot_filter

    table = apply_pivot_filter(store.read_parquet(f"{probe.probes_key}/probes.parquet"), cfg.probing.lambda_diff)
    solved = sorted(table.loc[table["decision"] == "all_pass", "state_id"].astype(str))
    if not solved:
        return []
    key = pivot_candidates_key(store, probe)
    if key is None:
        raise DataError(f"the pivot set {probe.pivots} names no candidates table in this store, "
                        "so its anchor states (training.anchors_per_batch) cannot be read")
    cand = store.read_parquet(key)
    rows = cand[cand["state_id"].astype(str).isin(solved)].sort_values("state_id").reset_index(drop=True)
    return frame_to_states(expand_candidates(rows, read_histories(store, key.rsplit("/", 1)[0], rows["trajectory_id"])))


def make_training_engines(cfg: RunConfig, model_dir: Path | str, *, hosts: Sequence[int] = (0,), rank: int = 0) -> Any:
    """The rollout engine(s) of the train stage on a host rank (``hosts``, see
    :mod:`pivotrl.training.rank_engines`).

    On rank 0 alone (``hosts == [0]``): one engine for ``rollout.num_engines: 1`` (as before), else
    an ``EnginePool`` of that many (:mod:`pivotrl.rollout.pool`), each vLLM engine on CPU bound to its
    own block of this process's CPUs (``engine_cpus``) with at most ``rollout.num_threads`` threads;
    on GPUs every engine of that pool is built with vLLM's own device choice (rank 0's GPU).

    On several host ranks: one engine on this rank. A vLLM engine on GPUs takes the GPUs
    ``LOCAL_RANK .. LOCAL_RANK + tensor_parallel_size - 1`` of its node (``device_ids``), the
    transformers engine ``cuda:LOCAL_RANK``; on CPU, the host ranks of one node split its CPUs.
    An engine that fails to build closes the ones already built."""
    from pivotrl.rollout.pool import EnginePool, engine_cpus

    hosts = list(hosts)
    if hosts != [0]:
        place = _host_engine_placement(cfg, hosts, rank)
        log.info("train: rollout engine %d of %d on rank %d (%s%s)", hosts.index(rank), len(hosts), rank,
                 cfg.rollout.engine, "".join(f", {k}={v}" for k, v in place.items()))
        return make_rollout_engine(cfg, model_dir, **place)
    n = cfg.rollout.num_engines
    if n == 1:
        return make_rollout_engine(cfg, model_dir)
    engines: list[Any] = []
    try:
        for j in range(n):
            extra = {"cpu_ids": engine_cpus(j, n)} if cfg.rollout.engine == "vllm" else {}
            engines.append(make_rollout_engine(cfg, model_dir, **extra))
    except BaseException:
        for e in engines:
            try:
                e.close()
            except Exception:  # noqa: BLE001 - the build error is the one to report
                log.warning("closing a rollout engine after a failed build failed", exc_info=True)
        raise
    log.info("train: %d rollout engines on rank 0 (%s)", n, cfg.rollout.engine)
    return EnginePool(engines)


def _host_engine_placement(cfg: RunConfig, hosts: list[int], rank: int) -> dict[str, Any]:
    """Constructor keywords placing the engine of host rank ``rank`` (see make_training_engines)."""
    import torch

    from pivotrl.rollout.pool import engine_cpus
    from pivotrl.training.rank_engines import local_world_size

    local_rank = int(os.environ.get("LOCAL_RANK", rank))
    if torch.cuda.is_available():
        if cfg.rollout.engine == "vllm":
            return {"device_ids": list(range(local_rank, local_rank + cfg.rollout.tensor_parallel_size))}
        return {"device": f"cuda:{local_rank}"}
    if cfg.rollout.engine != "vllm":
        return {}
    local = local_world_size(default=cfg.training.nproc_per_node)
    node = rank // local
    on_node = [h for h in hosts if h // local == node]
    return {"cpu_ids": engine_cpus(on_node.index(rank), len(on_node))}


def check_pivot_set(cfg: RunConfig, probe: ProbeResult, n_pivots: int) -> None:
    """Refuse to train on an empty pivot set (``n_pivots == 0``) unless ``training.allow_empty_pivots``.

    Raises TrainingError (permanent: a retry selects the same states) whose message names the pivot
    set, the filter's counts (``probe.stats["total"]``: candidates, all_fail, all_pass,
    above_threshold, skipped) and the settings that change them.
    """
    if n_pivots > 0 or cfg.training.allow_empty_pivots:
        return
    c = (probe.stats or {}).get("total", {})
    lam = (probe.stats or {}).get("lambda_diff", cfg.probing.lambda_diff)
    skipped = int(c.get("skipped_too_long", 0)) + int(c.get("skipped_verifier_error", 0))
    counts = (f"{c.get('candidates', '?')} candidate states: all_fail {c.get('all_fail', '?')}, "
              f"all_pass {c.get('all_pass', '?')}, above_threshold {c.get('above_threshold', '?')} "
              f"(μ̂ ≥ λ_diff = {lam}), skipped {skipped} (too long {c.get('skipped_too_long', 0)}, "
              f"verifier error {c.get('skipped_verifier_error', 0)})")
    raise TrainingError(
        f"the pivot set {probe.pivots} is empty, so there is nothing to train on; {counts}. To change it: "
        "probe more states (probing.max_states) or with more samples (probing.num_probes); for many all_fail, "
        "warm-start the reference (warm_start.enabled, warm_start.epochs); for above_threshold, raise "
        "probing.lambda_diff; for skipped too long, raise model.max_context; or set "
        "training.allow_empty_pivots: true to finish with the policy = π_ref.")


def _empty(cfg: RunConfig, store: ArtifactStore, probe: ProbeResult, tkey: str) -> TrainResult:
    """Nothing to train on tonight: the policy stays π_ref, and the report says so."""
    tr = cfg.training
    log.warning("the pivot set %s is empty (allowed by training.allow_empty_pivots): no PivotRL update; the "
                "policy is the reference.", probe.pivots)
    empty = pd.DataFrame({"step": pd.Series([], dtype="int64"), "reward_mean": pd.Series([], dtype="float64")})
    summary = {"steps": 0, "pivots": 0, "final_reward_mean": None, "policy": "reference",
               "note": "empty pivot set: policy = reference"}
    inputs = {"pivots": probe.pivots}
    store.write_artifact(f"{tkey}/metrics.parquet", empty, kind="training_metrics", inputs=inputs,
                         config={"training": tr.model_dump(mode="json")})
    store.write_artifact(f"{tkey}/summary.json", summary, kind="policy_checkpoint", inputs=inputs,
                         config={"training": tr.model_dump(mode="json")})
    return TrainResult(tkey, None, store.url(f"{tkey}/metrics.parquet"), summary)


def _maybe_kill(cfg: RunConfig, store: ArtifactStore, tkey: str, step: int) -> None:
    """Fault injection before step ``step`` (0-based, on every rank), once per run (a marker in the
    store): at ``faults.kill_trainer_at_step`` rank 0 SIGKILLs itself; at
    ``faults.kill_trainer_node_at_step`` the ranks of the last node of a process group placed by Ray
    SIGKILL that node's raylet and themselves (the node is lost)."""
    from pivotrl.training.ray_nodes import RAYLET_PID_ENV

    at = cfg.faults.kill_trainer_at_step
    marker = f"{tkey}/faults/killed-at-{at}"
    if at is not None and step == at and int(os.environ.get("RANK", "0")) == 0 and not store.exists(marker):
        store.write_text(marker, "killed\n")
        os.kill(os.getpid(), signal.SIGKILL)
    node_at = cfg.faults.kill_trainer_node_at_step
    last_node = int(os.environ.get("GROUP_RANK", "0")) == cfg.training.nnodes - 1 > 0
    if node_at is not None and step == node_at and last_node and RAYLET_PID_ENV in os.environ:
        marker = f"{tkey}/faults/node-lost-at-{node_at}"
        if not store.exists(marker):
            store.write_text(marker, "node lost\n")
            os.kill(int(os.environ[RAYLET_PID_ENV]), signal.SIGKILL)
            os.kill(os.getpid(), signal.SIGKILL)
