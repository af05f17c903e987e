"""Probe throughput of sharded probing on a real local Ray cluster with 1 and 2 worker nodes of one
CPU each (prefect-ray's RayTaskRunner, the product path: the ``pivotrl-probe-shards`` flow).

The workload is the smoke data with more records (tiny random model, transformers engine, fp32,
m = 4, ``--max-tokens`` per action): demonstrations and the warm start run once in this process;
each measured run probes the whole pivot split from scratch (fresh shard keys via a new probing
seed) in shards of ``--shard-size`` trajectories. Wall time includes Prefect's task runs, Ray
scheduling and each worker's engine start (once per worker, then warm).

    python benchmarks/bench_shards_ray.py [--repeats 2] [--records 24] [--shard-size 3]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--records", type=int, default=24, help="records per single-turn BFCL category")
    ap.add_argument("--shard-size", type=int, default=3)
    ap.add_argument("--max-tokens", type=int, default=32)
    a = ap.parse_args()
    os.environ.setdefault("PREFECT_SERVER_ANALYTICS_ENABLED", "false")
    from prefect.testing.utilities import prefect_test_harness

    from pivotrl.config import load_config
    from pivotrl.flows.shards import sharded_probe
    from pivotrl.pipeline import stages
    from pivotrl.pipeline.demos import build_demonstrations
    from pivotrl.ray_local import RayCluster
    from pivotrl.storage import ArtifactStore
    from pivotrl.tasks.shards import task_runner
    from pivotrl.testing import save_tiny_checkpoint

    tmp = Path(tempfile.mkdtemp(prefix="pivotrl-bench-ray-"))
    tiny = save_tiny_checkpoint(tmp / "tiny")
    base = [f"run.storage_root={tmp / 'root'}", f"model.source={tiny}", f"rollout.max_tokens={a.max_tokens}",
            f"data.sources.0.limit_per_category={a.records}", "data.sources.1.limit_per_category=0"]
    base = [o for o in base if not o.startswith("data.sources.1")]
    cfg = load_config(str(REPO / "configs" / "smoke.yaml"), base)
    store = ArtifactStore(cfg.run.storage_root)
    demos = build_demonstrations(cfg, store)
    ref = stages.stage_reference(cfg, store, demos).to_dict()  # a flow input: the result's JSON dict
    rows = []
    os.environ["PREFECT_HOME"] = str(tmp / "prefect")
    with prefect_test_harness(server_startup_timeout=120):
        for workers in (1, 2):
            with RayCluster(workers=workers) as cluster:
                for rep in range(a.repeats):
                    over = base + ["scale_out.task_runner=ray", f"scale_out.ray_address={cluster.address}",
                                   f"scale_out.probe_shard_size={a.shard_size}", f"probing.seed={100 * workers + rep}"]
                    c = load_config(str(REPO / "configs" / "smoke.yaml"), over).model_dump(mode="json")
                    t0 = time.time()
                    out = sharded_probe.with_options(task_runner=task_runner(c))(c, {"demos": demos, "reference": ref})
                    wall = time.time() - t0
                    probes = store.read_parquet(f"{out['probes_key']}/probes.parquet")
                    ok = probes[probes["status"] == "ok"]
                    toks = sum(sum(json.loads(v)) for v in ok["sample_tokens"])
                    rows.append({"workers": workers, "repeat": rep, "states": len(probes), "samples": len(ok) * 4,
                                 "gen_tokens": toks, "wall_s": round(wall, 2), "states_per_s": round(len(probes) / wall, 3),
                                 "gen_tok_per_s": round(toks / wall, 1), "load_avg": round(os.getloadavg()[0], 2)})
                    print(json.dumps(rows[-1]), flush=True)
    for w in (1, 2):
        r = [x["states_per_s"] for x in rows if x["workers"] == w]
        print(f"workers={w}: states/s median {statistics.median(r):.3f} (runs: {r})")


if __name__ == "__main__":
    sys.exit(main())
