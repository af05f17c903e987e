from __future__ import annotations

import json
import logging
import math
from pathlib import Path

import pytest
import torch

from pivotrl.core.errors import ConfigError, DataError
from pivotrl.testing import save_tiny_checkpoint, tiny_tokenizer
from pivotrl.training.launch import LaunchConfig, read_spec, render_launch_command
from pivotrl.training.offline import OfflineSpec
from pivotrl.training.pivotrl import Group, PivotRLTrainer

TIMING_KEYS = {"step_time_s", "trainer_s", "policy_tokens_per_s", "ref_tokens_per_s", "mfu"}


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return save_tiny_checkpoint(tmp_path_factory.mktemp("tiny") / "model")


def _ids(n: int, gen: torch.Generator) -> list[int]:
    return torch.randint(2, 500, (n,), generator=gen).tolist()


def _groups(seed: int, n: int, k: int = 4, rewards: list[list[float]] | None = None) -> list[Group]:
    gen = torch.Generator().manual_seed(seed)
    out = []
    for i in range(n):
        r = rewards[i] if rewards else [float((i + j) % 2) for j in range(k)]
        out.append(Group(f"s{seed}-{i}", _ids(10 + i, gen), [_ids(2 + (i + j) % 4, gen) for j in range(k)], r))
    return out


def _sample(model: torch.nn.Module, prompt: list[int], k: int, t: int, gen: torch.Generator) -> list[list[int]]:
    """K actions of T tokens sampled from the model itself (temperature 1)."""
    with torch.no_grad():
        seqs = torch.tensor([prompt] * k)
        for _ in range(t):
            probs = torch.softmax(model(input_ids=seqs).logits[:, -1].float(), -1)
            seqs = torch.cat([seqs, torch.multinomial(probs, 1, generator=gen)], 1)
    return seqs[:, len(prompt) :].tolist()


def _chosen_mass(model: torch.nn.Module, prompts: list[list[int]]) -> float:
    """Exact expected reward of the toy verifier: P(first action token ≡ 0 mod 3), averaged over states."""
    with torch.no_grad():
        masses = [
            torch.softmax(model(input_ids=torch.tensor([p])).logits[0, -1].float(), -1)[0::3].sum().item() for p in prompts
        ]
    return sum(masses) / len(masses)


def test_mean_reward_rises_with_a_toy_verifier(ckpt: Path) -> None:
    trainer = PivotRLTrainer.build(ckpt, group_size=8, dtype="float32", lr=2e-3, beta=0.01, micro_batch_groups=4, seed=0)
    gen = torch.Generator().manual_seed(0)
    prompts = [_ids(12, gen) for _ in range(8)]
    before = _chosen_mass(trainer.engine.module, prompts)
    rewards = []
    for _ in range(10):
        groups = []
        for i, p in enumerate(prompts):
            acts = _sample(trainer.engine.module, p, 8, 3, gen)
            groups.append(Group(f"s{i}", p, acts, [float(a[0] % 3 == 0) for a in acts]))
        rewards.append(trainer.train_step(groups)["reward_mean"])
    after = _chosen_mass(trainer.engine.module, prompts)
    assert 0.25 < before < 0.40  # about a third of the vocabulary is ≡ 0 mod 3
    assert after > before + 0.2
    assert sum(rewards[-3:]) / 3 > sum(rewards[:3]) / 3 + 0.15


