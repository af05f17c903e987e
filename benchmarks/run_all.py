"""Run every benchmark in sequence and collect their markdown output in one file (``make bench``).

Usage::

    python benchmarks/run_all.py [--quick] [--only trainer,rollout,trl,pipeline] [--out FILE]
                                 [--trl-python PATH]

Each benchmark runs as its own process with the interpreter running this script (TRL's with
``--trl-python``, default: the environment variable ``PIVOTRL_TRL_PYTHON``; without one the TRL
comparison is skipped and the output says so). The combined markdown goes to ``--out`` (default
``runs/benchmarks/results-<UTC timestamp>.md``, written atomically) and to stdout. ``--quick`` runs
each script's ``--quick`` mode on a tiny random model (seconds to a few minutes; numbers
meaningless, for checking that everything runs). Curated numbers with their commands, dates and
load live in ``benchmarks/RESULTS.md``.

The default (full) commands are those quoted in RESULTS.md: real BFCL states, SmolLM2-135M.
"""

from __future__ import annotations

import argparse
import datetime as dt
import os
import subprocess
import sys
import tempfile
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent

FULL = {
    "trainer": ["bench_trainer.py", "--groups", "6", "--threads", "1"],
    "rollout": ["bench_rollout.py", "--prompts", "16", "--n", "8", "--max-tokens", "64", "--repeats", "2",
                "--order", "trajectory", "--engines", "vllm,transformers"],
    "pipeline": ["bench_pipeline.py"],
}
QUICK = {
    "trainer": ["bench_trainer.py", "--quick"],
    "rollout": ["bench_rollout.py", "--quick"],
    "pipeline": ["bench_pipeline.py", "--quick"],
}
ORDER = ("trainer", "trl", "rollout", "pipeline")


def _run(cmd: list[str], env: dict[str, str]) -> str:
    """Run one benchmark; its stdout (the markdown), or a failure note with the tail of stderr."""
    shown = " ".join(Path(c).name if c == sys.executable else c for c in cmd)
    print(f"running: {shown}", file=sys.stderr, flush=True)
    proc = subprocess.run(cmd, cwd=str(ROOT), env=env, capture_output=True, text=True)
    if proc.returncode != 0:
        tail = "\n".join(proc.stderr.strip().splitlines()[-15:])
        return f"## {shown}\n\nFAILED (exit code {proc.returncode}):\n\n```\n{tail}\n```\n"
    return proc.stdout


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--only", default=",".join(ORDER), help=f"comma-separated subset of {','.join(ORDER)}")
    ap.add_argument("--out", default=None)
    ap.add_argument("--model", default=None, help="model for trainer/rollout (--quick: a fresh tiny checkpoint)")
    ap.add_argument("--trl-python", default=os.environ.get("PIVOTRL_TRL_PYTHON"))
    args = ap.parse_args(argv)
    chosen = [b for b in args.only.split(",") if b]
    unknown = sorted(set(chosen) - set(ORDER))
    if unknown:
        ap.error(f"unknown benchmark(s) {unknown}; valid: {', '.join(ORDER)}")

    env = {**os.environ, "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1"), "TOKENIZERS_PARALLELISM": "false"}
    table = QUICK if args.quick else FULL
    stamp = dt.datetime.now(dt.timezone.utc).strftime("%Y%m%dT%H%M%SZ")
    parts = [f"# pivotrl benchmarks ({'quick' if args.quick else 'full'}), {stamp}\n"]
    with tempfile.TemporaryDirectory(prefix="pivotrl-bench-") as tmp:
        model = args.model
        if model is None and args.quick:
            from pivotrl.testing import save_tiny_checkpoint

            model = str(save_tiny_checkpoint(Path(tmp) / "tiny"))
        model_args = ["--model", model] if model else []
        for name in (b for b in ORDER if b in chosen):
            if name == "trl":
                if not args.trl_python:
                    parts.append("## TRL comparison\n\nskipped: no --trl-python / PIVOTRL_TRL_PYTHON "
                                 "(an interpreter whose environment has trl; see bench_trl.py)\n")
                    continue
                groups = str(Path(tmp) / "groups.json")
                trainer = table["trainer"]
                dump = [sys.executable, str(HERE / trainer[0]), *trainer[1:], *model_args, "--dump-groups", groups]
                if not args.quick:
                    dump += ["--groups", "3"]
                parts.append(_run(dump, env))
                parts.append(_run([args.trl_python, str(HERE / "bench_trl.py"), "--groups-json", groups], env))
                continue
            script, *rest = table[name]
            extra = model_args if name in ("trainer", "rollout") else []
            parts.append(_run([sys.executable, str(HERE / script), *rest, *extra], env))
    text = "\n\n".join(p.strip() + "\n" for p in parts)
    out = Path(args.out) if args.out else ROOT / "runs" / "benchmarks" / f"results-{stamp}.md"
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp_out = out.with_name(out.name + ".tmp")
    tmp_out.write_text(text)
    tmp_out.replace(out)
    print(text)
    print(f"written to {out}", file=sys.stderr)
    return 0 if "FAILED (exit code" not in text else 1


if __name__ == "__main__":
    raise SystemExit(main())
