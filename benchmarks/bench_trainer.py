"""Trainer throughput: forward+backward of K actions per state, shared prefix vs naive.

Usage::

    python benchmarks/bench_trainer.py [--model SOURCE] [--groups 6] [--group-size 8] [--threads 1]
                                       [--naive-seqs N] [--json OUT] [--quick] [--trainer-step]

The model comes from ``pivotrl.runtime.models.resolve_model`` (default: the project's default source,
SmolLM2-135M-Instruct dequantised from Q4_1, not the original bf16 weights). States are drawn
uniformly at random from *all* real BFCL ``multi_turn_base`` turn states that fit
``--max-prompt`` (rendered with ``pivotrl.format.prompts.encode_state``), so P follows the real
distribution; the script prints that distribution. The K actions of a group are real
demonstrated actions of the same task (``pivotrl.format.prompts.encode_action``), the state's own first.
``--synthetic`` (or BFCL being unavailable) uses random ids with P in ``--min-prompt``..
``--max-prompt`` and T in ``--min-action``..``--max-action``.

For every group the two modes run back to back, in alternating order (shared first on even
groups, naive first on odd ones), each timing ``compute_group_logprobs`` + backward of the summed
log-probs in plain PyTorch (no DeepSpeed, no optimiser step):

* **shared**: the state once, its key/value cache repeated K times, the K actions on top:
  ``P + K·(T_max−1)`` tokens.
* **naive**: K sequences ``state + action[:-1]``, one per backward (same FLOPs as all K at once,
  1/K of the activation memory): ``K·(P+T_max−1)`` tokens. With ``--naive-seqs n < K`` only the
  first n sequences are timed and the time is scaled by K/n (each sequence costs the same: same
  P, actions padded to T_max); the table says so.

Reported per group and as medians: tokens run through the model, seconds, tokens/s, the
token ratio naive/shared and the speed-up (naive s / shared s), each with the 1-minute load
average when it was measured. ``--json`` also writes the raw numbers. With ``--trainer-step`` it
also times ``PivotRLTrainer.train_step`` (DeepSpeed ZeRO 0, policy + reference passes, one
optimiser update) with ``shared_prefix`` on and off, interleaved, on the same groups.
"""

from __future__ import annotations

import argparse
import os
import random
import sys
import time
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import (  # noqa: E402
    DEFAULT_CACHE_DIR, bfcl_multi_turn_states, distribution, header, load1, md_table, median,
    synthetic_ids, write_json,
)

Group = tuple[str, list[int], list[list[int]]]  # (state id, prompt ids (P,), K actions (T_i,))


def _groups(tokenizer: Any, args: argparse.Namespace, rng: random.Random) -> tuple[list[Group], str, list[int]]:
    """``--groups`` groups, where they came from, and P of every state they were drawn from."""
    if not args.synthetic:
        try:
            states = bfcl_multi_turn_states(tokenizer, args.cache_dir, max_prompt=args.max_prompt,
                                            records=args.bfcl_records)
            all_p = [len(p) for _, p, _ in states]
            picked = rng.sample(states, min(args.groups, len(states)))
            groups = []
            for sid, prompt, acts in picked:
                k = args.group_size
                groups.append((sid, prompt, [acts[i % len(acts)] for i in range(k)]))
            if len(groups) == args.groups:
                return groups, f"BFCL multi_turn_base turn states ({len(states)} fit in {args.max_prompt} tokens)", all_p
            print(f"only {len(groups)} BFCL states; topping up with synthetic ones", file=sys.stderr)
        except Exception as err:  # noqa: BLE001 - any failure → synthetic states, reported
            print(f"BFCL states unavailable ({type(err).__name__}: {err}); using synthetic ids", file=sys.stderr)
            groups = []
    else:
        groups = []
    vocab = len(tokenizer)
    while len(groups) < args.groups:
        p = rng.randint(args.min_prompt, args.max_prompt)
        acts = [synthetic_ids(rng, vocab, rng.randint(args.min_action, args.max_action)) for _ in range(args.group_size)]
        groups.append((f"synthetic-{len(groups)}", synthetic_ids(rng, vocab, p), acts))
    return groups, "synthetic token ids", [len(p) for _, p, _ in groups]


