"""The smoke pipeline end to end with tiny models that speak other chat templates (Qwen2.5-style
hermes, Llama-3.1-style JSON, Gemma-3-style without tools): every stage runs, the run records the
resolved prompt format and template hash, and the exported policy still has its template."""

from __future__ import annotations

from pathlib import Path

import pytest

from pivotrl.config import load_config
from pivotrl.runtime.models import load_tokenizer
from pivotrl.pipeline import stages
from pivotrl.pipeline.demos import build_demonstrations
from pivotrl.storage import ArtifactStore
from pivotrl.testing import save_tiny_checkpoint, tiny_chat_tokenizer

REPO = Path(__file__).resolve().parents[2]
TEMPLATES = Path(__file__).resolve().parents[1] / "fixtures" / "chat_templates"
# The Llama 3.1 template renders one call per assistant turn: single-call BFCL categories only.
SINGLE_CALL = "data.sources=[{kind: bfcl, categories: [simple_python, multiple], limit_per_category: 5}]"
CASES = {
    "qwen2.5": ("hermes", []),
    "llama3.1": ("llama3_json", [SINGLE_CALL]),
    "gemma3": ("pythonic", []),
}


@pytest.mark.integration
@pytest.mark.parametrize("family", list(CASES))
def test_smoke_pipeline_runs_on_the_template(tmp_path, family):
    parser, extra = CASES[family]
    tok = tiny_chat_tokenizer(family, (TEMPLATES / f"{family}.jinja").read_text())
    model = save_tiny_checkpoint(tmp_path / "model", tokenizer=tok)
    cfg = load_config(str(REPO / "configs" / "smoke.yaml"), [
        f"run.storage_root={tmp_path / 'root'}", f"model.source={model}", "prompt.format=chat_template",
        f"prompt.tool_parser={parser}", "warm_start.epochs=2", "training.max_steps=1", "evaluation.num_tasks=1",
        # The test is about the template's path through every stage; a tiny random model under some
        # templates selects no pivot (e.g. 7 all fail, 10 too long), which is then no failure.
        "training.allow_empty_pivots=true", *extra])
    store = ArtifactStore(cfg.run.storage_root)
    demos = build_demonstrations(cfg, store)
    ref = stages.stage_reference(cfg, store, demos)
    fmt = ref.prompt_format
    assert (fmt["format"], fmt["tool_parser"], fmt["prefix_stable"]) == ("chat_template", parser, True)
    assert ref.sft["examples"] > 0 and ref.sft["per_turn_trajectories"] == 0
    manifest = store.read_manifest(f"{ref.ref_key}.sft.json")
    assert manifest.extra["template_hash"] == fmt["template_hash"]
    probe = stages.stage_probe(cfg, store, demos, ref)
    assert probe.stats["total"]["candidates"] > 0
    assert store.read_manifest(f"{probe.pivots_key}/pivots.parquet").extra["prompt_format"] == fmt
    train = stages.stage_train(cfg, store, probe, ref)
    ev = stages.stage_evaluate(cfg, store, demos, ref, probe, train)
    assert Path(str(ev.report_md).removeprefix("file://")).exists() or store.exists(f"{ev.eval_key}/report.md")
    # The exported reference keeps the model's own chat template (it serves as it was trained).
    exported = load_tokenizer(stages.reference_dir(cfg, store, ref))
    assert exported.chat_template == tok.chat_template


@pytest.mark.integration
def test_a_model_without_template_runs_with_prompt_chat_template(tmp_path):
    """A Gemma-like checkpoint that ships no chat template (as the Gemma-3-270M GGUF) and stops only
    at <eos>: prompt.chat_template supplies one; the run's checkpoints carry it and stop at its
    end-of-turn token."""
    import json

    tok = tiny_chat_tokenizer("gemma3", "")
    tok.chat_template = None
    model = save_tiny_checkpoint(tmp_path / "model", tokenizer=tok, eos_token_id=tok.eos_token_id)
    template = TEMPLATES / "gemma3.jinja"
    cfg = load_config(str(REPO / "configs" / "smoke.yaml"), [
        f"run.storage_root={tmp_path / 'root'}", f"model.source={model}", f"run.cache_dir={tmp_path / 'cache'}",
        f"prompt.chat_template={template}", "warm_start.epochs=1", "training.max_steps=1", "evaluation.num_tasks=1"])
    store = ArtifactStore(cfg.run.storage_root)
    demos = build_demonstrations(cfg, store)
    ref = stages.stage_reference(cfg, store, demos)
    assert (ref.prompt_format["format"], ref.prompt_format["tool_parser"]) == ("chat_template", "pythonic")
    base = Path(ref.base_dir)
    assert json.loads((base / "generation_config.json").read_text())["eos_token_id"] == [1, 4]  # <eos>, <end_of_turn>
    exported = load_tokenizer(stages.reference_dir(cfg, store, ref))
    assert exported.chat_template == template.read_text()
    probe = stages.stage_probe(cfg, store, demos, ref)
    assert probe.stats["total"]["candidates"] > 0
