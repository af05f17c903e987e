"""Machine-wide CPU claims (pivotrl.runtime.cpu_claims): engines of separate processes on one machine (Ray
worker processes of a local cluster) bind to different CPUs while free ones remain."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest

from pivotrl.runtime.cpu_claims import CLAIMS_DIR_ENV, claim_cpus
from pivotrl.core.errors import ConfigError
from pivotrl.rollout.vllm_placement import engine_cpu_bind

HOLDER = textwrap.dedent("""
    import sys
    from pivotrl.rollout.vllm_placement import engine_cpu_bind
    bind, claim = engine_cpu_bind(1, {}, None, claims=sys.argv[1])
    print(bind, flush=True)
    sys.stdin.readline()  # hold the claim until the parent says so
""")


def _holder(claims):
    proc = subprocess.Popen([sys.executable, "-c", HOLDER, str(claims)], stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE, text=True)
    return proc, proc.stdout.readline().strip()


@pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="needs two CPUs")
def test_two_processes_bind_their_engines_to_different_cpus(tmp_path):
    # Each Ray worker process builds its own engine with rollout.num_threads=1: the first-n choice
    # of its (unrestricted) affinity gave both the same CPU.
    first, bind_a = _holder(tmp_path)
    try:
        second, bind_b = _holder(tmp_path)
        try:
            assert bind_a != bind_b
            assert {int(bind_a), int(bind_b)} <= set(os.sched_getaffinity(0))
        finally:
            second.communicate("\n", timeout=30)
    finally:
        first.communicate("\n", timeout=30)
    again, bind_c = _holder(tmp_path)  # both exited: their CPUs are free again
    again.communicate("\n", timeout=30)
    assert bind_c == bind_a


def test_claims_take_free_cpus_first_then_share_and_release(tmp_path):
    a = claim_cpus(1, [1, 0], tmp_path)
    assert (a.cpus, a.claimed, a.shared) == ([0], [0], [])
    b = claim_cpus(2, [0, 1], tmp_path)  # one free: the thread count is kept, CPU 0 shared
    assert (b.cpus, b.claimed, b.shared) == ([0, 1], [1], [0])
    c = claim_cpus(1, [0, 1], tmp_path)
    assert (c.cpus, c.shared) == ([0], [0])
    a.release()
    b.release()
    d = claim_cpus(None, [0, 1], tmp_path)  # None: all of them
    assert (d.cpus, d.claimed) == ([0, 1], [0, 1])
    d.release()
    d.release()  # idempotent
    assert claim_cpus(5, [3], tmp_path).cpus == [3]
    with pytest.raises(ConfigError, match="n must be >= 1"):
        claim_cpus(0, [0], tmp_path)


def test_an_explicit_bind_or_explicit_cpu_ids_claim_nothing(tmp_path, monkeypatch):
    monkeypatch.setenv(CLAIMS_DIR_ENV, str(tmp_path))
    assert engine_cpu_bind(1, {"VLLM_CPU_OMP_THREADS_BIND": "0-3"}) == (None, None)
    assert engine_cpu_bind(2, {}, [5, 4, 6]) == ("4,5", None)
    bind, claim = engine_cpu_bind(1, {})  # the default directory comes from the environment
    try:
        assert claim is not None and bind == str(claim.cpus[0]) and list(tmp_path.glob("cpu-*.lock"))
    finally:
        claim.release()
