"""model.dtype: auto — the resolution rule on given hardware records, the config and stage keys."""

from __future__ import annotations

import pytest

from pivotrl.runtime.precision import Hardware, parse_cpuinfo, resolve_precision, with_resolved_dtype

AVX512_BF16 = frozenset("fpu sse2 avx avx2 fma avx512f avx512bw avx512vl avx512_bf16".split())
AVX2_ONLY = frozenset("fpu sse2 avx avx2 fma".split())
AMX = frozenset("avx2 avx512f amx_bf16 amx_tile".split())
#: ONEDNN_MAX_CPU_ISA values below oneDNN's bf16 kernels (its documented ISA order).
ONEDNN_CAPS_BELOW_BF16 = ("SSE41", "AVX", "AVX2", "AVX2_VNNI", "AVX2_VNNI_2", "AVX512_CORE", "AVX512_CORE_VNNI")


def cpu(flags, cap="AVX512", isa=None):
    return Hardware(device="cpu", cpu_flags=flags, torch_cpu_capability=cap, onednn_max_isa=isa)


@pytest.mark.parametrize("hw, dtype", [
    (cpu(AVX512_BF16), "bf16"),
    (cpu(AMX), "bf16"),
    (cpu(AVX2_ONLY, cap="AVX2"), "fp32"),
    (cpu(frozenset("avx2 avx512f avx512bw".split())), "fp32"),  # AVX-512 without its bf16 extension
    (cpu(AVX512_BF16, cap="AVX2"), "fp32"),  # ATEN_CPU_CAPABILITY=avx2 (the AVX2 imitation)
    (cpu(AVX512_BF16, isa="AVX2"), "fp32"),  # ONEDNN_MAX_CPU_ISA=AVX2
    (cpu(AVX512_BF16, isa="avx512_core"), "fp32"),  # oneDNN capped below its bf16 kernels
    (cpu(AVX512_BF16, isa="AVX512_CORE_AMX"), "bf16"),
    (Hardware(device="cuda", cuda_bf16=True), "bf16"),
    (Hardware(device="cuda", cuda_bf16=False), "fp32"),
])
def test_auto_is_bf16_exactly_where_bf16_is_native(hw, dtype):
    p = resolve_precision("auto", hw)
    assert (p.dtype, p.requested, p.native_bf16, p.warning) == (dtype, "auto", dtype == "bf16", None)
    assert p.reason and p.line().startswith(f"precision: {dtype} compute")


def test_the_imitation_env_says_why_it_resolves_to_fp32():
    p = resolve_precision("auto", cpu(AVX512_BF16, cap="AVX2", isa="AVX2"))
    assert p.dtype == "fp32" and "capped at AVX2" in p.reason


def test_explicit_values_are_kept_and_emulated_bf16_warns():
    assert resolve_precision("fp32", cpu(AVX512_BF16)).dtype == "fp32"
    ok = resolve_precision("bf16", cpu(AVX512_BF16))
    assert ok.dtype == "bf16" and ok.warning is None
    slow = resolve_precision("bf16", cpu(AVX2_ONLY, cap="AVX2"))
    assert slow.dtype == "bf16" and "slower than fp32" in slow.warning and "no avx512_bf16" in slow.warning
    with pytest.raises(ValueError, match="auto, bf16 or fp32"):
        resolve_precision("fp16", cpu(AVX512_BF16))


def test_parse_cpuinfo_reads_the_first_flags_line_and_model():
    text = "processor\t: 0\nmodel name\t: AMD EPYC\nflags\t\t: fpu AVX2 avx512_bf16\n\nprocessor\t: 1\nflags\t: fpu\n"
    flags, model = parse_cpuinfo(text)
    assert flags == frozenset({"fpu", "avx2", "avx512_bf16"}) and model == "AMD EPYC"


def test_config_default_is_auto_and_resolves_with_its_refresh_tolerance(monkeypatch):
    from pivotrl.runtime import precision
    from pivotrl.config import load_config

    cfg = load_config("configs/default.yaml", [])
    assert cfg.model.dtype == "auto" and cfg.training.refresh_tolerance is None
    for hw, dtype, tol in ((cpu(AVX512_BF16), "bf16", 0.3), (cpu(AVX2_ONLY, cap="AVX2"), "fp32", 1e-4)):
        monkeypatch.setattr(precision, "detect_hardware", lambda hw=hw: hw)
        r = with_resolved_dtype(cfg)
        assert (r.model.dtype, r.training.refresh_tolerance) == (dtype, tol)
    explicit = load_config("configs/default.yaml", ["model.dtype=fp32"])
    assert with_resolved_dtype(explicit) is explicit and explicit.training.refresh_tolerance == 1e-4


def test_the_resolved_dtype_enters_the_stage_cache_keys(monkeypatch):
    from pivotrl.runtime import precision
    from pivotrl.config import load_config
    from pivotrl.provenance.fingerprints import inputs_fingerprint

    cfg = load_config("configs/smoke.yaml", ["model.dtype=auto"])
    keys = {}
    for name, hw in (("bf16", cpu(AVX512_BF16)), ("fp32", cpu(AVX2_ONLY, cap="AVX2"))):
        monkeypatch.setattr(precision, "detect_hardware", lambda hw=hw: hw)
        keys[name] = inputs_fingerprint(cfg)
    assert keys["bf16"]["precision"] == "bf16" and keys["fp32"]["precision"] == "fp32"
    assert keys["bf16"] != keys["fp32"]


def test_this_machine_resolves_consistently_with_torch():
    """What detect_hardware reads is what torch and /proc/cpuinfo say, and auto is bf16 exactly when
    they allow native bf16: on a CPU, a bf16 flag and torch kernels at AVX512 or better (and no oneDNN
    cap below its bf16 kernels); on CUDA, a device that supports bf16."""
    import torch

    from pivotrl.runtime.precision import detect_hardware

    hw = detect_hardware()
    p = resolve_precision("auto", hw)
    cuda = torch.cuda.is_available()
    assert hw.device == ("cuda" if cuda else "cpu")
    capability = str(torch.backends.cpu.get_cpu_capability())
    assert hw.torch_cpu_capability == capability
    try:
        with open("/proc/cpuinfo", encoding="utf-8", errors="replace") as f:
            flags_line = next((line for line in f if line.lower().startswith("flags")), "")
    except OSError:
        flags_line = ""
    flags = set(flags_line.partition(":")[2].lower().split())
    assert hw.cpu_flags == flags
    cpu_bf16 = (bool(flags & {"avx512_bf16", "amx_bf16"}) and capability in ("AVX512", "AVX512_BF16", "AMX")
                and (hw.onednn_max_isa or "").upper() not in ONEDNN_CAPS_BELOW_BF16)
    native = torch.cuda.is_bf16_supported() if cuda else cpu_bf16
    assert (p.dtype, p.native_bf16) == ("bf16" if native else "fp32", native)
