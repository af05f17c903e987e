"""One reuse layer and one retry layer per failure class.

Reuse: a stage whose artifacts exist under its content key is returned by its task with no stage
process started (the stage's own check, ``pivotrl.pipeline.keys.cached_result``); a missing
artifact makes it run again. Retries: one failing storage write is tried exactly the store's
``RetryPolicy.attempts`` times on the whole path a stage write takes (Prefect task → stage → store),
never again by a wrapper or by the task.
"""

from __future__ import annotations

import json
import types

import pytest
from prefect import flow

from pivotrl.config import load_config
from pivotrl.core.errors import StorageError
from pivotrl.core.retry import RetryPolicy
from pivotrl.storage import ArtifactStore

TOOL = {"type": "function", "function": {"name": "cd", "description": "change folder",
                                         "parameters": {"type": "object", "properties": {"folder": {"type": "string"}},
                                                        "required": ["folder"]}}}


def _record(tid: str) -> dict:
    return {"id": tid, "category": "demo", "tools": [TOOL], "messages": [
        {"role": "user", "content": "go to docs"},
        {"role": "assistant", "content": "", "tool_calls": [
            {"id": "c1", "type": "function", "function": {"name": "cd", "arguments": "{\"folder\": \"docs\"}"}}]},
        {"role": "tool", "tool_call_id": "c1", "content": "ok"},
        {"role": "assistant", "content": "Done."}]}


def _config(tmp_path, root: str) -> dict:
    src = tmp_path / "demo.jsonl"
    src.write_text("".join(json.dumps(_record(t)) + "\n" for t in "abc"), encoding="utf-8")
    return load_config(None, [f"run.storage_root={root}", f"data.sources=[{{kind: chat, url: '{src}'}}]",
                              "warm_start.enabled=false", "data.split.warm_start=0.0", "data.split.pivot=0.67",
                              "data.split.heldout=0.33"]).model_dump(mode="json")


@pytest.fixture()
def no_waits(monkeypatch):
    """The retry helper's sleeps, recorded instead of slept."""
    waits: list[float] = []
    monkeypatch.setattr("pivotrl.core.retry.time", types.SimpleNamespace(sleep=waits.append))
    return waits


def test_one_failing_write_is_tried_the_store_policy_attempts_on_the_whole_stage_path(tmp_path, monkeypatch,
                                                                                        no_waits, capfd):
    """A store whose every publish fails transiently (a reset connection): the demonstrations task
    (in-process stage, Prefect retries 2) ends Failed after exactly RetryPolicy().attempts tries of
    its first write, in one task run. Before, the pipeline's retrying store (5 tries) wrapped the
    store's own retries (6) and the task retried the stage (3 runs): 90 tries of one write."""
    from fsspec.implementations.memory import MemoryFileSystem

    from pivotrl.tasks.stages import demonstrations

    tries: list[str] = []

    def failing_mv(self, src, dst, *a, **kw):  # the publish step of every remote write
        tries.append(dst)
        raise ConnectionResetError(104, "connection reset by peer")

    monkeypatch.setattr(MemoryFileSystem, "mv", failing_mv)
    config = _config(tmp_path, "memory://retry-count/root")

    @flow(name="one-failing-write")
    def run() -> object:
        return demonstrations(config)

    with pytest.raises(StorageError, match=rf"storage unreachable after {RetryPolicy().attempts} attempts"):
        run()
    assert capfd.readouterr().out.count("[pivotrl] stage demonstrations: started") == 1  # one task run
    assert len(tries) == RetryPolicy().attempts, tries  # one write, tried by the store alone
    assert len(set(tries)) == 1 and tries[0].endswith("trajectories.parquet")
    assert no_waits == RetryPolicy().delays()  # the store's backoff, once
    assert not MemoryFileSystem().exists("/retry-count/root/leases") or \
        MemoryFileSystem().ls("/retry-count/root/leases") == []  # the lease was released


