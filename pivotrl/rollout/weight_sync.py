"""Moving the trainer's weights into the rollout engines without a trip through disk.

``rollout.weight_sync`` chooses how π_old is refreshed after every training step:

* ``memory`` (default): the trainer writes its weights (compute dtype, tied duplicates left out:
  the engine re-ties its head) into one block of **shared memory** (:class:`SharedWeights`,
  POSIX shm, allocated once and reused every step); each engine reads them from there —
  the transformers engine copies them into its model, a vLLM engine's worker processes attach to
  the block by name and feed zero-copy views to vLLM's in-place ``reload_weights`` (only the
  block's name and the tensors' names, dtypes, shapes and offsets cross vLLM's RPC channel). No
  safetensors file is written or parsed.
* ``disk``: the fallback; the trainer exports an HF checkpoint (safetensors) and every engine
  reloads from that directory (``load_weights``). Needed when an engine runs on another machine
  than its trainer rank's (each host rank has its own engine on its own node, so ``memory`` also
  works with ``rollout.engine_placement: node``).

Either way the refresh check (``pivotrl.training.refresh_check.check_refresh``) then compares the engine's
log-probs of a fixed action with the trainer's.

**GPUs (design; the broadcast primitives are here and tested on CPU with gloo).** On GPU
machines the field's trainers (OpenRLHF, veRL, NeMo RL) send the weights device to device: trainer
rank 0 and the engines' workers join one extra process group (NCCL; rank 0 = the trainer, ranks
1..W = the engine workers, created with a TCP rendezvous after both sides exist), and after every
step rank 0 broadcasts each tensor (:func:`broadcast_weights`) while every worker receives into
buffers of the announced shapes (:func:`receive_weights`) and hands them to
``model_runner.reload_weights(weights_iterator=...)`` inside a ``collective_rpc`` call, then
re-ties a tied head. The metadata (names, dtypes, shapes) goes first as one broadcast object; the
tensors follow in a fixed order, so no per-tensor negotiation is needed. Under ZeRO-3 the trainer
gathers the partitions (``deepspeed.zero.GatheredParameters``) before rank 0 sends. With tensor
parallel engines each worker receives the full tensor and vLLM's loader shards it. The same code
runs with the gloo backend on CPU processes (``tests/unit/test_weight_sync.py``); on CUDA the
tensors are allocated on the worker's device and the group's backend is ``nccl``.

Pure of the engines: imports torch only.
"""

from __future__ import annotations

import math
import weakref
from multiprocessing import resource_tracker, shared_memory
from typing import Any, Iterable, Iterator, Sequence
from unittest import mock

import torch

__all__ = ["SharedWeights", "WEIGHT_SYNC_MODES", "WeightMeta", "broadcast_weights", "module_weights",
           "read_shared", "receive_weights"]

WEIGHT_SYNC_MODES = ("memory", "disk")

#: (name, dtype name, shape, byte offset) of one tensor in a :class:`SharedWeights` block.
WeightMeta = tuple[str, str, tuple[int, ...], int]

_ALIGN = 64


def _dtype(name: str) -> torch.dtype:
    dt = getattr(torch, name, None)
    if not isinstance(dt, torch.dtype):
        raise ValueError(f"unknown tensor dtype {name!r} in shared weights")
    return dt


def module_weights(module: torch.nn.Module) -> list[tuple[str, torch.Tensor]]:
    """``(HF name, tensor)`` of ``module``'s state dict, detached, without tied duplicates (a tied
    ``lm_head.weight`` is the embedding: the receiver re-ties it)."""
    seen: set[tuple[int, tuple[int, ...], torch.dtype]] = set()
    out: list[tuple[str, torch.Tensor]] = []
    for name, t in module.state_dict(keep_vars=False).items():
        # the same tensor under two names (a tied head); not merely the same storage: DeepSpeed's
        # ZeRO-1/2 keep every parameter as a view into one flat buffer
        key = (t.data_ptr(), tuple(t.shape), t.dtype)
        if t.numel() and key in seen:
            continue
        seen.add(key)
        out.append((name, t.detach()))
    return out


