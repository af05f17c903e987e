"""Two ``pivotrl run`` on the same storage root at once: every stage is computed once (the other
run waits on the stage's lease and reuses the result), both runs complete with the same report, and
no lease is left behind. Also the lease itself, with threads and an expired holder."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from pivotrl.storage import lease as lease_module
from pivotrl.storage.lease import lease_path, stage_lease
from pivotrl.storage import ArtifactStore

REPO = Path(__file__).resolve().parents[2]
STAGES = ("demonstrations", "reference", "probe", "train", "evaluate")


def test_lease_serialises_holders_and_breaks_an_expired_one(tmp_path, monkeypatch):
    store = ArtifactStore(str(tmp_path / "root"))
    inside, order = [], []

    def worker(name: str) -> None:
        with stage_lease(store, "pivotrl-probe-abc", poll=0.05):
            inside.append(name)
            assert len(inside) == 1, inside  # never two holders at once
            order.append(name)
            time.sleep(0.2)
            inside.remove(name)

    threads = [threading.Thread(target=worker, args=(f"t{i}",)) for i in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=30)
    assert sorted(order) == ["t0", "t1", "t2"]
    assert not os.path.exists(lease_path(store, "pivotrl-probe-abc"))

    # A holder that died: its lease expired without renewal and is taken over at once.
    path = Path(lease_path(store, "pivotrl-train-x"))
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps({"owner": "dead", "pid": 1, "expires_at": time.time() - 1}))
    seen = []
    clock = _CountingTime()
    monkeypatch.setattr(lease_module, "time", clock)  # the lease module's polls only, no other thread's sleeps
    with stage_lease(store, "pivotrl-train-x", poll=0.05, on_wait=seen.append) as info:
        assert info.owner != "dead"
    monkeypatch.undo()
    assert [h["owner"] for h in seen] == ["dead"]
    assert clock.polls == []  # taken at the first look: not one poll waited for the dead holder


class _CountingTime:
    """Stands in for ``time`` inside ``pivotrl.storage.lease``: records each ``sleep`` (a poll of the lease) and
    passes everything else to the real module."""

    def __init__(self) -> None:
        self.polls: list[float] = []

    def sleep(self, seconds: float) -> None:
        self.polls.append(seconds)
        time.sleep(seconds)

    def __getattr__(self, name: str) -> object:
        return getattr(time, name)


@pytest.mark.integration
@pytest.mark.timeout(600)
def test_two_concurrent_runs_compute_each_stage_once(tmp_path):
    from pivotrl.testing import save_tiny_checkpoint

    model = save_tiny_checkpoint(tmp_path / "tiny")
    root = tmp_path / "runs"
    procs, logs = [], []
    for i in range(2):
        home = tmp_path / f"prefect-home-{i}"
        home.mkdir()
        env = {**os.environ, "PREFECT_HOME": str(home), "PREFECT_SERVER_ANALYTICS_ENABLED": "false",
               "PREFECT_API_URL": "", "PREFECT_LOGGING_LEVEL": "INFO", "COLUMNS": "400"}
        env.pop("PREFECT_API_URL")
        log = open(tmp_path / f"run-{i}.log", "w")
        logs.append(log)
        procs.append(subprocess.Popen(
            [str(Path(sys.executable).parent / "pivotrl"), "run", "--config", "configs/smoke.yaml",
             "--set", f"run.storage_root={root}", "--set", f"model.source={model}"],
            cwd=REPO, env=env, stdout=log, stderr=subprocess.STDOUT))
    try:
        codes = [p.wait(timeout=540) for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
        for log in logs:
            log.close()
    texts = [(tmp_path / f"run-{i}.log").read_text() for i in range(2)]
    assert codes == [0, 0], "\n\n".join(t[-3000:] for t in texts)

    both = "\n".join(texts)
    computed = {s: len(re.findall(rf"stage {s}: computing", both)) for s in STAGES}
    assert computed == dict.fromkeys(STAGES, 1), computed
    # The second run did meet a stage being computed (it waited for it, then reused the result).
    waits = re.findall(r"stage (\w+) is being computed by another run", both)
    reused = re.findall(r"stage (\w+): reused ", both)
    assert waits and set(waits) <= set(reused), (waits, reused)

    reports = [re.search(r"^report: (\S+)", t, re.M).group(1) for t in texts]
    assert reports[0] == reports[1]
    assert len(list(root.glob("eval/*/report.json"))) == 1
    assert len(list(root.glob("train/*/checkpoints/step-*/ranks.json"))) == 2  # smoke: 2 steps, each once
    assert not list((root / "leases").iterdir())

    # A later run that changes only training and evaluation settings finds the artifacts of the
    # demonstrations, the warm start and the probe stage under their keys (which cover their own
    # inputs only): each is reused by its task, no stage process starts.
    env = {**os.environ, "PREFECT_HOME": str(tmp_path / "prefect-home-0"), "PREFECT_LOGGING_LEVEL": "INFO",
           "COLUMNS": "400"}
    env.pop("PREFECT_API_URL", None)
    out = subprocess.run(
        [str(Path(sys.executable).parent / "pivotrl"), "probe", "--config", "configs/smoke.yaml",
         "--set", f"run.storage_root={root}", "--set", f"model.source={model}", "--set", "training.lr=3e-5",
         "--set", "evaluation.num_tasks=1"], cwd=REPO, env=env, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    text = out.stdout + out.stderr
    reused = {s for s in ("demonstrations", "reference", "probe")
              if re.search(rf"Task run '{s}-[^']*' - stage {s}: reused .*no stage process started", text)}
    assert reused == {"demonstrations", "reference", "probe"}, text[-3000:]
    assert not re.search(r"stage \w+: (computing|started)", text), text[-3000:]
