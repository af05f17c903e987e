"""A source's index is written one way in every message: ``data.sources[0]`` (as the config's own
errors write a list item), never ``data.sources.0`` (which stays the ``--set`` key syntax)."""

from __future__ import annotations

import io
import re
import tokenize
from pathlib import Path

import pytest

from pivotrl.config import load_config
from pivotrl.core.errors import ConfigError, DataError, SourceNotFoundError

REPO = Path(__file__).resolve().parents[2]
# data.sources.0 / .{i} / .%d, except as the key of a --set example ("data.sources.0.url=…").
DOTTED = re.compile(r"data\.sources\.(?:\d+|\{[^}]*\}|%d)(?![\w.]*=)")
BRACKETED = re.compile(r"data\.sources\[\d+\]")


def _strings(path: Path) -> list[tuple[int, str]]:
    with open(path, "rb") as f:
        return [(t.start[0], t.string) for t in tokenize.tokenize(f.readline)
                if t.type in (tokenize.STRING, getattr(tokenize, "FSTRING_MIDDLE", -1))]


def test_no_string_of_the_code_writes_a_source_index_with_a_dot():
    found = [f"{p.relative_to(REPO)}:{line}: {text}" for folder in ("pivotrl", "flows", "tasks")
             for p in sorted((REPO / folder).rglob("*.py")) for line, text in _strings(p) if DOTTED.search(text)]
    assert found == []


def _message(fn) -> str:
    try:
        fn()
    except (ConfigError, DataError) as e:
        return str(e)
    raise AssertionError("no error")


def test_every_message_naming_a_source_writes_its_index_in_brackets(tmp_path):
    from pivotrl.data.sources import check_sources_exist
    from pivotrl.pipeline.demos import build_demonstrations
    from pivotrl.storage import ArtifactStore

    dup = tmp_path / "dup.yaml"
    dup.write_text("data:\n  sources:\n    - kind: chat\n      url: a.jsonl\n      url: b.jsonl\n", encoding="utf-8")
    empty = tmp_path / "empty.jsonl"
    empty.write_text("")
    cfg = load_config(None, [f"run.storage_root={tmp_path / 'root'}", f"data.sources=[{{kind: chat, url: '{empty}'}}]"])
    messages = [
        _message(lambda: load_config(None, ["data.sources=[{kind: csv}]"])),
        _message(lambda: load_config(None, ["data.sources.0.bogus=1"])),
        _message(lambda: load_config(None, ["data.sources.5.limit_per_category=1"])),
        _message(lambda: load_config(None, ["data.sources.0.kind.x=1"])),
        _message(lambda: load_config(str(dup))),
        _message(lambda: check_sources_exist(load_config(None, [f"data.sources=[{{kind: chat, url: '{tmp_path}/x'}}]"])
                                             .data.sources)),
        _message(lambda: build_demonstrations(cfg, ArtifactStore(cfg.run.storage_root))),
    ]
    for text in messages:
        assert BRACKETED.search(text) and not DOTTED.search(text), text  # the override quoted as written aside
    with pytest.raises(SourceNotFoundError, match=r"data\.sources\[0\] \(chat\)"):
        check_sources_exist(load_config(None, [f"data.sources=[{{kind: chat, url: '{tmp_path}/x'}}]"]).data.sources)
