"""DeepSpeed on CPU or GPU: process-group setup, engine construction and HF checkpoint export.

Choices made here (and why):

* **Communication**: ``gloo`` on CPU (``nccl`` when CUDA is available). DeepSpeed's first
  ``init_distributed`` on CPU JIT-compiles a shared-memory all-reduce op (about a minute);
  :func:`disable_shm_comm` marks that op incompatible so DeepSpeed uses plain ``torch.distributed``
  collectives instead: no compiler run, identical results. Set ``PIVOTRL_DS_SHM_COMM=1`` to keep
  DeepSpeed's default (worth it only for many ranks on one large host).
* **Optimizer**: a client ``torch.optim.AdamW`` with ``fused=True`` (torch's own fused kernel, CPU
  and CUDA; DeepSpeed's ``"optimizer"`` config entry would compile its FusedAdam instead). With ZeRO stage 0 and fp32 DeepSpeed neither clips nor records the
  gradient norm, so :class:`ClippingAdamW` does both itself; all other modes clip inside DeepSpeed.
* **bf16** means bf16 compute with fp32 master weights (DeepSpeed's bf16 mode): stage 0 uses
  DeepSpeed's unfused mixed-precision optimizer, stage 1 its BF16 optimizer (fp32 gradient
  accumulation), stages 2–3 the ZeRO optimizer; every one keeps fp32 master copies. The master
  copies start from the bf16-rounded weights.
* **Gradient accumulation** is caller-owned (``managed_gradient_accumulation: false``): every
  ``engine.backward`` accumulates, ``engine.step()`` is the accumulation boundary and applies one
  update, however many micro-batches preceded it. Every rank must call ``backward`` the same
  number of times (ZeRO 2–3 reduce inside backward).
* **Loss scaling across ranks**: DeepSpeed averages gradients over the data-parallel ranks. Losses
  normalised by a *global* count must therefore be multiplied by the world size before
  ``engine.backward`` (see :func:`data_parallel_loss_scale`).
"""

from __future__ import annotations

import os
import shutil
import socket
from pathlib import Path
from typing import Any, Iterable, Mapping, Sequence

import torch

from pivotrl.core.errors import ConfigError, ModelError, StorageError
from pivotrl.training.host_memory import retain_freed_memory
from pivotrl.storage.files import atomic_dir, replace_path

__all__ = [
    "DTYPES",
    "ClippingAdamW",
    "build_engine",
    "copy_tokenizer_files",
    "data_parallel_loss_scale",
    "deepspeed_config",
    "disable_shm_comm",
    "ensure_dist_env",
    "export_hf_checkpoint",
    "free_port",
    "init_distributed",
    "load_causal_lm",
    "rank_and_world",
    "replace_directory",
    "resolve_dtype",
    "set_num_threads",
]

DTYPES: dict[str, torch.dtype] = {"float32": torch.float32, "bfloat16": torch.bfloat16}

TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "added_tokens.json",
    "vocab.json",
    "merges.txt",
    "tokenizer.model",
    "chat_template.jinja",
    "chat_template.json",
)


def resolve_dtype(dtype: str) -> torch.dtype:
    """``"float32"`` or ``"bfloat16"`` → torch dtype; ConfigError (key ``dtype``) otherwise."""
    try:
        return DTYPES[dtype]
    except (KeyError, TypeError):
        raise ConfigError(f"dtype must be one of {sorted(DTYPES)}, got {dtype!r}") from None


