"""``pivotrl rollouts`` reads every record once, from the run root or any folder under it
(pivotrl.provenance.rollouts.read_rollouts), on a real local artifact store."""

from __future__ import annotations

import json

import pandas as pd
import pytest

from pivotrl.core.errors import StorageError
from pivotrl.provenance.rollouts import ROLLOUT_COLUMNS, read_rollouts
from pivotrl.storage import ArtifactStore


def _probes(state: str, rewards: list[float]) -> pd.DataFrame:
    return pd.DataFrame({"state_id": [state], "status": ["ok"], "samples": [json.dumps([f"a{k}" for k in range(len(rewards))])],
                         "rewards": [json.dumps(rewards)], "reasons": [json.dumps(["r"] * len(rewards))],
                         "sample_tokens": [json.dumps([3] * len(rewards))]})


@pytest.fixture()
def root(tmp_path):
    store = ArtifactStore(str(tmp_path / "root"))
    # a sharded probe: two shard tables and their merge (the same rows)
    store.write_parquet("probes/shards/s0/probes.parquet", _probes("t0#1", [1.0, 0.0]))
    store.write_parquet("probes/shards/s1/probes.parquet", _probes("t1#1", [0.0, 0.0]))
    store.write_parquet("probes/k1/probes.parquet", pd.concat([_probes("t0#1", [1.0, 0.0]), _probes("t1#1", [0.0, 0.0])]))
    step = pd.DataFrame([{"stage": "train", "policy": "policy", "policy_step": 0, "step": 1, "state_id": "t0#1",
                          "sample_index": k, "action_text": "x", "action_tokens": 1, "reward": 1.0, "reason": "ok",
                          "advantage": 0.5, "ratio": 1.0} for k in range(2)], columns=ROLLOUT_COLUMNS)
    store.write_parquet("train/t1/rollouts/step-000001.parquet", step)
    return tmp_path / "root"


def test_the_run_root_counts_each_probe_sample_once(root):
    df = read_rollouts(ArtifactStore(str(root)))
    probe = df[df["stage"] == "probe"]
    assert sorted(zip(probe["state_id"], probe["sample_index"])) == [("t0#1", 0), ("t0#1", 1), ("t1#1", 0), ("t1#1", 1)]
    assert (df["stage"] == "train").sum() == 2


@pytest.mark.parametrize("folder, stages, rows", [
    ("probes/k1", {"probe"}, 4),         # the folder of one probe table
    ("train/t1", {"train"}, 2),          # the folder of one training run
    ("probes/shards", {"probe"}, 4),     # inside the shards: their own tables
    ("probes/shards/s0", {"probe"}, 2),
])
def test_any_folder_under_the_root_reads_its_own_records(root, folder, stages, rows):
    df = read_rollouts(ArtifactStore(str(root / folder)))
    assert set(df["stage"]) == stages and len(df) == rows


def test_a_folder_without_records_names_itself(root, tmp_path):
    (tmp_path / "empty").mkdir()
    with pytest.raises(StorageError, match="empty: no rollout records"):
        read_rollouts(ArtifactStore(str(tmp_path / "empty")))