def test_reference_groups_packed_into_one_forward_give_the_same_update(ckpt: Path) -> None:
    """training.pack_tokens packs a step's four groups into one π_ref forward (π_θ keeps one forward
    per group, so every rank runs the same number of policy forwards); pack_tokens = 1 runs π_ref
    group by group: the same loss, KL, gradient and weights."""
    groups = _groups(11, 4)
    kw = dict(group_size=4, dtype="float32", lr=1e-2, beta=0.05, updates_per_batch=2, micro_batch_groups=4, seed=0)
    one = PivotRLTrainer.build(ckpt, pack_tokens=1, **kw)
    packed = PivotRLTrainer.build(ckpt, **kw)
    before = [p.detach().clone() for p in one.engine.module.parameters()]
    ref_forwards: dict[str, list[int]] = {"one": [], "packed": []}
    policy_forwards: list[int] = []
    for name, trainer in (("one", one), ("packed", packed)):
        trainer.ref_model.register_forward_pre_hook(
            lambda _m, _a, kw, name=name: ref_forwards[name].append(kw["input_ids"].shape[1]), with_kwargs=True)
    packed.engine.module.register_forward_pre_hook(
        lambda _m, _a, kw: policy_forwards.append(kw["input_ids"].shape[1]), with_kwargs=True)
    m1, m4 = one.train_step(groups), packed.train_step(groups)
    sizes = [len(g.prompt_ids) + 4 * (max(map(len, g.actions)) - 1) for g in groups]
    assert ref_forwards == {"one": sizes, "packed": [sum(sizes)]}
    assert policy_forwards == sizes * 2  # two updates, one forward per group each
    assert m4["tokens"] == m1["tokens"] and m4["ref_tokens"] == m1["ref_tokens"]
    assert m4["model_tflop"] == pytest.approx(m1["model_tflop"], rel=1e-12)
    for key in ("loss", "loss_last", "kl", "grad_norm", "ratio_max", "entropy"):
        assert m4[key] == pytest.approx(m1[key], rel=1e-5, abs=1e-7), key
    # AdamW divides by √v: where a gradient is ~0, fp32 summation order shows in the update; the
    # weights agree to 1 % of how far they moved
    for p0, p1, p4 in zip(before, one.engine.module.parameters(), packed.engine.module.parameters()):
        moved = (p1 - p0).abs().max().item()
        assert moved > 0 and (p1 - p4).abs().max().item() <= 0.01 * moved


def test_clipping_binds_only_after_the_first_update(ckpt: Path) -> None:
    groups = _groups(1, 3)
    one = PivotRLTrainer.build(ckpt, group_size=4, dtype="float32", lr=5e-2, updates_per_batch=1, beta=0.0)
    m1 = one.train_step(groups)
    assert m1["ratio_mean"] == 1.0 and m1["ratio_min"] == 1.0 and m1["ratio_max"] == 1.0
    assert m1["clip_frac"] == 0.0
    three = PivotRLTrainer.build(ckpt, group_size=4, dtype="float32", lr=5e-2, updates_per_batch=3, beta=0.0)
    m3 = three.train_step(groups)
    assert m3["updates"] == 3.0
    assert m3["ratio_max"] > 1.2 or m3["ratio_min"] < 0.8  # ratios left [1−ε, 1+ε]
    assert m3["clip_frac"] > 0.0
    assert m3["clip_frac"] == pytest.approx(m3["clip_frac_high"] + m3["clip_frac_low"])
    # first update: ratios are exactly 1 (π_old = the weights of that forward) → loss is −mean(Â) = 0 for GRPO
    assert m3["loss"] == pytest.approx(0.0, abs=1e-7)


def test_zero_variance_groups_stay_in_the_denominator(ckpt: Path) -> None:
    informative = _groups(2, 1, rewards=[[1.0, 0.0, 0.0, 1.0]])
    flat = _groups(3, 1, rewards=[[1.0, 1.0, 1.0, 1.0]])
    alone = PivotRLTrainer.build(ckpt, group_size=4, dtype="float32", lr=1e-4, beta=0.0, grad_clip=None).train_step(informative)
    mixed = PivotRLTrainer.build(ckpt, group_size=4, dtype="float32", lr=1e-4, beta=0.0, grad_clip=None).train_step(
        informative + flat
    )
    assert mixed["zero_variance_frac"] == 0.5 and mixed["groups_trained"] == 1.0
    assert alone["groups_trained"] == 1.0 and alone["zero_variance_frac"] == 0.0
    # the flat group is skipped (no forward pass) but counts in the loss denominator: half the gradient
    assert mixed["tokens"] == alone["tokens"]
    assert mixed["grad_norm"] == pytest.approx(alone["grad_norm"] / 2, rel=1e-5)
    assert mixed["reward_mean"] == pytest.approx((0.5 + 1.0) / 2)


