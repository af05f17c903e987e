"""The same GRPO update with TRL's ``GRPOTrainer`` and with pivotrl, timed interleaved in one process.

TRL is *not* a dependency of pivotrl. Run this script with the interpreter of a separate virtual
environment that has ``trl`` (and the same ``torch``); it imports pivotrl's pure modules
(``pivotrl.training.logprobs``, ``pivotrl.objective``) from this checkout::

    python -m venv <tmp>/trl-venv
    <tmp>/trl-venv/bin/pip install torch==2.13.0          # pinned first: never let pip pick torch
    echo torch==2.13.0 > <tmp>/c.txt && <tmp>/trl-venv/bin/pip install -c <tmp>/c.txt trl
    .venv/bin/python benchmarks/bench_trainer.py --groups 4 --dump-groups <tmp>/groups.json ...
    <tmp>/trl-venv/bin/python benchmarks/bench_trl.py --groups-json <tmp>/groups.json

The groups file (written by ``bench_trainer.py --dump-groups``) holds the model directory and the
groups: real BFCL states (P tokens) with K real demonstrated actions each.

Per group, interleaved (order alternating between groups), on one bf16 model instance, each a
forward+backward of one group of K actions with advantages from rewards 0/1 and β = 0 (no reference
pass on either side; no optimiser step):

* **trl**: ``GRPOTrainer.compute_loss`` + ``backward`` on the pre-generated completions
  (``prompt_ids``/``completion_ids`` tensors as its generation step produces them: prompts
  left-padded, completions right-padded). TRL runs the K sequences ``prompt + completion``
  (``K·(P+T_max)`` tokens), gradient checkpointing off (TRL's default is on: slower still).
* **pivotrl**: ``compute_group_logprobs`` (shared prefix: ``P + K·(T_max−1)`` tokens) +
  ``pivotrl_loss`` + ``backward``.

With ``--full-step`` it also times one whole ``GRPOTrainer.train()`` step per group (generation of
K completions of ``--gen-tokens`` tokens with transformers ``generate``, a constant reward, the loss,
backward and an AdamW step), which is what a TRL GRPO step costs end to end on this machine.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

import torch  # noqa: E402

from _common import header, load1, md_table, median  # noqa: E402


def _trl_inputs(prompt: list[int], actions: list[list[int]], pad: int, adv: torch.Tensor) -> dict[str, Any]:
    """The tensors TRL's generation step hands to its loss, for one group (K rows)."""
    k, t_max = len(actions), max(len(a) for a in actions)
    comp = torch.full((k, t_max), pad, dtype=torch.long)
    cmask = torch.zeros(k, t_max, dtype=torch.long)
    for i, a in enumerate(actions):
        comp[i, : len(a)] = torch.tensor(a)
        cmask[i, : len(a)] = 1
    p = torch.tensor(prompt).unsqueeze(0).expand(k, -1).contiguous()
    return {"prompt_ids": p, "prompt_mask": torch.ones_like(p), "completion_ids": comp, "completion_mask": cmask,
            "advantages": adv, "num_items_in_batch": cmask.sum()}


