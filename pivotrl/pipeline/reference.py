"""The reference stage: resolve the base model and, if enabled, the supervised warm start (π_ref).

``stage_reference(cfg, store, demos) -> ReferenceResult``; :func:`reference_dir` gives π_ref's
local directory to the later stages, :func:`prompt_identity` what their keys need of the prompt.
"""

from __future__ import annotations

import json
import logging
import tempfile
from pathlib import Path
from typing import Any, Mapping

from pivotrl.provenance.code_digest import stage_code_digest
from pivotrl.config import RunConfig
from pivotrl.core.hashing import content_hash
from pivotrl.core.errors import StateTooLongError
from pivotrl.pipeline.common import local_checkpoint, prompt_format, prompt_kwargs, resolve_base_model
from pivotrl.pipeline.demos import cache_dir, read_trajectories
from pivotrl.pipeline.results import ReferenceResult
from pivotrl.runtime.precision import with_resolved_dtype
from pivotrl.storage import ArtifactStore
from pivotrl.training.settings import TRAINER_DTYPE  # config dtype names → the trainer's names

log = logging.getLogger("pivotrl.pipeline")



def _record_key(cfg: RunConfig, demos: Mapping[str, Any] | None) -> str:
    return f"{reference_inputs_key(cfg, demos)}/reference.json"


def cached_reference(cfg: RunConfig, store: ArtifactStore, demos: Mapping[str, Any] | None) -> ReferenceResult | None:
    """The result of :func:`stage_reference` if it was resolved before under the stage's content
    key (:func:`reference_inputs_key`): its record ``reference/<key>/reference.json`` exists, the
    base model's local directory it names is still there and the warm-started checkpoint it names
    (if any) is complete in the store. Else None. Loads no model."""
    cfg = with_resolved_dtype(cfg)
    record = _record_key(cfg, demos)
    if not store.exists(record):
        return None
    ref = ReferenceResult.of(store.read_json(record))
    if Path(ref.base_dir).is_absolute() and not Path(ref.base_dir).is_dir():
        return None  # the local cache was cleared: resolve the base model again (a hub id is kept)
    if ref.ref_key is not None and not (store.exists(f"{ref.ref_key}/_COMPLETE")
                                        and store.exists(f"{ref.ref_key}.sft.json")):
        return None
    return ref


def stage_reference(cfg: RunConfig, store: ArtifactStore, demos: Mapping[str, Any]) -> ReferenceResult:
    """Resolve the base model and, if enabled, fine-tune it on the warm-start split (π_ref).

    ``demos``: the demonstrations stage's result (``key``, ``trajectories``). The warm start never
    sees the pivot-candidate split it will be probed on. The result is recorded under the stage's
    content key (:func:`cached_reference` reads it back).
    """
    cfg = with_resolved_dtype(cfg)  # model.dtype: auto → bf16 | fp32 on this hardware
    hit = cached_reference(cfg, store, demos)
    if hit is not None:
        return hit
    ref = _resolve_reference(cfg, store, demos)
    store.write_json(_record_key(cfg, demos), ref.to_dict())
    return ref


def _resolve_reference(cfg: RunConfig, store: ArtifactStore, demos: Mapping[str, Any]) -> ReferenceResult:
    from pivotrl.runtime.models import checkpoint_hash, load_tokenizer
    from pivotrl.format.prompts import build_sft_examples

    cache = cache_dir(cfg)
    base_dir = resolve_base_model(cfg, cache)
    base_hash = checkpoint_hash(base_dir)
    tok = load_tokenizer(base_dir)
    fmt = prompt_format(cfg, tok).to_dict()  # checked once here: format, parser, template hash, stability
    from pivotrl.format.tool_tags import tool_tags_record

    if tool_tags_record(base_dir):  # tags spelled as text (untrained rows): in the manifests and the keys
        fmt["tool_tags"] = tool_tags_record(base_dir)
    log.info("prompt format %s, tool parser %s, chat template %s (%s)", fmt["format"], fmt["tool_parser"],
             fmt["template_hash"], "prefix-stable" if fmt["prefix_stable"] else
             "not prefix-stable: per-turn examples")
    if not cfg.warm_start.enabled:
        return ReferenceResult(str(base_dir), base_hash, None, base_hash, None, fmt)
    ws = cfg.warm_start.model_dump(mode="json")
    key = "models/warm_start/" + content_hash(
        {"base": base_hash, "demos": demos["key"], "warm_start": ws, "prompt": cfg.prompt.model_dump(mode="json"),
         "template": fmt["template_hash"], "dtype": cfg.model.dtype, "seed": cfg.run.seed,
         "code": stage_code_digest("reference")})[:16]
    if store.exists(f"{key}/_COMPLETE") and store.exists(f"{key}.sft.json"):
        sft = store.read_json(f"{key}.sft.json")
        return ReferenceResult(str(base_dir), base_hash, key, sft["checkpoint_hash"], sft, fmt)

    from pivotrl.runtime.mfu import calibrated_peak_gflops
    from pivotrl.training.sft import run_sft

    trajs = read_trajectories(store, demos["key"], split="warm_start")
    examples, too_long, per_turn = [], 0, 0
    for t in trajs:
        try:
            got, split = build_sft_examples(t, tok, max_len=cfg.warm_start.max_len, **prompt_kwargs(cfg))
        except StateTooLongError:
            too_long += 1
            continue
        examples.extend(got)
        per_turn += int(split)
    if per_turn:
        log.warning("warm start: %d of %d trajectories trained as per-turn examples (the chat template re-renders "
                    "earlier turns)", per_turn, len(trajs))
    with tempfile.TemporaryDirectory(dir=cache) as tmp:
        ckpt = Path(tmp) / "ckpt"
        metrics = run_sft(
            str(base_dir), examples, str(ckpt), epochs=cfg.warm_start.epochs, lr=cfg.warm_start.lr,
            batch_size=cfg.warm_start.batch_size, dtype=TRAINER_DTYPE[cfg.model.dtype],
            zero_stage=cfg.training.deepspeed.zero_stage, seed=cfg.run.seed,
            peak_gflops_per_thread=calibrated_peak_gflops(cfg.model.dtype, str(cfg.run.local_cache())),
            retain_host_memory=cfg.training.retain_host_memory,
        )
        ref_hash = checkpoint_hash(ckpt)
        store.put_dir(str(ckpt), key)
    metrics = {k: v for k, v in _jsonable(metrics).items() if k != "out_dir"}  # a deleted temp dir
    sft = {"examples": len(examples), "skipped_too_long": too_long, "per_turn_trajectories": per_turn,
           "prompt_format": fmt, "checkpoint_hash": ref_hash, "metrics": metrics}
    store.write_artifact(f"{key}.sft.json", sft, kind="reference_checkpoint",
                         inputs={"trajectories": demos["trajectories"], "base_model": f"{cfg.model.source}#{base_hash}"},
                         config={"warm_start": ws, "model": cfg.model.model_dump(mode="json")},
                         extra={"seed": cfg.run.seed, "checkpoint": store.url(key), "checkpoint_hash": ref_hash,
                                "template_hash": fmt["template_hash"], "prompt_format": fmt})
    return ReferenceResult(str(base_dir), base_hash, key, ref_hash, sft, fmt)


