"""Peak RSS and wall time of `pivotrl demos` on one chat trajectory of N turns.

A turn is one assistant tool call and its tool result (2 messages), after a system and a user
message, so N = 5,000 turns is a 10,002-message trajectory. Each size runs `pivotrl demos` in a
fresh process (its own storage root); peak RSS is that process's ``ru_maxrss``; also reported: the
size of the candidates table and how many states were skipped as longer than ``model.max_context``. A process that
passes ``--cap-gib`` of address space is stopped and reported as such (the machine is shared).

    python benchmarks/bench_long_trajectories.py --turns 10 100 1000 5000 [--cap-gib 8]
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path


def trajectory(turns: int) -> dict:
    tools = [{"type": "function", "function": {"name": "lookup", "description": "Look a key up.",
              "parameters": {"type": "object", "properties": {"key": {"type": "string"}}, "required": ["key"]}}}]
    msgs = [{"role": "system", "content": "You are a careful assistant with tools."},
            {"role": "user", "content": "Look up every key from k0 on, one call at a time."}]
    for i in range(turns):
        msgs.append({"role": "assistant", "content": "", "tool_calls": [
            {"id": f"c{i}", "type": "function", "function": {"name": "lookup", "arguments": json.dumps({"key": f"k{i}"})}}]})
        msgs.append({"role": "tool", "tool_call_id": f"c{i}", "content": f"value of k{i}: {i * 7 % 1000}"})
    return {"id": f"long-{turns}", "messages": msgs, "tools": tools, "category": "chat"}


def run(turns: int, cap_gib: float, work: Path) -> dict:
    d = work / f"t{turns}"
    d.mkdir(parents=True, exist_ok=True)
    src = d / "demos.jsonl"
    src.write_text(json.dumps(trajectory(turns)) + "\n")
    cfg = d / "config.yaml"
    cfg.write_text(f"run:\n  storage_root: {d / 'root'}\nwarm_start:\n  enabled: false\ndata:\n  sources:\n    - kind: chat\n      url: {src}\n"
                   "  split:\n    warm_start: 0.0\n    pivot: 1.0\n    heldout: 0.0\n")
    exe = str(Path(sys.executable).with_name("pivotrl"))
    cap = int(cap_gib * 2**30)

    def limit() -> None:
        resource.setrlimit(resource.RLIMIT_AS, (cap, cap))

    t0 = time.time()
    log = d / "out.txt"
    with open(log, "w") as f:
        p = subprocess.Popen([exe, "demos", "--config", str(cfg)], stdout=f, stderr=subprocess.STDOUT,
                             preexec_fn=limit)
        _, status, usage = os.wait4(p.pid, 0)  # this child's own peak RSS
    wall = time.time() - t0
    rc = os.waitstatus_to_exitcode(status)
    tail = log.read_text().strip().splitlines()[-1:] if rc else []
    counts = [json.loads(p.read_text()) for p in (d / "root").rglob("counts.json")]
    tables = list((d / "root").rglob("candidates.parquet"))
    return {"turns": turns, "messages": 2 + 2 * turns, "rc": rc, "wall_s": round(wall, 2),
            "peak_rss_mib": round(usage.ru_maxrss / 1024, 1),
            "source_mib": round(src.stat().st_size / 2**20, 2),
            "candidates_mib": round(tables[0].stat().st_size / 2**20, 3) if tables else None,
            "skipped_too_long": counts[0]["skipped_too_long"] if counts else None,
            "error": tail[0][:300] if tail else "", "load_avg": os.getloadavg()[0]}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--turns", type=int, nargs="+", default=[10, 100, 1000, 5000])
    ap.add_argument("--cap-gib", type=float, default=8.0)
    a = ap.parse_args()
    with tempfile.TemporaryDirectory(prefix="pivotrl-long-") as tmp:
        for n in sorted(a.turns):
            print(json.dumps(run(n, a.cap_gib, Path(tmp))), flush=True)


if __name__ == "__main__":
    main()