def test_batch_without_signal_and_beta_zero_changes_nothing(ckpt: Path) -> None:
    trainer = PivotRLTrainer.build(ckpt, group_size=4, dtype="float32", lr=1e-2, beta=0.0)
    before = [p.detach().clone() for p in trainer.engine.module.parameters()]
    m = trainer.train_step(_groups(6, 2, rewards=[[0.0] * 4, [1.0] * 4]))
    assert m["groups_trained"] == 0.0 and m["updates"] == 0.0 and m["tokens"] == 0.0
    assert m["zero_variance_frac"] == 1.0 and m["step"] == 1.0
    assert all(torch.equal(p, q) for p, q in zip(before, trainer.engine.module.parameters()))


def test_no_step_without_signal_at_the_reference_but_the_kl_term_once_moved(ckpt: Path, tmp_path: Path) -> None:
    """With β > 0 a group with Â = 0 has only the KL term, whose gradient at π_θ = π_ref is zero: a
    backward there gives rounding noise, which Adam would scale to a full step. Until the first update
    such groups are skipped (a batch of them takes no step); once π_θ moved, they are trained."""
    trainer = PivotRLTrainer.build(ckpt, group_size=4, dtype="float32", lr=1e-2, beta=0.1)
    before = [p.detach().clone() for p in trainer.engine.module.parameters()]
    flat = _groups(6, 2, rewards=[[0.0] * 4, [1.0] * 4])
    m = trainer.train_step(flat)
    assert m["groups_trained"] == 0.0 and m["updates"] == 0.0 and m["step"] == 1.0
    assert all(torch.equal(p, q) for p, q in zip(before, trainer.engine.module.parameters()))
    # a resumed run knows π_θ is still π_ref
    trainer.save_checkpoint(tmp_path / "at-ref")
    resumed = PivotRLTrainer.build(ckpt, group_size=4, dtype="float32", lr=1e-2, beta=0.1)
    resumed.at_reference = False
    resumed.load_checkpoint(tmp_path / "at-ref")
    assert resumed.at_reference and resumed.train_step(flat)["updates"] == 0.0
    # a batch with signal: only its informative group is trained at the reference
    m = trainer.train_step(_groups(7, 1, rewards=[[1.0, 0.0, 0.0, 1.0]]) + flat[:1])
    assert m["groups_trained"] == 1.0 and m["updates"] == 1.0
    moved = [p.detach().clone() for p in trainer.engine.module.parameters()]
    assert any(not torch.equal(p, q) for p, q in zip(before, moved))
    # π_θ has left π_ref: the same flat batch now trains through its KL term (the spec's case 3)
    m = trainer.train_step(flat)
    assert m["groups_trained"] == 2.0 and m["updates"] == 1.0 and m["kl"] > 1e-6 and m["grad_norm"] > 1e-4
    assert any(not torch.equal(p, q) for p, q in zip(moved, trainer.engine.module.parameters()))


def test_first_step_metrics(ckpt: Path) -> None:
    trainer = PivotRLTrainer.build(ckpt, group_size=4, dtype="float32", lr=1e-4, beta=0.1, shared_prefix=True)
    groups = _groups(4, 2)
    m = trainer.train_step(groups)
    assert m["step"] == 1.0 and m["actions"] == 8.0 and m["groups"] == 2.0
    # π_θ = π_ref at the first step: k3 KL and its estimator are 0, ratios are 1
    assert m["kl"] == pytest.approx(0.0, abs=1e-9) and m["kl_term"] == pytest.approx(0.0, abs=1e-9)
    assert m["ratio_mean"] == 1.0
    lens = [len(a) for g in groups for a in g.actions]
    assert m["action_tokens"] == float(sum(lens))
    # shared prefix: per group P + K·(T_max − 1) tokens
    expected = sum(len(g.prompt_ids) + 4 * (max(map(len, g.actions)) - 1) for g in groups)
    assert m["tokens"] == float(expected) and m["ref_tokens"] == float(expected)
    assert 0.0 < m["entropy"] < math.log(512) + 1e-6
    assert m["grad_norm"] > 0
    assert m["zero_variance_frac"] == 0.0


