"""``data.on_invalid: quarantine`` quarantines a whole source too: a table without a required column,
a file that cannot be read, a source that yields nothing. Each is a note in ``quarantine.jsonl``
with its reason, counted, and the other sources go on; the stage fails, naming every such source
in one message, only when nothing is left. With ``on_invalid: error`` the first one stops the run."""

from __future__ import annotations

import json
from pathlib import Path

import pandas as pd
import pytest

from pivotrl.config import load_config
from pivotrl.core.errors import DataError, StorageError
from pivotrl.pipeline.demos import build_demonstrations
from pivotrl.storage import ArtifactStore

from test_bad_input import good


def _good_file(tmp_path: Path) -> Path:
    ok = tmp_path / "ok.jsonl"
    ok.write_text("".join(json.dumps(good(t)) + "\n" for t in "abc"), encoding="utf-8")
    return ok


def _config(tmp_path: Path, urls: list[str], on_invalid: str = "quarantine"):
    sources = ", ".join(f"{{kind: chat, url: '{u}'}}" for u in urls)
    return load_config(None, [f"run.storage_root={tmp_path / 'root'}", f"data.on_invalid={on_invalid}",
                              f"data.sources=[{sources}]", "warm_start.enabled=false", "data.split.warm_start=0.0",
                              "data.split.pivot=0.67", "data.split.heldout=0.33"])


def _no_messages_column(tmp_path: Path) -> Path:
    path = tmp_path / "no-messages.parquet"
    pd.DataFrame({"id": ["x"], "tools": ["[]"]}).to_parquet(path)
    return path


def _not_parquet(tmp_path: Path) -> Path:
    path = tmp_path / "garbage.parquet"
    path.write_bytes(b"PAR1" + b"\x00not a footer" * 10)
    return path


def _a_folder(tmp_path: Path) -> Path:
    path = tmp_path / "folder.jsonl"
    path.mkdir()
    return path


def _missing(tmp_path: Path) -> Path:
    return tmp_path / "gone.jsonl"


def _empty(tmp_path: Path) -> Path:
    path = tmp_path / "empty.jsonl"
    path.write_text("\n\n", encoding="utf-8")
    return path


def _all_bad(tmp_path: Path) -> Path:
    path = tmp_path / "bad.jsonl"
    path.write_text(json.dumps({"id": "e", "messages": []}) + "\n", encoding="utf-8")
    return path


KINDS = [  # (the bad source, what its quarantine note says)
    (_no_messages_column, "Parquet column(s) messages missing (have id, tools)"),
    (_not_parquet, "not a readable Parquet file"),
    (_a_folder, "cannot read (IsADirectoryError"),
    (_missing, "no such file"),
    (_empty, "the source is empty"),
    (_all_bad, "all 1 records were invalid; the first: "),
]


@pytest.mark.parametrize("make, reason", KINDS, ids=[k[0].__name__.strip("_") for k in KINDS])
def test_a_bad_source_is_quarantined_counted_and_the_others_go_on(tmp_path, make, reason):
    bad = make(tmp_path)
    cfg = _config(tmp_path, [str(bad), str(_good_file(tmp_path))])
    store = ArtifactStore(cfg.run.storage_root)
    out = build_demonstrations(cfg, store)
    assert out["counts"]["trajectories"] == 3 and out["counts"]["quarantined_sources"] == 1
    assert out["counts"]["quarantined"] == (1 if make is _all_bad else 0)  # bad records only
    notes = [json.loads(x) for x in store.read_text(f"{out['key']}/quarantine.jsonl").splitlines()]
    note = notes[-1]
    assert (note["source"], note["record"], note["note"]) == (str(bad), "source", True)
    assert note["error"].startswith(f"data.sources[0] ({bad}) gave no trajectories: ") and reason in note["error"]
    assert out["quarantine"] == store.url(f"{out['key']}/quarantine.jsonl")


@pytest.mark.parametrize("make, error", [(_no_messages_column, DataError), (_a_folder, StorageError),
                                         (_empty, DataError)])
def test_with_on_invalid_error_a_bad_source_stops_the_stage(tmp_path, make, error):
    cfg = _config(tmp_path, [str(make(tmp_path)), str(_good_file(tmp_path))], on_invalid="error")
    with pytest.raises(error):
        build_demonstrations(cfg, ArtifactStore(cfg.run.storage_root))


def test_when_nothing_is_left_one_message_names_every_bad_source(tmp_path):
    bad = [_no_messages_column(tmp_path), _a_folder(tmp_path), _empty(tmp_path), _all_bad(tmp_path)]
    cfg = _config(tmp_path, [str(b) for b in bad])
    with pytest.raises(DataError) as e:
        build_demonstrations(cfg, ArtifactStore(cfg.run.storage_root))
    lines = str(e.value).splitlines()
    assert lines[0] == ("data.sources: nothing to train on, every source was quarantined (1 bad record in the "
                        "quarantine)")
    assert [line.split(" gave no trajectories: ")[0] for line in lines[1:]] == [
        f"  - data.sources[{i}] ({b})" for i, b in enumerate(bad)]
    # one source: one line
    cfg = _config(tmp_path, [str(bad[0])])
    with pytest.raises(DataError) as e:
        build_demonstrations(cfg, ArtifactStore(cfg.run.storage_root))
    assert "\n" not in str(e.value) and "Parquet column(s) messages missing" in str(e.value)


def test_pivotrl_demos_goes_on_past_a_parquet_source_without_messages(tmp_path):
    from typer.testing import CliRunner

    from pivotrl.flows.cli import app

    bad, ok = _no_messages_column(tmp_path), _good_file(tmp_path)
    sets = [f"run.storage_root={tmp_path / 'root'}", "data.on_invalid=quarantine",
            f"data.sources=[{{kind: chat, url: '{bad}'}}, {{kind: chat, url: '{ok}'}}]", "warm_start.enabled=false",
            "data.split.warm_start=0.0", "data.split.pivot=0.67", "data.split.heldout=0.33"]
    out = CliRunner().invoke(app, ["demos", *(a for kv in sets for a in ("--set", kv))])
    assert out.exit_code == 0, out.output
    counts = json.loads(out.output.split("\ntrajectories: ", 1)[0])
    assert counts["trajectories"] == 3 and counts["quarantined_sources"] == 1
    assert "\nquarantine: " in out.output
