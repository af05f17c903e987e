"""Helpers shared by the pipeline stages: the run's artifact store, local paths of checkpoints,
checkpoint integrity, engines and verifiers (with the run's retry policy and fault injection)."""

from __future__ import annotations

import json
import logging
import os
import struct
from pathlib import Path
from typing import Any, Mapping

from pivotrl.config import RunConfig
from pivotrl.core.errors import ModelError
from pivotrl.runtime.faults import FaultInjector, fault_seed
from pivotrl.storage import ArtifactStore, RetryPolicy
from pivotrl.training.checkpoints import is_local, local_checkpoint, local_path  # noqa: F401 (re-export)

log = logging.getLogger("pivotrl.pipeline")

class RunArtifactStore(ArtifactStore):
    """The :class:`ArtifactStore` of a stage: every manifest it writes carries :attr:`manifest_extra`.

    It adds no retry: a storage failure is retried by the store alone (transient remote failures
    and injected faults, under its RetryPolicy; see :mod:`pivotrl.storage.store`), and nothing above
    it — the stage, its Prefect task — retries a storage error again.
    """

    def __init__(self, root_url: str, storage_options: Mapping[str, Any] | None = None, *,
                 failure_rate: float = 0.0, seed: int | None = None, retry: RetryPolicy | None = None) -> None:
        super().__init__(root_url, storage_options, failure_rate=failure_rate, seed=seed, retry=retry)
        #: Facts merged into the ``extra`` of every manifest this store writes (e.g. the resolved
        #: precision of the stage process: see pivotrl.pipeline.entry.run_stage).
        self.manifest_extra: dict[str, Any] = {}

    def write_artifact(self, key: str, payload: Any, *, extra: Mapping[str, Any] | None = None, **kw: Any) -> Any:
        """:meth:`ArtifactStore.write_artifact` with :attr:`manifest_extra` merged under ``extra``."""
        merged = {**self.manifest_extra, **(extra or {})} if self.manifest_extra else extra
        return super().write_artifact(key, payload, extra=merged, **kw)


def make_store(cfg: RunConfig, *, attempt: int = 0) -> RunArtifactStore:
    """The artifact store of a run: ``run.storage_root`` + ``run.storage_options``, failing writes
    with probability ``faults.storage_failure_rate`` (seeded by ``run.seed`` and ``attempt``, the
    retry number of the calling stage, so a re-run stage does not fail at the same writes); each
    operation retried by the store's own :class:`~pivotrl.core.retry.RetryPolicy`."""
    return RunArtifactStore(
        cfg.run.storage_root, cfg.run.storage_options or None, failure_rate=cfg.faults.storage_failure_rate,
        seed=fault_seed(cfg.run.seed, "storage", attempt),
    )


def verify_checkpoint(directory: str | os.PathLike[str]) -> Path:
    """Check that every ``*.safetensors`` file of a checkpoint directory is complete.

    A safetensors file is an 8-byte little-endian header length N, an N-byte JSON header giving
    each tensor's ``data_offsets`` [begin, end) into the data section, then the data section; a
    complete file is exactly ``8 + N + max(end)`` bytes long. Returns the directory.

    Raises:
        ModelError: naming the file, when the directory has no ``config.json`` or no weights, or a
            weights file is truncated, has a malformed header or trailing bytes.
    """
    root = Path(directory)
    if not (root / "config.json").is_file():
        raise ModelError(f"checkpoint {root} has no config.json")
    files = sorted(root.glob("*.safetensors"))
    if not files:
        raise ModelError(f"checkpoint {root} has no *.safetensors file")
    for f in files:
        size = f.stat().st_size
        with open(f, "rb") as fh:
            head = fh.read(8)
            if len(head) < 8:
                raise ModelError(f"{f}: truncated safetensors file ({size} bytes, no header)")
            (n,) = struct.unpack("<Q", head)
            if n > size - 8:
                raise ModelError(f"{f}: truncated safetensors file (header of {n} bytes, file of {size})")
            try:
                header = json.loads(fh.read(n).decode("utf-8"))
                end = max((int(v["data_offsets"][1]) for k, v in header.items() if k != "__metadata__"), default=0)
            except (ValueError, KeyError, TypeError, IndexError, AttributeError) as e:
                raise ModelError(f"{f}: malformed safetensors header ({type(e).__name__}: {e})") from None
        expected = 8 + n + end
        if size != expected:
            what = "truncated" if size < expected else "has trailing bytes"
            raise ModelError(f"{f}: {what}: safetensors file of {size} bytes, its header needs {expected}")
    return root


def close_quietly(obj: Any) -> None:
    """Call ``obj.close()`` if it has one (verifiers with sandboxes, engines)."""
    close = getattr(obj, "close", None)
    if callable(close):
        close()


def sampling_for(cfg: RunConfig, *, n: int, temperature: float, seed: int | None,
                 top_p: float = 1.0, top_k: int = 0) -> Any:
    from pivotrl.rollout import SamplingConfig

    return SamplingConfig(n=n, temperature=temperature, top_p=top_p, top_k=top_k,
                          max_tokens=cfg.rollout.max_tokens, seed=seed)