def test_old_policy_logprobs_match_exported_checkpoint(ckpt: Path, tmp_path: Path) -> None:
    from transformers import AutoModelForCausalLM

    from pivotrl.training.logprobs import group_logprobs

    trainer = PivotRLTrainer.build(ckpt, group_size=4, dtype="float32", lr=1e-3, beta=0.0)
    groups = _groups(5, 2)
    trainer.train_step(groups)
    out = trainer.export_hf(tmp_path / "export")
    names = {p.name for p in out.iterdir()}
    assert {"config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json"} <= names
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".")]  # no temporary left behind
    reloaded = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).eval()
    g = groups[0]
    mine = trainer.old_policy_logprobs(g.prompt_ids, g.actions[1])
    theirs, _ = group_logprobs(reloaded, g.prompt_ids, [g.actions[1]])
    assert len(mine) == len(g.actions[1])
    assert max(abs(a - b) for a, b in zip(mine, theirs[0].tolist())) < 1e-5
    # every parameter the optimiser trains moved, as exported; π_ref (frozen) is the checkpoint as loaded
    initial = dict(AutoModelForCausalLM.from_pretrained(ckpt, dtype=torch.float32).named_parameters())
    optimised = {id(p) for group in trainer.engine.optimizer.param_groups for p in group["params"]}
    trained = [n for n, p in trainer.engine.module.named_parameters() if p.requires_grad and id(p) in optimised]
    assert trained == list(initial)  # π_θ trains all of its parameters
    exported = dict(reloaded.named_parameters())
    assert [n for n in trained if torch.equal(exported[n], initial[n])] == []
    frozen = dict(trainer.ref_model.named_parameters())
    assert frozen.keys() == initial.keys()
    assert not any(p.requires_grad or id(p) in optimised for p in frozen.values())
    assert [n for n, p in frozen.items() if not torch.equal(p, initial[n])] == []


def test_resume_reproduces_the_uninterrupted_run(ckpt: Path, tmp_path: Path) -> None:
    batches = [_groups(10 + s, 2) for s in range(4)]
    kw = dict(group_size=4, dtype="float32", lr=1e-2, updates_per_batch=2, beta=0.05, seed=7)

    full = PivotRLTrainer.build(ckpt, **kw)
    ref_metrics = []
    for i, batch in enumerate(batches):
        ref_metrics.append(full.train_step(batch))
        full.data_position = i + 1
        if i == 1:
            full.extra_state = {"note": "after two"}
            full.save_checkpoint(tmp_path / "ckpt")
            rng_after_save = torch.rand(3)

    resumed = PivotRLTrainer.build(ckpt, **kw)
    state = resumed.load_checkpoint(tmp_path / "ckpt")
    assert torch.equal(torch.rand(3), rng_after_save)  # RNG restored
    assert state["step"] == 2 and resumed.step == 2 and resumed.data_position == 2
    assert resumed.extra_state == {"note": "after two"}
    assert {p.name for p in (tmp_path / "ckpt").iterdir()} == {"deepspeed", "hf", "rng_rank0.pt", "trainer_state.json"}
    assert not (tmp_path / "ckpt.partial").exists()
    got = [resumed.train_step(b) for b in batches[resumed.data_position :]]
    for want, have in zip(ref_metrics[2:], got):
        for key in set(want) - TIMING_KEYS:
            assert have[key] == pytest.approx(want[key], rel=1e-6, abs=1e-9), key


def test_bad_groups_and_settings(ckpt: Path) -> None:
    # The bounds are the config schema's (TrainingSection); build() validates its keywords with it.
    with pytest.raises(ConfigError, match="clip: Extra inputs are not permitted"):
        PivotRLTrainer.build(ckpt, group_size=4, clip=0.2)
    with pytest.raises(ConfigError, match="group_size"):
        PivotRLTrainer.build(ckpt, group_size=1)
    with pytest.raises(ConfigError, match="deepspeed.zero_stage"):
        PivotRLTrainer.build(ckpt, group_size=4, deepspeed={"zero_stage": 4})
    trainer = PivotRLTrainer.build(ckpt, group_size=4, dtype="float32")
    with pytest.raises(DataError, match="expected group_size=4"):
        trainer.train_step([Group("x", [3, 4], [[5]] * 3, [0.0, 1.0, 0.0])])
    with pytest.raises(DataError, match="action 2 has no tokens"):
        trainer.train_step([Group("x", [3, 4], [[5], [6], [], [7]], [0.0, 1.0, 0.0, 1.0])])
    with pytest.raises(DataError, match="at least one group"):
        trainer.train_step([])


