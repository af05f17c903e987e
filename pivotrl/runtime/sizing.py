"""A run sized to the machine it runs on (``run.sizing: auto``), from a short calibration.

The default config's sizes were chosen, and the whole default run timed, on the *reference class*:
a 2-core CPU with native bf16 (AVX-512 with avx512_bf16), computing in bf16. A slower machine (an
AVX2-only CPU computes in fp32, about 2–2.5× slower per matmul) would take proportionally longer.
With ``run.sizing: auto`` the flow measures this machine once — a timed square matmul in the run's
resolved dtype on one torch thread (per-core speed; one thread is what a second busy process
disturbs least), about three seconds — predicts the default run's wall time from the
reference run's, and, when the prediction is over :data:`BUDGET_MINUTES`, scales the work-carrying
sizes (:data:`SCALED`) by the largest of :data:`TIERS` that fits.

* Explicit sizes win: a key given as an override (``--set training.max_steps=10``) is never scaled.
* ``run.sizing: fixed`` turns it off; on CUDA nothing is ever scaled.
* Stable keys: the measurement is kept per machine (CPU model, flags, torch capability, dtype,
  torch version) in ``<cache_dir>/calibration.json``, so the nightly run of one machine
  always gets the same sizes (and its cached stages); delete the file to measure again.
* Recorded: the resolved sizes are part of the config (hence of every stage key) and
  :func:`apply_sizing` returns a record (measurement, prediction, tier, changed keys) that the CLI
  prints and the flow logs.

Pure core: imports torch only inside :func:`measure_gflops`.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Callable, Sequence

from pivotrl.storage.files import atomic_file

__all__ = ["BUDGET_MINUTES", "REFERENCE", "SCALED", "TIERS", "Sizing", "annotate_dump", "apply_sizing",
           "choose_tier", "measure_gflops", "predict_minutes"]

# The reference class and its measured default run (benchmarks/RESULTS.md §10b, a cold `make run` from
# a fresh clone with nothing else running): throughput of a 1024x1024 bf16 matmul on one torch thread
# (the run's own calibration), and the run's wall time. ``fixed_fraction`` is the part of the run no
# size below changes (engine starts, model loads, full-task evaluation of the held-out tasks), from
# the stage times of the first reference run (§10).
REFERENCE: dict[str, Any] = {
    "cpu": "2-core AMD EPYC, avx512f avx512_bf16 (no AMX), bf16",
    "gflops": 206.0,
    "minutes": 20.1,
    "fixed_fraction": 0.4,
}
# The target for a cold default run, minus a margin for load and model download.
BUDGET_MINUTES = 40.0
# Work multipliers tried, largest first.
TIERS: tuple[float, ...] = (1.0, 0.5, 0.25)
# (section, field, minimum): the sizes that carry the run's work, scaled by the tier (rounded up).
SCALED: tuple[tuple[str, str, int], ...] = (
    ("warm_start", "epochs", 1),
    ("probing", "max_states", 16),
    ("training", "max_steps", 2),
    ("quality", "out_of_domain_limit", 10),
)


@dataclass(frozen=True)
class Sizing:
    """What sizing decided: ``mode`` ("auto" | "fixed" | "cuda"), the measured ``gflops`` (None when
    not measured), the ``predicted_minutes`` of the unscaled run, the ``tier`` applied, the keys it
    ``changed`` (dotted key → [configured, applied]) and the keys left alone as ``explicit``;
    ``calibration``: where the measurement came from, ``"measured"`` (now) or the calibration file
    it was read from (:data:`CALIBRATION_FILE` under the cache folder), ``measured_at`` when it was taken."""

    mode: str
    gflops: float | None = None
    predicted_minutes: float | None = None
    tier: float = 1.0
    changed: dict[str, list[int]] | None = None
    explicit: tuple[str, ...] = ()
    measured_at: str | None = None
    calibration: str | None = None

    def record(self) -> dict[str, Any]:
        """JSON-able form for logs and manifests."""
        return asdict(self)

    def line(self) -> str:
        """One line for the console."""
        if self.mode != "auto":
            return f"sizing: {self.mode} (the config's sizes)"
        where = ("measured now" if self.calibration in (None, "measured") else
                 f"read from {self.calibration}" + (f" (measured {self.measured_at})" if self.measured_at else ""))
        head = (f"sizing: auto, {self.gflops:.0f} GFLOP/s {where} (reference class {REFERENCE['gflops']:.0f}), "
                f"default run predicted {self.predicted_minutes:.0f} min")
        if not self.changed:
            return head + ", the config's sizes fit"
        keys = ", ".join(f"{k} {a}→{b}" for k, (a, b) in self.changed.items())
        return head + f" > {BUDGET_MINUTES:.0f} min budget: work x{self.tier:g} ({keys})"


#: Names the calibration's method in its cache key: a machine calibrated by an earlier method (one
#: second of matmuls) is measured again once.
CALIBRATION_METHOD = "best of 3 s, 1024^2"
#: The file under the cache folder that keeps each machine's calibration.
CALIBRATION_FILE = "calibration.json"


def measure_gflops(dtype: str, threads: int, seconds: float = 3.0, n: int = 1024) -> float:
    """GFLOP/s of an ``n``x``n`` matmul in ``dtype`` ("bf16" | "fp32") on ``threads`` torch threads,
    best of repeated timings over about ``seconds`` (2·n³ FLOP per product). A shared or virtual
    machine has slow stretches of a second or more (one-second windows read 77–91 GFLOP/s in a row on
    one 2-core machine): three seconds find its peak more reliably, and a low peak would overstate
    every MFU measured against it (pivotrl.runtime.mfu)."""
    import torch

    prev = torch.get_num_threads()
    torch.set_num_threads(max(1, int(threads)))
    try:
        dt = torch.bfloat16 if dtype == "bf16" else torch.float32
        a, b = torch.randn(n, n, dtype=dt), torch.randn(n, n, dtype=dt)
        a @ b  # warm-up
        best, t_end = math.inf, time.perf_counter() + seconds
        while time.perf_counter() < t_end:
            t0 = time.perf_counter()
            a @ b
            best = min(best, time.perf_counter() - t0)
        return 2 * n ** 3 / best / 1e9
    finally:
        torch.set_num_threads(prev)


def predict_minutes(gflops: float, tier: float = 1.0, reference: dict[str, Any] = REFERENCE) -> float:
    """Predicted wall time (minutes) of the default run at work multiplier ``tier`` on a machine of
    ``gflops``: the reference run's time scaled by throughput, its fixed part unscaled by ``tier``."""
    base = reference["minutes"] * reference["gflops"] / max(gflops, 1e-9)
    f = reference["fixed_fraction"]
    return base * (f + (1 - f) * tier)


