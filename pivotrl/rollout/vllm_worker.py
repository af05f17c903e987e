"""Functions a :class:`~pivotrl.rollout.vllm.VLLMEngine` runs inside its vLLM workers to refresh the weights.

They travel pickled through ``LLM.collective_rpc`` / ``LLM.apply_model`` (the engine sets
``VLLM_ALLOW_INSECURE_SERIALIZATION``), so they are plain module-level functions:
:func:`reload_shared` feeds vLLM's in-place ``reload_weights`` with zero-copy views of a
shared-memory block (:mod:`pivotrl.rollout.weight_sync`); :func:`refresh_tied_head` re-ties the
output layer to the reloaded input embedding.
"""

from __future__ import annotations

from typing import Any, Sequence

__all__ = ["refresh_tied_head", "reload_shared"]


def reload_shared(worker: Any, block: str, meta: Sequence[Any]) -> None:
    """Inside a vLLM worker: ``reload_weights`` fed with the tensors of a shared-memory block."""
    from pivotrl.rollout.weight_sync import read_shared

    read_shared(block, meta, lambda tensors: worker.reload_weights(weights_iterator=tensors))


def refresh_tied_head(model: Any) -> bool:
    """Make the output layer use the (reloaded) input embedding again; runs inside a vLLM worker.

    Re-points ``lm_head.weight`` at the embedding if the tie was broken and re-runs the head's
    post-load processing (on CPU this rebuilds the packed GEMM copy of the weight, which an
    in-place reload does not touch when the checkpoint has no ``lm_head.weight``).
    Returns True if a head was refreshed.
    """
    head = getattr(model, "lm_head", None)
    embed = model.get_input_embeddings() if hasattr(model, "get_input_embeddings") else None
    if embed is None:
        embed = getattr(getattr(model, "model", None), "embed_tokens", None)
    if head is None or embed is None:
        return False
    if head.weight is not embed.weight:
        head.weight = embed.weight
    method = getattr(head, "quant_method", None)
    if method is not None and hasattr(method, "process_weights_after_loading"):
        method.process_weights_after_loading(head)
    return True
