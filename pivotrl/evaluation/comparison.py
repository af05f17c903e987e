"""Intervals on every evaluation rate and paired comparisons between policies (for the report).

Inputs are the per-unit tables the evaluation writes: ``full_task.parquet`` (one row per task, policy
and seed: ``task_id``, ``success``, ``turns_passed``, ``n_turns``, ``policy``, ``seed``) and
``local.parquet`` (one row per state, policy, seed and kind: ``state_id``, ``status``, ``n_samples``,
``n_accepted``, ``policy``, ``seed``, ``kind``). The statistics come from
:mod:`pivotrl.evaluation.stats`:

* full-task success: with one seed, k/n over tasks with a Wilson interval, and exact McNemar between
  two policies on the same tasks; with several seeds, each task's mean success over seeds, a
  bootstrap interval over tasks and the paired sign-flip test (with a bootstrap interval) between
  policies;
* turns passed / turns (per-turn measure: consecutive turns passed from the start, as BFCL's checker
  stops at the first failing turn): ratio of sums with a bootstrap interval over tasks; the paired
  sign-flip test of each task's fraction between policies;
* local accuracy: greedy (one sample per state) Wilson + exact McNemar on the same states; sampled
  (m per state) bootstrap over states + the paired sign-flip test of per-state accuracy.

Pairs are formed on units both policies have (inner join), so a comparison is always paired.
"""

from __future__ import annotations

from itertools import combinations
from typing import Any, Mapping, Sequence

import pandas as pd

from pivotrl.evaluation.stats import (
    PairedResult,
    bootstrap_mean_interval,
    paired_binary,
    paired_bootstrap,
    wilson_interval,
)

__all__ = ["compare_policies", "comparison_markdown", "floor_note", "format_meta_value", "format_rate", "rate_with_interval", "stats_name",
           "turn_interval"]


def rate_with_interval(k: int, n: int) -> dict[str, Any]:
    """``{"rate", "k", "n", "low", "high", "interval": "Wilson 95%"}`` (rate None when n = 0)."""
    lo, hi = wilson_interval(int(k), int(n))
    return {"rate": k / n if n else None, "k": int(k), "n": int(n), "low": lo if n else None,
            "high": hi if n else None, "interval": "Wilson 95%"}


def _boot(values: Sequence[float], weights: Sequence[float] | None, seed: int) -> dict[str, Any]:
    est, lo, hi = bootstrap_mean_interval(values, weights, seed=seed, proportion=True)
    n = len(values)
    same = n and est in (0.0, 1.0) and (lo, hi) == wilson_interval(int(est) * n, n)
    return {"rate": est if n else None, "n": n, "low": lo if n else None, "high": hi if n else None,
            "interval": "Wilson over units 95% (every unit at the same rate)" if same else "bootstrap over units 95%"}


def _paired(r: PairedResult) -> dict[str, Any]:
    out = {"n": r.n, "difference": r.difference, "p_value": r.p_value, "test": r.test,
           "significant": r.significant, "verdict": r.verdict,
           "low": None if r.low != r.low else r.low, "high": None if r.high != r.high else r.high}
    if r.b is not None:
        out.update({"only_a": r.b, "only_b": r.c, "both": r.both})
    return out


