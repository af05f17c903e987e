"""The in-memory weight refresh: the shared-memory block, the transformers engine reading it, the
training loop with ``weight_sync="memory"``, and the broadcast design over gloo across processes."""

from __future__ import annotations

import os
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from pivotrl.rollout import make_engine
from pivotrl.testing import save_tiny_checkpoint
from pivotrl.rollout.weight_sync import SharedWeights, module_weights, read_shared


@pytest.fixture(scope="module")
def ckpts(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    root = tmp_path_factory.mktemp("tiny")
    return save_tiny_checkpoint(root / "a", seed=0), save_tiny_checkpoint(root / "b", seed=1)


def test_shared_block_round_trip_and_reuse() -> None:
    weights = [("a", torch.arange(7, dtype=torch.float32)), ("b", torch.randn(3, 5).to(torch.bfloat16)),
               ("empty", torch.zeros(0, 4)), ("c", torch.tensor([[1, 2], [3, 4]], dtype=torch.int64))]
    sw = SharedWeights()
    name, meta = sw.write(weights)
    assert [m[0] for m in meta] == ["a", "b", "empty", "c"] and all(m[3] % 64 == 0 for m in meta)
    got = read_shared(name, [list(m) for m in meta],  # metadata as it arrives through an RPC (lists)
                      lambda it: {n: t.clone() for n, t in it})
    for n, t in weights:
        assert got[n].dtype == t.dtype and torch.equal(got[n], t), n
    # rewritten in place: same block, new values
    name2, _ = sw.write([(n, t + 1 if n != "empty" else t) for n, t in weights])
    assert name2 == name
    assert torch.equal(read_shared(name, meta, lambda it: dict(it)["a"].clone()), weights[0][1] + 1)
    sw.close()
    with pytest.raises(FileNotFoundError):
        read_shared(name, meta, lambda it: None)


def test_module_weights_leave_the_tied_head_out(ckpts: tuple[Path, Path]) -> None:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(ckpts[0])
    names = [n for n, _ in module_weights(model)]
    assert "model.embed_tokens.weight" in names and "lm_head.weight" not in names
    assert len(names) == len(model.state_dict()) - 1


def test_transformers_engine_reads_the_block_like_a_checkpoint(ckpts: tuple[Path, Path]) -> None:
    a, b = ckpts
    from transformers import AutoModelForCausalLM

    prompt, action = [5, 6, 7, 8], [9, 10, 11]
    from_disk = make_engine("transformers", str(a), dtype="fp32", max_model_len=128)
    from_disk.load_weights(str(b))
    in_memory = make_engine("transformers", str(a), dtype="fp32", max_model_len=128)
    before = in_memory.score([prompt], [action])[0]
    sw = SharedWeights()
    in_memory.update_weights(*sw.write(module_weights(AutoModelForCausalLM.from_pretrained(b))))
    after = in_memory.score([prompt], [action])[0]
    assert after != before
    assert after == pytest.approx(from_disk.score([prompt], [action])[0], abs=1e-6)
    # the tied head follows the new embedding
    m = in_memory.model
    assert m.lm_head.weight.data_ptr() == m.model.embed_tokens.weight.data_ptr()
    from pivotrl.core.errors import ModelError

    with pytest.raises(ModelError, match="shared weights .* does not match"):
        in_memory.update_weights(*sw.write([("nope", torch.zeros(2))]))
    sw.close()


@pytest.mark.parametrize("mode", ["memory", "disk"])
def test_the_loop_refreshes_the_engine_in_memory_or_from_disk(ckpts: tuple[Path, Path], tmp_path: Path,
                                                             mode: str) -> None:
    from pivotrl.verifiers.base import VerifierResult
    from pivotrl.config import load_config
    from pivotrl.training.loop import pivot_schedule, run_rl_loop
    from pivotrl.training.pivotrl import PivotRLTrainer

    class Even:
        def score(self, state, actions):
            return [VerifierResult.accept() if len(x) % 2 == 0 else VerifierResult.reject("odd") for x in actions]

    engine = make_engine("transformers", str(ckpts[0]), dtype="fp32", max_model_len=256)
    calls: list[str] = []
    for name in ("load_weights", "update_weights"):  # record which path the loop took
        orig = getattr(engine, name)
        setattr(engine, name, lambda *a, _o=orig, _n=name: (calls.append(_n), _o(*a))[1])
    trainer = PivotRLTrainer.build(ckpts[0], group_size=4, dtype="float32", lr=1e-2, beta=0.0, seed=0)
    pivots = [SimpleNamespace(state_id=f"p{i}") for i in range(4)]
    prompts = [[5, 17, 42, 9, 11], [7, 8, 9], [100, 3, 64, 2], [12, 13, 14, 15, 16, 17]]
    settings = load_config(None, ["model.dtype=fp32", "run.seed=0", "rollout.max_tokens=6", f"rollout.weight_sync={mode}",
                                  "training.group_size=4", "training.checkpoint_every=5", "training.pivots_per_batch=2",
                                  "training.updates_per_batch=1", "training.eval_every=0"])
    rows = run_rl_loop(trainer, engine, Even(), pivots, prompts, pivot_schedule(4, 2, 1, 0, None), settings,
                       tmp_path / "work", progress=False)
    assert len(rows) == 2
    assert calls == ["update_weights" if mode == "memory" else "load_weights"] * 2
    # the refresh check: the engine serves the trainer's weights (fp32) after every step
    assert all(r["refresh_max_abs_delta"] <= 1e-4 and r["refresh_s"] > 0 for r in rows)
    assert not list((tmp_path / "work").glob("policy-*")) if mode == "memory" else True
    engine.close()


# ------------------------------------------------------------------- broadcast over gloo (GPU design)
def _broadcast_rank(rank: int, world: int, port: int, a: str, b: str, out: str) -> None:
    import torch.distributed as dist
    from transformers import AutoModelForCausalLM

    from pivotrl.rollout.weight_sync import broadcast_weights, receive_weights

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    try:
        if rank == 0:  # the trainer
            broadcast_weights(module_weights(AutoModelForCausalLM.from_pretrained(a)), src=0)
        else:  # an engine worker: its own (different) weights, replaced by the received ones
            model = AutoModelForCausalLM.from_pretrained(b)
            got = receive_weights(src=0)
            missing, unexpected = model.load_state_dict(dict(got), strict=False)
            model.tie_weights()
            ref = AutoModelForCausalLM.from_pretrained(a)
            same = all(torch.equal(p, q) for p, q in zip(model.state_dict().values(), ref.state_dict().values()))
            Path(out, f"rank{rank}.txt").write_text(f"{same} {sorted(missing)} {sorted(unexpected)}")
    finally:
        dist.destroy_process_group()


def test_broadcast_from_the_trainer_to_engine_workers_over_gloo(ckpts: tuple[Path, Path], tmp_path: Path) -> None:
    import torch.multiprocessing as mp

    from pivotrl.training.deepspeed_utils import free_port

    world = 3
    mp.start_processes(_broadcast_rank, args=(world, free_port(), str(ckpts[0]), str(ckpts[1]), str(tmp_path)),
                       nprocs=world, join=True, start_method="spawn")
    for r in (1, 2):
        # every tensor equal to the trainer's; only the tied head (re-tied) was not sent
        assert (tmp_path / f"rank{r}.txt").read_text() == "True ['lm_head.weight'] []"


def test_engines_implement_the_in_memory_refresh() -> None:
    from pivotrl.rollout.hf import TransformersEngine
    from pivotrl.rollout.pool import EnginePool

    for cls in (TransformersEngine, EnginePool):
        assert callable(getattr(cls, "update_weights", None)), cls
    if os.environ.get("PIVOTRL_SKIP_VLLM_IMPORT") != "1":
        try:
            from pivotrl.rollout.vllm import VLLMEngine
            from pivotrl.rollout.vllm_worker import reload_shared
        except ImportError:  # no vLLM in this environment
            return
        assert callable(VLLMEngine.update_weights) and callable(reload_shared)


def test_module_weights_of_parameters_sharing_one_flat_buffer(ckpts: tuple[Path, Path]) -> None:
    """DeepSpeed ZeRO-1/2 keep every parameter as a view into one flat buffer: all of them are sent
    (only a tensor listed under two names, the tied head, is left out)."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(ckpts[0])
    params = list(model.parameters())  # distinct parameters (the tied head once)
    flat = torch.zeros(sum(p.numel() for p in params))
    offset = 0
    for p in params:
        view = flat[offset: offset + p.numel()].view_as(p)
        view.copy_(p.data)
        p.data = view
        offset += p.numel()
    got = dict(module_weights(model))
    assert len(got) == len(model.state_dict()) - 1 and "lm_head.weight" not in got
    for name, t in model.state_dict().items():
        if name != "lm_head.weight":
            assert torch.equal(got[name], t), name
