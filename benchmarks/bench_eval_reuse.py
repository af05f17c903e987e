"""The evaluate stage after a change of training settings: every policy evaluated vs the base
model's and π_ref's results reused from the store, interleaved in one process.

Usage::

    python benchmarks/bench_eval_reuse.py [--pairs 3] [--model DIR] [--json OUT]

The smoke config (``configs/smoke.yaml``, the tiny random model on the transformers engine): every
stage once in a scratch root (run A), then a second training run that differs in
``training.max_steps`` only (run B: a new policy; the same base model and π_ref). Then, per pair,
run B's evaluate stage (:func:`pivotrl.pipeline.stages.stage_evaluate`) in two fresh copies of the
root, in alternating order:

- "cold": the copy holds no evaluation artifact, so base, π_ref and the new policy are all
  evaluated (what the stage did for run B before each policy's results had a key of their own;
  it now also writes and reads back each policy's part, a few small files);
- "reuse": the copy holds run A's evaluation, so the base model's and π_ref's parts are read back
  and only the new policy is evaluated.

Reports the wall seconds of each stage call, the prompts the engine served per policy (from the
shards' manifests, ``policy_parts``), that both reports are the same (``comparable_report``) and
the median per-pair ratio cold / reuse.
"""

from __future__ import annotations

import argparse
import shutil
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests" / "integration"))
from _common import header, load1, md_table, median, write_json  # noqa: E402


def _requests(store: Any, cfg: Any, run: Any, train: Any) -> dict[str, int]:
    """Policy → prompts its evaluation sent to the engine in this stage call, over the shards."""
    from pivotrl.pipeline.evaluate_stage import plan_eval_shards

    out: dict[str, int] = {}
    for s in plan_eval_shards(cfg, store, run.demos, run.ref, run.probe, train)["shards"]:
        for name, d in store.read_manifest(s["output"]).extra["policy_parts"].items():
            out[name] = out.get(name, 0) + int(d["requests"] or 0)
    return out


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--pairs", type=int, default=3)
    ap.add_argument("--model", default=None, help="tiny checkpoint directory (default: written in the scratch dir)")
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)

    from smoke_runs import run_smoke_stages, smoke_config

    from pivotrl.pipeline import stages
    from pivotrl.storage import ArtifactStore
    from pivotrl.testing import comparable_report, save_tiny_checkpoint

    print(header("Evaluation after a training change: every policy vs base and π_ref reused", sys.argv))
    tmp = Path(tempfile.mkdtemp(prefix="bench_eval_reuse_"))
    try:
        model = Path(args.model) if args.model else save_tiny_checkpoint(tmp / "tiny")
        t0 = time.perf_counter()
        run = run_smoke_stages(smoke_config(tmp / "a", model))  # run A, every stage
        cfg_b = run.cfg.model_copy(update={"training": run.cfg.training.model_copy(update={"max_steps": 1})})
        train_b = stages.stage_train(cfg_b, run.store, run.probe, run.ref)  # run B's policy
        print(f"setup (run A, run B's training): {time.perf_counter() - t0:.1f} s\n")
        src = Path(run.cfg.run.storage_root)

        def evaluate(variant: str, i: int) -> dict[str, Any]:
            root = tmp / f"{variant}{i}"
            keep_eval = variant == "reuse"
            shutil.copytree(src, root, ignore=lambda d, names: [] if keep_eval else [
                n for n in names if Path(d) == src and n == "eval"])
            cfg = cfg_b.model_copy(update={"run": cfg_b.run.model_copy(update={"storage_root": str(root)})})
            store = ArtifactStore(str(root))
            la = load1()
            t = time.perf_counter()
            ev = stages.stage_evaluate(cfg, store, run.demos, run.ref, run.probe, train_b)
            wall = time.perf_counter() - t
            return {"variant": variant, "pair": i, "wall_s": wall, "load": la, "root": root,
                    "requests": _requests(store, cfg, run, train_b), "result": ev.to_dict()}

        rows = []
        for i in range(args.pairs):
            order = ("cold", "reuse") if i % 2 == 0 else ("reuse", "cold")
            rows += [evaluate(v, i) for v in order]
        roots = [r["root"] for r in rows]
        same = all(comparable_report(r["result"], roots) == comparable_report(rows[0]["result"], roots) for r in rows)
        table = [(r["pair"], r["variant"], r["wall_s"], r["requests"].get("base", 0),
                  r["requests"].get("reference", 0), r["requests"].get("pivotrl", 0), r["load"]) for r in rows]
        print(md_table(["pair", "variant", "evaluate stage wall s", "base prompts", "π_ref prompts",
                        "PivotRL prompts", "load"], table))
        by = {(r["pair"], r["variant"]): r["wall_s"] for r in rows}
        ratios = [by[(i, "cold")] / by[(i, "reuse")] for i in range(args.pairs)]
        print(f"\nsame report (comparable_report) in every run: {same}")
        print(f"cold / reuse, per pair: {', '.join(f'{x:.2f}' for x in ratios)}; median {median(ratios):.2f}x")
        if args.json:
            write_json(args.json, {"rows": [{k: v for k, v in r.items() if k not in ("root", "result")} for r in rows],
                                   "ratios": ratios, "same_report": same})
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


if __name__ == "__main__":
    main()