class SharedWeights:
    """One block of POSIX shared memory holding a set of named tensors, rewritten in place.

    :meth:`write` copies ``(name, tensor)`` pairs into the block (allocating it on the first call,
    or again when the total size changes) and returns the metadata a reader needs
    (:func:`read_shared`): the block's ``name`` and one :data:`WeightMeta` per tensor. The writer
    owns the block: :meth:`close` unlinks it (also on garbage collection).
    """

    def __init__(self) -> None:
        self._shm: shared_memory.SharedMemory | None = None
        self.meta: list[WeightMeta] = []

    @property
    def name(self) -> str:
        if self._shm is None:
            raise RuntimeError("SharedWeights: nothing written yet")
        return self._shm.name

    def write(self, weights: Iterable[tuple[str, torch.Tensor]]) -> tuple[str, list[WeightMeta]]:
        """Copy ``weights`` into the block → ``(block name, metadata)``."""
        items = [(n, t.detach().cpu() if t.device.type != "cpu" else t.detach()) for n, t in weights]
        meta: list[WeightMeta] = []
        offset = 0
        for n, t in items:
            meta.append((n, str(t.dtype).removeprefix("torch."), tuple(int(x) for x in t.shape), offset))
            offset += math.ceil(t.numel() * t.element_size() / _ALIGN) * _ALIGN
        size = max(offset, _ALIGN)
        if self._shm is None or self._shm.size < size:
            self.close()
            self._shm = shared_memory.SharedMemory(create=True, size=size)
            # freed at interpreter exit too (a trainer is rarely closed explicitly)
            self._finalizer = weakref.finalize(self, _free, self._shm)
        buf = self._shm.buf
        for (n, t), (_, _, _, off) in zip(items, meta):
            nbytes = t.numel() * t.element_size()
            if nbytes:
                dst = torch.frombuffer(buf, dtype=torch.uint8, count=nbytes, offset=off)
                dst.copy_(t.contiguous().reshape(-1).view(torch.uint8))
        self.meta = meta
        return self._shm.name, meta

    def close(self) -> None:
        """Free the block (readers that still hold views keep their mapping until they drop it)."""
        if self._shm is not None:
            self._finalizer()
            self._shm = None


def _free(shm: shared_memory.SharedMemory) -> None:
    try:
        shm.close()
    except BufferError:  # views still exported in this process: unlink only
        pass
    try:
        shm.unlink()
    except FileNotFoundError:
        pass


class _Attached:
    """A reader's handle on a block: tensors are zero-copy views; :meth:`close` detaches."""

    def __init__(self, name: str) -> None:
        # Python < 3.13 registers an attached block with the resource tracker, which would unlink it
        # when this process exits (or, with the writer's tracker shared by a spawned child, forget
        # the writer's registration): the writer owns the block, a reader registers nothing.
        with mock.patch.object(resource_tracker, "register", lambda *a, **k: None):
            self.shm = shared_memory.SharedMemory(name=name)

    def tensors(self, meta: Sequence[WeightMeta]) -> Iterator[tuple[str, torch.Tensor]]:
        for name, dtype, shape, off in meta:
            dt = _dtype(dtype)
            numel = math.prod(shape)
            if numel == 0:
                yield name, torch.empty(shape, dtype=dt)
                continue
            raw = torch.frombuffer(self.shm.buf, dtype=torch.uint8, count=numel * dt.itemsize, offset=off)
            yield name, raw.view(dt).view(shape)

    def close(self) -> None:
        try:
            self.shm.close()
        except BufferError:
            pass


def read_shared(name: str, meta: Sequence[WeightMeta], consume: Any) -> Any:
    """Attach to the block ``name``, call ``consume(iterator of (name, tensor view))`` and detach;
    returns what ``consume`` returns. The views are valid only inside ``consume`` (copy them)."""
    block = _Attached(name)
    try:
        return consume(block.tensors(meta))
    finally:
        import gc

        gc.collect()  # drop the views before closing the mapping
        block.close()


# ------------------------------------------------------------------------------ GPU design: broadcast
def broadcast_weights(weights: Sequence[tuple[str, torch.Tensor]], *, src: int = 0, group: Any = None) -> None:
    """Send ``weights`` from rank ``src`` to every rank of ``group`` (torch.distributed): first the
    metadata (names, dtypes, shapes) as one object, then each tensor in order. The receivers call
    :func:`receive_weights` with the same ``src`` and ``group``."""
    import torch.distributed as dist

    meta = [(n, str(t.dtype).removeprefix("torch."), tuple(int(x) for x in t.shape)) for n, t in weights]
    dist.broadcast_object_list([meta], src=src, group=group)
    for _, t in weights:
        dist.broadcast(t.detach().contiguous(), src=src, group=group)


def receive_weights(*, src: int = 0, group: Any = None, device: str | torch.device = "cpu"
                    ) -> list[tuple[str, torch.Tensor]]:
    """The receiving side of :func:`broadcast_weights`: ``(name, tensor)`` on ``device``, in the
    sender's order (feed them to ``load_weights``/``reload_weights(weights_iterator=...)``)."""
    import torch.distributed as dist

    box: list[Any] = [None]
    dist.broadcast_object_list(box, src=src, group=group)
    out: list[tuple[str, torch.Tensor]] = []
    for name, dtype, shape in box[0]:
        buf = torch.empty(tuple(shape), dtype=_dtype(dtype), device=device)
        dist.broadcast(buf, src=src, group=group)
        out.append((name, buf))
    return out
