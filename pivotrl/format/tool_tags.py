"""Tool-call tags whose output rows were never trained, and the fix: spell them as text.

Some models ship a tool-call tag as one added token whose row of the output layer was never
trained: Qwen2.5-Coder-0.5B's ``<tool_call>`` (151657) and ``</tool_call>`` (151658) rows sit, with
cosine > 0.999, in a group of ≈ 2,450 near-identical rows of never-used tokens (vocabulary padding,
unused specials), so the tag gets log-probability −24 where a demonstration has it and the model
writes bare JSON instead. The same text spelled as ordinary pieces (``<`` ``tool`` ``_call`` ``>``)
is what the model did learn: the demonstrated action then costs −1.8 nats instead of −60.9
(measured on that model; see the project's notes).

:func:`untrained_tag_rows` reads the output rows of a parser's tags from a checkpoint's safetensors
(no model is built) and calls a tag's row untrained when it coincides (cosine > 0.999) with a
reference row known to be untrained — a vocabulary-padding row (index ≥ ``len(tokenizer)``), one
of the tokenizer's last :data:`END_ROWS` ids (where a GGUF vocabulary names its padding,
``[PAD151935]``, so ``len(tokenizer)`` equals the rows; where reserved special tokens sit), or the
padding token's row when that is not the end-of-sequence token — or when its norm is below 5 % of
the median row norm. Two trained rows of different tokens do not coincide, so a trained last token
is no false alarm. :func:`spell_tags_as_text` writes a copy of the checkpoint whose tokenizer no
longer has the tags as added tokens: every other text encodes to the same ids, checked on a probe
text. :func:`fix_untrained_tags` applies ``prompt.untrained_tool_tags`` (``text``: spell them,
saying so once; ``error``: refuse, naming the fix; ``keep``: warn only). The copy carries
``pivotrl_tool_tags.json`` (what was spelled and why), which :func:`tool_tags_record` reads for the
manifests and stage keys; its tokenizer files also change the checkpoint hash.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import shutil
from pathlib import Path
from typing import Any, Sequence

from pivotrl.core.errors import ConfigError, ModelError

log = logging.getLogger("pivotrl.runtime.models")

__all__ = ["COSINE_THRESHOLD", "END_ROWS", "NORM_RATIO", "RECORD_FILE", "TOOL_TAGS", "fix_untrained_tags", "spell_tags_as_text",
           "tool_tags_record", "untrained_tag_rows"]

#: The tags each tool-call parser writes (parsers without tags are absent).
TOOL_TAGS: dict[str, tuple[str, ...]] = {"hermes": ("<tool_call>", "</tool_call>")}
COSINE_THRESHOLD = 0.999
NORM_RATIO = 0.05
#: How many of the tokenizer's last ids serve as reference rows besides the padding beyond it.
END_ROWS = 8
RECORD_FILE = "pivotrl_tool_tags.json"
_PROBE_TEXT = ('Call it: {"name": "ls", "arguments": {"a": true}} <|x|> tool_call <b> 12 '
               "The results come back as tool messages.")
_ANNOUNCED: set[str] = set()


def _output_matrix(directory: Path) -> tuple[Any, str]:
    """(safetensors handle, tensor name) of the output layer (``lm_head.weight``, else the tied
    input embedding)."""
    from safetensors import safe_open

    files = sorted(directory.glob("*.safetensors"))
    if not files:
        raise ModelError(f"checkpoint directory {directory} has no *.safetensors file")
    for suffix in ("lm_head.weight", "embed_tokens.weight", "wte.weight"):
        for f in files:
            handle = safe_open(str(f), framework="pt")
            name = next((k for k in handle.keys() if k.endswith(suffix)), None)
            if name is not None:
                return handle, name
    raise ModelError(f"checkpoint {directory}: no output layer (lm_head.weight or a tied embedding) in its safetensors")


def single_token_ids(tokenizer: Any, tags: Sequence[str]) -> dict[str, int]:
    """Tag → its id, for the tags the tokenizer encodes as exactly one token."""
    out = {}
    for tag in tags:
        ids = tokenizer(tag, add_special_tokens=False)["input_ids"]
        if len(ids) == 1:
            out[tag] = int(ids[0])
    return out


def untrained_tag_rows(directory: str | os.PathLike[str], tokenizer: Any, tags: Sequence[str], *,
                       cosine_threshold: float = COSINE_THRESHOLD, norm_ratio: float = NORM_RATIO) -> dict[str, str]:
    """Which of ``tags`` (each one token of ``tokenizer``) have an untrained output row.

    Returns tag → reason (e.g. ``"row 151657 has cosine 0.99981 with padding row 151900"``); tags
    that are not one token, or whose rows look trained, are absent. Reads only the rows it needs
    (and about 2,048 evenly spaced rows for the median norm) from the checkpoint's safetensors.
    Raises ModelError when the checkpoint has no readable output layer.
    """
    import torch

    ids = single_token_ids(tokenizer, tags)
    if not ids:
        return {}
    handle, name = _output_matrix(Path(directory))
    matrix = handle.get_slice(name)
    rows = int(matrix.get_shape()[0])

    def row(i: int) -> Any:
        return matrix[i : i + 1].to(torch.float64)[0]

    refs: dict[int, str] = {}
    n_tok = len(tokenizer)
    for i in range(n_tok, rows, max(1, (rows - n_tok) // 32)):
        refs[i] = "padding row"  # vocabulary padding: never a token, never trained
    tag_ids = set(ids.values())
    for i in range(min(n_tok, rows) - 1, max(-1, min(n_tok, rows) - 1 - END_ROWS), -1):
        if i not in tag_ids:  # a GGUF vocabulary names its padding ([PAD151935]); reserved specials sit here too
            refs.setdefault(i, "end-of-vocabulary row")
    pad, eos = getattr(tokenizer, "pad_token_id", None), getattr(tokenizer, "eos_token_id", None)
    if pad is not None and pad != eos and pad not in ids.values() and pad < rows:
        refs[int(pad)] = "padding-token row"
    ref_rows = {i: row(i) for i in refs}
    stride = max(1, rows // 2048)
    median_norm = float(torch.stack([row(i) for i in range(0, rows, stride)]).norm(dim=1).median())
    out: dict[str, str] = {}
    for tag, i in ids.items():
        if i >= rows:
            out[tag] = f"id {i} has no output row (the layer has {rows})"
            continue
        r = row(i)
        norm = float(r.norm())
        if norm < norm_ratio * median_norm:
            out[tag] = f"row {i} has norm {norm:.3g}, under {norm_ratio:g} × the median row norm {median_norm:.3g}"
            continue
        for j, ref in ref_rows.items():
            cos = float(torch.nn.functional.cosine_similarity(r, ref, dim=0))
            if cos > cosine_threshold:
                out[tag] = f"row {i} has cosine {cos:.5f} with {refs[j]} {j}"
                break
    return out


def _without_tags(data: Any, tags: set[str]) -> Any:
    """tokenizer.json / tokenizer_config.json content with the tags removed from its added tokens."""
    if isinstance(data, dict):
        if isinstance(data.get("added_tokens"), list):
            data["added_tokens"] = [t for t in data["added_tokens"] if t.get("content") not in tags]
        if isinstance(data.get("added_tokens_decoder"), dict):
            data["added_tokens_decoder"] = {k: v for k, v in data["added_tokens_decoder"].items()
                                            if v.get("content") not in tags}
        for key in ("additional_special_tokens", "extra_special_tokens"):
            if isinstance(data.get(key), list):
                data[key] = [t for t in data[key] if (t.get("content") if isinstance(t, dict) else t) not in tags]
    return data


def spell_tags_as_text(directory: str | os.PathLike[str], tags: Sequence[str], cache: str | os.PathLike[str],
                       reasons: dict[str, str] | None = None) -> Path:
    """A copy of checkpoint ``directory`` whose tokenizer spells ``tags`` as ordinary text pieces.

    The copy lives under ``<cache>/models/tags-<hash>`` (weights hard-linked where possible), keyed
    by the checkpoint's file listing and the tags; written to a temporary sibling and renamed. Only
    the tags' added-token entries are removed (``tokenizer.json``, ``tokenizer_config.json``): every
    other text keeps its ids, and each tag then encodes to several ids, none of them its old one.
    ``pivotrl_tool_tags.json`` in the copy records the tags, their old ids and ``reasons``.

    Raises ModelError when the copy's tokenizer does not behave so (the message names the fix).
    """
    from transformers import AutoTokenizer

    from pivotrl.storage.files import atomic_dir

    src = Path(directory)
    listing = sorted((p.name, p.stat().st_size, int(p.stat().st_mtime)) for p in src.iterdir() if p.is_file())
    key = hashlib.sha256(json.dumps([str(src.resolve()), listing, sorted(tags), 1]).encode()).hexdigest()[:16]
    target = Path(cache).expanduser() / "models" / f"tags-{key}"
    if (target / "config.json").is_file():
        return target
    before = AutoTokenizer.from_pretrained(str(src))
    old_ids = single_token_ids(before, tags)
    with atomic_dir(target, already_published=lambda t: (t / "config.json").is_file()) as tmp:
        for p in src.iterdir():
            if not p.is_file():
                continue
            if p.name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"):
                data = _without_tags(json.loads(p.read_text(encoding="utf-8")), set(tags))
                (tmp / p.name).write_text(json.dumps(data, ensure_ascii=False), encoding="utf-8")
                continue
            try:
                os.link(p, tmp / p.name)
            except OSError:
                shutil.copy2(p, tmp / p.name)
        after = AutoTokenizer.from_pretrained(str(tmp))
        for tag in tags:
            ids = after(tag, add_special_tokens=False)["input_ids"]
            if len(ids) < 2 or old_ids.get(tag) in ids or after.decode(ids) != tag:
                raise ModelError(f"checkpoint {src}: the tokenizer still encodes {tag!r} as {ids} after its "
                                 "added-token entry was removed; set prompt.untrained_tool_tags: keep, or "
                                 "prompt.tool_parser: pythonic")
        probe_before = before(_PROBE_TEXT, add_special_tokens=False)["input_ids"]
        if probe_before != after(_PROBE_TEXT, add_special_tokens=False)["input_ids"]:
            raise ModelError(f"checkpoint {src}: removing the tool-call tags changed the ids of other text")
        record = {"spelled_as_text": list(tags), "old_ids": old_ids, "reasons": dict(reasons or {}),
                  "source": str(src)}
        (tmp / RECORD_FILE).write_text(json.dumps(record, indent=2, sort_keys=True) + "\n")
    return target


def tool_tags_record(directory: str | os.PathLike[str]) -> dict[str, Any] | None:
    """The tags a checkpoint spells as text (its ``pivotrl_tool_tags.json``), or None."""
    path = Path(directory) / RECORD_FILE
    return json.loads(path.read_text()) if path.is_file() else None


def fix_untrained_tags(directory: str | os.PathLike[str], parser: str, policy: str,
                       cache: str | os.PathLike[str]) -> Path:
    """Apply ``prompt.untrained_tool_tags`` (``policy``) to the base checkpoint ``directory`` read
    with tool-call parser ``parser`` (resolved): the directory itself when the parser has no tags or
    their rows look trained; else a copy spelling them as text (``text``, said once per checkpoint),
    a ModelError naming the fix (``error``), or the directory with a warning (``keep``)."""
    if policy not in ("text", "error", "keep"):
        raise ConfigError(f"prompt.untrained_tool_tags = {policy!r}: expected text, error or keep")
    tags = TOOL_TAGS.get(parser)
    src = Path(directory)
    if not tags or not src.is_dir():
        return src
    from pivotrl.runtime.models import load_tokenizer

    untrained = untrained_tag_rows(src, load_tokenizer(src), tags)
    if not untrained:
        return src
    why = "; ".join(f"{t}: {r}" for t, r in untrained.items())
    if policy == "error":
        raise ModelError(f"model {src}: the output rows of the {parser} tool-call tags are untrained ({why}), so the "
                         "model cannot write them. Fix: prompt.untrained_tool_tags: text (spell the tags as ordinary "
                         "text pieces), or prompt.tool_parser: pythonic")
    if policy == "keep":
        if str(src) not in _ANNOUNCED:
            _ANNOUNCED.add(str(src))
            log.warning("the %s tool-call tags have untrained output rows (%s); kept as tokens "
                        "(prompt.untrained_tool_tags: keep)", parser, why)
        return src
    out = spell_tags_as_text(src, tags, cache, untrained)
    if str(src) not in _ANNOUNCED:
        _ANNOUNCED.add(str(src))
        log.warning("the %s tool-call tags %s have untrained output rows (%s): they are spelled as ordinary text "
                    "pieces from here on (same ids for every other text; prompt.untrained_tool_tags: text)",
                    parser, " ".join(tags), why)
    return out