def test_sft_loss_falls_and_exports(ckpt: Path, tmp_path: Path) -> None:
    from transformers import AutoModelForCausalLM

    from pivotrl.data.schema import Message, Trajectory
    from pivotrl.format.prompts import build_sft_example
    from pivotrl.training.deepspeed_utils import load_causal_lm
    from pivotrl.training.sft import run_sft

    tok = tiny_tokenizer()
    trajs = [
        Trajectory(
            id=f"t{i}",
            messages=(
                Message(role="user", content=q),
                Message(role="assistant", content=a),
            ),
        )
        for i, (q, a) in enumerate(
            [
                ("What is the factorial of five?", "[math.factorial(number=5)]"),
                ("Please move the final report into the temp folder.", "[mv(source='final_report.pdf', destination='temp')]"),
                ("List the files.", "[ls(a=True)]"),
            ]
        )
    ]
    examples = [build_sft_example(t, tok, max_len=512) for t in trajs]

    # the first step's loss is the masked mean NLL of the initial model over the whole (single) batch
    model = AutoModelForCausalLM.from_pretrained(ckpt, dtype=torch.float32).eval()
    nll, count = 0.0, 0
    with torch.no_grad():
        for ids, mask in examples:
            logp = torch.log_softmax(model(input_ids=torch.tensor([ids])).logits[0, :-1], -1)
            for t in range(1, len(ids)):
                if mask[t]:
                    nll -= logp[t - 1, ids[t]].item()
                    count += 1

    metrics = run_sft(
        ckpt, examples, tmp_path / "sft", epochs=8, lr=3e-3, batch_size=3, micro_batch_size=2, dtype="float32", seed=0
    )
    assert metrics["steps"] == 8
    assert metrics["first_loss"] == pytest.approx(nll / count, rel=1e-5)
    assert metrics["final_loss"] < 0.5 * metrics["first_loss"]
    assert metrics["loss_tokens"] == count
    out = tmp_path / "sft"
    assert (out / "model.safetensors").is_file() and (out / "tokenizer.json").is_file()
    # SFT optimises every parameter that requires a gradient once loaded (build_engine); each one moved
    trained = [n for n, p in load_causal_lm(ckpt, torch.float32).named_parameters() if p.requires_grad]
    initial = dict(model.named_parameters())
    assert trained == list(initial)  # nothing is frozen
    tuned = dict(AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).named_parameters())
    assert tuned.keys() == initial.keys()
    assert [n for n in trained if torch.equal(tuned[n], initial[n])] == []


def test_sft_entry_point_in_process(ckpt: Path, tmp_path: Path) -> None:
    from pivotrl.training.launch import launch

    examples = tmp_path / "examples.jsonl"
    examples.write_text(
        json.dumps({"input_ids": [0, 5, 6, 7, 8, 1], "loss_mask": [0, 0, 0, 1, 1, 1]}) + "\n"
        + json.dumps({"input_ids": [0, 9, 10, 11, 1], "loss_mask": [0, 0, 1, 1, 1]}) + "\n"
    )
    spec = {
        "model_dir": str(ckpt),
        "examples_path": str(examples),
        "out_dir": str(tmp_path / "out"),
        "metrics_path": str(tmp_path / "metrics.json"),
        "options": {"epochs": 2, "batch_size": 2, "dtype": "float32", "lr": 1e-3},
    }
    assert launch(LaunchConfig(), entry="sft", spec=spec, workdir=tmp_path / "work") == 0
    metrics = json.loads((tmp_path / "metrics.json").read_text())
    assert metrics["steps"] == 2 and metrics["loss_tokens"] == 6 and metrics["tokens"] == 2 * 11
    assert (tmp_path / "out" / "model.safetensors").is_file()
    assert json.loads((tmp_path / "work" / "sft-spec.json").read_text()) == spec


def test_sft_batches_cycle_through_seeded_epochs():
    import random

    from pivotrl.training.sft import batch_orders

    # epochs: a fresh shuffle each, the last batch of an epoch smaller
    assert [len(b) for b in batch_orders(5, 2, 2, random.Random(0))] == [2, 2, 1, 2, 2, 1]
    # cycled: the same shuffles as one stream cut into full batches (every example once before any twice)
    stream = batch_orders(5, 2, 1, random.Random(0), cycle=True)
    flat = [i for _ in range(5) for i in next(stream)]
    epochs = [i for b in batch_orders(5, 2, 2, random.Random(0)) for i in b]
    assert flat == epochs and sorted(flat[:5]) == list(range(5))


