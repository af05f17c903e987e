"""Supervised warm start: next-token loss on the assistant action tokens of demonstrations.

The default reference model cannot produce the action format at all (see the measured notes), so
pivot filtering needs a policy that can act: this module fine-tunes it on demonstration turns
first. Examples are ``(input_ids, loss_mask)`` pairs from ``pivotrl.format.prompts.build_sft_example``:
``loss_mask[t] = 1`` on assistant action tokens (including their end-of-turn token), 0 on the
system prompt, tool schemas, user turns and tool outputs.

Loss per optimiser step (one batch of ``batch_size`` examples)::

    loss = − Σ_{examples, t: loss_mask[t]=1} log π(x_t | x_<t)  /  (number of such tokens in the batch)

a token-level mean over the *global* batch: the same on 1 or many ranks (each rank's share is
divided by the global token count; see ``deepspeed_utils.data_parallel_loss_scale``). Batches are
drawn from a per-epoch shuffle seeded by ``seed``; each rank processes its examples in micro-batches
of ``micro_batch_size`` (right-padded). Same DeepSpeed engine and launch path as the RL trainer.

Budgets (:func:`run_sft`): ``epochs`` passes, or with ``cycle`` an endless stream of seeded epoch
orders cut into full batches (every example once before any twice), stopped by ``max_steps`` or by
``max_wall_s``, the wall time of the optimiser steps (exports left out) at the first step past it;
``snapshot_step`` exports the policy after that step too, so one run gives the policy at a step
count and at a wall time.
"""

from __future__ import annotations

import json
import math
import os
import random
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Iterator, Sequence

import torch

from pivotrl.core.errors import ConfigError, DataError, TrainingError
from pivotrl.storage.files import atomic_file
from pivotrl.runtime.mfu import ModelShape, attention_pairs_causal, mfu, train_flops
from pivotrl.training.deepspeed_utils import (
    build_engine,
    data_parallel_loss_scale,
    export_hf_checkpoint,
    load_causal_lm,
    rank_and_world,
)

__all__ = ["SFTSpec", "main", "read_examples", "run_sft", "sft_batch_loss"]

Example = tuple[Sequence[int], Sequence[int]]


def _check_examples(examples: Sequence[Example]) -> None:
    if len(examples) == 0:
        raise DataError("run_sft: no examples")
    for i, ex in enumerate(examples):
        if len(ex) != 2:
            raise DataError(f"SFT example {i}: expected (input_ids, loss_mask), got {len(ex)} items")
        ids, mask = ex
        if len(ids) != len(mask):
            raise DataError(f"SFT example {i}: input_ids has {len(ids)} tokens but loss_mask has {len(mask)}")
        if len(ids) < 2:
            raise DataError(f"SFT example {i}: needs at least 2 tokens, got {len(ids)}")
        if any(m not in (0, 1) for m in mask):
            raise DataError(f"SFT example {i}: loss_mask must contain only 0 and 1")
        if not any(mask[1:]):
            raise DataError(f"SFT example {i}: loss_mask marks no predictable token (positions ≥ 1)")


