"""Data-parallel invariance: 2 ranks × half the batch = 1 rank × the whole batch (real torchrun, gloo)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from pivotrl.testing import save_tiny_checkpoint
from pivotrl.training.deepspeed_utils import free_port
from pivotrl.training.launch import LaunchConfig, launch
from pivotrl.training.pivotrl import Group

# Several processes each (launchers, stage subprocesses, benchmark scripts): not in `make test-fast`.
pytestmark = pytest.mark.integration


def _batches() -> list[list[Group]]:
    gen = torch.Generator().manual_seed(0)

    def ids(n: int) -> list[int]:
        return torch.randint(2, 500, (n,), generator=gen).tolist()

    rewards = [[1.0, 0.0, 0.0, 0.0], [1.0, 1.0, 0.0, 1.0], [0.0, 0.0, 0.0, 0.0]]
    # 3 groups per batch: from the second, rank 0 trains two, rank 1 one plus a zero-loss pass (matched
    # collectives); at the first, π_θ = π_ref, the flat group is skipped and each rank trains one
    return [
        [Group(f"b{b}g{i}", ids(9 + 2 * i), [ids(2 + (i + j) % 3) for j in range(4)], rewards[i]) for i in range(3)]
        for b in range(2)
    ]


@pytest.mark.parametrize("zero_stage", [0, 2])
def test_two_ranks_equal_one_rank(tmp_path: Path, zero_stage: int) -> None:
    model_dir = save_tiny_checkpoint(tmp_path / "model")
    batches_path = tmp_path / "batches.jsonl"
    batches_path.write_text("".join(json.dumps({"groups": [g.to_dict() for g in b]}) + "\n" for b in _batches()))
    training = dict(group_size=4, deepspeed={"zero_stage": zero_stage}, lr=1e-2, beta=0.05, updates_per_batch=2,
                    grad_clip=None)

    runs = {}
    for name, cfg in (
        ("one", LaunchConfig()),
        ("two", LaunchConfig(launcher="torchrun", nproc_per_node=2, master_port=free_port())),
    ):
        out = tmp_path / name
        spec = {
            "model_dir": str(model_dir),
            "batches_path": str(batches_path),
            "out_dir": str(out / "hf"),
            "metrics_path": str(out / "metrics.jsonl"),
            "training": training,
            "dtype": "float32",
            "seed": 0,
        }
        launch(cfg, entry="offline", spec=spec, workdir=out, timeout_s=240)
        runs[name] = (
            load_file(out / "hf" / "model.safetensors"),
            [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()],
        )

    (w1, m1), (w2, m2) = runs["one"], runs["two"]
    initial = load_file(model_dir / "model.safetensors")
    assert w1.keys() == w2.keys()
    moved = max((w1[k] - initial[k]).abs().max().item() for k in w1)
    assert moved > 1e-3  # the updates did something
    for k in w1:
        assert (w1[k] - w2[k]).abs().max().item() < 1e-5, k
    assert len(m1) == len(m2) == 2
    for step, (a, b) in enumerate(zip(m1, m2)):
        for key in ("loss", "loss_last", "kl", "grad_norm", "clip_frac", "ratio_max", "entropy", "tokens", "action_tokens"):
            assert b[key] == pytest.approx(a[key], rel=1e-4, abs=1e-6), key
        # the flat group is trained (its KL term) once π_θ has left π_ref, i.e. from the second step
        assert a["groups_trained"] == b["groups_trained"] == (2.0 if step == 0 else 3.0)
        assert a["zero_variance_frac"] == pytest.approx(1 / 3)