def choose_tier(gflops: float, budget: float = BUDGET_MINUTES, tiers: Sequence[float] = TIERS) -> float:
    """The largest tier whose predicted time fits ``budget``; the smallest tier when none does."""
    for tier in tiers:
        if predict_minutes(gflops, tier) <= budget:
            return tier
    return tiers[-1]


def _machine_id(dtype: str, threads: int) -> str:
    import torch

    from pivotrl.runtime.precision import detect_hardware

    hw = detect_hardware()
    parts = [hw.cpu_model, " ".join(sorted(hw.cpu_flags)), hw.torch_cpu_capability, str(hw.onednn_max_isa),
             dtype, str(threads), torch.__version__, CALIBRATION_METHOD]
    return hashlib.sha256("\n".join(parts).encode()).hexdigest()[:16]


def _cached_gflops(cache_dir: str, dtype: str, threads: int,
                   measure: Callable[[str, int], float]) -> tuple[float, str]:
    """``(gflops, measured_at)`` of :func:`_calibration`."""
    return _calibration(cache_dir, dtype, threads, measure)[:2]


def _calibration(cache_dir: str, dtype: str, threads: int,
                 measure: Callable[[str, int], float]) -> tuple[float, str, str]:
    """``(gflops, measured_at, where)``: the machine's measurement from ``<cache_dir>/calibration.json``
    (``where`` = that file), measured and kept when absent (``where`` = ``"measured"``)."""
    path = Path(os.path.expanduser(cache_dir)) / CALIBRATION_FILE
    key = _machine_id(dtype, threads)
    try:
        known = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        known = {}
    if isinstance(known, dict) and isinstance(known.get(key), dict) and "gflops" in known[key]:
        return float(known[key]["gflops"]), str(known[key].get("measured_at", "")), str(path)
    gflops = float(measure(dtype, threads))
    stamp = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
    known = known if isinstance(known, dict) else {}
    known[key] = {"gflops": round(gflops, 2), "dtype": dtype, "threads": threads, "measured_at": stamp}
    with atomic_file(path) as tmp:
        tmp.write_text(json.dumps(known, indent=1, sort_keys=True) + "\n", encoding="utf-8")
    return round(gflops, 2), stamp, "measured"


