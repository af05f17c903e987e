"""Probe throughput of sharded probing on a real local Ray cluster with 1 and 2 worker nodes of one
CPU each (prefect-ray's RayTaskRunner, the product path: the ``pivotrl-probe-shards`` flow).

``--model tiny`` (default): the smoke data with more records (tiny random model, transformers
engine, fp32, m = 4, ``--max-tokens`` per action).

``--model smollm2``: the default config's model and data (SmolLM2-135M-Instruct from
``model.source``, a dequantised Q4_1 GGUF copy; BFCL multi_turn_base + simple_python + multiple),
``rollout.engine=vllm``, ``rollout.num_threads=1`` (one OpenMP thread per engine, on the CPU its
engine claimed: ``pivotrl.runtime.cpu_claims``), ``model.dtype`` as resolved from the default ``auto``
(bf16 on CPUs with AVX512_BF16, else fp32; ``--dtype`` overrides; printed), m = 8,
``rollout.max_tokens`` 96, ``--states`` pivot states per run (``probing.max_states``),
``rollout.kv_cache_gib=1``. The warm start is disabled (``warm_start.enabled=false``): it would
take many minutes on a CPU before the first measured run, so π_ref is the base model. The cost per
generated token is the same for both; the base model's actions are longer (it rarely stops before
``max_tokens``), so compare generated tok/s rather than states/s with a warm-started run.

In both modes demonstrations (and the tiny model's warm start) run once in this process; each
measured run probes the selected pivot states from scratch in a copy of that store (nothing
probed yet), with the same probing seed: every run probes the same states with the same sample
seeds, in shards of ``--shard-size`` trajectories. Wall time
includes Prefect's task runs, Ray scheduling and one engine start per worker process (a flow run
is a Ray job: its worker processes, and the engines they keep warm between shards, end with it).
During each run the CPU affinity of every vLLM model-worker process of the cluster is sampled
(``engine_cpus``: one ``Cpus_allowed_list`` per engine process seen), to show that the engines of
two workers run on different CPUs.

    python benchmarks/bench_shards_ray.py [--repeats 2] [--records 24] [--shard-size 3]
    python benchmarks/bench_shards_ray.py --model smollm2 [--states 24] [--shard-size 2] [--repeats 3] [--interleave]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]


def engine_cpus(root_pids: list[int]) -> dict[int, str]:
    """``{pid: Cpus_allowed_list}`` of each vLLM model-worker process under ``root_pids``."""
    from pivotrl.testing import vllm_worker_cpus

    return vllm_worker_cpus(root_pids)


class EngineWatch:
    """Samples :func:`engine_cpus` every ``every_s`` seconds in a thread while a run goes on;
    ``seen``: every engine process met, with its CPUs."""

    def __init__(self, root_pids: list[int], every_s: float = 2.0) -> None:
        self.root_pids, self.every_s, self.seen = root_pids, every_s, {}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        while not self._stop.wait(self.every_s):
            self.seen.update(engine_cpus(self.root_pids))

    def __enter__(self) -> "EngineWatch":
        self._thread.start()
        return self

    def __exit__(self, *exc: Any) -> None:
        self._stop.set()
        self._thread.join()


def _setup(a: argparse.Namespace, tmp: Path) -> tuple[str, list[str]]:
    """The config file and base overrides of the chosen model."""
    if a.model == "tiny":
        from pivotrl.testing import save_tiny_checkpoint

        tiny = save_tiny_checkpoint(tmp / "tiny")
        base = [f"run.storage_root={tmp / 'root'}", f"model.source={tiny}", f"rollout.max_tokens={a.max_tokens}",
                f"data.sources.0.limit_per_category={a.records}"]
        return str(REPO / "configs" / "smoke.yaml"), base
    base = [f"run.storage_root={tmp / 'root'}", "run.sizing=fixed", "warm_start.enabled=false",
            "rollout.engine=vllm", "rollout.num_threads=1", "rollout.kv_cache_gib=1",
            f"probing.max_states={a.states}", f"model.dtype={a.dtype}"]
    return str(REPO / "configs" / "default.yaml"), base


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", choices=("tiny", "smollm2"), default="tiny")
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--records", type=int, default=24, help="tiny: records per single-turn BFCL category")
    ap.add_argument("--shard-size", type=int, default=None, help="trajectories per shard (tiny 3, smollm2 2)")
    ap.add_argument("--max-tokens", type=int, default=32, help="tiny: tokens per action")
    ap.add_argument("--states", type=int, default=24, help="smollm2: pivot states per run (probing.max_states)")
    ap.add_argument("--dtype", default="auto", help="smollm2: model.dtype (auto = resolved for this CPU)")
    ap.add_argument("--workers", default="1,2", help="worker counts to measure, comma-separated")
    ap.add_argument("--interleave", action="store_true",
                    help="alternate the worker counts run by run (A B B A ...), a fresh cluster each run")
    a = ap.parse_args()
    shard_size = a.shard_size or (3 if a.model == "tiny" else 2)
    os.environ.setdefault("PREFECT_SERVER_ANALYTICS_ENABLED", "false")
    from prefect.testing.utilities import prefect_test_harness

    from pivotrl.config import load_config
    from pivotrl.flows.shards import sharded_probe
    from pivotrl.pipeline import stages
    from pivotrl.pipeline.demos import build_demonstrations
    from pivotrl.runtime.precision import with_resolved_dtype
    from pivotrl.runtime.ray_local import RayCluster
    from pivotrl.storage import ArtifactStore
    from pivotrl.tasks.shards import task_runner

    tmp = Path(tempfile.mkdtemp(prefix="pivotrl-bench-ray-"))
    cfg_path, base = _setup(a, tmp)
    cfg = load_config(cfg_path, base)
    resolved = with_resolved_dtype(cfg).model.dtype
    print(json.dumps({"model": a.model, "source": cfg.model.source, "engine": cfg.rollout.engine,
                      "dtype": cfg.model.dtype, "resolved_dtype": resolved, "m": cfg.probing.num_probes,
                      "max_tokens": cfg.rollout.max_tokens, "shard_size": shard_size,
                      "threads_per_engine": cfg.rollout.num_threads}), flush=True)
    store = ArtifactStore(cfg.run.storage_root)
    demos = build_demonstrations(cfg, store)
    ref = stages.stage_reference(cfg, store, demos).to_dict()  # a flow input: the result's JSON dict
    rows: list[dict[str, Any]] = []
    os.environ["PREFECT_HOME"] = str(tmp / "prefect")
    counts = [int(w) for w in a.workers.split(",")]
    if a.interleave:  # A B B A ...: a drift of the machine's load hits every worker count alike
        runs = [(w, rep) for rep in range(a.repeats) for w in (counts if rep % 2 == 0 else counts[::-1])]
    else:
        runs = [(w, rep) for w in counts for rep in range(a.repeats)]

    def probe(cluster: RayCluster, root: Path) -> tuple[dict[str, Any], float]:
        shutil.copytree(cfg.run.storage_root, root)  # demonstrations and π_ref; nothing probed yet
        over = [*base, f"run.storage_root={root}", "scale_out.task_runner=ray", f"scale_out.ray_address={cluster.address}",
                f"scale_out.probe_shard_size={shard_size}"]
        c = load_config(cfg_path, over).model_dump(mode="json")
        t0 = time.time()
        out = sharded_probe.with_options(task_runner=task_runner(c))(c, {"demos": demos, "reference": ref})
        return out, time.time() - t0

    with prefect_test_harness(server_startup_timeout=120):
        i = 0
        while i < len(runs):
            workers = runs[i][0]
            with RayCluster(workers=workers) as cluster:
                while i < len(runs) and runs[i][0] == workers:  # consecutive runs share the cluster
                    rep = runs[i][1]
                    i += 1
                    load0 = os.getloadavg()
                    root = tmp / f"run-{workers}w-{rep}"
                    with EngineWatch([p.pid for p in cluster.procs]) as watch:
                        out, wall = probe(cluster, root)
                    probes = ArtifactStore(str(root)).read_parquet(f"{out['probes_key']}/probes.parquet")
                    ok = probes[probes["status"] == "ok"]
                    toks = sum(sum(json.loads(v)) for v in ok["sample_tokens"])
                    rows.append({"workers": workers, "repeat": rep, "utc": time.strftime("%H:%M:%S", time.gmtime()),
                                 "states": len(probes), "ok_states": len(ok),
                                 "samples": len(ok) * cfg.probing.num_probes, "gen_tokens": toks,
                                 "prompt_tokens": int(ok["prompt_tokens"].sum()),
                                 "wall_s": round(wall, 2), "states_per_s": round(len(probes) / wall, 3),
                                 "gen_tok_per_s": round(toks / wall, 1), "loadavg_before": [round(x, 2) for x in load0],
                                 "loadavg_after": [round(x, 2) for x in os.getloadavg()],
                                 "engine_cpus": sorted(watch.seen.values())})
                    print(json.dumps(rows[-1]), flush=True)
                    shutil.rmtree(root, ignore_errors=True)
    for w in sorted({x["workers"] for x in rows}):
        r = [x["states_per_s"] for x in rows if x["workers"] == w]
        t = [x["gen_tok_per_s"] for x in rows if x["workers"] == w]
        print(f"workers={w}: states/s median {statistics.median(r):.3f} (runs: {r}); "
              f"gen tok/s median {statistics.median(t):.1f} (runs: {t})")


if __name__ == "__main__":
    sys.exit(main())