def _make_trainer(model: Any, tokenizer: Any, k: int, t_max: int, out: str, args: argparse.Namespace) -> Any:
    from datasets import Dataset
    from trl import GRPOConfig, GRPOTrainer

    cfg = GRPOConfig(
        output_dir=out, use_cpu=True, bf16=False, gradient_checkpointing=False, beta=0.0, num_generations=k,
        per_device_train_batch_size=k, max_completion_length=t_max, max_steps=1, learning_rate=1e-7,
        logging_steps=1, report_to=[], save_strategy="no", temperature=1.0, seed=0,
        dataloader_num_workers=0,
    )
    ds = Dataset.from_dict({"prompt": ["x"] * k})
    return GRPOTrainer(model=model, reward_funcs=lambda completions, **kw: [1.0] * len(completions), args=cfg,
                       train_dataset=ds, processing_class=tokenizer)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--groups-json", required=True, help="written by bench_trainer.py --dump-groups")
    ap.add_argument("--repeats", type=int, default=1)
    ap.add_argument("--threads", type=int, default=int(os.environ.get("OMP_NUM_THREADS", "1")))
    ap.add_argument("--full-step", action="store_true", help="also time one whole GRPOTrainer.train() step")
    ap.add_argument("--gen-tokens", type=int, default=16, help="completion length of --full-step generation")
    args = ap.parse_args(argv)

    import transformers
    import trl
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from pivotrl.objective import compute_advantages, pivotrl_loss
    from pivotrl.training.logprobs import compute_group_logprobs

    torch.set_num_threads(args.threads)
    spec = json.loads(Path(args.groups_json).read_text())
    model_dir, groups = spec["model_dir"], spec["groups"]
    print(header("TRL GRPOTrainer vs pivotrl: one group's loss + backward"))
    print(f"trl {trl.__version__}, transformers {transformers.__version__}, torch {torch.__version__}; model {model_dir} "
          f"(bf16); torch threads {args.threads}; {len(groups)} groups from {spec.get('origin', '?')}\n")
    tok = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.bfloat16)
    k = len(groups[0]["actions"])
    t_all = max(len(a) for g in groups for a in g["actions"])
    with tempfile.TemporaryDirectory() as out:
        trainer = _make_trainer(model, tok, k, t_all, out, args)
        trainer.model.train()
        trainer.current_gradient_accumulation_steps = 1  # set by the training loop; one window here
        print(f"TRL loss_type {trainer.loss_type!r}, beta {trainer.beta}, gradient checkpointing off\n")
        net = trainer.model
        pad = tok.pad_token_id if tok.pad_token_id is not None else tok.eos_token_id
        rows = []
        for rep in range(args.repeats):
            for gi, g in enumerate(groups):
                prompt, actions = g["prompt_ids"], g["actions"]
                rewards = torch.tensor([float(i % 2) for i in range(len(actions))])
                adv = compute_advantages(rewards)  # (K,) GRPO advantages
                times: dict[str, tuple[float, float]] = {}
                order = ("trl", "pivotrl") if (gi + rep) % 2 == 0 else ("pivotrl", "trl")
                for mode in order:
                    la = load1()
                    t0 = time.perf_counter()
                    if mode == "trl":
                        loss = trainer.compute_loss(net, _trl_inputs(prompt, actions, pad, adv.float()))
                    else:
                        res = compute_group_logprobs(net, prompt, actions, shared_prefix=True)
                        old = res.logprobs.detach()
                        loss, _ = pivotrl_loss(res.logprobs, old, old, adv.float(), res.action_mask, epsilon=0.2, beta=0.0)
                    loss.backward()
                    times[mode] = (time.perf_counter() - t0, la)
                    net.zero_grad(set_to_none=True)
                t_max = max(len(a) for a in actions)
                trl_tok, piv_tok = k * (len(prompt) + t_max), len(prompt) + k * (t_max - 1)
                rows.append([g["state"], len(prompt), t_max, k, trl_tok, piv_tok, times["trl"][0], times["pivotrl"][0],
                             times["trl"][0] / times["pivotrl"][0], times["trl"][1], times["pivotrl"][1]])
                print(f"{g['state']}: trl {times['trl'][0]:.2f}s pivotrl {times['pivotrl'][0]:.2f}s", file=sys.stderr, flush=True)
        print(md_table(["group", "P", "T_max", "K", "trl tokens", "pivotrl tokens", "trl s", "pivotrl s", "speed-up",
                        "load (trl)", "load (pivotrl)"], rows))
        sp = [r[8] for r in rows]
        print(f"\nTRL loss+backward / pivotrl loss+backward per group (median of per-group ratios): {median(sp):.2f}x "
              f"(min {min(sp):.2f}x, max {max(sp):.2f}x)")

        if args.full_step:
            from datasets import Dataset

            frows = []
            for g in groups:
                text = tok.decode(g["prompt_ids"], skip_special_tokens=False)
                tr = _make_trainer(net, tok, k, args.gen_tokens, out, args)
                tr.train_dataset = Dataset.from_dict({"prompt": [text] * k})
                la = load1()
                t0 = time.perf_counter()
                tr.train()
                frows.append([g["state"], len(g["prompt_ids"]), k, args.gen_tokens, time.perf_counter() - t0, la])
            print(f"\nWhole GRPOTrainer.train() step (generate K × {args.gen_tokens} tokens, constant reward, loss, "
                  f"backward, AdamW; prompt passed as text):\n")
            print(md_table(["group", "P", "K", "gen tokens", "step s", "load"], frows))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