def free_port() -> int:
    """A TCP port that was free on 127.0.0.1 a moment ago (for single-host process groups)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def ensure_dist_env(*, rank: int = 0, world_size: int = 1, master_port: int | None = None) -> None:
    """Set RANK/WORLD_SIZE/LOCAL_RANK/MASTER_ADDR/MASTER_PORT where no launcher set them.

    Without these DeepSpeed searches for MPI. Variables already present (torchrun, the deepspeed
    launcher) are left untouched; ``MASTER_PORT`` defaults to a free local port.
    """
    os.environ.setdefault("RANK", str(rank))
    os.environ.setdefault("WORLD_SIZE", str(world_size))
    os.environ.setdefault("LOCAL_RANK", str(rank))
    os.environ.setdefault("LOCAL_WORLD_SIZE", str(world_size))
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", str(master_port if master_port is not None else free_port()))


def set_num_threads(num_threads: int | None = None) -> int:
    """Set torch's intra-op threads: ``num_threads``, else ``OMP_NUM_THREADS``, else 1. Returns it.

    One thread per rank is the right default when several ranks share a host.
    """
    n = num_threads if num_threads is not None else int(os.environ.get("OMP_NUM_THREADS", "1") or 1)
    if n < 1:
        raise ConfigError(f"num_threads must be >= 1, got {n}")
    os.environ["OMP_NUM_THREADS"] = str(n)
    torch.set_num_threads(n)
    return n


def disable_shm_comm() -> None:
    """Stop DeepSpeed from compiling and using its CPU shared-memory all-reduce op.

    DeepSpeed consults ``deepspeed.ops.__compatible_ops__`` before building the op; marking it
    incompatible makes its torch backend fall back to ``torch.distributed`` (gloo). Probing the
    op table takes well under a second. No-op when ``PIVOTRL_DS_SHM_COMM=1``.
    """
    if os.environ.get("PIVOTRL_DS_SHM_COMM", "0") == "1":
        return
    import deepspeed.ops

    ops = deepspeed.ops.__compatible_ops__
    ops["deepspeed_shm_comm"] = False


def init_distributed(*, num_threads: int | None = None) -> tuple[int, int]:
    """Initialise the process group once (gloo on CPU, nccl on CUDA). Returns ``(rank, world_size)``.

    Sets the launcher variables if missing (a single-process run), the thread count and disables
    the shared-memory op (see :func:`disable_shm_comm`). Safe to call repeatedly.
    """
    import deepspeed

    ensure_dist_env()
    set_num_threads(num_threads)
    disable_shm_comm()
    backend = "nccl" if torch.cuda.is_available() else "gloo"
    deepspeed.init_distributed(dist_backend=backend)
    return rank_and_world()


def rank_and_world() -> tuple[int, int]:
    """``(rank, world_size)`` of the default process group, ``(0, 1)`` when none exists."""
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        return torch.distributed.get_rank(), torch.distributed.get_world_size()
    return 0, 1


def data_parallel_loss_scale() -> float:
    """Factor turning a loss normalised by a global count into what ``engine.backward`` needs.

    DeepSpeed divides the all-reduced gradient sum by the world size W. A rank's loss
    ``Σ_local term / N_global`` then yields ``(1/W) Σ_all term / N_global``; multiplying it by W
    restores the full-batch gradient (so 2 ranks × half a batch = 1 rank × the whole batch).
    """
    return float(rank_and_world()[1])


class ClippingAdamW(torch.optim.AdamW):
    """AdamW that clips the global gradient norm itself and records it as ``_global_grad_norm``.

    Used only for ZeRO stage 0 in fp32, where DeepSpeed passes the client optimizer through
    unwrapped. Gradients are already all-reduced when ``step`` runs, so the norm is global.
    ``max_norm`` ≤ 0 disables clipping (the norm is still recorded).
    """

    def __init__(self, params: Iterable[Any], *, max_norm: float, **kwargs: Any) -> None:
        super().__init__(params, **kwargs)
        self.max_norm = float(max_norm)
        self._global_grad_norm: float | None = None

    def step(self, closure: Any = None) -> Any:  # noqa: D102 - torch API
        params = [p for g in self.param_groups for p in g["params"] if p.grad is not None]
        if params:
            if self.max_norm > 0:
                norm = torch.nn.utils.clip_grad_norm_(params, self.max_norm)
            else:
                norm = torch.nn.utils.get_total_norm([p.grad for p in params])
            self._global_grad_norm = float(norm)
        return super().step(closure)


def _merge(base: dict[str, Any], extra: Mapping[str, Any]) -> dict[str, Any]:
    """Recursive dict merge: values of ``extra`` win; nested mappings are merged key by key."""
    out = dict(base)
    for k, v in extra.items():
        out[k] = _merge(out[k], v) if isinstance(v, Mapping) and isinstance(out.get(k), dict) else v
    return out


_FIXED_KEYS = ("optimizer", "managed_gradient_accumulation", "gradient_accumulation_steps", "train_micro_batch_size_per_gpu", "train_batch_size")


def deepspeed_config(
    *, zero_stage: int, dtype: str, grad_clip: float | None, extra: Mapping[str, Any] | None = None
) -> dict[str, Any]:
    """The DeepSpeed JSON config used for every pivotrl engine.

    ``zero_stage`` ∈ {0, 1, 2, 3}; ``dtype`` ∈ :data:`DTYPES`; ``grad_clip`` ≥ 0 (0 or None = no
    clipping). One micro-batch per backward, caller-owned gradient accumulation; no optimizer entry
    (the client AdamW is passed in). ``extra`` is merged over the result (e.g.
    ``{"zero_optimization": {"stage3_gather_16bit_weights_on_model_save": true}}``), except the
    keys the trainer owns (``optimizer``, batch sizes, gradient accumulation).
    Raises ConfigError naming the bad key.
    """
    if grad_clip is None:
        grad_clip = 0.0
    if isinstance(zero_stage, bool) or zero_stage not in (0, 1, 2, 3):
        raise ConfigError(f"zero_stage must be 0, 1, 2 or 3, got {zero_stage!r}")
    resolve_dtype(dtype)
    if isinstance(grad_clip, bool) or not isinstance(grad_clip, (int, float)) or not grad_clip >= 0:
        raise ConfigError(f"grad_clip must be >= 0 (0 disables clipping), got {grad_clip!r}")
    bf16 = dtype == "bfloat16"
    cfg: dict[str, Any] = {
        "train_micro_batch_size_per_gpu": 1,
        "gradient_accumulation_steps": 1,
        "managed_gradient_accumulation": False,
        "zero_optimization": {"stage": zero_stage},
        "bf16": {"enabled": bf16},
        "zero_allow_untested_optimizer": True,
        "gradient_clipping": float(grad_clip) if (bf16 or zero_stage > 0) else 0.0,
        "steps_per_print": 2**31 - 1,
        "wall_clock_breakdown": False,
    }
    if bf16 and zero_stage == 1:
        cfg["data_types"] = {"grad_accum_dtype": "fp32"}
    if zero_stage == 3:
        cfg["zero_optimization"]["stage3_gather_16bit_weights_on_model_save"] = True
    if extra:
        owned = sorted(set(extra) & set(_FIXED_KEYS))
        if owned:
            raise ConfigError(f"deepspeed extra config may not set {owned}: the trainer owns these keys")
        stage = extra.get("zero_optimization", {}).get("stage", zero_stage)
        if stage != zero_stage:
            raise ConfigError(f"deepspeed extra zero_optimization.stage={stage} contradicts zero_stage={zero_stage}")
        cfg = _merge(cfg, extra)
    return cfg


def build_engine(
    model: torch.nn.Module,
    *,
    lr: float,
    zero_stage: int = 0,
    dtype: str = "bfloat16",
    grad_clip: float | None = 1.0,
    weight_decay: float = 0.0,
    betas: tuple[float, float] = (0.9, 0.999),
    extra_config: Mapping[str, Any] | None = None,
    retain_host_memory: bool = True,
) -> Any:
    """Wrap ``model`` (fp32 weights) in a DeepSpeed engine with a client AdamW; returns the engine.

    Initialises the process group if needed (:func:`init_distributed`). The engine casts the model
    to ``dtype`` and keeps fp32 master weights for bf16 (see the module docstring).
    ``extra_config`` is merged over the generated DeepSpeed config (see :func:`deepspeed_config`).
    ``retain_host_memory`` (training on the CPU only): this process keeps the memory it frees
    instead of faulting it in again every step (:func:`pivotrl.training.host_memory.retain_freed_memory`;
    process-wide, for the rest of the process).
    Raises ConfigError for a bad ``lr``, ``zero_stage``, ``dtype``, ``grad_clip`` or extra key.
    """
    import deepspeed

    if not (isinstance(lr, (int, float)) and lr > 0):
        raise ConfigError(f"lr must be a number > 0, got {lr!r}")
    cfg = deepspeed_config(zero_stage=zero_stage, dtype=dtype, grad_clip=grad_clip, extra=extra_config)
    grad_clip = float(grad_clip or 0.0)
    init_distributed()
    if retain_host_memory and not torch.cuda.is_available():
        retain_freed_memory()
    params = [p for p in model.parameters() if p.requires_grad]
    # torch's fused AdamW kernel (CPU and CUDA): one pass over each tensor instead of a dozen
    # elementwise ops; measured 4–5x faster per step than the default for-loop on SmolLM2 (RESULTS.md §14).
    fused = {"fused": True} if _fused_adamw_ok(params) else {}
    if zero_stage == 0 and dtype == "float32":
        optimizer: torch.optim.Optimizer = ClippingAdamW(
            params, max_norm=grad_clip, lr=lr, betas=betas, weight_decay=weight_decay, **fused
        )
    else:
        optimizer = torch.optim.AdamW(params, lr=lr, betas=betas, weight_decay=weight_decay, **fused)
    engine, _, _, _ = deepspeed.initialize(model=model, optimizer=optimizer, config=cfg)
    return engine


def _fused_adamw_ok(params: Sequence[torch.Tensor]) -> bool:
    """Whether torch's fused AdamW takes these parameters (floating point, one CPU or CUDA device
    type); ``PIVOTRL_FUSED_ADAMW=0`` turns it off."""
    if os.environ.get("PIVOTRL_FUSED_ADAMW", "1") == "0" or not params:
        return False
    devices = {p.device.type for p in params}
    return devices <= {"cpu"} or devices <= {"cuda"}


def copy_tokenizer_files(src_dir: str | os.PathLike[str], dst_dir: str | os.PathLike[str]) -> list[str]:
    """Copy the tokenizer files (see ``TOKENIZER_FILES``) present in ``src_dir``; returns their names."""
    copied = []
    for name in TOKENIZER_FILES:
        src = Path(src_dir) / name
        if src.is_file():
            shutil.copy2(src, Path(dst_dir) / name)
            copied.append(name)
    return copied


def _tied_duplicates(module: torch.nn.Module) -> list[str]:
    """Names of parameters that are the same tensor as an earlier one (e.g. a tied ``lm_head.weight``)."""
    seen: set[int] = set()
    dups = []
    for name, p in module.named_parameters(remove_duplicate=False):
        if id(p) in seen:
            dups.append(name)
        seen.add(id(p))
    return dups


def _full_state_dict(engine: Any, writers: Sequence[int] = (0,)) -> dict[str, torch.Tensor] | None:
    """The complete module state dict on the ``writers`` ranks (None on the others), detached CPU
    clones. ZeRO 0–2 keep whole parameters on every rank; ZeRO-3 gathers them on all ranks first.

    Tied duplicates are left out (the config's ``tie_word_embeddings`` restores them on load).
    """
    rank, _ = rank_and_world()
    module = engine.module
    drop = set(_tied_duplicates(module))

    def _clone(sd: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        return {k: v.detach().cpu().clone() for k, v in sd.items() if k not in drop}

    if engine.zero_optimization_stage() == 3:
        import deepspeed

        # Gather every partitioned parameter on all ranks (fine for ≤ ~1B params per host).
        with deepspeed.zero.GatheredParameters(list(module.parameters()), modifier_rank=None):
            sd = _clone(module.state_dict()) if rank in writers else None
        return sd
    if rank not in writers:
        return None
    return _clone(module.state_dict())


def replace_directory(tmp: Path, target: Path) -> None:
    """Atomically put directory ``tmp`` at ``target`` (an existing target is replaced)."""
    replace_path(tmp, target, replace_existing=True)


def export_hf_checkpoint(
    engine: Any, out_dir: str | os.PathLike[str], *, tokenizer_dir: str | os.PathLike[str] | None = None,
    writers: Sequence[int] = (0,),
) -> Path:
    """Write the engine's current weights as an HF checkpoint directory (safetensors), atomically.

    Every rank must call this (ZeRO-3 gathers collectively); rank 0 (each rank of ``writers``: the
    ranks that own a rollout engine, each with its own ``out_dir``) writes into a temporary sibling
    directory and renames it to ``out_dir`` (replacing an existing one); all ranks wait for the
    renames. Weights are saved in the compute dtype (bf16 for a bf16 run: what the trainer
    computes with). ZeRO 0–2 read ``module.state_dict()``; ZeRO-3 gathers the partitions first.
    Tokenizer files from ``tokenizer_dir`` are copied alongside. Returns ``out_dir``.

    Raises StorageError if the directory cannot be written.
    """
    target = Path(out_dir)
    rank, world = rank_and_world()
    sd = _full_state_dict(engine, writers)
    if rank in writers:
        module = engine.module
        try:
            with atomic_dir(target, mode=None, replace_existing=True) as tmp:
                if rank == 0:
                    module.save_pretrained(tmp, state_dict=sd, safe_serialization=True)
                else:  # transformers' save_pretrained writes on distributed rank 0 only
                    from safetensors.torch import save_file

                    module.config.to_json_file(str(Path(tmp) / "config.json"))
                    save_file({k: v.contiguous() for k, v in sd.items()}, str(Path(tmp) / "model.safetensors"),
                              metadata={"format": "pt"})
                if tokenizer_dir is not None:
                    copy_tokenizer_files(tokenizer_dir, tmp)
        except OSError as err:
            raise StorageError(f"cannot write HF checkpoint to {target}: {err}") from err
    if world > 1:
        torch.distributed.barrier()
    return target


def load_causal_lm(model_dir: str | os.PathLike[str], dtype: torch.dtype = torch.float32) -> Any:
    """Load an HF causal LM from ``model_dir`` in ``dtype``; ModelError if it cannot be read."""
    from transformers import AutoModelForCausalLM

    path = Path(model_dir)
    if not (path / "config.json").is_file():
        raise ModelError(f"no HF checkpoint at {path} (config.json missing)")
    try:
        return AutoModelForCausalLM.from_pretrained(path, dtype=dtype)
    except (OSError, ValueError) as err:
        raise ModelError(f"cannot load the model in {path}: {err}") from err