def _full_task(per_task: pd.DataFrame, policies: Sequence[str], seed: int) -> dict[str, Any]:
    df = per_task[per_task["policy"].isin(policies)]
    n_seeds = int(df["seed"].nunique()) if len(df) else 0
    by = df.groupby(["policy", "task_id"]).agg(success=("success", "mean"), turns_passed=("turns_passed", "mean"),
                                               n_turns=("n_turns", "first")).reset_index()
    out: dict[str, Any] = {"seeds": n_seeds, "per_policy": {}, "pairs": []}
    for p in policies:
        g = by[by["policy"] == p]
        if not len(g):
            continue
        if n_seeds == 1:
            success = rate_with_interval(int(g["success"].sum()), len(g))
        else:
            success = _boot(list(g["success"]), None, seed)
        out["per_policy"][p] = {"task_success": success,
                                "turn_pass": {**_boot(list(g["turns_passed"]), list(g["n_turns"]), seed),
                                              "turns_passed": float(g["turns_passed"].sum()),
                                              "turns": int(g["n_turns"].sum())}}
    for a, b in combinations([p for p in policies if p in out["per_policy"]], 2):
        j = by[by["policy"] == a].merge(by[by["policy"] == b], on="task_id", suffixes=("_a", "_b"))
        if n_seeds == 1:
            succ = paired_binary([bool(x) for x in j["success_a"]], [bool(x) for x in j["success_b"]])
        else:
            succ = paired_bootstrap(list(j["success_a"]), list(j["success_b"]), seed=seed)
        turns = paired_bootstrap(list(j["turns_passed_a"] / j["n_turns_a"]), list(j["turns_passed_b"] / j["n_turns_b"]),
                                 seed=seed)
        out["pairs"].append({"a": a, "b": b, "task_success": _paired(succ), "turn_fraction": _paired(turns)})
    return out


def _local(local: pd.DataFrame, kind: str, policies: Sequence[str], seed: int) -> dict[str, Any]:
    mine = local[(local["kind"] == kind) & local["policy"].isin(policies)]
    df = mine[mine["status"] == "ok"]
    unit = ["state_id", "seed"]
    # states of this kind left out, by reason (one row per state, policy and seed: count states)
    left = mine[mine["status"] != "ok"].drop_duplicates(["state_id", "status"])
    out: dict[str, Any] = {"per_policy": {}, "pairs": [],
                           "not_evaluated": {str(k): int(v) for k, v in left["status"].value_counts().items()}}
    greedy = len(df) > 0 and bool((df["n_samples"] == 1).all())
    for p in policies:
        g = df[df["policy"] == p]
        if not len(g):
            continue
        if greedy:
            out["per_policy"][p] = rate_with_interval(int(g["n_accepted"].sum()), len(g))
        else:
            out["per_policy"][p] = _boot(list(g["n_accepted"]), list(g["n_samples"]), seed)
    for a, b in combinations(list(out["per_policy"]), 2):
        j = df[df["policy"] == a].merge(df[df["policy"] == b], on=unit, suffixes=("_a", "_b"))
        if greedy:
            r = paired_binary([x > 0 for x in j["n_accepted_a"]], [x > 0 for x in j["n_accepted_b"]])
        else:
            r = paired_bootstrap(list(j["n_accepted_a"] / j["n_samples_a"]), list(j["n_accepted_b"] / j["n_samples_b"]),
                                 seed=seed)
        out["pairs"].append({"a": a, "b": b, **_paired(r)})
    return out


def compare_policies(per_task: pd.DataFrame | None, local: pd.DataFrame | None, policies: Sequence[str],
                     seed: int = 0) -> dict[str, Any]:
    """Intervals and paired comparisons (module docstring) as a JSON-able dict.

    ``{"full_task": {...}, "local": {kind: {...}}}`` where each block has ``per_policy`` (rate, n,
    low, high, interval) and ``pairs`` (a, b, n, difference = a - b, p_value, test, verdict).
    """
    out: dict[str, Any] = {"confidence": 0.95}
    if per_task is not None and len(per_task):
        out["full_task"] = _full_task(per_task, policies, seed)
    if local is not None and len(local):
        out["local"] = {k: _local(local, k, policies, seed) for k in sorted(local["kind"].unique())}
    return out


def _ci(r: dict[str, Any]) -> str:
    if r.get("rate") is None:
        return "n/a (n = 0)"
    frac = f"{r['k']}/{r['n']}, " if "k" in r else f"n = {r['n']}, "
    return f"{r['rate']:.3f} ({frac}95% CI {r['low']:.3f}–{r['high']:.3f})"


