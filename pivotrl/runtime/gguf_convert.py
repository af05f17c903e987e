"""GGUF → Hugging Face checkpoint conversion: dequantise a GGUF file into an fp32 safetensors checkpoint.

:func:`convert_gguf` loads the GGUF file with ``transformers`` (reading it through one shared
``gguf.GGUFReader``), rebuilds a plain causal LM with the dequantised weights and writes it with its
tokenizer and ``pivotrl_converter.json`` (the converter's package versions) into a new directory,
atomically. A converted checkpoint is cached under :func:`converted_name`, which includes
:func:`converter_versions`, so upgrading ``transformers`` or ``gguf`` converts again. Errors:
ModelError (missing file, not a causal LM, existing target, weights that do not match the config).
"""

from __future__ import annotations

import hashlib
import json
import os
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Iterator

from pivotrl.core.errors import ModelError
from pivotrl.storage.files import atomic_dir

__all__ = ["convert_gguf", "convert_into_cache", "converted_name", "converter_versions", "is_published"]


def convert_gguf(gguf_path: str | os.PathLike[str], out_dir: str | os.PathLike[str]) -> Path:
    """Dequantise a GGUF model to an fp32 HF checkpoint (safetensors + tokenizer) in ``out_dir``.

    Written atomically (temporary sibling, then rename). Takes ≈ 30–60 s for a 135M model. The
    converter's package versions are recorded in ``pivotrl_converter.json`` (and are part of the
    cache key of :func:`pivotrl.runtime.models.resolve_model`'s converted checkpoints,
    :func:`converted_name`).

    Raises:
        ModelError: the file is missing, cannot be read as a causal LM, or ``out_dir`` exists.
    """
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    src = Path(gguf_path)
    target = Path(out_dir)
    if not src.is_file():
        raise ModelError(f"GGUF file {src} does not exist")
    if target.exists():
        raise ModelError(f"conversion target {target} already exists")
    try:
        with _gguf_parsed_once():
            loaded = AutoModelForCausalLM.from_pretrained(
                str(src.parent), gguf_file=src.name, dtype=torch.float32
            )
            tokenizer = AutoTokenizer.from_pretrained(str(src.parent), gguf_file=src.name)
    except Exception as exc:
        raise ModelError(f"cannot load GGUF model {src}: {exc}") from exc
    # A model loaded from GGUF carries a quantization_config and refuses save_pretrained;
    # the weights are already dequantised, so rebuild a plain model and copy them over.
    config = loaded.config
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    state = loaded.state_dict()
    del loaded
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    missing, unexpected = model.load_state_dict(state, strict=False)
    missing = [k for k in missing if not (k == "lm_head.weight" and config.tie_word_embeddings)]
    if missing or unexpected:
        raise ModelError(f"GGUF {src}: weights do not match the config (missing {missing}, unexpected {unexpected})")
    def write(tmp: Path) -> None:
        model.save_pretrained(tmp)
        tokenizer.save_pretrained(tmp)
        (Path(tmp) / "pivotrl_converter.json").write_text(json.dumps(
            {"gguf_file": src.name, "converter": converter_versions()}, indent=2, sort_keys=True) + "\n")

    with atomic_dir(target, already_published=is_published) as tmp:
        write(tmp)
    return target


@contextmanager
def _gguf_parsed_once() -> Iterator[None]:
    """While open, ``gguf.GGUFReader(path)`` parses each file once and hands the same reader back.

    transformers reads a GGUF file three times (config, weights, tokenizer), and the gguf
    package's pure-Python metadata parse dominates a conversion (≈ 20 s per read of Gemma-3's
    262k-token vocabulary on one core); the reader only memory-maps the file, so sharing it is safe.
    """
    import gguf

    original = gguf.GGUFReader
    readers: dict[tuple[str, str], Any] = {}

    def shared(path: Any, mode: str = "r") -> Any:
        key = (os.path.realpath(path), mode)
        if key not in readers:
            readers[key] = original(path, mode)
        return readers[key]

    gguf.GGUFReader = shared
    try:
        yield
    finally:
        gguf.GGUFReader = original
        readers.clear()


def converter_versions() -> dict[str, str]:
    """The versions of the packages that convert a GGUF file (``transformers`` builds the tokenizer
    and dequantises, ``gguf`` reads the file): part of a converted checkpoint's cache key, since
    the same GGUF converts differently under another version (transformers before 5.18 built a
    Qwen2 GGUF tokenizer that split ``<tool_call>`` into several pieces)."""
    from importlib.metadata import PackageNotFoundError, version

    out = {}
    for name in ("transformers", "gguf"):
        try:
            out[name] = version(name)
        except PackageNotFoundError:
            out[name] = "absent"
    return out


def converted_name(kind: str, sha256: str, versions: dict[str, str] | None = None) -> str:
    """Cache directory name of a converted GGUF: ``<kind>-<sha256[:16]>-<8 hex of the converter
    versions>`` (``versions``: default :func:`converter_versions`), so upgrading the converter
    converts again instead of reusing a checkpoint built by the old one."""
    v = converter_versions() if versions is None else versions
    tag = hashlib.sha256(json.dumps(v, sort_keys=True).encode()).hexdigest()[:8]
    return f"{kind}-{sha256[:16]}-{tag}"



def is_published(target: Path) -> bool:
    """Whether a complete checkpoint cache entry is at ``target``: entries are renamed into place
    whole, so one with a ``config.json`` is complete (another process may have published it first)."""
    return (target / "config.json").is_file()


def convert_into_cache(gguf: Path, target: Path) -> None:
    """:func:`convert_gguf` of ``gguf`` into the cache entry ``target``, renamed into place whole."""
    with atomic_dir(target, already_published=is_published) as tmp:
        tmp.rmdir()  # convert_gguf creates its own (absent) target
        convert_gguf(gguf, tmp)
