"""Compute precision chosen by the hardware: ``model.dtype: auto``.

bf16 compute (with fp32 master weights in the trainers) pays off only where the device multiplies
bf16 natively; elsewhere torch emulates it and a bf16 matmul can be ~100x slower than fp32 (an
AVX2-only CPU: 0.8 vs 74 GFLOP/s on one core, 1024x1024). The rule (:func:`resolve_precision`):

- ``fp32`` / ``bf16`` set explicitly are kept; an explicit ``bf16`` on a CPU without native bf16
  carries a warning (the CLI prints it once, with a measured slowdown: :func:`bf16_slowdown`).
- ``auto`` → ``bf16`` on CUDA with bf16 support, or on an x86 CPU with ``avx512_bf16`` or
  ``amx_bf16`` in its flags *and* torch's kernels allowed to use it (``torch.backends.cpu.
  get_cpu_capability()`` is AVX512 or better, and ``ONEDNN_MAX_CPU_ISA`` does not cap oneDNN below
  ``AVX512_CORE_BF16``); ``fp32`` everywhere else. ``ATEN_CPU_CAPABILITY=avx2
  ONEDNN_MAX_CPU_ISA=AVX2`` therefore imitates an AVX2-only CPU and resolves to fp32.

The resolved dtype is what every stage computes in (warm start, trainer, π_ref/π_old log-probs,
rollout engine); it enters the stage keys (a bf16 and an fp32 run never share a cached artifact)
and, with its reason, the manifests of the stage artifacts. Pure core: :func:`resolve_precision`
takes a :class:`Hardware` record; only :func:`detect_hardware` reads the machine.
"""

from __future__ import annotations

import functools
import os
from dataclasses import asdict, dataclass, field
from typing import Any, Mapping

#: CPU flags (``/proc/cpuinfo``) of native bf16 matmul on x86.
BF16_CPU_FLAGS = ("avx512_bf16", "amx_bf16")
#: torch CPU capabilities (``torch.backends.cpu.get_cpu_capability()``) that can run bf16 kernels natively.
BF16_TORCH_CAPABILITIES = ("AVX512", "AVX512_BF16", "AMX")
#: ``ONEDNN_MAX_CPU_ISA`` values that keep oneDNN below its bf16 kernels.
ONEDNN_ISA_WITHOUT_BF16 = ("SSE41", "AVX", "AVX2", "AVX2_VNNI", "AVX2_VNNI_2", "AVX512_CORE", "AVX512_CORE_VNNI")


@dataclass(frozen=True)
class Hardware:
    """What decides the precision. ``device``: "cuda" or "cpu"; ``cuda_bf16``: the CUDA device
    supports bf16; ``cpu_flags``: lower-case CPU flags; ``torch_cpu_capability``: torch's CPU kernel
    level (e.g. "AVX2", "AVX512"); ``onednn_max_isa``: the ``ONEDNN_MAX_CPU_ISA`` cap, if any."""

    device: str = "cpu"
    cuda_bf16: bool = False
    cpu_flags: frozenset[str] = field(default_factory=frozenset)
    torch_cpu_capability: str = ""
    onednn_max_isa: str | None = None
    cpu_model: str = ""


@dataclass(frozen=True)
class Precision:
    """The resolved choice: ``dtype`` ("bf16" | "fp32"), the ``requested`` value, a one-line
    ``reason`` and, for an explicit bf16 without native support, a ``warning``."""

    requested: str
    dtype: str
    reason: str
    native_bf16: bool
    warning: str | None = None

    def record(self) -> dict[str, Any]:
        """JSON-able form for manifests."""
        return asdict(self)

    def line(self) -> str:
        """One line for the start of a run, e.g. ``precision: bf16 (auto: CPU has avx512_bf16 ...)``."""
        master = ", fp32 master weights" if self.dtype == "bf16" else ""
        return f"precision: {self.dtype} compute{master} ({self.requested}: {self.reason})"


def native_bf16(hw: Hardware) -> tuple[bool, str]:
    """Whether ``hw`` computes bf16 natively, and why (one phrase)."""
    if hw.device == "cuda":
        return (True, "CUDA device supports bf16") if hw.cuda_bf16 else (False, "CUDA device without bf16")
    flags = [f for f in BF16_CPU_FLAGS if f in hw.cpu_flags]
    if not flags:
        return False, "CPU has no avx512_bf16/amx_bf16"
    cap = (hw.torch_cpu_capability or "").upper()
    if cap not in BF16_TORCH_CAPABILITIES:
        return False, f"CPU has {'+'.join(flags)} but torch's kernels are capped at {cap or 'unknown'} (ATEN_CPU_CAPABILITY)"
    isa = (hw.onednn_max_isa or "").upper()
    if isa in ONEDNN_ISA_WITHOUT_BF16:
        return False, f"CPU has {'+'.join(flags)} but ONEDNN_MAX_CPU_ISA={isa} disables its bf16 kernels"
    return True, f"CPU has {'+'.join(flags)}, torch kernels {cap}"


