"""What a run leaves for people and other frameworks, from one real smoke flow run:

* experiment tracking: the flow recorded in a real MLflow tracking server on loopback, read back
  through MLflow's client; ``tracking: none`` imports no tracker; an unreachable tracker switches
  itself off without failing the run;
* rollout records: every sampled action of probing, training and evaluation, per step, and the
  ``pivotrl rollouts`` command;
* NeMo Gym PivotRL rows: the exported pivot set read back as demonstrations gives the same states;
  the export's checks fail on bad pivot sets, naming the pivots.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from servers import free_port, server

from pivotrl.config import load_config
from pivotrl.core.errors import ConfigError
from pivotrl.storage import ArtifactStore
from pivotrl.tracking import flatten_params

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def mlflow_server(tmp_path_factory):
    """``mlflow server`` (SQLite backend, artifacts proxied to a temporary folder) on 127.0.0.1."""
    work = tmp_path_factory.mktemp("mlflow")
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    cmd = [sys.executable, "-m", "mlflow", "server", "--host", "127.0.0.1", "--port", str(port), "--workers", "1",
           "--backend-store-uri", f"sqlite:///{work / 'mlflow.db'}", "--artifacts-destination", str(work / "artifacts")]
    with server(cmd, work / "server.log", ready=f"{url}/health", what="mlflow server", cwd=work):
        yield url


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory) -> Path:
    from pivotrl.testing import save_tiny_checkpoint

    return save_tiny_checkpoint(tmp_path_factory.mktemp("model") / "tiny")


@pytest.fixture(scope="module")
def smoke_flow(mlflow_server, tiny_model, tmp_path_factory):
    """The nightly flow on the smoke config, tracked in the MLflow server: (result, flow-run id,
    store, overrides)."""
    from prefect.testing.utilities import prefect_test_harness

    from pivotrl.flows.nightly import nightly

    tmp = tmp_path_factory.mktemp("flow")
    root = tmp / "root"
    overrides = [f"run.storage_root={root}", f"model.source={tiny_model}", "tracking.backend=mlflow",
                 f"tracking.uri={mlflow_server}", "tracking.experiment=pivotrl-test"]
    old = os.environ.get("PREFECT_HOME")
    os.environ["PREFECT_HOME"] = str(tmp / "prefect")
    try:
        with prefect_test_harness(server_startup_timeout=120):
            state = nightly(config_path=str(REPO / "configs" / "smoke.yaml"), overrides=overrides, return_state=True)
            result = state.result()
    finally:
        if old is None:
            os.environ.pop("PREFECT_HOME", None)
        else:
            os.environ["PREFECT_HOME"] = old
    return result, str(state.state_details.flow_run_id), ArtifactStore(str(root)), overrides


@pytest.mark.integration
def test_smoke_flow_is_recorded_in_a_real_mlflow_server(smoke_flow, mlflow_server, tiny_model, tmp_path):
    from mlflow.tracking import MlflowClient

    from pivotrl.bfcl.wheel import BFCL_WHEEL_SHA256

    result, flow_run_id, store, overrides = smoke_flow
    client = MlflowClient(tracking_uri=mlflow_server)
    exp = client.get_experiment_by_name("pivotrl-test")
    runs = client.search_runs([exp.experiment_id])
    assert len(runs) == 1
    run = runs[0]
    assert run.info.status == "FINISHED" and run.info.run_name == "smoke"
    # Params: the resolved config, one dotted key each.
    cfg = load_config(str(REPO / "configs" / "smoke.yaml"), overrides)
    assert run.data.params["training.group_size"] == "4" == str(cfg.training.group_size)
    assert run.data.params["probing.num_probes"] == "4"
    assert run.data.params["model.source"] == str(tiny_model)
    assert json.loads(run.data.params["evaluation.seeds"]) == [0]
    assert not any(k.startswith("tracking.") for k in run.data.params)
    # A metric series with one point per training step, equal to metrics.parquet.
    metrics_key = f"{_train_key(store)}/metrics.parquet"
    m = store.read_parquet(metrics_key)
    # The training artifacts name the flow run and the task run that wrote them (handed to the stage
    # process, which never imports Prefect).
    ids = store.read_manifest(metrics_key).prefect
    assert ids["flow_run_id"] == flow_run_id and ids["task_run_id"] and ids["task_run_id"] != flow_run_id
    history = client.get_metric_history(run.info.run_id, "train/reward_mean")
    assert [p.step for p in history] == list(m["step"]) == [1, 2]
    assert [p.value for p in history] == pytest.approx(list(m["reward_mean"]))
    assert len(client.get_metric_history(run.info.run_id, "train/refresh_max_abs_delta")) == 2
    # Sent live, step by step, by the training process (and not sent again at the end of the stage).
    assert store.read_json(f"{_train_key(store)}/tracking/{run.info.run_id}.json") == {"steps": [1, 2]}
    # Stage summaries and evaluation.
    data = run.data.metrics
    assert data["probe/kept"] == result["report"]["meta"]["pivots"]
    assert data["demos/trajectories"] == 14
    assert 0.0 <= data["eval/pivotrl/full_task_success"] <= 1.0
    # The report artifact, byte for byte.
    listed = {f.path for f in client.list_artifacts(run.info.run_id, "report")}
    assert {"report/report.md", "report/report.json"} <= listed
    assert any(p.endswith(".png") for p in listed)
    local = client.download_artifacts(run.info.run_id, "report/report.md", str(tmp_path / "dl"))
    ekey = result["report_md"].removeprefix(store.root_url + "/")
    assert Path(local).read_bytes() == store.read_bytes(ekey)
    # Lineage tags equal to the manifests' hashes.
    tags = run.data.tags
    pivots = store.read_manifest(f"{_key_of(store, 'pivots/', 'pivots.parquet')}")
    probes = store.read_manifest(f"{_key_of(store, 'probes/', 'probes.parquet')}")
    trajs = store.read_manifest(f"{_key_of(store, 'demos/', 'trajectories.parquet')}")
    report = store.read_manifest(result["report_json"].removeprefix(store.root_url + "/"))
    assert tags["pivotrl.pivots.sha256"] == pivots.sha256
    assert tags["pivotrl.probes.sha256"] == probes.sha256
    assert tags["pivotrl.reference.hash"] == pivots.extra["reference_hash"] == probes.extra["reference_hash"]
    assert tags["pivotrl.trajectories.sha256"] == trajs.sha256
    assert tags["pivotrl.report.sha256"] == report.sha256
    assert tags["pivotrl.metrics.sha256"] == store.read_manifest(metrics_key).sha256
    sources = {k: v for k, v in trajs.inputs.items()}
    assert len(sources) == 2
    for i, (name, rec) in enumerate(sorted(sources.items())):
        assert tags[f"pivotrl.source.{i}.uri"] == rec["uri"]
        assert tags[f"pivotrl.source.{i}.sha256"] == (rec["sha256"] or BFCL_WHEEL_SHA256)
    assert tags["pivotrl.verifier.name"] == cfg.verifier.name == pivots.extra["verifier"]
    assert len(tags["pivotrl.verifier.code_hash"]) == 16
    assert tags["pivotrl.code_version"] == report.code_version
    assert tags["prefect.flow_run_id"] == flow_run_id


def _key_of(store: ArtifactStore, prefix: str, name: str) -> str:
    """The one key ``<prefix><folder>/<name>`` (checkpoint copies deeper down do not count)."""
    keys = [k for k in store.list(prefix.rstrip("/")) if k.endswith("/" + name) and k.count("/") == prefix.count("/") + 1]
    assert len(keys) == 1, keys
    return keys[0]


def _train_key(store: ArtifactStore) -> str:
    return _key_of(store, "train/", "metrics.parquet").rsplit("/", 1)[0]


def test_tracking_none_imports_no_tracker_library():
    code = ("import sys; from pivotrl.config import load_config; from pivotrl.tracking import make_tracker;"
            "t = make_tracker(load_config('configs/smoke.yaml')); t.log_metrics('', [('a', 1.0, 1)]);"
            "print(type(t).__name__, 'mlflow' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, check=True)
    assert out.stdout.split() == ["NoTracker", "False"]


def test_unreachable_tracker_is_switched_off_with_a_warning(tmp_path, monkeypatch, caplog):
    from pivotrl.tracking import RunRecorder

    monkeypatch.setenv("MLFLOW_HTTP_REQUEST_MAX_RETRIES", "0")
    monkeypatch.setenv("MLFLOW_HTTP_REQUEST_TIMEOUT", "2")
    cfg = load_config(str(REPO / "configs" / "smoke.yaml"),
                      [f"run.storage_root={tmp_path}", "tracking.backend=mlflow", f"tracking.uri=http://127.0.0.1:{free_port()}"])
    rec = RunRecorder(cfg, ArtifactStore(str(tmp_path)))
    assert rec.start() == ""
    rec.stage("probe", {"stats": {"total": {"kept": 3}}})  # a no-op now, no error
    rec.end()
    assert any("experiment tracking switched off" in r.getMessage() and "127.0.0.1" in r.getMessage()
               for r in caplog.records)


def test_config_params_are_flat_and_credentials_stay_out_of_the_uri():
    assert flatten_params({"a": {"b": 1, "c": [1, 2], "d": {}}, "e": None}) == {
        "a.b": "1", "a.c": "[1, 2]", "a.d": "{}", "e": "null"}
    with pytest.raises(ConfigError, match="tracking.uri.*MLFLOW_TRACKING_PASSWORD"):
        load_config(str(REPO / "configs" / "smoke.yaml"), ["tracking.uri=https://me:secret@mlflow.example:5000"])


# ------------------------------------------------------------------------------ rollout records
@pytest.mark.integration
def test_every_sample_is_kept_per_step_and_printed(smoke_flow):
    from pivotrl.provenance.rollouts import ROLLOUT_COLUMNS, read_rollouts

    result, _, store, _ = smoke_flow
    cfg = load_config(str(REPO / "configs" / "smoke.yaml"))
    df = read_rollouts(store)
    assert list(df.columns) == ROLLOUT_COLUMNS
    probes = store.read_parquet(_key_of(store, "probes/", "probes.parquet"))
    ok = probes[probes["status"] == "ok"]
    # Probing: m samples per scored candidate, rewards and reasons as in the probe table.
    pr = df[df["stage"] == "probe"]
    assert len(pr) == len(ok) * cfg.probing.num_probes
    first = ok.iloc[0]
    rows = pr[pr["state_id"] == first["state_id"]]
    assert list(rows["reward"]) == json.loads(first["rewards"]) and list(rows["reason"]) == json.loads(first["reasons"])
    assert (pr["action_tokens"] > 0).all() and (pr["policy_step"] == 0).all()
    # Training: K samples per pivot of every step, one file per step, advantages and ratios.
    train_key = _train_key(store)
    assert sorted(k.rsplit("/", 1)[1] for k in store.list(f"{train_key}/rollouts")) == [
        "step-000001.parquet", "step-000002.parquet"]
    tr = df[df["stage"] == "train"]
    m = store.read_parquet(f"{train_key}/metrics.parquet")
    for step, g in tr.groupby("step"):
        row = m[m["step"] == step].iloc[0]
        assert len(g) == row["groups"] * cfg.training.group_size
        assert g["reward"].mean() == pytest.approx(row["reward_mean"])
        assert (g["policy_step"] == step - 1).all()
        for _, grp in g.groupby("state_id"):  # GRPO advantages are centred within a group
            assert grp["advantage"].sum() == pytest.approx(0.0, abs=1e-6)
    assert tr["ratio"].between(0.1, 10.0).all()
    # Evaluation on the pivot set, per policy; and the report names the pivots that moved most.
    ev = df[df["stage"] == "evaluate"]
    assert set(ev["policy"]) == {"base", "reference", "pivotrl"}
    assert set(ev["state_id"]) == set(store.read_parquet(_key_of(store, "pivots/", "pivots.parquet"))["state_id"])
    md = store.read_text(result["report_md"].removeprefix(store.root_url + "/"))
    assert "## Pivots that changed most" in md and "pivotrl rollouts" in md
    # The command line: one pivot across steps.
    sid = tr["state_id"].iloc[0]
    out = subprocess.run([sys.executable, "-m", "pivotrl.flows.cli", "rollouts", store.root_url, "--state", sid],
                         capture_output=True, text=True, check=True).stdout
    lines = out.splitlines()
    assert lines[0].split()[:3] == ["stage", "step", "policy"]
    body = lines[2:]
    assert len(body) == len(df[df["state_id"] == sid]) and all(sid in line for line in body)
    assert {line.split()[0] for line in body} >= {"train", "evaluate"}
    step_only = subprocess.run([sys.executable, "-m", "pivotrl.flows.cli", "rollouts", store.root_url, "--step", "1",
                                "--json"], capture_output=True, text=True, check=True).stdout
    recs = [json.loads(line) for line in step_only.splitlines() if line.strip()]
    assert recs and {r["step"] for r in recs} == {1} and len(recs) == (df["step"] == 1).sum()


# -------------------------------------------------------------------------------- NeMo Gym rows
def _export(store, cfg, tiny_model, out, pivots_key=None, allow_stop_decisions=True):
    """The smoke pivot set holds stop decisions (quality.include_stop_decisions): allowed unless told."""
    from pivotrl.interop.export import export_pivots
    from pivotrl.runtime.models import load_tokenizer

    return export_pivots(store, pivots_key or _key_of(store, "pivots/", "pivots.parquet"), cfg,
                         load_tokenizer(tiny_model), str(out), allow_stop_decisions=allow_stop_decisions)


@pytest.mark.integration
def test_nemo_rows_round_trip_as_a_demonstration_source(smoke_flow, tiny_model, tmp_path):
    from pivotrl.data.sources import load_trajectories
    from pivotrl.data.states import extract_turn_states, frame_to_states

    _, _, store, overrides = smoke_flow
    cfg = load_config(str(REPO / "configs" / "smoke.yaml"), overrides)
    pivots_key = _key_of(store, "pivots/", "pivots.parquet")
    res = _export(store, cfg, tiny_model, tmp_path / "rows.jsonl")
    rows = [json.loads(line) for line in (tmp_path / "rows.jsonl").read_text().splitlines()]
    pivots = frame_to_states(store.read_parquet(pivots_key))
    assert res["rows"] == len(rows) == len(pivots) > 0
    probes = store.read_parquet(_key_of(store, "probes/", "probes.parquet")).set_index("state_id")
    for row, p in zip(rows, pivots):
        assert row["pivot_id"] == p.state_id and row["trajectory_id"] == p.trajectory_id
        assert row["decision_index"] == p.turn_index
        assert row["agent_ref"]["name"] and isinstance(row["responses_create_params"]["input"], list)
        assert {t["name"] for t in row["responses_create_params"]["tools"]} == {t.name for t in p.tools}
        act = row["expected_action"]
        assert act["type"] in ("function_call", "function_call_batch", "message")
        if act["type"] == "function_call":
            assert act["name"] == p.demo_action.tool_calls[0].name
            assert json.loads(act["arguments"]) == dict(p.demo_action.tool_calls[0].arguments)
        prof = row["profiling"]
        assert prof["rewards"] == json.loads(probes.loc[p.state_id, "rewards"]) and len(set(prof["rewards"])) == 2
        assert prof["mean_reward"] == pytest.approx(probes.loc[p.state_id, "mu"])
        assert prof["pivots_sha256"] == store.read_manifest(pivots_key).sha256
    # The command line writes the same rows.
    cli = subprocess.run([sys.executable, "-m", "pivotrl.flows.cli", "pivots", "export", store.url(pivots_key),
                          "--out", str(tmp_path / "cli.jsonl"), "--config", str(REPO / "configs" / "smoke.yaml"),
                          "--allow-stop-decisions", *[a for o in overrides for a in ("--set", o)]],
                         capture_output=True, text=True)
    assert cli.returncode == 0, cli.stderr
    assert (tmp_path / "cli.jsonl").read_bytes() == (tmp_path / "rows.jsonl").read_bytes()
    assert f"{len(rows)} rows" in cli.stdout
    # Read back through the ordinary demonstration loader: the last state of each trajectory is the pivot.
    trajs = load_trajectories(str(tmp_path / "rows.jsonl"))
    assert [t.id for t in trajs] == [p.state_id for p in pivots]
    for t, p in zip(trajs, pivots):
        back = extract_turn_states(t)[-1]
        assert back.messages == p.messages and back.tools == p.tools and back.demo_action == p.demo_action
        assert back.verifier_context == p.verifier_context and back.category == p.category
    # A chat-source config reads the rows as its demonstrations.
    cfg2 = load_config(str(REPO / "configs" / "smoke.yaml"),
                       [f"run.storage_root={tmp_path / 'r2'}", "data.sources=" + json.dumps(
                           [{"kind": "chat", "url": str(tmp_path / "rows.jsonl")}])])
    from pivotrl.pipeline.demos import build_demonstrations

    out = build_demonstrations(cfg2, ArtifactStore(str(tmp_path / "r2")))
    assert out["counts"]["trajectories"] == len(pivots)


@pytest.mark.integration
def test_export_checks_fail_naming_the_pivot(smoke_flow, tiny_model, tmp_path):
    import pandas as pd

    from pivotrl.data.states import expand_candidates
    from pivotrl.core.errors import DataError
    from pivotrl.pipeline.demos import read_histories
    from pivotrl.testing import tiny_tokenizer

    _, _, store, overrides = smoke_flow
    cfg = load_config(str(REPO / "configs" / "smoke.yaml"), overrides)
    pivots_key = _key_of(store, "pivots/", "pivots.parquet")
    pm = store.read_manifest(pivots_key)
    pivots = store.read_parquet(pivots_key)
    probes = store.read_parquet(_key_of(store, "probes/", "probes.parquet"))
    # 1. A "pivot" whose probes all had one outcome.
    one = probes[(probes["status"] == "ok") & (probes["var"] == 0)].iloc[0]["state_id"]
    cand_key = _key_of(store, "demos/", "candidates.parquet")
    cand = store.read_parquet(cand_key)
    row = expand_candidates(cand[cand["state_id"] == one], read_histories(store, cand_key.rsplit("/", 1)[0]))
    bad = pd.concat([pivots, row.assign(mu=1.0, var=0.0)[pivots.columns]], ignore_index=True)
    store.write_artifact("bad/one-outcome/pivots.parquet", bad, kind="pivots", inputs={k: v["uri"] for k, v in pm.inputs.items()},
                         config=pm.config, extra=pm.extra)
    with pytest.raises(DataError, match=re.escape(repr(one)) + ".*fewer than two distinct probe rewards") as e:
        _export(store, cfg, tiny_model, tmp_path / "x.jsonl", "bad/one-outcome/pivots.parquet")
    assert not (tmp_path / "x.jsonl").exists()  # nothing half written
    # 2. An action that is not the demonstration's (as if sampled from the policy).
    first = pivots.iloc[0]["state_id"]
    act = json.loads(pivots.iloc[0]["demo_action"])
    tampered = pivots.copy()
    tampered.loc[0, "demo_action"] = json.dumps({**act, "content": act.get("content", "") + " (sampled)",
                                                 "tool_calls": act.get("tool_calls", [])})
    store.write_artifact("bad/sampled/pivots.parquet", tampered, kind="pivots", inputs={k: v["uri"] for k, v in pm.inputs.items()},
                         config=pm.config, extra=pm.extra)
    with pytest.raises(DataError, match=re.escape(repr(first)) + ".*not the demonstration's own action"):
        _export(store, cfg, tiny_model, tmp_path / "x.jsonl", "bad/sampled/pivots.parquet")
    # 3. Another online verifier than at profiling.
    other = load_config(str(REPO / "configs" / "smoke.yaml"), [*overrides, "verifier.timeout_s=3.5"])
    with pytest.raises(DataError, match=re.escape(repr(first)) + ".*online verifier"):
        _export(store, other, tiny_model, tmp_path / "x.jsonl")
    # 4. Another chat template than at capture.
    from pivotrl.interop.export import export_pivots

    tok = tiny_tokenizer()
    tok.chat_template = tok.chat_template.replace("<|im_start|>", "<|im_start|> ")
    with pytest.raises(DataError, match=re.escape(repr(first)) + ".*chat template"):
        export_pivots(store, pivots_key, cfg, tok, str(tmp_path / "x.jsonl"), allow_stop_decisions=True)
    assert not (tmp_path / "x.jsonl").exists()


@pytest.mark.integration
def test_export_refuses_stop_decisions_unless_asked(smoke_flow, tiny_model, tmp_path):
    from pivotrl.data.states import frame_to_states
    from pivotrl.core.errors import DataError

    _, _, store, overrides = smoke_flow
    cfg = load_config(str(REPO / "configs" / "smoke.yaml"), overrides)
    pivots_key = _key_of(store, "pivots/", "pivots.parquet")
    stops = [p.state_id for p in frame_to_states(store.read_parquet(pivots_key))
             if p.verifier_context.get("candidate_kind") == "stop"]
    assert stops  # the smoke config keeps stop decisions (quality.include_stop_decisions)
    with pytest.raises(DataError, match=re.escape(repr(stops[0])) + r".*stop decisions.*--allow-stop-decisions"):
        _export(store, cfg, tiny_model, tmp_path / "x.jsonl", allow_stop_decisions=False)
    assert not (tmp_path / "x.jsonl").exists()
    cli = subprocess.run([sys.executable, "-m", "pivotrl.flows.cli", "pivots", "export", store.url(pivots_key),
                          "--out", str(tmp_path / "cli.jsonl"), "--config", str(REPO / "configs" / "smoke.yaml"),
                          *[a for o in overrides for a in ("--set", o)]], capture_output=True, text=True)
    assert cli.returncode == 2 and "stop decisions" in cli.stderr and not (tmp_path / "cli.jsonl").exists()
    assert _export(store, cfg, tiny_model, tmp_path / "x.jsonl")["rows"] >= len(stops)


@pytest.mark.integration
def test_export_refuses_a_table_edited_after_it_was_written(smoke_flow, tiny_model, tmp_path):
    from pivotrl.core.errors import DataError

    _, _, store, overrides = smoke_flow
    cfg = load_config(str(REPO / "configs" / "smoke.yaml"), overrides)
    pivots_key = _key_of(store, "pivots/", "pivots.parquet")
    probes_key = _key_of(store, "probes/", "probes.parquet")
    pm = store.read_manifest(pivots_key)
    root = Path(cfg.run.storage_root)
    # 1. The pivot set itself, one row dropped by hand (its manifest still says the original).
    pivots = store.read_parquet(pivots_key)
    store.write_artifact("edited/pivots/pivots.parquet", pivots, kind="pivots",
                         inputs={k: v["uri"] for k, v in pm.inputs.items()}, config=pm.config, extra=pm.extra)
    pivots.iloc[1:].to_parquet(root / "edited/pivots/pivots.parquet")
    with pytest.raises(DataError) as e:
        _export(store, cfg, tiny_model, tmp_path / "x.jsonl", "edited/pivots/pivots.parquet")
    msg = str(e.value)
    assert "\n" not in msg and msg.startswith(store.url("edited/pivots/pivots.parquet") + ": the pivot set's content")
    assert "changed after it was written" in msg
    # 2. The probe table it was selected from, a reward changed by hand.
    probes = store.read_parquet(probes_key)
    pk = store.write_artifact("edited/probes/probes.parquet", probes, kind="probes",
                              inputs={}, extra=store.read_manifest(probes_key).extra)
    inputs = {**{k: v["uri"] for k, v in pm.inputs.items()}, "probes": pk.uri}
    store.write_artifact("edited/set/pivots.parquet", store.read_parquet(pivots_key), kind="pivots", inputs=inputs,
                         config=pm.config, extra=pm.extra)
    _export(store, cfg, tiny_model, tmp_path / "ok.jsonl", "edited/set/pivots.parquet")  # intact: exported
    probes.loc[0, "mu"] = 0.125
    probes.to_parquet(root / "edited/probes/probes.parquet")
    with pytest.raises(DataError, match=r"^.*edited/probes/probes.parquet: the probe table's content .* changed after"):
        _export(store, cfg, tiny_model, tmp_path / "x.jsonl", "edited/set/pivots.parquet")
    assert not (tmp_path / "x.jsonl").exists()


# ------------------------------------------------------------------------------ unit level (fast)
def _state():
    from pivotrl.data.schema import Message, ToolCall, ToolSpec, Trajectory
    from pivotrl.data.states import extract_turn_states

    tools = (ToolSpec("cd", "Change directory.", {"type": "object", "properties": {"folder": {"type": "string"}}}),
             ToolSpec("ls", "List files.", {"type": "object", "properties": {"a": {"type": "boolean"}}}))
    msgs = (Message("system", "Be brief."), Message("user", "Go to docs and list."),
            Message("assistant", "", (ToolCall("cd", {"folder": "docs"}, "c1"),)),
            Message("tool", "ok", tool_call_id="c1", name="cd"),
            Message("assistant", "Listing now.", (ToolCall("ls", {"a": True}, "c2"), ToolCall("ls", {}, "c3"))),
            Message("tool", "a.txt", tool_call_id="c2", name="ls"), Message("tool", "a.txt", tool_call_id="c3", name="ls"),
            Message("user", "Thanks, now the parent."), Message("assistant", "", (ToolCall("cd", {"folder": ".."}, "c4"),)))
    traj = Trajectory("t1", msgs, tools, source="x", category="multi_turn_base",
                      env={"kind": "bfcl", "initial_config": {}, "involved_classes": ["GorillaFileSystem"]})
    return extract_turn_states(traj)[-1], traj


def test_nemo_row_round_trips_a_multi_turn_state():
    from pivotrl.data.schema import Trajectory
    from pivotrl.data.states import extract_turn_states
    from pivotrl.data.nemo import pivot_row, row_to_record

    state, traj = _state()
    row = json.loads(json.dumps(pivot_row(state, {"rewards": [0.0, 1.0]}, env=traj.env, meta=traj.meta)))
    items = row["responses_create_params"]["input"]
    assert [i.get("type", i.get("role")) for i in items] == [
        "system", "user", "function_call", "function_call_output", "assistant", "function_call", "function_call",
        "function_call_output", "function_call_output", "user"]
    assert row["expected_action"] == {"type": "function_call", "name": "cd", "arguments": '{"folder": ".."}'}
    assert (row["pivot_id"], row["trajectory_id"], row["decision_index"]) == ("t1#2", "t1", 2)
    back = extract_turn_states(Trajectory.from_dict(row_to_record(row)))[-1]
    assert back.messages == state.messages and back.tools == state.tools
    assert back.demo_action.tool_calls[0].name == "cd" and back.demo_action.tool_calls[0].arguments == {"folder": ".."}
    assert back.verifier_context["prior_calls"] == state.verifier_context["prior_calls"]
    assert back.verifier_context["env"] == state.verifier_context["env"]


def test_bad_nemo_rows_name_the_field():
    from pivotrl.core.errors import DataError
    from pivotrl.data.nemo import row_to_record

    with pytest.raises(DataError, match=r"line 3.expected_action.type: 'tool'"):
        row_to_record({"responses_create_params": {"input": "hi"}, "expected_action": {"type": "tool"},
                       "pivot_id": "p"}, "line 3")
    with pytest.raises(DataError, match=r"input\[0\].arguments: not valid JSON"):
        row_to_record({"responses_create_params": {"input": [{"type": "function_call", "name": "f", "arguments": "{"}]},
                       "expected_action": {"type": "message", "content": "x"}, "pivot_id": "p"})


def test_train_records_hold_group_advantages_and_whole_turn_ratios():
    import math

    import torch

    from pivotrl.objective.advantages import compute_advantages
    from pivotrl.rollout.base import Generation
    from pivotrl.provenance.rollouts import render_rollouts, train_records
    from pivotrl.verifiers.base import VerifierResult

    gens = [Generation([5, 6], "[ls()]", [-0.5, -0.25], "stop"), Generation([7], "hello", [-1.0], "stop"),
            Generation([5, 6, 2], "[cd(folder='x')]", [-0.1, -0.2, -0.3], "stop")]
    res = [VerifierResult.accept(), VerifierResult(0.0, False, "wrong_tool"), VerifierResult.accept()]
    new = [[[-0.4, -0.25], [-1.5], [-0.1, -0.2, -0.1]]]
    df = train_records(3, [("s#1", gens, res)], estimator="grpo", delta=1e-6, new_logprobs=new)
    expected = compute_advantages(torch.tensor([1.0, 0.0, 1.0], dtype=torch.float64), "grpo", 1e-6).tolist()
    assert list(df["advantage"]) == pytest.approx(expected)
    assert list(df["ratio"]) == pytest.approx([math.exp(0.1), math.exp(-0.5), math.exp(0.2)])
    assert list(df["action_tokens"]) == [2, 1, 3] and list(df["reason"]) == ["match", "wrong_tool", "match"]
    assert set(df["policy_step"]) == {2} and set(df["step"]) == {3}
    lines = render_rollouts(df)
    assert len(lines) == 5 and "wrong_tool" in lines[3] and "+" in lines[2]


def test_pivot_changes_rank_pivots_by_reward_change_and_the_report_names_them():
    import pandas as pd

    from pivotrl.provenance.rollouts import ROLLOUT_COLUMNS, changes_markdown, pivot_changes

    def rows(stage, policy, step, sid, rewards):
        return [{"stage": stage, "policy": policy, "policy_step": step, "step": step, "state_id": sid, "sample_index": k,
                 "action_text": "x", "action_tokens": 1, "reward": r, "reason": "match" if r else "wrong_tool",
                 "advantage": float("nan"), "ratio": float("nan")} for k, r in enumerate(rewards)]

    recs = (rows("probe", "reference", 0, "a#0", [0, 1]) + rows("train", "policy", 1, "a#0", [1, 1])
            + rows("evaluate", "reference", 0, "a#0", [0]) + rows("evaluate", "pivotrl", 2, "a#0", [1])
            + rows("probe", "reference", 0, "b#1", [1, 0]) + rows("evaluate", "reference", 0, "b#1", [1])
            + rows("evaluate", "pivotrl", 2, "b#1", [0])
            + rows("probe", "reference", 0, "c#0", [0, 1, 1, 1]) + rows("train", "policy", 2, "c#0", [0, 0]))
    ch = pivot_changes(pd.DataFrame(recs, columns=ROLLOUT_COLUMNS), ["a#0", "b#1", "c#0"])
    assert list(ch["state_id"]) == ["a#0", "c#0", "b#1"]
    assert list(ch["change"]) == [1.0, -0.75, -1.0]  # c has no evaluation: probes vs its last training group
    assert list(ch["trained_at_steps"]) == ["1", "2", ""]
    md = changes_markdown(ch, "runs/x", n=1)
    assert "| improved | `a#0` | 0.00 | 1.00 | +1.00 |" in md
    assert "| worsened | `b#1` | 1.00 | 0.00 | -1.00 |" in md and "pivotrl rollouts runs/x --state" in md
    flat = ch.assign(final=ch["reference"], change=0.0)  # no pivot moved: none is called improved
    assert "improved" not in changes_markdown(flat, "runs/x", n=1) and "| unchanged | `a#0` |" in changes_markdown(flat, "runs/x", n=1)


def test_pivot_changes_prefer_the_m_sample_reprobe_over_one_greedy_action():
    """With the evaluation's re-probe recorded, before/after are m samples each (probes vs re-probe),
    not the single greedy action of each policy."""
    import pandas as pd

    from pivotrl.provenance.rollouts import ROLLOUT_COLUMNS, changes_markdown, pivot_changes, probe_records

    def rows(stage, policy, step, sid, rewards):
        return [{"stage": stage, "policy": policy, "policy_step": step, "step": step, "state_id": sid, "sample_index": k,
                 "action_text": "x", "action_tokens": 1, "reward": r, "reason": "match" if r else "wrong_tool",
                 "advantage": float("nan"), "ratio": float("nan")} for k, r in enumerate(rewards)]

    reprobe = pd.DataFrame([{"state_id": "a#0", "status": "ok", "samples": '["x","y","z","w"]',
                             "rewards": "[1, 1, 1, 0]", "reasons": '["match","match","match","wrong_tool"]',
                             "sample_tokens": "[1, 1, 1, 1]"}])
    rep = probe_records(reprobe, stage="reprobe", policy="pivotrl", step=3)
    assert set(rep["stage"]) == {"reprobe"} and set(rep["policy_step"]) == {3} and len(rep) == 4
    recs = pd.concat([pd.DataFrame(rows("probe", "reference", 0, "a#0", [0, 1, 0, 0])
                                   + rows("evaluate", "reference", 0, "a#0", [1]) + rows("evaluate", "pivotrl", 3, "a#0", [0]),
                                   columns=ROLLOUT_COLUMNS), rep], ignore_index=True)
    (row,) = pivot_changes(recs, ["a#0"]).itertuples(index=False)
    assert (row.reference, row.final, row.n_reference, row.n_final) == (0.25, 0.75, 4, 4)
    assert row.basis == "probes vs re-probe"
    md = changes_markdown(pivot_changes(recs, ["a#0"]), "runs/x")
    assert "| improved | `a#0` | 0.25 | 0.75 | +0.50 | 4/4 |" in md and "re-probed" in md