def difference_ci(d: Mapping[str, Any]) -> str:
    """``95% CI −0.120–+0.340`` for a paired comparison's A − B ("no interval" without one)."""
    if d.get("low") is None or d.get("high") is None:
        return "no interval"
    return f"95% CI {signed(d['low'])}–{signed(d['high'])}"


def signed(x: float) -> str:
    """``+0.120`` / ``-0.034``; a value that rounds to zero is ``+0.000`` (never ``-0.000``)."""
    return f"{round(x, 3) + 0.0:+.3f}"


def _pair_line(label: str, d: dict[str, Any]) -> str:
    """One comparison as a list item (a table of it is too wide for the Prefect UI, which cuts it off)."""
    extra = f"n = {d['n']}" + (f"; only A {d['only_a']}, only B {d['only_b']}" if "only_a" in d else "")
    return (f"- {label}: A − B {signed(d['difference'])} ({difference_ci(d)}; {extra}); {d['test']} "
            f"p = {d['p_value']:.3g}: {d['verdict']}")


def comparison_markdown(stats: dict[str, Any]) -> list[str]:
    """Markdown lines: one table of rates with intervals and one of paired comparisons per measure."""
    lines = ["## Intervals and paired comparisons", "",
             "Every rate with its n and a 95% interval; every comparison paired on the same tasks/states "
             "(A − B), two-sided p-value; \"no significant difference\" unless p < 0.05.", ""]
    full = stats.get("full_task")
    if full:
        lines += [f"### Full task (seeds: {full['seeds']})", "", "| policy | task success | turns passed / turns |", "|---|---|---|"]
        for p, r in full["per_policy"].items():
            lines.append(f"| {p} | {_ci(r['task_success'])} | {_ci(r['turn_pass'])} |")
        lines += ["", "Paired comparisons (A vs B):", ""]
        for pair in full["pairs"]:
            lines.append(_pair_line(f"{pair['a']} vs {pair['b']} (task success)", pair["task_success"]))
            lines.append(_pair_line(f"{pair['a']} vs {pair['b']} (turn fraction)", pair["turn_fraction"]))
        lines.append("")
    for kind, block in (stats.get("local") or {}).items():
        if not block["per_policy"]:
            why = ", ".join(f"{n} {status.replace('_', ' ')}" for status, n in (block.get("not_evaluated") or {}).items())
            lines += [f"### Local accuracy: {kind}", "",
                      f"No state evaluated ({why})." if why else "No state of this kind.", ""]
            continue
        lines += [f"### Local accuracy: {kind}", "", "| policy | accuracy |", "|---|---|"]
        lines += [f"| {p} | {_ci(r)} |" for p, r in block["per_policy"].items()]
        lines += ["", "Paired comparisons (A vs B):", ""]
        lines += [_pair_line(f"{pair['a']} vs {pair['b']}", pair) for pair in block["pairs"]]
        lines.append("")
    return lines


#: Measures the verdict reads, in order: (block path, pair field, per-policy field, label, unit of n).
_VERDICT_MEASURES = ((("full_task",), "task_success", "task_success", "full-task success", "tasks"),
                     (("full_task",), "turn_fraction", "turn_pass", "turns passed per task", "tasks"),
                     (("local", "heldout_greedy"), None, None, "local accuracy, held-out states (greedy)", "states"),
                     (("local", "heldout_sampled"), None, None,
                      "local accuracy, held-out states (m samples per state at the probe temperature)", "states"),
                     (("local", "out_of_domain_greedy"), None, None, "local accuracy, out-of-domain states (greedy)",
                      "states"))