def reference_inputs_key(cfg: RunConfig, demos: Mapping[str, Any] | None) -> str:
    """``reference/<16 hex>``: what decides this stage's result, known without resolving or loading
    the base model — the same sections as the warm start's artifact key (demonstrations key,
    ``warm_start``, ``prompt``, resolved dtype, seed, the reference stage's code) with the base
    model and the chat template identified by their file fingerprints
    (:func:`~pivotrl.provenance.fingerprints.path_fingerprint`) instead of their checkpoint/template hash,
    and the local cache directory (the result names the base model's local directory there).
    ``cfg`` with its dtype resolved. Without a warm start the demonstrations do not count."""
    from pivotrl.provenance.fingerprints import inputs_fingerprint

    files = inputs_fingerprint(cfg)
    ws = cfg.warm_start.model_dump(mode="json") if cfg.warm_start.enabled else {"enabled": False}
    return "reference/" + content_hash(
        {"model": [cfg.model.source, files["model"]], "chat_template": files["chat_template"],
         "cache": str(cache_dir(cfg).resolve()), "warm_start": ws, "prompt": cfg.prompt.model_dump(mode="json"),
         "demos": demos["key"] if cfg.warm_start.enabled and demos else None,
         "dtype": cfg.model.dtype, "seed": cfg.run.seed if cfg.warm_start.enabled else None,
         "code": stage_code_digest("reference")})[:16]


def prompt_identity(cfg: RunConfig, ref: ReferenceResult | Mapping[str, Any]) -> dict[str, Any]:
    """What a stage key needs of the prompt: the config section and the chat template's hash."""
    fmt = ReferenceResult.of(ref).prompt_format or {}
    return {**cfg.prompt.model_dump(mode="json"), "template_hash": fmt.get("template_hash"),
            "resolved": [fmt.get("format"), fmt.get("tool_parser")],
            **({"tool_tags": fmt["tool_tags"]["spelled_as_text"]} if fmt.get("tool_tags") else {})}


def reference_dir(cfg: RunConfig, store: ArtifactStore, ref: ReferenceResult | Mapping[str, Any]) -> Path:
    """A local directory holding π_ref (HF format): the base model without warm start, else the
    warm-started checkpoint (downloaded into the run's cache if the store is remote)."""
    ref = ReferenceResult.of(ref)
    if ref.ref_key is None:
        return base_model_dir(cfg, ref)
    return local_checkpoint(store, ref.ref_key, cache_dir(cfg))


def base_model_dir(cfg: RunConfig, ref: ReferenceResult | Mapping[str, Any]) -> Path:
    """The base model's directory on this machine. ``ref.base_dir`` is where the reference stage
    resolved it, on the machine that ran that stage: it is used as is when it lies in this
    machine's cache, or when ``model.source`` names a local directory (a hub id is kept too);
    otherwise (a trainer node or a shard worker with its own cache) ``model.source`` is resolved
    again into this machine's cache, so no node reads another machine's disk.

    Raises ModelError when the model resolved here is not the one the run keyed (its hash differs
    from ``ref.base_hash``)."""
    from pivotrl.core.errors import ModelError
    from pivotrl.runtime.models import checkpoint_hash

    ref = ReferenceResult.of(ref)
    there, cache = Path(ref.base_dir), cache_dir(cfg).expanduser().resolve()
    if not there.is_absolute() or there.resolve().is_relative_to(cache) or Path(cfg.model.source).expanduser().is_dir():
        return there
    here = resolve_base_model(cfg, cache)
    if checkpoint_hash(here) != ref.base_hash:
        raise ModelError(f"model.source {cfg.model.source} resolved on this machine to {here}, whose hash differs "
                         f"from the base model the run was keyed with ({ref.base_hash[:12]}); every node must see the "
                         "same model")
    return here


def _jsonable(x: Any) -> Any:
    return json.loads(json.dumps(x, default=lambda o: o.item() if hasattr(o, "item") else str(o)))