def _collate(examples: Sequence[Example], device: torch.device) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Right-pad to (B, L): input ids, attention mask (long) and loss mask (float)."""
    length = max(len(ids) for ids, _ in examples)
    ids_t = torch.zeros(len(examples), length, dtype=torch.long, device=device)
    attn = torch.zeros(len(examples), length, dtype=torch.long, device=device)
    loss_mask = torch.zeros(len(examples), length, dtype=torch.float32, device=device)
    for i, (ids, mask) in enumerate(examples):
        ids_t[i, : len(ids)] = torch.as_tensor(list(ids), dtype=torch.long)
        attn[i, : len(ids)] = 1
        loss_mask[i, : len(ids)] = torch.as_tensor(list(mask), dtype=torch.float32)
    return ids_t, attn, loss_mask


def sft_batch_loss(model: Any, examples: Sequence[Example], num_tokens: int) -> tuple[torch.Tensor, float]:
    """Summed masked negative log-likelihood of ``examples`` divided by ``num_tokens``.

    ``num_tokens`` is the number of loss tokens (mask = 1 at positions ≥ 1) of the whole global
    batch. Returns ``(loss scalar fp32, summed NLL as a float)``. (B, L) internally.
    The output layer and log-softmax run only at the positions that predict a loss token (in
    any example of the batch: (B, N) logits instead of (B, L−1)); the numbers equal the full
    computation's (a multi-turn state's tool documentation and history carry no loss).
    """
    device = next(getattr(model, "module", model).parameters()).device
    ids, attn, loss_mask = _collate(examples, device)
    keep = loss_mask[:, 1:].amax(dim=0).nonzero().squeeze(-1)  # (N,) positions j predicting token j+1
    out = model(input_ids=ids, attention_mask=attn, use_cache=False, logits_to_keep=keep)
    logits = out.logits  # (B, N, V)
    if logits.shape[1] != keep.numel():  # a model that ignores logits_to_keep: all positions
        logits = logits[:, keep]
    logp = torch.log_softmax(logits.float(), dim=-1)
    target_lp = logp.gather(-1, ids[:, keep + 1].unsqueeze(-1)).squeeze(-1)  # (B, N)
    nll = -(target_lp * loss_mask[:, keep + 1]).sum()
    return nll / num_tokens, float(nll.detach())


def run_sft(
    model_dir: str | os.PathLike[str],
    examples: Sequence[Example],
    out_dir: str | os.PathLike[str],
    *,
    epochs: int = 1,
    lr: float = 1e-5,
    batch_size: int = 8,
    micro_batch_size: int = 1,
    dtype: str = "bfloat16",
    zero_stage: int = 0,
    seed: int = 0,
    grad_clip: float | None = 1.0,
    weight_decay: float = 0.0,
    tokenizer_dir: str | os.PathLike[str] | None = None,
    deepspeed_extra: dict[str, Any] | None = None,
    peak_gflops_per_thread: float | None = None,
    retain_host_memory: bool = True,
    cycle: bool = False,
    max_steps: int | None = None,
    max_wall_s: float | None = None,
    snapshot_step: int | None = None,
    snapshot_dir: str | os.PathLike[str] | None = None,
    label: str = "warm start",
) -> dict[str, Any]:
    """Fine-tune ``model_dir`` on ``examples`` and export an HF checkpoint (+ tokenizer) to ``out_dir``.

    Args:
        model_dir: HF checkpoint to start from (also the tokenizer source unless ``tokenizer_dir``).
        examples: ``(input_ids, loss_mask)`` pairs (lists of ints of equal length L; mask 1 on
            assistant action tokens). Every rank passes the same list.
        out_dir: the exported checkpoint directory (written atomically, replaced if present).
        epochs, lr, batch_size (global examples per optimiser step; the last batch of an epoch
            may be smaller), micro_batch_size (examples per backward pass on one rank), dtype
            (``"bfloat16"``: bf16 compute, fp32 master weights; or ``"float32"``), zero_stage
            (0–3), seed (shuffle order and torch seed), grad_clip (≥ 0; None = off), weight_decay,
            deepspeed_extra (merged over the generated DeepSpeed config), peak_gflops_per_thread
            (the calibrated matmul peak of one thread in ``dtype``, :mod:`pivotrl.runtime.mfu`; None =
            no ``mfu``), retain_host_memory (see :func:`pivotrl.training.deepspeed_utils.build_engine`).
        cycle: batches are consecutive slices of an endless stream of seeded epoch orders (every batch
            full; ``epochs`` is not read); needs ``max_steps``.
        max_steps: stop after this many optimiser steps (with or without ``cycle``).
        max_wall_s: stop after the first step at which the optimiser steps' wall time (seconds
            since the first began, exports left out) reaches it, but not before ``snapshot_step``:
            the policy at that first step is ``out_dir`` (exported then if the run goes on).
        snapshot_step, snapshot_dir: also export the policy after step ``snapshot_step`` to
            ``snapshot_dir`` (a run that stops before it exports none).
        label: the progress lines' name (with ``max_wall_s``: the wall budget and no ETA).

    Returns:
        metrics: ``losses`` (per step, mean NLL per loss token, nats), ``first_loss``,
        ``final_loss``, ``steps``, ``loss_tokens`` (per epoch), ``tokens`` (input tokens processed
        in total), ``time_s``, ``tokens_per_s`` (all forward+backward), ``model_tflop`` (model FLOPs,
        :mod:`pivotrl.runtime.mfu`: 6·n_body per token, 6·n_head per loss position, attention),
        ``threads`` (torch threads × ranks), with a peak ``peak_gflops`` and ``mfu``; ``out_dir``;
        ``step_tokens`` and ``step_time_s`` (per step, cumulative: input tokens of every rank, and
        the optimiser steps' wall time); ``out_step`` (the step ``out_dir`` holds) and
        ``wall_step`` (the first step at or past ``max_wall_s``, None without one or when never
        reached); ``snapshot_step`` (None when no snapshot was exported).

    Raises:
        DataError: malformed examples. ConfigError: bad settings. TrainingError: non-finite loss.
    """
    for name, value, lo in (("epochs", epochs, 1), ("batch_size", batch_size, 1), ("micro_batch_size", micro_batch_size, 1)):
        if isinstance(value, bool) or not isinstance(value, int) or value < lo:
            raise ConfigError(f"{name} must be an integer >= {lo}, got {value!r}")
    if cycle and max_steps is None:
        raise ConfigError("run_sft: cycle needs max_steps (an endless stream of batches)")
    if (snapshot_step is None) != (snapshot_dir is None):
        raise ConfigError("run_sft: snapshot_step and snapshot_dir go together")
    _check_examples(examples)
    random.seed(seed)
    torch.manual_seed(seed)
    model = load_causal_lm(model_dir, torch.float32)
    engine = build_engine(
        model,
        lr=lr,
        zero_stage=zero_stage,
        dtype=dtype,
        grad_clip=grad_clip,
        weight_decay=weight_decay,
        extra_config=deepspeed_extra,
        retain_host_memory=retain_host_memory,
    )
    engine.eval()  # no dropout: deterministic, and the same forward as the RL trainer
    rank, world = rank_and_world()
    order_rng = random.Random(seed)
    losses: list[float] = []
    t0 = time.perf_counter()
    loss_tokens_epoch = sum(int(sum(m[1:])) for _, m in examples)
    from pivotrl.core.progress import Progress, format_duration

    per_batch = math.ceil(math.ceil(batch_size / world) / micro_batch_size)
    n_micro_total = (max_steps * per_batch if cycle else
                     epochs * sum(math.ceil(math.ceil(len(examples[i:i + batch_size]) / world) / micro_batch_size)
                                  for i in range(0, len(examples), batch_size)))
    if max_steps is not None:
        n_micro_total = min(n_micro_total, max_steps * per_batch)
    tok_dir = tokenizer_dir if tokenizer_dir is not None else model_dir
    step_tokens: list[float] = []  # this rank's input tokens per step (summed over ranks below)
    step_time: list[float] = []  # the optimiser steps' wall time so far, per step
    marks: dict[str, int | None] = {"wall_step": None, "out_step": None, "snapshot_step": None}
    export_s = 0.0

    def export(target: Any) -> None:
        nonlocal export_s
        t = time.perf_counter()
        export_hf_checkpoint(engine, target, tokenizer_dir=tok_dir)
        export_s += time.perf_counter() - t

    def after_step(step: int, tokens_so_far: int) -> bool:
        """Book-keeping after optimiser step ``step`` (1-based); True to stop."""
        step_tokens.append(float(tokens_so_far))
        step_time.append(time.perf_counter() - t0 - export_s)
        if snapshot_step is not None and step == snapshot_step:
            export(snapshot_dir)
            marks["snapshot_step"] = step
        if max_wall_s is not None and marks["wall_step"] is None and _all_agree(step_time[-1] >= max_wall_s, world):
            marks["wall_step"] = step
        stop = max_steps is not None and step >= max_steps
        if marks["wall_step"] is not None:
            stop = stop or snapshot_step is None or step >= snapshot_step
            if marks["wall_step"] == step and not stop:  # the policy at the wall time; the run goes on
                export(out_dir)
                marks["out_step"] = step
        return stop

    bar_total: int | None = n_micro_total
    if max_wall_s is not None:  # the wall time ends the run, not the micro-batch count
        label, bar_total = f"{label} (to {format_duration(max_wall_s)} of optimiser steps)", None
    with Progress(label, bar_total, "micro-batches", enabled=rank == 0) as bar:
        tokens, flop = _sft_epochs(engine, examples, epochs, batch_size, micro_batch_size, order_rng, losses, bar,
                                   cycle=cycle, after_step=after_step)
    elapsed = time.perf_counter() - t0 - export_s
    both = torch.tensor([float(tokens), flop, *step_tokens], dtype=torch.float64)
    if world > 1:
        torch.distributed.all_reduce(both)
    tok_total, flop_total = both[0], float(both[1])
    threads = torch.get_num_threads() * world
    util = mfu(flop_total, elapsed, peak_gflops_per_thread, threads)
    speed = {"model_tflop": flop_total / 1e12, "threads": threads}
    if util is not None and peak_gflops_per_thread:
        speed.update(peak_gflops=peak_gflops_per_thread * threads, mfu=util)
    if marks["out_step"] is None:
        export_hf_checkpoint(engine, out_dir, tokenizer_dir=tok_dir)
        marks["out_step"] = len(losses)
    return {
        "step_tokens": [int(x) for x in both[2:].tolist()],
        "step_time_s": step_time,
        **marks,
        "losses": losses,
        "first_loss": losses[0],
        "final_loss": losses[-1],
        "steps": len(losses),
        "loss_tokens": loss_tokens_epoch,
        "tokens": int(tok_total),
        "time_s": elapsed,
        "tokens_per_s": float(tok_total) / elapsed if elapsed > 0 else 0.0,
        **speed,
        "out_dir": str(out_dir),
    }


def _all_agree(flag: bool, world: int) -> bool:
    """Rank 0's ``flag`` on every rank (each rank's clock differs: one decision for all)."""
    if world <= 1:
        return flag
    t = torch.tensor([1.0 if flag else 0.0], dtype=torch.float64)
    torch.distributed.broadcast(t, src=0)
    return bool(t.item())


def batch_orders(n: int, batch_size: int, epochs: int, order_rng: random.Random, *,
                 cycle: bool = False) -> Iterator[list[int]]:
    """Example indices per optimiser step: each epoch a fresh ``order_rng`` shuffle of ``range(n)``
    cut into batches (the last of an epoch may be smaller), ``epochs`` times; with ``cycle`` the
    epoch orders are one endless stream cut into full batches (never ending: the caller stops)."""
    if not cycle:
        for _epoch in range(epochs):
            order = list(range(n))
            order_rng.shuffle(order)
            for start in range(0, n, batch_size):
                yield order[start : start + batch_size]
        return
    buf: list[int] = []
    while True:
        while len(buf) < batch_size:
            order = list(range(n))
            order_rng.shuffle(order)
            buf.extend(order)
        yield buf[:batch_size]
        buf = buf[batch_size:]


def _sft_epochs(engine: Any, examples: Sequence[tuple[Sequence[int], Sequence[int]]], epochs: int, batch_size: int,
                micro_batch_size: int, order_rng: random.Random, losses: list[float], bar: Any, *,
                cycle: bool = False, after_step: Callable[[int, int], bool] | None = None) -> tuple[int, float]:
    """The warm start's optimiser steps (appends each step's mean NLL to ``losses``) over
    :func:`batch_orders`; returns the input tokens this rank processed and their model FLOPs
    (:func:`sft_flops`). ``bar``: a pivotrl.core.progress.Progress counting micro-batches;
    ``after_step(step, tokens so far on this rank)`` after each optimiser step, True to stop."""
    rank, world = rank_and_world()
    shape = ModelShape.of_model(engine)
    flop = 0.0
    scale = data_parallel_loss_scale()
    tokens = 0
    for order in batch_orders(len(examples), batch_size, epochs, order_rng, cycle=cycle):
        batch = [examples[i] for i in order]
        num_tokens = sum(int(sum(m[1:])) for _, m in batch)
        mine = batch[rank::world]
        n_micro = math.ceil(math.ceil(len(batch) / world) / micro_batch_size)
        nll_sum = 0.0
        for j in range(n_micro):
            mb = mine[j * micro_batch_size : (j + 1) * micro_batch_size]
            if mb:
                loss, nll = sft_batch_loss(engine, mb, num_tokens)
                if not math.isfinite(float(loss.detach())):
                    raise TrainingError(f"non-finite SFT loss at step {len(losses) + 1}")
                tokens += sum(len(ids) for ids, _ in mb)
                flop += sft_flops(shape, mb)
                nll_sum += nll
                bar.update(1, tokens=sum(len(ids) for ids, _ in mb))
            else:  # keep the number of backward passes equal on every rank
                out = engine(input_ids=torch.zeros(1, 1, dtype=torch.long, device=engine.device), use_cache=False)
                loss = out.logits.float().sum() * 0.0
                bar.update(1)
            engine.backward(loss * scale, scale_wrt_gas=False)
        engine.step()
        total = torch.tensor([nll_sum], dtype=torch.float64)
        if world > 1:
            torch.distributed.all_reduce(total)
        losses.append(float(total) / num_tokens)
        bar.update(0, steps=1)
        if after_step is not None and after_step(len(losses), tokens):
            break
    return tokens, flop


def sft_flops(shape: ModelShape, examples: Sequence[Example]) -> float:
    """Model FLOPs of one forward+backward over ``examples`` (:mod:`pivotrl.runtime.mfu`): every
    input token through the body, the output head at the positions that predict a loss token, causal
    attention over each example's own length (padding excluded)."""
    tokens = sum(len(ids) for ids, _ in examples)
    logits = sum(int(sum(m[1:])) for _, m in examples)
    return train_flops(shape, tokens, logits, attention_pairs_causal(len(ids) for ids, _ in examples))