def oriented_pair(block: Mapping[str, Any] | None, a: str, b: str, field: str | None = None) -> dict[str, Any] | None:
    """The paired comparison of ``a`` and ``b`` in a statistics block (its ``field``, e.g.
    ``task_success``, or the pair itself), as a − b whichever order it was stored in: the
    difference and its interval flipped for a pair stored as b − a. None without such a pair."""
    pair = next((q for q in (block or {}).get("pairs", []) if {q["a"], q["b"]} == {a, b}), None)
    if pair is None:
        return None
    d = dict(pair[field] if field else pair)
    if pair["a"] != a:
        d.update(difference=-d["difference"], low=None if d.get("high") is None else -d["high"],
                 high=None if d.get("low") is None else -d["low"])
    return d


def verdict(stats: Mapping[str, Any] | None, a: str = "pivotrl", b: str = "reference") -> list[dict[str, Any]]:
    """Policy ``a`` against ``b`` on each measure both were evaluated on, as JSON-able rows:
    measure, unit, a, b, rate_a, rate_b, difference (a − b), low, high (its 95% interval, None
    without one), test, p_value, n, significant, decision ("a better" / "b better" / "no
    significant difference"). [] without such a pair."""
    out: list[dict[str, Any]] = []
    for path, field, rate_field, label, unit in _VERDICT_MEASURES:
        block: Any = stats or {}
        for key in path:
            block = (block or {}).get(key) or {}
        d = oriented_pair(block, a, b, field)
        if d is None:
            continue
        rates = []
        for p in (a, b):
            r = (block.get("per_policy") or {}).get(p) or {}
            r = r.get(rate_field) if rate_field else r
            rates.append(None if not r else r.get("rate"))
        better = None if not d["significant"] else a if d["difference"] > 0 else b
        out.append({"measure": label, "unit": unit, "a": a, "b": b, "rate_a": rates[0], "rate_b": rates[1],
                    "difference": d["difference"], "low": d.get("low"), "high": d.get("high"), "test": d["test"],
                    "p_value": d["p_value"], "n": d["n"], "significant": d["significant"], "better": better,
                    "decision": f"{better} better" if better else "no significant difference"})
    return out


def verdict_lines(stats: Mapping[str, Any] | None, a: str = "pivotrl", b: str = "reference",
                  names: Mapping[str, str] | None = None) -> list[str]:
    """Markdown lines of a report's opening :func:`verdict`: per measure rate vs rate, A − B with
    its 95% interval, the test, p and n, and the decision (policies shown by ``names``)."""
    rows = verdict(stats, a, b)
    if not rows:
        return []
    shown = {p: (names or {}).get(p, p) for p in (a, b)}
    out = []
    for v in rows:
        rates = ["n/a" if r is None else f"{r:.3f}" for r in (v["rate_a"], v["rate_b"])]
        decision = f"{shown[v['better']]} better" if v["better"] else v["decision"]
        unit = v["unit"] if v["n"] != 1 else v["unit"][:-1]
        out.append(f"- {v['measure']}: {rates[0]} vs {rates[1]}, {signed(v['difference'])} ({difference_ci(v)}; "
                   f"{v['test']} p = {v['p_value']:.3g}; n = {v['n']} {unit}): **{decision}**")
    return ["## Verdict", "", f"{shown[a]} against {shown[b]} on the same held-out items (A − B):", "", *out,
            *_too_small(rows, shown[a], shown[b]), ""]


#: Where a run sized to show the method is described (a path in the repository).
SHOWCASE = "configs/showcase.yaml"


