"""One rank of ``test_engines``' several-rank test: the PivotRL loop with a rollout engine on every
rank (``hosts=[0, 1]``), under ``torch.distributed.run`` (gloo). Writes ``rank<r>.json`` to the
output directory: the loop's rows, what this rank's engine counted (its generation meter's
totals included), and its final log-probs."""

from __future__ import annotations

import dataclasses
import json
import sys
from pathlib import Path
from types import SimpleNamespace

sys.path.insert(0, str(Path(__file__).resolve().parent))

from test_engines import ACTION, PROMPTS, CountingEngine, EvenVerifier, _settings  # noqa: E402


def main(ckpt: str, out: str) -> None:
    from pivotrl.rollout.hf import TransformersEngine
    from pivotrl.training.checkpoints import rank_and_world
    from pivotrl.training.loop import pivot_schedule, run_rl_loop
    from pivotrl.training.pivotrl import PivotRLTrainer

    trainer = PivotRLTrainer.build(ckpt, group_size=4, dtype="float32", lr=1e-3, beta=0.0, updates_per_batch=1, seed=0)
    rank, world = rank_and_world()
    engine = CountingEngine(ckpt, dtype="fp32", max_model_len=256)
    pivots = [SimpleNamespace(state_id=f"p{i}") for i in range(len(PROMPTS))]
    schedule = pivot_schedule(len(pivots), 5, 2, seed=0, max_steps=None)
    rows = run_rl_loop(trainer, engine, EvenVerifier(), pivots, PROMPTS, schedule, _settings(),
                       Path(out) / f"work{rank}", progress=False, rank=rank, world=world, hosts=[0, 1])
    final = TransformersEngine.score(engine, [PROMPTS[0]], [ACTION])[0]
    Path(out, f"rank{rank}.json").write_text(json.dumps({
        "world": world, "rows": rows, "refreshes": engine.refreshes, "scores": engine.scores,
        "prompts": engine.prompts, "final_logprobs": [float(x) for x in final],
        "meter": dataclasses.asdict(engine.meter.totals())}))
    engine.close()


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