def test_sft_to_a_wall_time_exports_the_policy_at_a_step_count_on_the_way(ckpt: Path, tmp_path: Path,
                                                                          caplog: pytest.LogCaptureFixture) -> None:
    """One run gives SFT at a step count (``snapshot_step``) and at a wall time: the same batches as a
    run that stops at that step count, so the same weights; the wall-time policy is exported at the
    first step past it, and the run goes on to the step count when the wall time came first. Its
    progress lines name the wall budget and give no ETA from the micro-batch bound."""
    from pivotrl.runtime.models import checkpoint_hash
    from pivotrl.training.sft import run_sft

    examples = [([0, 5 + i, 6, 7 + i, 8, 1], [0, 0, 0, 1, 1, 1]) for i in range(5)]
    common = dict(lr=3e-3, batch_size=2, dtype="float32", seed=0, cycle=True)
    steps = run_sft(ckpt, examples, tmp_path / "steps", max_steps=3, **common)
    assert (steps["steps"], steps["out_step"], steps["wall_step"], steps["snapshot_step"]) == (3, 3, None, None)
    assert steps["tokens"] == 3 * 2 * 6 and steps["step_tokens"] == [12, 24, 36]
    # the wall time (0 s) is reached at step 1: that policy is exported then, and the run goes on to step 3
    m = run_sft(ckpt, examples, tmp_path / "wall", max_steps=50, max_wall_s=0.0, snapshot_step=3,
                snapshot_dir=tmp_path / "snap", **common)
    assert (m["steps"], m["wall_step"], m["out_step"], m["snapshot_step"]) == (3, 1, 1, 3)
    assert len(m["step_time_s"]) == 3 and m["step_time_s"] == sorted(m["step_time_s"])
    assert checkpoint_hash(tmp_path / "snap") == checkpoint_hash(tmp_path / "steps")
    assert checkpoint_hash(tmp_path / "wall") != checkpoint_hash(tmp_path / "steps")
    # a wall time never reached: the cap stops it, the policy is the last step's
    with caplog.at_level(logging.INFO, logger="pivotrl.core.progress"):
        capped = run_sft(ckpt, examples, tmp_path / "capped", max_steps=4, max_wall_s=5400, snapshot_step=2,
                         snapshot_dir=tmp_path / "snap2", label="sft baseline", **common)
    lines = [r.getMessage() for r in caplog.records if r.name == "pivotrl.core.progress"]
    assert lines[-1].startswith("sft baseline (to 1h30m of optimiser steps): 8 micro-batches, 48 tokens")
    assert not any("ETA" in x or "%" in x for x in lines)
    assert (capped["steps"], capped["wall_step"], capped["out_step"], capped["snapshot_step"]) == (4, None, 4, 2)
    with pytest.raises(ConfigError, match="cycle needs max_steps"):
        run_sft(ckpt, examples, tmp_path / "x", cycle=True, dtype="float32")


def test_sft_rejects_bad_examples(ckpt: Path, tmp_path: Path) -> None:
    from pivotrl.training.sft import run_sft

    with pytest.raises(DataError, match="example 0: input_ids has 3 tokens but loss_mask has 2"):
        run_sft(ckpt, [([1, 2, 3], [0, 1])], tmp_path / "x", dtype="float32")
    with pytest.raises(DataError, match="no predictable token"):
        run_sft(ckpt, [([1, 2, 3], [1, 0, 0])], tmp_path / "x", dtype="float32")


# ---------------------------------------------------------------------- launch commands
def test_render_torchrun_multi_node() -> None:
    cmd = render_launch_command(
        LaunchConfig(launcher="torchrun", nnodes=2, nproc_per_node=4, node_rank=1, master_addr="10.0.0.1", master_port=29600),
        entry="offline",
        spec_path="/runs/a/spec.json",
        python="py",
    )
    assert cmd == [
        "py", "-m", "torch.distributed.run", "--nnodes=2", "--nproc-per-node=4", "--node-rank=1",
        "--master-addr=10.0.0.1", "--master-port=29600", "-m", "pivotrl.training.offline", "--spec", "/runs/a/spec.json",
    ]  # fmt: skip