def _too_small(rows: Sequence[Mapping[str, Any]], a: str, b: str) -> list[str]:
    """When no measure separates the two policies: what this run could have resolved (the half-width
    of the 95 % interval of its most precise measure of 0/1 outcomes) and where a run sized to show the
    method is. Measures of 0/1 outcomes (exact McNemar, Newcombe's interval) come first: their interval
    keeps its width when the two policies agree on every unit, while a bootstrap interval over per-unit
    fractions shrinks towards zero then and says nothing of what the size could resolve."""
    if any(v["significant"] for v in rows):
        return []
    bounded = [v for v in rows if v.get("low") is not None and v.get("high") is not None]
    if not bounded:
        return []
    binary = [v for v in bounded if "McNemar" in str(v.get("test", ""))]
    best = min(binary or bounded, key=lambda v: v["high"] - v["low"])
    half = (best["high"] - best["low"]) / 2
    unit = best["unit"] if best["n"] != 1 else best["unit"][:-1]
    return ["", f"No measure separates {a} from {b}. The most precise one here ({best['measure']}, n = {best['n']} "
                f"{unit}) has a 95% interval ±{half:.3f} wide, so a true difference smaller than about {half:.3f} "
                "cannot show at this size: this run is too small to show the method, whether or not it works. A run "
                "that is to show it needs a few hundred held-out items (`evaluation.local_states`) and enough "
                f"training steps; `{SHOWCASE}` is one sized for a 2-core CPU (its measured result: "
                "`benchmarks/showcase/`)."]


def format_rate(rate: float | None, num: Any, den: Any, interval: tuple[float, float] | None = None,
                over: str | None = None) -> str:
    """``0.175 (7/40), 95% CI 0.087–0.320`` (Wilson on num/den unless ``interval`` is given; ``over``
    names the interval's units when they are not the counted ones, e.g. ``0.250 (1/4), 95% CI over
    2 tasks 0.000–0.750``); "not evaluated" for a missing rate."""
    if rate is None:
        return "not evaluated"
    frac = f" ({num}/{den})" if num is not None and den is not None else ""
    if interval is None and num is not None and den:
        interval, over = wilson_interval(int(num), int(den)), None
    unit = f" over {over}" if over else ""
    ci = f", 95% CI{unit} {interval[0]:.3f}–{interval[1]:.3f}" if interval is not None else ""
    return f"{rate:.3f}{frac}{ci}"


def turn_interval(statistics: dict[str, Any] | None, policy: str) -> tuple[float, float] | None:
    """The bootstrap-over-tasks interval of a policy's turns passed / turns, if computed."""
    per = (((statistics or {}).get("full_task") or {}).get("per_policy") or {}).get(policy) or {}
    tp = per.get("turn_pass") or {}
    return None if tp.get("low") is None else (tp["low"], tp["high"])


def stats_name(policy: str, aliases: Mapping[str, str]) -> str:
    """The key a policy has in a report's ``statistics`` (its short name, e.g. ``reference``), given
    the report's short → display name ``aliases``."""
    for short, long in aliases.items():
        if policy == long:
            return short
    return policy


def floor_note(rows: Sequence[Mapping[str, Any]]) -> list[str]:
    """One known limit when no evaluated policy solved any held-out task (the metric is at its floor)."""
    done = [r for r in rows if r.get("tasks")]
    if not done or any(r.get("tasks_succeeded") for r in done):
        return []
    n = max(int(r["tasks"]) for r in done)
    return [f"Full-task success is at its floor: no policy solved any of the {n} held-out tasks, so it "
            "cannot separate them here. A BFCL multi-turn task needs every call of every turn right, which "
            "this small model (and its few CPU-sized training steps) does not reach; turns passed and local "
            "accuracy carry the signal at this scale. A larger model (see the README's model list and "
            "configs/) is the way to a non-zero full-task number."]


def format_meta_value(v: Any) -> str:
    """A run-table value, short: a mapping as ``key=value`` pairs of its scalars (nested lists and
    mappings are left to report.json and counted), floats to 4 significant digits."""
    def short(x: Any) -> str:
        return f"{x:.4g}" if isinstance(x, float) else str(x)

    if isinstance(v, Mapping):
        flat = [f"{k}={short(x)}" for k, x in v.items() if not isinstance(x, (Mapping, list, tuple))]
        nested = len(v) - len(flat)
        return ", ".join(flat) + (f" (+{nested} more in report.json)" if nested else "") if flat or nested else "{}"
    if isinstance(v, (list, tuple)) and len(v) > 8:
        return f"{len(v)} values (in report.json)"
    return short(v)
