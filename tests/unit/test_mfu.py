"""Model FLOPs and MFU: the counting rule by hand, and the trainer's and warm start's speed columns."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from pivotrl.testing import save_tiny_checkpoint
from pivotrl.training.logprobs import compute_group_logprobs, work_counts
from pivotrl.runtime.mfu import (
    ModelShape,
    attention_pairs_causal,
    attention_pairs_shared,
    calibrated_peak_gflops,
    forward_flops,
    mfu,
    summarize,
    train_flops,
)

# SmolLM2-135M-Instruct's config and parameter count (tied embeddings).
SMOL = SimpleNamespace(vocab_size=49152, hidden_size=576, num_hidden_layers=30, num_attention_heads=9,
                       tie_word_embeddings=True)
SMOL_PARAMS = 134_515_008


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return save_tiny_checkpoint(tmp_path_factory.mktemp("tiny") / "model")


def test_shape_of_smollm2_config() -> None:
    s = ModelShape.of_config(SMOL, SMOL_PARAMS)
    assert s.n_head == 49152 * 576 == 28_311_552
    assert s.n_body == 134_515_008 - 28_311_552 == 106_203_456
    assert (s.n_layers, s.attn_dim) == (30, 576)
    # untied: a second V·d matrix is not body
    untied = ModelShape.of_config(SimpleNamespace(**{**vars(SMOL), "tie_word_embeddings": False}),
                                  SMOL_PARAMS + 28_311_552)
    assert untied.n_body == s.n_body
    with pytest.raises(ValueError, match="lacks a field"):
        ModelShape.of_config(SimpleNamespace(vocab_size=3), 10)
    with pytest.raises(ValueError, match="no transformer body"):
        ModelShape.of_config(SMOL, 1000)


def test_flops_by_hand() -> None:
    s = ModelShape(n_body=10, n_head=3, n_layers=2, attn_dim=4)
    # 2·10·5 + 2·3·2 + 4·2·4·15 = 100 + 12 + 480
    assert forward_flops(s, tokens=5, logit_positions=2, attention_pairs=15) == 592.0
    assert train_flops(s, 5, 2, 15) == 3 * 592.0
    assert attention_pairs_causal([3, 2]) == 6 + 3
    # P = 3 once (6 pairs), then 2 continuations of 2 tokens attending 4 and 5 keys
    assert attention_pairs_shared(3, 2, 2) == 6 + 2 * (4 + 5)
    assert attention_pairs_shared(3, 5, 0) == 6


def test_smollm2_per_token_figures_in_the_docstring() -> None:
    s = ModelShape.of_config(SMOL, SMOL_PARAMS)
    # a 1,000-token warm-start sequence, logits everywhere: ≈ 911 MFLOP per token
    per_token = train_flops(s, 1000, 1000, attention_pairs_causal([1000])) / 1000
    assert per_token == pytest.approx(6 * SMOL_PARAMS + 12 * 30 * 576 * 500.5)
    assert per_token / 1e6 == pytest.approx(911, abs=1)


def test_mfu_against_the_peak() -> None:
    assert mfu(1e12, 2.0, 250.0, 2) == pytest.approx(1.0)
    assert mfu(1e12, 4.0, 250.0, 2) == pytest.approx(0.5)
    assert mfu(1e12, 2.0, None, 2) is None and mfu(1e12, 0.0, 250.0, 2) is None


def test_work_counts_match_the_paths() -> None:
    # shared: the state's last position + K·(T_max − 1) logits; pairs P(P+1)/2 + K·Σ(P + t)
    assert work_counts(4, [3, 1], shared_prefix=True) == (1 + 2 * 2, 10 + 2 * (5 + 6))
    # naive: K·T_max logits; K sequences of P + T_max − 1 tokens
    assert work_counts(4, [3, 1], shared_prefix=False) == (2 * 3, 2 * 21)


def test_group_logprobs_report_their_work(ckpt: Path) -> None:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(ckpt, dtype=torch.float32).eval()
    with torch.no_grad():
        shared = compute_group_logprobs(model, [5, 6, 7, 8], [[9, 10, 11], [12]])
        naive = compute_group_logprobs(model, [5, 6, 7, 8], [[9, 10, 11], [12]], shared_prefix=False)
    assert (shared.logit_positions, shared.attention_pairs) == (5, 32)
    assert (naive.logit_positions, naive.attention_pairs) == (6, 42)


def test_summarize_a_stage() -> None:
    rows = [{"model_tflop": 2.0, "trainer_s": 10.0, "tokens": 100.0, "ref_tokens": 50.0, "peak_gflops": 400.0},
            {"model_tflop": 1.0, "trainer_s": 5.0, "tokens": 50.0, "ref_tokens": 25.0, "peak_gflops": 400.0},
            {"step": 3}]
    s = summarize(rows)
    assert s["model_tflop"] == 3.0 and s["trainer_s"] == 15.0
    assert s["policy_tokens_per_s"] == 10.0 and s["ref_tokens_per_s"] == 5.0
    assert s["mfu"] == pytest.approx(3e12 / 15 / 400e9)  # 0.5
    assert summarize([{"step": 1}]) == {}
    assert "mfu" not in summarize([{**rows[0], "peak_gflops": None}])


def test_calibrated_peak_reuses_calibration_json(tmp_path: Path) -> None:
    calls: list[tuple[str, int]] = []

    def fake(dtype: str, threads: int) -> float:
        calls.append((dtype, threads))
        return 123.0

    assert calibrated_peak_gflops("float32", str(tmp_path), measure=fake) == 123.0
    assert calibrated_peak_gflops("fp32", str(tmp_path), measure=fake) == 123.0  # kept in calibration.json
    assert calls == [("fp32", 1)]
    assert (tmp_path / "calibration.json").is_file()


def test_trainer_step_reports_flops_and_mfu(ckpt: Path) -> None:
    from pivotrl.training.pivotrl import Group, PivotRLTrainer

    trainer = PivotRLTrainer.build(ckpt, group_size=2, dtype="float32", lr=1e-4, beta=0.1)
    trainer.peak_gflops_per_thread = 50.0
    groups = [Group("a", [5, 6, 7, 8], [[9, 10, 11], [12]], [1.0, 0.0]),
              Group("b", [5, 6, 7], [[9, 10], [13, 14]], [0.0, 1.0])]
    m = trainer.train_step(groups)
    s = trainer.shape
    # per group: forward of (tokens, logits, pairs); policy 3× (fwd+bwd), reference 1×
    work = [(4 + 2 * 2, 5, 32), (3 + 2 * 1, 3, 6 + 2 * 4)]
    fwd = sum(forward_flops(s, *w) for w in work)
    assert m["model_tflop"] * 1e12 == pytest.approx(4 * fwd)
    assert m["tokens"] == m["ref_tokens"] == 8 + 5
    assert m["trainer_s"] == m["step_time_s"] > 0
    assert m["policy_tokens_per_s"] == pytest.approx(m["tokens"] / m["trainer_s"])
    assert m["ref_tokens_per_s"] == pytest.approx(m["ref_tokens"] / m["trainer_s"])
    assert "tokens_per_s" not in m  # no sum of forward+backward and forward-only tokens
    threads = torch.get_num_threads()
    assert m["threads"] == threads and m["peak_gflops"] == 50.0 * threads
    assert m["mfu"] == pytest.approx(4 * fwd / m["trainer_s"] / (50e9 * threads))
    trainer.peak_gflops_per_thread = None
    assert "mfu" not in trainer.train_step(groups)


def test_warm_start_reports_flops_and_mfu(ckpt: Path, tmp_path: Path) -> None:
    from pivotrl.training.sft import run_sft

    examples = [([5, 6, 7, 8, 9], [0, 0, 1, 1, 1]), ([5, 6, 7], [0, 1, 1])]
    m = run_sft(ckpt, examples, tmp_path / "sft", epochs=1, batch_size=2, micro_batch_size=1, dtype="float32",
                peak_gflops_per_thread=40.0)
    from pivotrl.runtime.mfu import ModelShape

    from transformers import AutoModelForCausalLM

    s = ModelShape.of_model(AutoModelForCausalLM.from_pretrained(ckpt))
    # 8 tokens through the body, 3 + 2 loss positions, 15 + 6 attention pairs, 3× forward
    expected = 3 * (2 * s.n_body * 8 + 2 * s.n_head * 5 + 4 * s.n_layers * s.attn_dim * 21)
    assert m["model_tflop"] * 1e12 == pytest.approx(expected)
    assert m["mfu"] == pytest.approx(expected / m["time_s"] / (40e9 * m["threads"]))


def test_report_shows_the_speed_of_each_stage(tmp_path: Path) -> None:
    import json

    import pandas as pd

    from pivotrl.evaluation.report import build_report

    metrics = pd.DataFrame([{"step": 1, "reward_mean": 0.2, "model_tflop": 2.0, "trainer_s": 10.0, "tokens": 100.0,
                             "ref_tokens": 50.0, "peak_gflops": 400.0},
                            {"step": 2, "reward_mean": 0.4, "model_tflop": 1.0, "trainer_s": 5.0, "tokens": 50.0,
                             "ref_tokens": 25.0, "peak_gflops": 400.0}])
    meta = {"sft": {"metrics": {"time_s": 20.0, "tokens_per_s": 30.0, "model_tflop": 4.0, "mfu": 0.25}}}
    rj, rm = build_report({"pivotrl": {"local": None, "full_task": None}}, metrics_df=metrics, probe_df=None,
                          pivot_stats=None, meta=meta, out_dir=tmp_path)
    report = json.loads(Path(rj).read_text())
    assert report["training"]["speed"]["mfu"] == pytest.approx(0.5)
    assert report["warm_start_speed"]["mfu"] == 0.25
    md = Path(rm).read_text()
    assert "| warm start (forward+backward) | 20.0 | 30.0 | 4.00 | 25.0 % |" in md
    assert "| 15.0 | 10.0; 5.0 | 3.00 | 50.0 % |" in md
