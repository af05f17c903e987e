"""The vLLM engines of two Ray worker processes on one machine bind to different CPUs.

Ray does not restrict a worker process's CPU affinity, so each engine used to bind its one OpenMP
thread (``rollout.num_threads=1``) to the first CPU it may run on: both on CPU 0, CPU 1 idle. The
engines now claim their CPUs machine-wide (``pivotrl.cpu_claims``)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from pivotrl.ray_local import RayCluster
from pivotrl.testing import save_tiny_checkpoint

pytestmark = [pytest.mark.integration, pytest.mark.vllm]


@pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="needs two CPUs")
def test_engines_of_two_ray_workers_bind_to_different_cpus(tmp_path, monkeypatch):
    pytest.importorskip("vllm")
    import ray

    monkeypatch.setenv("PIVOTRL_CPU_CLAIMS_DIR", str(tmp_path / "claims"))  # the nodes inherit it
    tiny = save_tiny_checkpoint(tmp_path / "tiny")
    with RayCluster(workers=2) as cluster:
        ray.init(address=cluster.address, logging_level="ERROR")
        try:
            @ray.remote(num_cpus=1)
            def build(path: str, hold_s: float) -> dict:
                import time

                from pivotrl.rollout.base import SamplingConfig
                from pivotrl.rollout.vllm import VLLMEngine

                def _worker_cpus(pid: int) -> list[str]:
                    """``Cpus_allowed_list`` of the vLLM model-worker processes under ``pid``."""
                    parent = {}
                    for d in Path("/proc").iterdir():
                        if d.name.isdigit():
                            try:
                                parent[int(d.name)] = int((d / "stat").read_text().rsplit(")", 1)[1].split()[1])
                            except (OSError, ValueError):
                                pass
                    todo, found = [pid], []
                    while todo:
                        p = todo.pop()
                        for c in [c for c, pp in parent.items() if pp == p]:
                            todo.append(c)
                            try:
                                if Path(f"/proc/{c}/comm").read_text().strip() == "VLLM::Worker":
                                    status = Path(f"/proc/{c}/status").read_text()
                                    found += [ln.split()[1] for ln in status.splitlines() if ln.startswith("Cpus_allowed_list")]
                            except OSError:
                                pass
                    return found

                engine = VLLMEngine(path, dtype="fp32", max_model_len=512, cpu_threads=1)
                try:
                    engine.generate([[1, 2, 3]], SamplingConfig(n=2, max_tokens=4))
                    time.sleep(hold_s)  # both engines alive together
                    return {"bind": engine.cpu_bind, "worker_cpus": _worker_cpus(os.getpid())}
                finally:
                    engine.close()

            out = ray.get([build.remote(str(tiny), 20.0), build.remote(str(tiny), 20.0)], timeout=400)
        finally:
            ray.shutdown()
    binds = sorted(o["bind"] for o in out)
    allowed = sorted(str(c) for c in os.sched_getaffinity(0))
    assert binds == allowed[:2]  # one CPU each, different ones
    # The engine processes run there: each model worker found under its Ray worker is allowed exactly
    # its engine's CPU (the process-tree scan can miss a worker that a busy machine started late).
    found = [o for o in out if o["worker_cpus"]]
    assert found and all(o["worker_cpus"] == [o["bind"]] for o in found), out
