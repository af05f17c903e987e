"""Helpers shared by the benchmark scripts: load average, medians, markdown tables, BFCL states.

Timing convention of every benchmark here: the variants being compared run *interleaved inside one
process* (A, B, A, B, ...), each measurement is tagged with the 1-minute load average at the time it
was taken, and ratios are medians of per-pair ratios. On a shared machine absolute numbers move
with the load; ratios taken this way move much less.
"""

from __future__ import annotations

import json
import os
import random
import statistics
import sys
from pathlib import Path
from typing import Any, Iterable, Sequence

DEFAULT_CACHE_DIR = os.environ.get("PIVOTRL_CACHE_DIR", str(Path.home() / ".cache" / "pivotrl"))


def load1() -> float:
    """The 1-minute load average of the machine (``os.getloadavg()[0]``)."""
    return os.getloadavg()[0]


def median(values: Iterable[float]) -> float:
    """Median of a non-empty iterable of floats (ValueError when empty)."""
    vals = list(values)
    if not vals:
        raise ValueError("median of no values")
    return float(statistics.median(vals))


def md_table(headers: Sequence[str], rows: Iterable[Sequence[Any]]) -> str:
    """A markdown table; floats ≥ 100 as integers, others with 3 significant digits (NaN as n/a)."""

    def cell(v: Any) -> str:
        if isinstance(v, float):
            if v != v:  # NaN
                return "n/a"
            if abs(v) >= 100:
                return f"{v:.0f}"
            return f"{v:.3g}" if abs(v) >= 1 else f"{v:.3f}"
        return str(v)

    lines = ["| " + " | ".join(headers) + " |", "|" + "|".join("---" for _ in headers) + "|"]
    lines += ["| " + " | ".join(cell(v) for v in row) + " |" for row in rows]
    return "\n".join(lines)


def parse_md_tables(text: str) -> list[list[dict[str, str]]]:
    """Every markdown table in ``text`` as a list of {header: cell} rows (in order of appearance)."""
    tables: list[list[dict[str, str]]] = []
    block: list[str] = []
    for line in text.splitlines() + [""]:
        if line.startswith("|"):
            block.append(line)
            continue
        if len(block) >= 2:
            split = [[c.strip() for c in b.strip().strip("|").split("|")] for b in block]
            headers, body = split[0], split[2:]
            tables.append([dict(zip(headers, row)) for row in body])
        block = []
    return tables


def write_json(path: str | os.PathLike[str], obj: Any) -> None:
    """Write ``obj`` as JSON atomically (temporary file, then rename)."""
    target = Path(path)
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = target.with_name(target.name + ".tmp")
    tmp.write_text(json.dumps(obj, indent=1, default=str))
    tmp.replace(target)


def distribution(values: Sequence[float]) -> str:
    """"min / p10 / median / p90 / max (n=…)" of a non-empty sequence."""
    vals = sorted(values)
    if len(vals) == 1:
        return f"{vals[0]:.0f} (n=1)"
    dec = statistics.quantiles(vals, n=10, method="inclusive")
    return (f"min {vals[0]:.0f} / p10 {dec[0]:.0f} / median {statistics.median(vals):.0f} / "
            f"p90 {dec[-1]:.0f} / max {vals[-1]:.0f} (n={len(vals)})")


def bfcl_multi_turn_states(tokenizer: Any, cache_dir: str, *, max_prompt: int,
                           records: int | None = None) -> list[tuple[str, list[int], list[list[int]]]]:
    """Real BFCL ``multi_turn_base`` turn states: ``(state_id, prompt_ids (P,), demo actions)``.

    ``prompt_ids`` come from ``pivotrl.format.prompts.encode_state`` (the project's renderer, compact
    tools); states longer than ``max_prompt`` tokens are skipped, as the pipeline does. The demo
    actions are every demonstrated action of the same trajectory, encoded with
    ``pivotrl.format.prompts.encode_action`` (the state's own action first): real action strings and
    lengths. Raises whatever loading BFCL raises (callers decide whether to fall back).
    """
    from pivotrl.format.actions import format_action
    from pivotrl.bfcl.data import load_bfcl
    from pivotrl.data.states import extract_turn_states
    from pivotrl.core.errors import StateTooLongError
    from pivotrl.format.prompts import encode_action, encode_state

    out = []
    for traj in load_bfcl(["multi_turn_base"], cache_dir, limit_per_category=records):
        states = extract_turn_states(traj)
        acts = [encode_action(format_action(s.demo_action), tokenizer) for s in states]
        for i, st in enumerate(states):
            try:
                prompt = encode_state(st, tokenizer, max_len=max_prompt)
            except StateTooLongError:
                continue
            out.append((st.state_id, prompt, [acts[i]] + acts[:i] + acts[i + 1:]))
    return out


def synthetic_ids(rng: random.Random, vocab: int, n: int) -> list[int]:
    """``n`` random token ids in ``[0, vocab)`` (compute depends on lengths only)."""
    return [rng.randrange(vocab) for _ in range(n)]


def header(title: str, command: Sequence[str] | None = None) -> str:
    """A result header: title, the exact command, the date and the current load average."""
    import datetime as _dt

    cmd = " ".join(command if command is not None else [Path(sys.executable).name, *sys.argv])
    now = _dt.datetime.now().astimezone().strftime("%Y-%m-%d %H:%M %Z")
    la = os.getloadavg()
    return (f"## {title}\n\n`{cmd}`  \n{now}; load average at start {la[0]:.2f} / {la[1]:.2f} / {la[2]:.2f}; "
            f"{os.cpu_count()} CPUs\n")
