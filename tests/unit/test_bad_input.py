"""Bad input end to end: every error names its record/field/key/file, and nothing half-written is
left behind (no artifact, no temporary file). With ``data.on_invalid=quarantine`` bad records are
skipped, counted and described in ``quarantine.jsonl``."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from pivotrl.config import load_config
from pivotrl.data.sources import load_trajectories
from pivotrl.data.states import extract_turn_states
from pivotrl.core.errors import ConfigError, DataError, ModelError, StorageError
from pivotrl.pipeline.common import local_checkpoint, make_store, verify_checkpoint
from pivotrl.pipeline.demos import build_demonstrations, demos_key
from pivotrl.pipeline.probe import pivot_stats, probe_states
from pivotrl.storage import ArtifactStore

TOOL = {"type": "function", "function": {"name": "cd", "description": "change dir",
                                         "parameters": {"type": "object", "properties": {"folder": {"type": "string"}}}}}


def good(tid: str) -> dict:
    return {
        "id": tid,
        "category": "demo",
        "messages": [
            {"role": "user", "content": "go to docs"},
            {"role": "assistant", "content": "", "tool_calls": [
                {"id": "c1", "type": "function", "function": {"name": "cd", "arguments": "{\"folder\": \"docs\"}"}}]},
            {"role": "tool", "tool_call_id": "c1", "content": "ok"},
            {"role": "assistant", "content": "Done."},
        ],
        "tools": [TOOL],
    }


def bad_lines() -> list[bytes]:
    """Line k+1 of the file: three good records and one of each kind of bad record."""
    unknown = good("unknown_tool")
    unknown["messages"][1]["tool_calls"][0]["function"]["name"] = "rm"
    orphan = good("orphan")
    orphan["messages"][2]["tool_call_id"] = "nope"
    no_messages = good("no_messages")
    del no_messages["messages"]
    no_name = good("no_name")
    del no_name["messages"][1]["tool_calls"][0]["function"]["name"]
    bad_rule = {**good("bad_rule"), "meta": {"answer_rule": {"regex": "(unclosed"}}}
    no_tools = good("no_tools")
    del no_tools["tools"]
    return [
        json.dumps(good("a")).encode(),                    # line 1
        b'{"id": "cut", "messages": [{"role": "us',         # line 2: malformed JSON
        json.dumps(unknown).encode(),                       # line 3: unknown tool
        json.dumps(orphan).encode(),                        # line 4: tool message without its call
        json.dumps({"id": "empty", "messages": []}).encode(),  # line 5: empty trajectory
        json.dumps(no_messages).encode(),                   # line 6: missing field
        json.dumps(no_name).encode(),                       # line 7: missing nested field
        b'{"id": "latin1", "messages": "caf\xe9"}',         # line 8: not UTF-8
        json.dumps(good("b")).encode(),                     # line 9
        json.dumps(good("c")).encode(),                     # line 10
        json.dumps(bad_rule).encode(),                      # line 11: an answer rule that cannot compile
        json.dumps(no_tools).encode(),                      # line 12: calls a tool, declares none
    ]


def chat_config(tmp_path: Path, url: str, *extra: str):
    return load_config(None, [
        f"run.storage_root={tmp_path / 'root'}",
        f"data.sources=[{{kind: chat, url: '{url}'}}]",
        "warm_start.enabled=false", "data.split.warm_start=0.0", "data.split.pivot=0.67", "data.split.heldout=0.33",
        *extra,
    ])


def leftovers(root: Path) -> list[str]:
    """Every file under the store root (temporary writes included)."""
    return sorted(p.relative_to(root).as_posix() for p in root.rglob("*") if p.is_file()) if root.exists() else []


# ------------------------------------------------------------------------------ demonstrations
@pytest.mark.parametrize(
    "line, pattern",
    [
        (2, r"line 2: malformed JSON"),
        (3, r"line 2 'unknown_tool'\.messages\[1\]\.tool_calls\[0\]\.function\.name: 'rm' is not one of"),
        (4, r"line 2 'orphan'\.messages\[2\]\.tool_call_id: 'nope' does not match any earlier tool call"),
        (5, r"line 2 'empty'\.messages: missing or empty"),
        (6, r"line 2 'no_messages'\.messages: missing or empty"),
        (7, r"line 2 'no_name'\.messages\[1\]\.tool_calls\[0\]\.function\.name: missing"),
        (8, r"line 2: not valid UTF-8"),
        (11, r"line 2 'bad_rule'\.meta\.answer_rule\.regex: not a valid regular expression"),
        (12, r"line 2 'no_tools'\.tools: missing or empty, but messages\[1\]\.tool_calls\[0\] calls 'cd'"),
    ],
)
def test_a_bad_record_stops_the_demonstrations_stage_and_writes_nothing(tmp_path, line, pattern):
    lines = bad_lines()
    src = tmp_path / "demo.jsonl"
    src.write_bytes(lines[0] + b"\n" + lines[line - 1] + b"\n")
    cfg = chat_config(tmp_path, str(src))
    store = ArtifactStore(cfg.run.storage_root)
    with pytest.raises(DataError, match=rf"demo\.jsonl {pattern}"):
        build_demonstrations(cfg, store)
    assert leftovers(tmp_path / "root") == []  # no trajectories/candidates parquet, no .tmp file


def test_quarantine_skips_counts_and_describes_bad_records(tmp_path):
    src = tmp_path / "demo.jsonl"
    src.write_bytes(b"\n".join(bad_lines()) + b"\n")
    cfg = chat_config(tmp_path, str(src), "data.on_invalid=quarantine")
    store = ArtifactStore(cfg.run.storage_root)
    out = build_demonstrations(cfg, store)
    assert out["counts"]["trajectories"] == 3 and out["counts"]["quarantined"] == 9
    key = demos_key(cfg)
    q = [json.loads(x) for x in store.read_text(f"{key}/quarantine.jsonl").splitlines()]
    assert [(e["record"], e["id"], e["field"]) for e in q] == [
        ("line 2", "", "record"),
        ("line 3", "unknown_tool", "messages[1].tool_calls[0].function.name"),
        ("line 4", "orphan", "messages[2].tool_call_id"),
        ("line 5", "empty", "messages"),
        ("line 6", "no_messages", "messages"),
        ("line 7", "no_name", "messages[1].tool_calls[0].function.name"),
        ("line 8", "", "record"),
        ("line 11", "bad_rule", "meta.answer_rule.regex"),
        ("line 12", "no_tools", "tools"),
    ]
    assert store.read_manifest(f"{key}/quarantine.jsonl").kind == "quarantine"
    assert sorted(store.read_parquet(f"{key}/trajectories.parquet")["id"]) == ["a", "b", "c"]
    # 3 trajectories × 2 assistant turns
    assert len(store.read_parquet(f"{key}/candidates.parquet")) == 6
    assert not [f for f in leftovers(tmp_path / "root") if f.startswith(".tmp/")]


def test_a_source_with_no_trajectory_is_an_error_naming_the_source(tmp_path):
    empty = tmp_path / "empty.jsonl"
    empty.write_bytes(b"\n\n")
    cfg = chat_config(tmp_path, str(empty))
    with pytest.raises(DataError, match=r"data\.sources\[0\] \(.*empty\.jsonl\) gave no trajectories: the source is empty"):
        build_demonstrations(cfg, ArtifactStore(cfg.run.storage_root))
    bad = tmp_path / "bad.jsonl"
    bad.write_bytes(bad_lines()[1] + b"\n" + bad_lines()[2] + b"\n")
    # In quarantine mode an all-quarantined source is reported, not fatal; with no other source
    # there is nothing left to train on, which is an error.
    cfg = chat_config(tmp_path, str(bad), "data.on_invalid=quarantine")
    with pytest.raises(DataError, match=r"nothing to train on, every source was quarantined \(2 bad records in the quarantine\): "
                       r"data\.sources\[0\] .*: all 2 records were invalid"):
        build_demonstrations(cfg, ArtifactStore(cfg.run.storage_root))
    one = tmp_path / "one.jsonl"
    one.write_bytes(bad_lines()[1] + b"\n")
    cfg = chat_config(tmp_path, str(one), "data.on_invalid=quarantine")
    with pytest.raises(DataError, match=r"\(1 bad record in the quarantine\): "):  # not "2 entries": its note
        build_demonstrations(cfg, ArtifactStore(cfg.run.storage_root))
    assert leftovers(tmp_path / "root") == []
    ok = tmp_path / "ok.jsonl"
    ok.write_bytes(b"\n".join(json.dumps(good(t)).encode() for t in "abc") + b"\n")
    cfg = load_config(None, [f"run.storage_root={tmp_path / 'root'}", "data.on_invalid=quarantine",
                             f"data.sources=[{{kind: chat, url: '{bad}'}}, {{kind: chat, url: '{ok}'}}]",
                             "warm_start.enabled=false", "data.split.warm_start=0.0", "data.split.pivot=0.67",
                             "data.split.heldout=0.33"])
    out = build_demonstrations(cfg, ArtifactStore(cfg.run.storage_root))
    assert out["counts"]["trajectories"] == 3 and out["counts"]["quarantined"] == 2  # the 2 records, not the note
    store = ArtifactStore(cfg.run.storage_root)
    lines = [json.loads(x) for x in store.read_bytes(f"{out['key']}/quarantine.jsonl").decode().splitlines()]
    assert lines[-1]["error"].startswith(f"data.sources[0] ({bad}) gave no trajectories: all 2 records were invalid")
    assert lines[-1]["note"] is True and out["counts"]["quarantined_sources"] == 1
    assert len(lines) == 3 and not any(x.get("note") for x in lines[:2])


def test_a_malformed_parquet_file_is_named_and_nothing_is_written(tmp_path):
    src = tmp_path / "demo.parquet"
    src.write_bytes(b"PAR1" + b"\x00garbage, not a footer" * 10)
    cfg = chat_config(tmp_path, str(src))
    with pytest.raises(DataError, match=r"demo\.parquet: not a readable Parquet file"):
        build_demonstrations(cfg, ArtifactStore(cfg.run.storage_root))
    assert leftovers(tmp_path / "root") == []


def test_a_parquet_file_without_messages_names_the_missing_column(tmp_path):
    import pandas as pd

    src = tmp_path / "demo.parquet"
    pd.DataFrame({"id": ["a"], "tools": ["[]"]}).to_parquet(src)
    with pytest.raises(DataError, match=r"demo\.parquet: Parquet column\(s\) messages missing \(have id, tools\)"):
        load_trajectories(str(src))


def test_pivotrl_demos_prints_the_same_counts_fresh_and_cached_and_names_a_missing_category(tmp_path):
    from typer.testing import CliRunner

    from pivotrl.flows.cli import app

    recs = [good("a"), good("b"), {k: v for k, v in good("c").items() if k != "category"}]
    src = tmp_path / "demo.jsonl"
    src.write_text("".join(json.dumps(r) + "\n" for r in recs), encoding="utf-8")
    sets = [f"run.storage_root={tmp_path / 'root'}", f"data.sources=[{{kind: chat, url: '{src}'}}]",
            "warm_start.enabled=false", "data.split.warm_start=0.0", "data.split.pivot=0.67", "data.split.heldout=0.33"]
    args = ["demos", *(a for kv in sets for a in ("--set", kv))]
    fresh = CliRunner().invoke(app, args)
    cached = CliRunner().invoke(app, args)  # the counts read back from counts.json
    assert fresh.exit_code == cached.exit_code == 0, fresh.output + cached.output
    assert fresh.output == cached.output
    counts = json.loads(fresh.output.split("\ntrajectories: ", 1)[0])
    assert list(counts) == sorted(counts)
    assert list(counts["trajectories_per_category"].items()) == [("(none)", 1), ("demo", 2)]
    assert list(counts["candidates_per_category"].items()) == [("(none)", 2), ("demo", 4)]


# ------------------------------------------------------------------------------------ fuzzing
_json = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=True) | st.text(max_size=8),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner, max_size=4),
    max_leaves=20,
)
_field = st.sampled_from(["id", "messages", "tools", "role", "content", "tool_calls", "function", "name",
                          "arguments", "tool_call_id", "type", "parameters", "env", "meta", "category", "source"])
# Records shaped like trajectories (the right keys, random values), to get past the first checks.
_record = st.recursive(
    _json,
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(_field, inner, max_size=6),
    max_leaves=30,
)


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(data=st.binary(max_size=300))
def test_random_bytes_raise_nothing_but_data_errors(tmp_path, data):
    path = tmp_path / "fuzz.jsonl"
    path.write_bytes(data)
    try:
        trajs = load_trajectories(str(path))
    except DataError as e:
        assert "fuzz.jsonl" in str(e)
        return
    q: list = []
    assert len(load_trajectories(str(path), on_invalid="quarantine", quarantine=q)) == len(trajs)


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(records=st.lists(_record, min_size=1, max_size=3))
def test_random_json_records_raise_nothing_but_data_errors(tmp_path, records):
    path = tmp_path / "fuzz.jsonl"
    path.write_text("\n".join(json.dumps(r) for r in records) + "\n", encoding="utf-8")
    q: list = []
    kept = load_trajectories(str(path), on_invalid="quarantine", quarantine=q)
    assert len(kept) + len(q) == len(records)
    try:
        load_trajectories(str(path))
    except DataError as e:
        assert "fuzz.jsonl line " in str(e)
    else:
        assert q == []


def test_json_nested_beyond_the_parser_limit_is_a_data_error(tmp_path):
    # Found by fuzzing: the JSON decoder raises RecursionError, which used to escape.
    path = tmp_path / "deep.jsonl"
    path.write_text(json.dumps(good("a")) + "\n" + '{"id": "deep", "messages": ' + "[" * 100_000 + "]" * 100_000 + "}\n")
    with pytest.raises(DataError, match=r"deep\.jsonl line 2: JSON nested too deeply to read"):
        load_trajectories(str(path))
    q: list = []
    assert [t.id for t in load_trajectories(str(path), on_invalid="quarantine", quarantine=q)] == ["a"]
    assert [(e["record"], e["field"]) for e in q] == [("line 2", "record")]


# ---------------------------------------------------------------------------- over-long states
def test_states_beyond_the_context_are_skipped_and_counted_never_truncated():
    from pivotrl.data.schema import Trajectory
    from pivotrl.rollout.base import SamplingConfig
    from pivotrl.rollout.hf import TransformersEngine
    from pivotrl.testing import tiny_llama, tiny_tokenizer
    from pivotrl.verifiers import get_verifier

    short = Trajectory.from_dict(good("short"))
    long = good("long")
    long["messages"][0]["content"] = "please go to the docs folder " * 200
    states = extract_turn_states(short)[:1] + extract_turn_states(Trajectory.from_dict(long))[:1]
    tok = tiny_tokenizer()
    engine = TransformersEngine(tiny_llama(tok, seed=0), tok, max_model_len=512)
    df = probe_states(engine, tok, states, get_verifier("tool_name"), num_probes=2,
                      sampling=SamplingConfig(n=2, temperature=1.0, max_tokens=8, seed=0),
                      max_context=512, max_tokens=8, progress=False)
    assert list(df["status"]) == ["ok", "too_long"]
    row = df.iloc[1]
    assert row["state_id"] == "long#0" and json.loads(row["rewards"]) == []
    assert "turn state 'long#0': prompt is" in row["reason"] and "more than max_len=504" in row["reason"]
    assert pivot_stats(df.assign(decision=["all_fail", "skipped_too_long"]), 0.5)["total"]["skipped_too_long"] == 1


# ---------------------------------------------------------------------------------- checkpoints
@pytest.fixture()
def tiny_ckpt(tmp_path):
    from pivotrl.testing import save_tiny_checkpoint

    return save_tiny_checkpoint(tmp_path / "ckpt")


def test_a_truncated_safetensors_file_is_a_model_error_naming_the_file(tiny_ckpt, tmp_path):
    from pivotrl.config import RunConfig
    from pivotrl.pipeline.common import make_rollout_engine

    assert verify_checkpoint(tiny_ckpt) == tiny_ckpt
    weights = tiny_ckpt / "model.safetensors"
    data = weights.read_bytes()
    weights.write_bytes(data[: len(data) // 2])
    with pytest.raises(ModelError, match=rf"{weights}: truncated: safetensors file of {len(data) // 2} bytes, "
                                         rf"its header needs {len(data)}"):
        verify_checkpoint(tiny_ckpt)
    cfg = RunConfig.model_validate({"rollout": {"engine": "transformers"}, "model": {"max_context": 2048},
                                 "warm_start": {"max_len": 2048}})
    with pytest.raises(ModelError, match="model.safetensors: truncated"):
        make_rollout_engine(cfg, tiny_ckpt)
    weights.write_bytes(data[:5])
    with pytest.raises(ModelError, match=r"model\.safetensors: truncated safetensors file \(5 bytes, no header\)"):
        verify_checkpoint(tiny_ckpt)
    weights.write_bytes(data + b"\0")
    with pytest.raises(ModelError, match="has trailing bytes"):
        verify_checkpoint(tiny_ckpt)


def test_a_checkpoint_without_its_completion_marker_is_refused(tiny_ckpt, tmp_path):
    store = ArtifactStore(str(tmp_path / "root"))
    store.put_dir(tiny_ckpt, "models/x/step-000001")
    store.put_dir(tiny_ckpt, "models/x/step-000002")
    # An upload cut short: the marker (written last) is missing.
    (tmp_path / "root" / "models/x/step-000002/_COMPLETE").unlink()
    with pytest.raises(StorageError, match=r"models/x/step-000002 has no _COMPLETE marker"):
        store.get_dir("models/x/step-000002", tmp_path / "dl")
    assert not (tmp_path / "dl").exists()
    with pytest.raises(StorageError, match="has no _COMPLETE marker"):
        local_checkpoint(store, "models/x/step-000002", tmp_path / "cache")
    assert not list((tmp_path / "cache").rglob("*.safetensors"))
    assert verify_checkpoint(local_checkpoint(store, "models/x/step-000001", tmp_path / "cache"))


# --------------------------------------------------------------------------------------- config
def test_a_config_with_wrong_types_names_every_key(tmp_path):
    path = tmp_path / "bad.yaml"
    path.write_text("probing:\n  num_probes: many\ntraining:\n  beta: true\nfaults:\n  tool_failure_rate: 1.5\n")
    with pytest.raises(ConfigError) as info:
        load_config(str(path))
    msg = str(info.value)
    assert f"invalid config {path}: 3 problems" in msg
    assert "probing.num_probes = 'many': must be an integer" in msg
    assert "training.beta = true: must be a number, not true/false" in msg
    assert "faults.tool_failure_rate = 1.5: must be < 1" in msg


def test_a_stage_spec_with_a_bad_config_is_a_config_error(tmp_path):
    from pivotrl.pipeline.entry import run_stage

    with pytest.raises(ConfigError, match=r"^invalid config the probe stage spec: probing\.num_probes = 1: must be ≥ 2"):
        run_stage("probe", {"probing": {"num_probes": 1}}, {})
    with pytest.raises(ConfigError, match="unknown stage 'sample'; valid: demonstrations, reference, probe, train, evaluate"):
        run_stage("sample", {}, {})


def test_storage_faults_are_retried_and_publish_whole_artifacts(tmp_path):
    import pandas as pd

    cfg = load_config(None, [f"run.storage_root={tmp_path / 'root'}", "faults.storage_failure_rate=0.5"])
    store = make_store(cfg)
    df = pd.DataFrame({"x": list(range(100))})
    for i in range(12):
        store.write_artifact(f"a/{i}.parquet", df, kind="test")
    assert store.write_retries > 0
    for i in range(12):
        assert store.read_parquet(f"a/{i}.parquet").equals(df)
        assert store.has_artifact(f"a/{i}.parquet")
    assert [f for f in leftovers(tmp_path / "root") if f.startswith(".tmp/")] == []
