"""How an exported checkpoint is served: vLLM's OpenAI-compatible server with the run's parser.

A checkpoint trained with ``prompt.format: chat_template`` keeps its tokenizer and chat template
(the HF directory holds ``tokenizer_config.json`` / ``chat_template.jinja``), and its actions were
read with the tool-call parser named by ``prompt.tool_parser`` — the name vLLM's
``--tool-call-parser`` takes. So the model serves unchanged::

    vllm serve <checkpoint> --enable-auto-tool-choice --tool-call-parser hermes

``tests/integration/test_serving.py`` starts this server on 127.0.0.1 with a tiny exported checkpoint and
sends a chat request with tools.
"""

from __future__ import annotations

import sys
from typing import Any

__all__ = ["serve_command"]


def serve_command(
    checkpoint: str,
    *,
    tool_parser: str,
    dtype: str = "bf16",
    tensor_parallel_size: int = 1,
    max_model_len: int | None = None,
    host: str = "127.0.0.1",
    port: int = 8000,
    python: str | None = None,
    extra: list[str] | None = None,
) -> list[str]:
    """The argv that serves ``checkpoint`` with vLLM's OpenAI-compatible server.

    Args:
        checkpoint: HF checkpoint directory (or hub id).
        tool_parser: the run's resolved ``prompt.tool_parser`` (e.g. "hermes").
        dtype: "bf16" or "fp32". tensor_parallel_size: GPUs per server (``rollout.tensor_parallel_size``).
        max_model_len: context limit (``model.max_context``); None = the model's own.
        python: interpreter to run ``-m vllm.entrypoints.openai.api_server`` with (default: this one).

    Returns a list of strings (no shell quoting needed).
    """
    from pivotrl.format.tool_parsers import TOOL_PARSERS

    TOOL_PARSERS.get(tool_parser)
    cmd = [python or sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", str(checkpoint),
           "--host", host, "--port", str(port), "--dtype", {"bf16": "bfloat16", "fp32": "float32"}.get(dtype, dtype),
           "--enable-auto-tool-choice", "--tool-call-parser", tool_parser]
    if tensor_parallel_size > 1:
        cmd += ["--tensor-parallel-size", str(tensor_parallel_size)]
    if max_model_len is not None:
        cmd += ["--max-model-len", str(max_model_len)]
    return cmd + list(extra or [])


def serve_command_for(cfg: Any, checkpoint: str, *, tool_parser: str | None = None, **kwargs: Any) -> list[str]:
    """:func:`serve_command` with the run config's dtype, tensor parallelism, context and parser
    (``tool_parser`` must be given when ``prompt.tool_parser`` is ``auto``: the resolved name)."""
    parser = tool_parser or cfg.prompt.tool_parser
    if parser == "auto":
        from pivotrl.core.errors import ConfigError

        raise ConfigError("prompt.tool_parser = auto: pass the parser the run resolved (its manifests record it)")
    return serve_command(checkpoint, tool_parser=parser, dtype=cfg.model.dtype,
                         tensor_parallel_size=cfg.rollout.tensor_parallel_size,
                         max_model_len=cfg.model.max_context, **kwargs)