# ---------------------------------------------------------------------- entry point
@dataclass(frozen=True)
class SFTSpec:
    """``python -m pivotrl.training.sft --spec spec.json``.

    ``examples_path``: JSON Lines of ``{"input_ids": [...], "loss_mask": [...]}``;
    ``metrics_path``: where rank 0 writes the returned metrics (JSON); ``options``: keyword
    arguments of :func:`run_sft` (epochs, lr, batch_size, micro_batch_size, dtype, zero_stage,
    seed, grad_clip, weight_decay, tokenizer_dir, deepspeed_extra).
    """

    model_dir: str
    examples_path: str
    out_dir: str
    metrics_path: str | None = None
    options: dict[str, Any] | None = None



def read_examples(path: str | os.PathLike[str]) -> list[Example]:
    """Read SFT examples from JSON Lines; DataError naming the line."""
    out: list[Example] = []
    for n, line in enumerate(Path(path).read_text().splitlines(), start=1):
        if not line.strip():
            continue
        try:
            rec = json.loads(line)
            out.append(([int(x) for x in rec["input_ids"]], [int(x) for x in rec["loss_mask"]]))
        except (json.JSONDecodeError, KeyError, TypeError, ValueError) as err:
            raise DataError(f"{path}:{n}: not an SFT example ({err})") from None
    return out


def main(argv: Sequence[str] | None = None) -> int:
    """Command-line entry: ``--spec <json file>`` with the fields of :class:`SFTSpec`."""
    from pivotrl.training.launch import read_spec

    spec = read_spec(argv, SFTSpec)
    metrics = run_sft(spec.model_dir, read_examples(spec.examples_path), spec.out_dir, **(spec.options or {}))
    rank, _ = rank_and_world()
    if rank == 0 and spec.metrics_path:
        with atomic_file(spec.metrics_path) as tmp:
            tmp.write_text(json.dumps(metrics, indent=2, sort_keys=True))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