def resolve_precision(requested: str, hw: Hardware) -> Precision:
    """Resolve ``model.dtype`` ("auto" | "bf16" | "fp32") on ``hw`` (see the module docstring).

    Raises ValueError for any other ``requested``.
    """
    if requested not in ("auto", "bf16", "fp32"):
        raise ValueError(f"model.dtype must be auto, bf16 or fp32; got {requested!r}")
    native, why = native_bf16(hw)
    if requested == "auto":
        return Precision("auto", "bf16" if native else "fp32", why, native)
    if requested == "fp32":
        return Precision("fp32", "fp32", "set explicitly", native)
    warning = None
    if not native:
        warning = (f"model.dtype=bf16 on a device without native bf16 ({why}): torch emulates bf16 and runs "
                   "far slower than fp32; use model.dtype=auto or fp32")
    return Precision("bf16", "bf16", "set explicitly", native, warning)


def parse_cpuinfo(text: str) -> tuple[frozenset[str], str]:
    """The first ``flags`` line and ``model name`` of ``/proc/cpuinfo`` text → (flags, model)."""
    flags: frozenset[str] = frozenset()
    model = ""
    for line in text.splitlines():
        key, _, value = line.partition(":")
        key = key.strip().lower()
        if key == "flags" and not flags:
            flags = frozenset(value.lower().split())
        elif key == "model name" and not model:
            model = value.strip()
    return flags, model


@functools.lru_cache(maxsize=1)
def detect_hardware(cpuinfo_path: str = "/proc/cpuinfo") -> Hardware:
    """The :class:`Hardware` of this process: CUDA if available, else the CPU's flags and torch's
    CPU capability (both under the environment's ``ATEN_CPU_CAPABILITY``/``ONEDNN_MAX_CPU_ISA``)."""
    import torch

    try:
        with open(cpuinfo_path, encoding="utf-8", errors="replace") as f:
            flags, model = parse_cpuinfo(f.read())
    except OSError:
        flags, model = frozenset(), ""
    cuda = bool(torch.cuda.is_available())
    cuda_bf16 = bool(cuda and torch.cuda.is_bf16_supported())
    try:
        cap = str(torch.backends.cpu.get_cpu_capability())
    except Exception:  # noqa: BLE001 - old torch builds
        cap = ""
    return Hardware(device="cuda" if cuda else "cpu", cuda_bf16=cuda_bf16, cpu_flags=flags,
                    torch_cpu_capability=cap, onednn_max_isa=os.environ.get("ONEDNN_MAX_CPU_ISA"), cpu_model=model)


def run_precision(cfg: Any) -> Precision:
    """The precision of a run config (``cfg.model.dtype`` on this machine's hardware), resolved once
    per process for each (requested dtype, hardware) pair: every stage function that asks again
    (with_resolved_dtype, the manifests, the engine's dtype) gets the same answer without resolving it again."""
    return _resolved(cfg.model.dtype, detect_hardware())


@functools.lru_cache(maxsize=8)
def _resolved(requested: str, hw: Hardware) -> Precision:
    return resolve_precision(requested, hw)


def with_resolved_dtype(cfg: Any) -> Any:
    """``cfg`` with ``model.dtype`` resolved (a copy; the same object when already bf16/fp32)."""
    if cfg.model.dtype != "auto":
        return cfg
    dtype = run_precision(cfg).dtype
    update: dict[str, Any] = {"model": cfg.model.model_copy(update={"dtype": dtype})}
    if cfg.training.refresh_tolerance is None:  # the config fills it in only for an explicit dtype
        from pivotrl.config.train_eval import DEFAULT_REFRESH_TOLERANCE

        update["training"] = cfg.training.model_copy(update={"refresh_tolerance": DEFAULT_REFRESH_TOLERANCE[dtype]})
    return cfg.model_copy(update=update)


def bf16_slowdown(n: int = 256, reps: int = 5) -> float:
    """Measured time of an ``n``x``n`` bf16 matmul over the fp32 one on this CPU (best of ``reps``;
    about a second at most on a CPU that emulates bf16)."""
    import time

    import torch

    def best(dtype: torch.dtype) -> float:
        a = torch.randn(n, n).to(dtype)
        b = torch.randn(n, n).to(dtype)
        for _ in range(2):  # warm-up (kernel selection, JIT)
            a @ b
        times = []
        for _ in range(reps):
            t0 = time.perf_counter()
            a @ b
            times.append(time.perf_counter() - t0)
        return min(times)

    return best(torch.bfloat16) / max(best(torch.float32), 1e-9)


def describe(hw: Hardware) -> Mapping[str, Any]:
    """A short JSON-able description of ``hw`` for reports and benchmarks."""
    return {"device": hw.device, "cpu_model": hw.cpu_model, "torch_cpu_capability": hw.torch_cpu_capability,
            "onednn_max_isa": hw.onednn_max_isa,
            "bf16_flags": sorted(f for f in BF16_CPU_FLAGS if f in hw.cpu_flags)}