def test_an_injected_fault_is_retried_by_the_store_only_and_at_once(tmp_path, no_waits):
    """The fault injector at rate 1.0: every write fails; the store tries it ``attempts`` times
    without waiting (no outage to wait out) and publishes nothing."""
    store = ArtifactStore(str(tmp_path / "root"), failure_rate=1.0, seed=0, retry=RetryPolicy(attempts=4))
    with pytest.raises(StorageError, match=r"cannot write .*a\.json: injected faults after 4 attempts"):
        store.write_json("a.json", {"x": 1})
    assert store.attempts == 4 and store.write_retries == 3 and no_waits == [0.0, 0.0, 0.0]
    assert store.list() == []
    # a local store's own errors are not transient: tried once
    local = ArtifactStore(str(tmp_path / "root"), retry=RetryPolicy(attempts=4))
    with pytest.raises(StorageError, match="not found"):
        local.read_bytes("missing.json")
    assert local.attempts == 1


def test_the_pipeline_store_adds_no_retry_and_a_task_never_retries_a_storage_error():
    from pivotrl.config import RunConfig
    from pivotrl.core.errors import ConfigError, StorageAccessError, VerifierError
    from pivotrl.pipeline.common import make_store
    from pivotrl.pipeline.entry import StageError, retried_by_task

    store = make_store(RunConfig())
    assert type(store)._write_bytes is ArtifactStore._write_bytes  # no wrapper around the store's writes
    assert type(store).put_dir is ArtifactStore.put_dir
    assert not retried_by_task(StorageError("cannot write x: storage unreachable after 6 attempts"))
    assert not retried_by_task(StorageAccessError("access refused"))
    assert not retried_by_task(StageError("stage 'probe' failed (exit code 4)", permanent=False, storage=True))
    assert not retried_by_task(StageError("stage 'probe' failed (exit code 3)", permanent=True))
    assert not retried_by_task(ConfigError("bad"))
    assert retried_by_task(StageError("stage 'probe' failed (exit code -9)", permanent=False))  # a crash
    assert retried_by_task(VerifierError("sandbox kept failing"))


def test_a_stage_whose_artifacts_exist_starts_no_process_and_a_missing_one_runs_it(tmp_path, monkeypatch):
    """The reference task: its record and warm-start checkpoint exist under the stage's key → the
    recorded result, no stage process; the checkpoint's marker deleted → the stage process runs."""
    import pivotrl.pipeline.entry as entry
    from pivotrl.pipeline.keys import cached_result, stage_key
    from pivotrl.pipeline.results import ReferenceResult
    from pivotrl.tasks.stages import lease_key, reference

    config = _config(tmp_path, str(tmp_path / "root"))
    config["warm_start"]["enabled"] = True
    config["data"]["split"].update(warm_start=0.34, pivot=0.33)
    cfg = load_config(None, []).model_validate(config)
    store = ArtifactStore(str(tmp_path / "root"))
    demos = {"key": "demos/0123456789abcdef", "trajectories": store.url("demos/0123456789abcdef/trajectories.parquet")}
    key = stage_key("reference", cfg, store, {"demos": demos})
    assert lease_key("reference", config, {"demos": demos}) == key and key.startswith("reference/")
    ref = ReferenceResult(str(tmp_path), "b" * 64, "models/warm_start/abc", "c" * 64,
                          {"examples": 3, "checkpoint_hash": "c" * 64}, {"format": "hermes", "template_hash": "t"})
    store.write_json(f"{key}/reference.json", ref.to_dict())
    store.write_json("models/warm_start/abc.sft.json", ref.sft)
    store.write_json("models/warm_start/abc/_COMPLETE", {"files": {}})
    started: list[str] = []

    def stage_process(stage, *_a, **_kw):
        started.append(stage)
        return ref.to_dict()

    monkeypatch.setattr(entry, "run_stage_process", stage_process)

    @flow(name="reuse-reference")
    def run() -> dict:
        return reference(config, {"demos": demos})

    assert run() == ref.to_dict() and started == []  # reused: no stage process
    store.delete("models/warm_start/abc/_COMPLETE")
    assert cached_result("reference", cfg, store, {"demos": demos}) is None
    assert run() == ref.to_dict() and started == ["reference"]  # an artifact is gone: the stage runs