def rollout_engine_settings(cfg: RunConfig, engine: str | None = None) -> tuple[str, dict[str, Any]]:
    """``(engine name, constructor keywords)`` of the configured rollout engine: everything
    :func:`make_rollout_engine` gives the engine but the model and the caller's ``extra``. The
    dtype is resolved (``model.dtype: auto`` → what this CPU or GPU runs). A warm engine's identity
    (:func:`pivotrl.pipeline.warm_engine.shard_engine`) is this and the model directory."""
    from pivotrl.runtime.precision import with_resolved_dtype

    name = engine or cfg.rollout.engine
    kwargs: dict[str, Any] = {"dtype": with_resolved_dtype(cfg).model.dtype, "max_model_len": cfg.model.max_context}
    if name == "vllm":
        kwargs.update(kv_cache_gib=cfg.rollout.kv_cache_gib,
                      enable_prefix_caching=cfg.rollout.enable_prefix_caching, seed=cfg.run.seed,
                      cpu_threads=cfg.rollout.num_threads, block_size=cfg.rollout.block_size)
        if cfg.rollout.tensor_parallel_size > 1:
            kwargs["tensor_parallel_size"] = cfg.rollout.tensor_parallel_size
        if cfg.rollout.gpu_memory_utilization is not None:
            kwargs["gpu_memory_utilization"] = cfg.rollout.gpu_memory_utilization
    return name, kwargs


def make_rollout_engine(cfg: RunConfig, model_dir: Path | str, *, engine: str | None = None, **extra: Any) -> Any:
    """The configured rollout engine on ``model_dir`` (vLLM by default, transformers fallback), built
    with :func:`rollout_engine_settings`; ``extra`` keywords go to the engine's constructor (e.g.
    ``cpu_ids`` of one of several vLLM engines)."""
    from pivotrl.rollout import make_engine

    if Path(model_dir).is_dir():
        verify_checkpoint(model_dir)
    name, kwargs = rollout_engine_settings(cfg, engine)
    return make_engine(name, str(model_dir), **kwargs, **extra)


def prompt_kwargs(cfg: RunConfig) -> dict[str, Any]:
    return {"tool_style": cfg.prompt.tool_style, "max_tool_output_chars": cfg.prompt.max_tool_output_chars,
            "format": cfg.prompt.format, "tool_parser": cfg.prompt.tool_parser}


def resolve_base_model(cfg: RunConfig, cache: Path) -> Path:
    """The base policy's checkpoint directory: ``model.source`` resolved (downloaded, converted),
    carrying ``prompt.chat_template`` when one is configured (``pivotrl.format.chat_format.attach_chat_template``),
    with the tool parser's tags spelled as text when their output rows are untrained
    (``prompt.untrained_tool_tags``, :func:`pivotrl.format.tool_tags.fix_untrained_tags`)."""
    from pivotrl.runtime.models import resolve_model

    base_dir = Path(resolve_model(cfg.model.source, cache))
    if base_dir.is_dir():
        base_dir = base_dir.absolute()  # recorded for later stages, which may run in another directory
        verify_checkpoint(base_dir)  # a truncated checkpoint fails here, naming the file
    if cfg.prompt.chat_template:
        from pivotrl.format.chat_format import attach_chat_template

        base_dir = attach_chat_template(base_dir, cfg.prompt.chat_template, cache)
    if base_dir.is_dir() and cfg.prompt.tool_parser in ("auto", "hermes"):  # tags whose rows are untrained
        from pivotrl.runtime.models import load_tokenizer
        from pivotrl.format.tool_tags import fix_untrained_tags

        parser = prompt_format(cfg, load_tokenizer(base_dir)).tool_parser
        base_dir = fix_untrained_tags(base_dir, parser, cfg.prompt.untrained_tool_tags, cache)
    return base_dir


def prompt_format(cfg: RunConfig, tokenizer: Any) -> Any:
    """The run's resolved prompt format for ``tokenizer`` (``pivotrl.format.chat_format.ResolvedFormat``)."""
    from pivotrl.format.chat_format import resolve_format

    return resolve_format(tokenizer, cfg.prompt.format, cfg.prompt.tool_parser)


def make_verifier(cfg: RunConfig, bfcl_root: Path | str, tokenizer: Any, *, backoff_s: float | None = None,
                  pool: Any = None, fail_tools: bool = False) -> Any:
    """The one verifier of a stage (probing, training, evaluation, every shard of them): the
    configured verifier (``verifier.name``) reading sampled actions with the run's tool-call parser
    (``prompt.tool_parser`` resolved for ``tokenizer``), with the run's time limit
    (``verifier.timeout_s``), retry policy (``verifier.retries``; ``backoff_s`` overrides the
    verifier's default first wait) and tool-fault injection (``faults.tool_failure_rate``/
    ``tool_latency_s``, seeded by ``run.seed``).

    ``tokenizer``: the policy's tokenizer; required, because a verifier without it would read every
    hermes or JSON tool call as text (the pythonic parser). ``pool``: a SandboxPool to execute in
    (its own faults apply); default: the verifier starts one. ``fail_tools``: every tool execution
    fails (the ``faults.tool_failure_trajectories`` drill; a real worker death per request).
    Its ``stats`` (RetryStats) count sandbox requests, retries and final failures.
    """
    from pivotrl.verifiers import get_verifier

    opts: dict[str, Any] = {"timeout_s": cfg.verifier.timeout_s, "retries": cfg.verifier.retries,
                            "bfcl_root": str(bfcl_root), "tool_parser": prompt_format(cfg, tokenizer).tool_parser}
    faults = (FaultInjector(1.0, 0.0, fault_seed(cfg.run.seed, "tools-drill")) if fail_tools
              else FaultInjector.from_config(cfg))
    if faults is not None:
        opts["faults"] = faults
    if fail_tools and backoff_s is None:
        backoff_s = 0.05
    if backoff_s is not None:
        opts["backoff_s"] = backoff_s
    if pool is not None:
        opts["pool"] = pool
    return get_verifier(cfg.verifier.name, **opts)


def set_threads(n: int) -> None:
    os.environ["OMP_NUM_THREADS"] = str(n)
    try:
        import torch

        torch.set_num_threads(n)
    except Exception:  # pragma: no cover - torch always present in practice
        pass