def _run(model: Any, prompt: list[int], actions: list[list[int]], shared: bool, naive_seqs: int) -> tuple[float, int]:
    """Forward+backward of one group → (seconds, tokens run through the model), naive scaled to K."""
    from pivotrl.training.logprobs import compute_group_logprobs, processed_tokens

    k = len(actions)
    t_max = max(len(a) for a in actions)
    t0 = time.perf_counter()
    if shared:
        res = compute_group_logprobs(model, prompt, actions, shared_prefix=True)
        res.logprobs.sum().backward()
        if not res.shared_prefix:
            raise RuntimeError("the model fell back to the naive path; the shared mode cannot be measured")
        secs = time.perf_counter() - t0
    else:
        n = min(naive_seqs, k)
        for a in actions[:n]:
            # pad every sequence to T_max so each one costs what it does inside a batched group
            padded = list(a) + [a[-1]] * (t_max - len(a))
            compute_group_logprobs(model, prompt, [padded], shared_prefix=False).logprobs.sum().backward()
        secs = (time.perf_counter() - t0) * k / n
    model.zero_grad(set_to_none=True)
    return secs, processed_tokens(len(prompt), [len(a) for a in actions], shared_prefix=shared)


def packed_group_logprobs(model: Any, prompt: list[int], actions: list[list[int]]) -> tuple[torch.Tensor, torch.Tensor]:
    """Log-probs (K, T_max) and action mask (K, T_max) of K actions at one state in ONE sequence.

    An alternative to the shared-prefix cache path, measured by ``--packed``: the input is
    ``state + a_1[:-1] + … + a_K[:-1]`` (each action right-padded to T_max, ``P + K·(T_max−1)``
    tokens) with explicit ``position_ids`` (every action starts at position P) and a 4-D boolean
    attention mask: the state is causal, every action token sees the whole state and its own
    earlier tokens only. Nothing is repeated K times, so the backward pass computes the state's
    key/value gradients once instead of once per action. Same numbers as the naive computation
    (up to rounding). Needs a model that accepts a 4-D boolean ``attention_mask`` (Llama does).
    """
    k, p = len(actions), len(prompt)
    t_max = max(len(a) for a in actions)
    s = t_max - 1
    ids = torch.zeros(k, t_max, dtype=torch.long)
    mask = torch.zeros(k, t_max)
    for i, a in enumerate(actions):
        ids[i, : len(a)] = torch.tensor(a)
        mask[i, : len(a)] = 1.0
    length = p + k * s
    inputs = torch.cat([torch.tensor(prompt), ids[:, :-1].reshape(-1)]).unsqueeze(0)  # (1, P + K·s)
    positions = torch.cat([torch.arange(p), (p + torch.arange(s)).repeat(k)]).unsqueeze(0)
    attend = torch.zeros(length, length, dtype=torch.bool)
    attend[:p, :p] = torch.ones(p, p, dtype=torch.bool).tril()
    attend[p:, :p] = True
    block = torch.ones(s, s, dtype=torch.bool).tril()
    for i in range(k):
        attend[p + i * s : p + (i + 1) * s, p + i * s : p + (i + 1) * s] = block
    logits = model(input_ids=inputs, position_ids=positions, attention_mask=attend[None, None],
                   logits_to_keep=k * s + 1, use_cache=False).logits[0]  # (K·s + 1, V)
    logits = logits.double() if logits.dtype == torch.float64 else logits.float()
    first = logits[:1].expand(k, -1).unsqueeze(1)  # the state's last position predicts every first token
    full = torch.cat([first, logits[1:].view(k, s, -1)], dim=1)  # (K, T_max, V)
    logprobs = torch.log_softmax(full, dim=-1).gather(-1, ids.unsqueeze(-1)).squeeze(-1)
    return logprobs * mask.to(logprobs.dtype), mask


def _run_packed(model: Any, prompt: list[int], actions: list[list[int]]) -> tuple[float, int]:
    t0 = time.perf_counter()
    packed_group_logprobs(model, prompt, actions)[0].sum().backward()
    secs = time.perf_counter() - t0
    model.zero_grad(set_to_none=True)
    return secs, len(prompt) + len(actions) * (max(len(a) for a in actions) - 1)


def _trainer_steps(model_dir: Any, groups: list[Group], args: argparse.Namespace) -> list[list[Any]]:
    """Interleaved ``PivotRLTrainer.train_step`` timings with shared_prefix on/off → table rows."""
    from pivotrl.training.pivotrl import Group as TrainGroup, PivotRLTrainer

    batch = [TrainGroup(sid, p, acts, [float(j % 2) for j in range(len(acts))]) for sid, p, acts in groups]
    trainers = {mode: PivotRLTrainer.build(str(model_dir), group_size=args.group_size, dtype=args.dtype, lr=1e-7,
                                           beta=0.01, seed=args.seed, shared_prefix=(mode == "shared"))
                for mode in ("shared", "naive")}
    rows = []
    for rep in range(args.repeats):
        for mode in (("shared", "naive") if rep % 2 == 0 else ("naive", "shared")):
            la = load1()
            m = trainers[mode].train_step(batch)
            rows.append([rep, mode, len(batch), m["step_time_s"], m["policy_tokens_per_s"], la])
    return rows


