"""Helpers shared by the pipeline stages: local paths of checkpoints, tokenizers, engines."""

from __future__ import annotations

import os
import shutil
from pathlib import Path
from typing import Any

from pivotrl.config import RunConfig
from pivotrl.storage import ArtifactStore


def is_local(store: ArtifactStore) -> bool:
    root = str(store.root_url)
    return root.startswith(("/", "file://")) or "://" not in root


def local_path(store: ArtifactStore, key: str) -> Path:
    url = str(store.url(key))
    return Path(url[len("file://"):] if url.startswith("file://") else url)


def local_checkpoint(store: ArtifactStore, key: str, cache: Path) -> Path:
    """A local directory holding the checkpoint published at ``key`` (downloaded if remote)."""
    if is_local(store):
        p = local_path(store, key)
        if (p / "_COMPLETE").exists():
            return p
    target = cache / "checkpoints" / key.replace("/", "_")
    if not (target / "_COMPLETE").exists():
        if target.exists():
            shutil.rmtree(target)
        store.get_dir(key, str(target))
        (target / "_COMPLETE").touch()
    return target


def sampling_for(cfg: RunConfig, *, n: int, temperature: float, seed: int | None,
                 top_p: float = 1.0, top_k: int = 0) -> Any:
    from pivotrl.rollout import SamplingConfig

    return SamplingConfig(n=n, temperature=temperature, top_p=top_p, top_k=top_k,
                          max_tokens=cfg.rollout.max_tokens, seed=seed)


def make_rollout_engine(cfg: RunConfig, model_dir: Path | str, *, engine: str | None = None) -> Any:
    """The configured rollout engine on ``model_dir`` (vLLM by default, transformers fallback)."""
    from pivotrl.rollout import make_engine

    name = engine or cfg.rollout.engine
    kwargs: dict[str, Any] = {"dtype": cfg.model.dtype, "max_model_len": cfg.model.max_context}
    if name == "vllm":
        kwargs.update(kv_cache_gib=cfg.rollout.kv_cache_gib,
                      enable_prefix_caching=cfg.rollout.enable_prefix_caching, seed=cfg.run.seed)
    return make_engine(name, str(model_dir), **kwargs)


def prompt_kwargs(cfg: RunConfig) -> dict[str, Any]:
    return {"tool_style": cfg.prompt.tool_style, "max_tool_output_chars": cfg.prompt.max_tool_output_chars}


def make_verifier(cfg: RunConfig, bfcl_root: Path) -> Any:
    from pivotrl.verifiers import get_verifier

    return get_verifier("auto" if cfg.verifier.name == "auto" else cfg.verifier.name,
                        timeout_s=cfg.verifier.timeout_s, retries=cfg.verifier.retries, bfcl_root=str(bfcl_root))


def set_threads(n: int) -> None:
    os.environ["OMP_NUM_THREADS"] = str(n)
    try:
        import torch

        torch.set_num_threads(n)
    except Exception:  # pragma: no cover - torch always present in practice
        pass