def apply_sizing(cfg: Any, explicit: Sequence[str] = (), *,
                 measure: Callable[[str, int], float] | None = None) -> tuple[Any, Sizing]:
    """``(cfg', sizing)``: ``cfg`` with its :data:`SCALED` sizes fitted to this machine.

    ``explicit`` are the dotted keys the user set (override keys); they are never scaled. ``cfg``
    is returned unchanged for ``run.sizing: fixed``, on CUDA, or when the config's sizes fit.
    ``measure(dtype, threads) -> GFLOP/s`` is the calibration (default :func:`measure_gflops`).
    """
    from pivotrl.runtime.precision import detect_hardware, resolve_precision

    if cfg.run.sizing == "fixed":
        return cfg, Sizing(mode="fixed")
    hw = detect_hardware()
    if hw.device == "cuda":
        return cfg, Sizing(mode="cuda")
    dtype = resolve_precision(cfg.model.dtype, hw).dtype
    threads = 1
    gflops, stamp, where = _calibration(str(cfg.run.local_cache()), dtype, threads, measure or measure_gflops)
    tier = choose_tier(gflops)
    skip = {k.strip() for k in explicit}
    changed: dict[str, list[int]] = {}
    kept: list[str] = []
    update: dict[str, Any] = {}
    for section, field, floor in SCALED:
        key = f"{section}.{field}"
        value = getattr(getattr(cfg, section), field)
        if tier >= 1.0 or value is None:
            continue
        if key in skip:
            kept.append(key)
            continue
        new = max(int(floor), int(math.ceil(value * tier)))
        if new < value:
            changed[key] = [int(value), new]
            update.setdefault(section, {})[field] = new
    if update:
        cfg = cfg.model_copy(update={s: getattr(cfg, s).model_copy(update=u) for s, u in update.items()})
    return cfg, Sizing(mode="auto", gflops=gflops, predicted_minutes=round(predict_minutes(gflops), 1),
                       tier=tier if changed else 1.0, changed=changed or None, explicit=tuple(kept),
                       measured_at=stamp, calibration=where)


def annotate_dump(text: str, sizing: Sizing, notes: dict[str, str] | None = None) -> str:
    """``text`` (a config dumped by ``pivotrl.config.dump_config``) with a comment after each size
    :func:`apply_sizing` scaled (``# scaled from 40: run.sizing auto, work x0.25``), after each
    it left alone because it was set explicitly, and after each dotted key of ``notes`` (its note)."""
    notes = dict(notes or {})
    notes.update({k: f"scaled from {a}: run.sizing auto, work x{sizing.tier:g}"
                  for k, (a, _) in (sizing.changed or {}).items()})
    notes.update({k: "set explicitly: not scaled" for k in sizing.explicit})
    out, section = [], ""
    for line in text.splitlines():
        if line and not line.startswith((" ", "#")) and line.endswith(":"):
            section = line[:-1]
        elif section and line.startswith("  ") and not line.startswith("   ") and ":" in line:
            key = f"{section}.{line.strip().split(':', 1)[0]}"
            if key in notes:
                line = f"{line}  # {notes[key]}"
        out.append(line)
    return "\n".join(out) + ("\n" if text.endswith("\n") else "")


def sized_config(cfg: Any, overrides: Sequence[str] = (), echo: Callable[[str], Any] | None = None) -> Any:
    """:func:`apply_sizing` with the keys of ``--set``-style ``overrides`` as the explicit ones;
    ``echo`` (e.g. ``print``) receives the one-line decision."""
    cfg, sizing = apply_sizing(cfg, [o.split("=", 1)[0] for o in overrides])
    if echo is not None:
        echo(sizing.line())
    return cfg