def main(argv: list[str] | None = None) -> int:
    from pivotrl.runtime.models import DEFAULT_MODEL_SOURCE

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=DEFAULT_MODEL_SOURCE, help="model source for pivotrl.runtime.models.resolve_model")
    ap.add_argument("--cache-dir", default=DEFAULT_CACHE_DIR)
    ap.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    ap.add_argument("--groups", type=int, default=6)
    ap.add_argument("--group-size", type=int, default=8)
    ap.add_argument("--min-prompt", type=int, default=500, help="synthetic states only")
    ap.add_argument("--max-prompt", type=int, default=8096, help="longest state (default: 8192 context − 96 action tokens)")
    ap.add_argument("--min-action", type=int, default=3, help="synthetic actions only")
    ap.add_argument("--max-action", type=int, default=40, help="synthetic actions only")
    ap.add_argument("--bfcl-records", type=int, default=None, help="first N multi_turn_base records (default all 200)")
    ap.add_argument("--naive-seqs", type=int, default=None, help="time only this many of the K naive sequences")
    ap.add_argument("--repeats", type=int, default=1, help="passes over the groups (trainer step: steps per mode)")
    ap.add_argument("--threads", type=int, default=int(os.environ.get("OMP_NUM_THREADS", "1")))
    ap.add_argument("--synthetic", action="store_true")
    ap.add_argument("--quick", action="store_true", help="2 synthetic groups of K=4, P 64–128 (for tests)")
    ap.add_argument("--packed", action="store_true", help="also time the one-sequence block-mask variant")
    ap.add_argument("--trainer-step", action="store_true", help="also time PivotRLTrainer.train_step, shared vs naive")
    ap.add_argument("--json", default=None, help="also write the raw numbers here")
    ap.add_argument("--dump-groups", default=None, help="write the groups (ids) as JSON for bench_trl.py and exit")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args(argv)
    if args.quick:
        args.synthetic, args.groups, args.group_size = True, 2, 4
        args.min_prompt, args.max_prompt, args.min_action, args.max_action = 64, 128, 3, 12
    naive_seqs = args.naive_seqs or args.group_size
    if args.groups < 1 or args.group_size < 1 or naive_seqs < 1:
        ap.error("--groups, --group-size and --naive-seqs must be >= 1")

    from pivotrl.runtime.models import load_tokenizer, resolve_model
    from pivotrl.training.deepspeed_utils import load_causal_lm
    from pivotrl.training.logprobs import compute_group_logprobs

    print(header("Trainer: shared-prefix vs naive forward+backward"))
    torch.set_num_threads(args.threads)
    rng = random.Random(args.seed)
    model_dir = resolve_model(args.model, args.cache_dir)
    tokenizer = load_tokenizer(model_dir)
    groups, origin, all_p = _groups(tokenizer, args, rng)
    dtype = torch.bfloat16 if args.dtype == "bfloat16" else torch.float32
    if args.dump_groups:
        write_json(args.dump_groups, {"model_dir": str(model_dir), "origin": origin, "groups": [
            {"state": sid, "prompt_ids": p, "actions": acts} for sid, p, acts in groups]})
        print(f"wrote {len(groups)} groups to {args.dump_groups}; P of the pool: {distribution(all_p)}")
        return 0
    model = load_causal_lm(model_dir, dtype).eval()

    # warm-up (allocations, kernel selection) in both modes on a short group
    for shared in (True, False):
        compute_group_logprobs(model, groups[0][1][:64], groups[0][2][:2], shared_prefix=shared).logprobs.sum().backward()
    model.zero_grad(set_to_none=True)

    rows, raw, prows = [], [], []
    for rep in range(args.repeats):
        for gi, (sid, prompt, actions) in enumerate(groups):
            order = (True, False) if (gi + rep) % 2 == 0 else (False, True)
            res: dict[bool, tuple[float, int, float]] = {}
            for shared in order:
                la = load1()
                secs, toks = _run(model, prompt, actions, shared, naive_seqs)
                res[shared] = (secs, toks, la)
            (ss, st, sl), (ns, nt, nl) = res[True], res[False]
            if args.packed:
                la = load1()
                ps, pt = _run_packed(model, prompt, actions)
                la2 = load1()
                ss2, _ = _run(model, prompt, actions, True, naive_seqs)  # shared again, right after: a fair pair
                prows.append([sid, len(prompt), pt, ps, ss2, ss2 / ps, ns / ps, la, la2])
            t_max = max(len(a) for a in actions)
            rows.append([sid, len(prompt), t_max, len(actions), st, nt, nt / st, ss, ns, ns / ss, st / ss, nt / ns, sl, nl])
            raw.append({"state": sid, "P": len(prompt), "T_max": t_max, "K": len(actions), "shared_tokens": st,
                        "naive_tokens": nt, "shared_s": ss, "naive_s": ns, "load_shared": sl, "load_naive": nl})
            print(f"group {sid}: P={len(prompt)} shared {ss:.2f}s naive {ns:.2f}s ({ns / ss:.2f}x, load {nl:.2f})",
                  file=sys.stderr, flush=True)

    p_used = [len(p) for _, p, _ in groups]
    t_used = [len(a) for _, _, acts in groups for a in acts]
    scaled = f"; naive time = {naive_seqs} of K={args.group_size} sequences timed × K/{naive_seqs}" if naive_seqs < args.group_size else ""
    print(f"model: {args.model} ({model_dir}), dtype {args.dtype}, torch threads {args.threads}\n")
    print(f"states: {origin}\n\nP of all those states: {distribution(all_p)}  \nP of the {len(groups)} groups drawn: "
          f"{distribution(p_used)}  \naction tokens T: {distribution(t_used)}; K={args.group_size}{scaled}\n")
    print(md_table(["group", "P", "T_max", "K", "shared tokens", "naive tokens", "token ratio", "shared s", "naive s",
                    "speed-up", "shared tok/s", "naive tok/s", "load (shared)", "load (naive)"], rows))
    med = {k: median(r[k] for r in raw) for k in raw[0] if k not in ("state",)}
    speedups = [r[9] for r in rows]
    summary = [
        ["shared", med["shared_tokens"], med["shared_s"], median(r[10] for r in rows),
         median(r["naive_tokens"] / r["shared_s"] for r in raw), med["load_shared"]],
        ["naive", med["naive_tokens"], med["naive_s"], median(r[11] for r in rows),
         median(r["naive_tokens"] / r["naive_s"] for r in raw), med["load_naive"]],
    ]
    print("\nMedians over groups:\n")
    print(md_table(["mode", "tokens per group", "s per group", "processed tok/s", "naive-equivalent tok/s", "load"], summary))
    token_ratio = median(r[6] for r in rows)
    speedup = median(speedups)
    print(f"\nnaive/shared processed tokens (median): {token_ratio:.2f}x  \n"
          f"speed-up per group, naive s / shared s (median of per-group ratios): {speedup:.2f}x "
          f"(min {min(speedups):.2f}x, max {max(speedups):.2f}x)")
    if prows:
        print("\nPacked variant (one sequence, block mask; timed right before a second shared run):\n")
        print(md_table(["group", "P", "packed tokens", "packed s", "shared s", "shared s / packed s",
                        "naive s / packed s", "load (packed)", "load (shared)"], prows))
        print(f"\npacked vs shared (median): {median(r[5] for r in prows):.2f}x faster; vs naive: "
              f"{median(r[6] for r in prows):.2f}x")
    out: dict[str, Any] = {"packed": prows, "groups": raw, "token_ratio": token_ratio, "speedup": speedup, "P_all": distribution(all_p),
                           "origin": origin, "model_dir": str(model_dir), "dtype": args.dtype, "threads": args.threads}

    if args.trainer_step:
        trows = _trainer_steps(model_dir, groups, args)
        print("\nPivotRLTrainer.train_step (DeepSpeed ZeRO 0, policy fwd+bwd + reference fwd + optimiser update):\n")
        print(md_table(["repeat", "mode", "groups", "step s", "policy tokens/s (forward+backward)", "load"], trows))
        tr = median(n[3] / s[3] for s, n in zip([r for r in trows if r[1] == "shared"], [r for r in trows if r[1] == "naive"]))
        print(f"\ntrain_step speed-up, naive / shared (median): {tr:.2f}x")
        out["trainer_step"] = {"rows": trows, "speedup": tr}
    if args.json:
        write_json(args.json, out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