def test_render_deepspeed_with_hostfile_and_inprocess() -> None:
    cmd = render_launch_command(
        LaunchConfig(launcher="deepspeed", nnodes=2, nproc_per_node=2, hostfile="hosts", no_ssh=True, node_rank=0),
        entry="sft",
        spec_path="s.json",
        python="py",
    )
    assert cmd == [
        "py", "-m", "deepspeed.launcher.runner", "--hostfile=hosts", "--num_nodes=2", "--no_ssh", "--node_rank=0",
        "--num_gpus=2", "--master_addr=127.0.0.1", "--master_port=29500", "--module", "pivotrl.training.sft",
        "--spec", "s.json",
    ]  # fmt: skip
    assert render_launch_command(LaunchConfig(), entry="sft", spec_path="s.json", python="py") == [
        "py", "-m", "pivotrl.training.sft", "--spec", "s.json",
    ]  # fmt: skip
    two = LaunchConfig.from_keys(launcher="torchrun", nproc_per_node=2, world_size=2)
    assert (two.launcher, two.world_size, two.node_rank) == ("torchrun", 2, 0)


def test_launch_config_errors(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="nodes: Extra inputs are not permitted"):
        LaunchConfig.from_keys(nodes=2)
    with pytest.raises(ConfigError, match="inprocess runs one process"):
        LaunchConfig.from_keys(launcher="inprocess", nproc_per_node=2, world_size=2)
    with pytest.raises(ConfigError, match=r"node_rank=2 must be in \[0, nnodes=2\)"):
        LaunchConfig(nnodes=2, node_rank=2)
    with pytest.raises(ConfigError, match="unknown trainer entry"):
        render_launch_command(LaunchConfig(), entry="ppo", spec_path="s.json")
    spec = tmp_path / "spec.json"
    spec.write_text(json.dumps({"model_dir": "m", "batches_path": "b", "out_dir": "o", "lr": 1}))
    with pytest.raises(ConfigError, match=r"unknown key\(s\) \['lr'\]"):
        read_spec(["--spec", str(spec)], OfflineSpec)


def test_deepspeed_config_modes_and_extra() -> None:
    from pivotrl.training.deepspeed_utils import deepspeed_config

    cfg = deepspeed_config(zero_stage=1, dtype="bfloat16", grad_clip=None)
    assert cfg["bf16"] == {"enabled": True} and cfg["gradient_clipping"] == 0.0
    assert cfg["data_types"] == {"grad_accum_dtype": "fp32"}  # DeepSpeed's BF16 optimizer: fp32 accumulation
    assert cfg["managed_gradient_accumulation"] is False and "optimizer" not in cfg
    # stage 0 fp32: the client optimizer clips (DeepSpeed would not record the norm)
    assert deepspeed_config(zero_stage=0, dtype="float32", grad_clip=1.0)["gradient_clipping"] == 0.0
    merged = deepspeed_config(
        zero_stage=3, dtype="float32", grad_clip=1.0, extra={"zero_optimization": {"reduce_bucket_size": 1000}}
    )
    assert merged["zero_optimization"] == {
        "stage": 3,
        "stage3_gather_16bit_weights_on_model_save": True,
        "reduce_bucket_size": 1000,
    }
    with pytest.raises(ConfigError, match="may not set \\['optimizer'\\]"):
        deepspeed_config(zero_stage=0, dtype="float32", grad_clip=1.0, extra={"optimizer": {"type": "Adam"}})
    with pytest.raises(ConfigError, match="contradicts zero_stage=0"):
        deepspeed_config(zero_stage=0, dtype="float32", grad_clip=1.0, extra={"zero_optimization": {"stage": 2}})
    with pytest.raises(ConfigError, match="dtype must be one of"):
        deepspeed_config(zero_stage=0, dtype="fp16", grad_clip=1.0)
    with pytest.raises(ConfigError, match="grad_clip"):
        deepspeed_config(zero_stage=0, dtype="float32", grad_clip=-1.0)
    with pytest.raises(ConfigError, match="world_size = 3: must equal"):
        LaunchConfig.from_keys(world_size=3, nproc_per_node=2, launcher="torchrun")
