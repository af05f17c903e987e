"""``pivotrl demos`` runs the pre-run checks of ``pivotrl run`` and ``pivotrl probe`` (flows/cli.py
``_preflight``) before the demonstrations stage: a folder or a missing file given as a chat source is
one line naming ``data.sources[i]``, exit 2, with nothing written under the storage root."""

from __future__ import annotations

import pytest
from typer.testing import CliRunner

from pivotrl.flows.cli import app


@pytest.fixture(autouse=True)
def _cache_dir(tmp_path, monkeypatch):
    monkeypatch.setenv("PIVOTRL_CACHE_DIR", str(tmp_path / "cache"))


def _demos(tmp_path, url: str, *extra: str):
    sets = [f"run.storage_root={tmp_path / 'root'}", f"data.sources=[{{kind: chat, url: '{url}'}}]", *extra]
    return CliRunner().invoke(app, ["demos", *(a for kv in sets for a in ("--set", kv))])


def test_pivotrl_demos_checks_its_sources_before_the_stage(tmp_path):
    folder = tmp_path / "demos"
    folder.mkdir()
    out = _demos(tmp_path, str(folder))
    assert out.exit_code == 2, out.output
    assert out.output.strip() == f"data error: data.sources[0] (chat): {folder}: is a directory, not a file"
    assert "cannot read" not in out.output and not (tmp_path / "root").exists()
    out = _demos(tmp_path, str(tmp_path / "gone.jsonl"))
    assert out.exit_code == 2 and out.output.startswith(f"data error: data.sources[0] (chat): {tmp_path / 'gone.jsonl'}: "
                                                        "no such file"), out.output


def test_pivotrl_demos_checks_the_model_only_when_it_measures_lengths(tmp_path):
    src = tmp_path / "empty.jsonl"
    src.write_text("")
    model = f"model.source={tmp_path / 'no-model'}"
    out = _demos(tmp_path, str(src), model)
    assert "model error" not in out.output  # the stage needs no model: it reads the (empty) source
    assert "the source is empty" in str(out.exception)  # the stage's DataError (main() prints it, exit 2)
    out = CliRunner().invoke(app, ["demos", "--lengths", "--set", f"run.storage_root={tmp_path / 'root'}", "--set",
                                   f"data.sources=[{{kind: chat, url: '{src}'}}]", "--set", model])
    assert out.exit_code == 2 and out.output.startswith("model error: model source"), out.output
