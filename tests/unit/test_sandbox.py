"""Sandbox pool: limits, failure reasons, worker replacement, retries (real worker processes)."""

from __future__ import annotations

import os

import pytest

from pivotrl.envs.sandbox import RetryStats, SandboxError, SandboxPool, call_with_retries
from pivotrl.core.errors import ConfigError, ToolExecutionError


@pytest.fixture(scope="module")
def pool():
    with SandboxPool(num_workers=1, timeout_s=2.0, memory_mb=256, cpu_s=1.5) as p:
        yield p


def test_echo_round_trips_json_and_runs_in_an_empty_directory(pool):
    payload = {"a": [1, 2.5, None, True], "s": "é ✓"}
    assert pool.call("echo", payload) == payload
    assert pool.call("sleep", {"seconds": 0}) == []  # a fresh, empty working directory


def test_a_request_that_sleeps_forever_is_stopped_and_the_pool_recovers(pool):
    before = pool.replaced
    with pytest.raises(SandboxError) as info:
        pool.call("sleep", {"seconds": None})  # stopped by the pool's wall-clock limit (no time asserted here)
    assert info.value.reason == "timeout"
    assert isinstance(info.value, ToolExecutionError)
    assert pool.replaced == before + 1
    assert pool.call("echo", [7]) == [7]


def test_unbounded_allocation_is_stopped_as_a_memory_error(pool):
    with pytest.raises(SandboxError) as info:
        pool.call("allocate", {"mb": None})
    assert info.value.reason == "memory"
    assert "256 MiB" in str(info.value)
    assert pool.call("allocate", {"mb": 32}) == 32  # a fresh worker, well within the limit


def test_a_crash_is_reported_with_the_exit_code(pool):
    with pytest.raises(SandboxError) as info:
        pool.call("exit", {"code": 7})
    assert info.value.reason == "crash"
    assert "exit code 7" in str(info.value)
    assert pool.call("echo", "ok") == "ok"


def test_cpu_time_limit_kills_a_busy_loop():
    # Wall-clock limit far away: the CPU-time limit (1 s per request) must act first.
    with SandboxPool(timeout_s=20.0, memory_mb=256, cpu_s=1.0) as p:
        assert p.call("spin", {"seconds": 0.1}) > 0
        with pytest.raises(SandboxError) as info:
            p.call("spin", {"seconds": None})
        assert info.value.reason == "timeout"
        assert "CPU-time" in str(info.value)  # the CPU-time limit acted, not the 20-s wall clock
        assert p.call("spin", {"seconds": 0.1}) > 0  # the per-request budget is fresh again


def test_network_sockets_are_refused_inside_the_worker(pool):
    assert pool.call("network", {}).startswith("refused")


def test_function_errors_keep_the_worker_and_unknown_names_are_rejected(pool):
    before = pool.replaced
    with pytest.raises(SandboxError) as info:
        pool.call("sleep", {"seconds": "not a number"})
    assert info.value.reason == "error"
    assert "ValueError" in str(info.value)
    assert pool.replaced == before
    with pytest.raises(ConfigError, match="not allowed"):
        pool.call("os.system", "true")


def test_two_workers_run_requests_in_parallel(tmp_path, monkeypatch):
    from concurrent.futures import ThreadPoolExecutor
    from pathlib import Path

    # Each request waits until both have started (a rendezvous in a folder, 60 s at most): each
    # sees 2 only if two workers run them at once.
    here = str(Path(__file__).resolve().parent)
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join([here, *filter(None, [os.environ.get("PYTHONPATH")])]))
    with SandboxPool(num_workers=2, timeout_s=120.0, memory_mb=256, functions={"meet": "sandbox_meet:meet"}) as p:
        with ThreadPoolExecutor(2) as ex:
            seen = list(ex.map(lambda _: p.call("meet", {"dir": str(tmp_path), "n": 2, "timeout_s": 60}), range(2)))
        assert seen == [2, 2]


def test_call_with_retries_counts_retries_and_reraises():
    attempts = []

    def flaky():
        attempts.append(1)
        if len(attempts) < 3:
            raise SandboxError("boom", "crash")
        return "done"

    stats = RetryStats()
    assert call_with_retries(flaky, retries=2, backoff_s=0.0, stats=stats) == "done"
    assert (stats.calls, stats.retries, stats.failures) == (1, 2, 0)

    attempts.clear()
    with pytest.raises(SandboxError):
        call_with_retries(flaky, retries=1, backoff_s=0.0, stats=stats)
    assert (stats.calls, stats.retries, stats.failures) == (2, 3, 1)

    def wrong():
        raise KeyError("not retried")

    with pytest.raises(KeyError):
        call_with_retries(wrong, retries=5, backoff_s=0.0, stats=stats)
    assert stats.retries == 3


def test_a_refusal_of_the_store_is_never_retried():
    from pivotrl.core.errors import StorageAccessError, StorageError

    calls = []

    def denied():
        calls.append(1)
        raise StorageAccessError("cannot write s3://b/k: access refused (AccessDenied)")

    stats = RetryStats()
    with pytest.raises(StorageAccessError):  # even where the caller retries every StorageError
        call_with_retries(denied, retries=5, backoff_s=0.0, retry_on=(StorageError,), stats=stats)
    with pytest.raises(StorageAccessError):
        call_with_retries(denied, retries=5, backoff_s=0.0, retry_if=lambda e: True, stats=stats)
    assert len(calls) == 2 and stats.retries == 0


def test_bad_settings_are_config_errors():
    with pytest.raises(ConfigError, match="num_workers"):
        SandboxPool(num_workers=0)
    with pytest.raises(ConfigError, match="timeout_s"):
        SandboxPool(timeout_s=0)
    with pytest.raises(ConfigError, match="module:function"):
        SandboxPool(functions={"x": "no_colon"})


def test_a_killed_worker_leaves_no_scratch_directory():
    with SandboxPool(timeout_s=1.0, memory_mb=256) as p:
        p.call("echo", 1)
        (first,) = list(p._all)
        assert os.path.isdir(first.base_dir)
        with pytest.raises(SandboxError):
            p.call("sleep", {"seconds": None})  # timed out: the worker is SIGKILLed and replaced
        assert not os.path.exists(first.base_dir)
        p.call("echo", 2)
        (second,) = list(p._all)
    assert second.base_dir != first.base_dir and not os.path.exists(second.base_dir)


def test_closed_pool_leaves_no_worker_running():
    p = SandboxPool(timeout_s=5.0, memory_mb=256)
    p.call("echo", 1)
    (worker,) = list(p._all)
    pid = worker.proc.pid
    p.close()
    with pytest.raises(ProcessLookupError):
        os.kill(pid, 0)
