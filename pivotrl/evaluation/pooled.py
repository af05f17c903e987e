"""Paired comparisons pooled over several runs of one config (e.g. split seeds 0 and 1).

A run's report (``report.json`` of ``pivotrl run`` or ``pivotrl compare``) holds, for every local
measure (``statistics.local.<measure>``) and pair of policies A, B evaluated on the same items, the
paired 2×2 table in counts: ``n`` items, ``both`` / ``only_a`` / ``only_b`` items both / only A /
only B got right (reports written before ``both`` was stored give it through each policy's ``k``
where both policies were scored on the same items). Pooling adds the tables of the runs: every run's items
are its own units (another split of the records and another training run), and the pooled exact
McNemar test (:func:`pivotrl.evaluation.stats.mcnemar_exact`) asks whether A beats B across all of
them, with Newcombe's interval on the pooled difference
(:func:`pivotrl.evaluation.stats.paired_difference_interval`). Each run's own Δ and p stay beside the
pooled one, so a win that exists for one split only shows as such. The runs must be separate
evaluations (other splits or seeds): a report given twice is refused.

Only measures scored by the exact McNemar test pool this way (binary outcomes per item: the greedy
measures); a measure with another test (the sampled accuracy's sign-flip test over per-item rates)
is listed as not pooled, since the report keeps no per-item values to pool.
"""

from __future__ import annotations

from typing import Any, Mapping, Sequence

from pivotrl.core.errors import DataError
from pivotrl.evaluation.stats import mcnemar_exact, paired_difference_interval

__all__ = ["pool_reports", "pooled_markdown"]

MCNEMAR = "exact McNemar"


def _table(block: Mapping[str, Any], pair: Mapping[str, Any], a: str, b: str) -> tuple[int, int, int, int] | None:
    """(both, only_a, only_b, neither) of ``pair`` oriented as a − b, or None when the report does not
    give it: ``both`` is stored with the pair, or (reports before it was) read from A's ``k`` where
    both policies were scored on exactly the pair's items."""
    only_a, only_b = (pair["only_a"], pair["only_b"]) if pair["a"] == a else (pair["only_b"], pair["only_a"])
    n = int(pair["n"])
    if "both" in pair:
        both = int(pair["both"])
    else:
        pa, pb = (block.get("per_policy") or {}).get(a), (block.get("per_policy") or {}).get(b)
        if not pa or not pb or pa.get("n") != n or pb.get("n") != n or pa["k"] - only_a != pb["k"] - only_b:
            return None
        both = int(pa["k"]) - int(only_a)
    return both, int(only_a), int(only_b), n - both - int(only_a) - int(only_b)


def pool_reports(reports: Sequence[Mapping[str, Any]], names: Sequence[str]) -> dict[str, Any]:
    """Pool the paired local comparisons of ``reports`` (parsed ``report.json`` dicts, one per run;
    ``names`` label them, e.g. ``["seed 0", "seed 1"]``).

    Returns ``{"runs": names, "measures": {measure: [row, ...]}, "not_pooled": {measure: why}}``, one
    row per pair of policies present in every run (oriented as in the first): ``a``, ``b``, ``n``,
    ``difference`` (pooled mean of A − B per item), ``low``/``high`` (95 % interval), ``p_value``,
    ``only_a``, ``only_b`` and ``per_run`` (each run's ``n``, ``difference``, ``p_value``).
    Raises DataError for fewer than two reports, a count of names that differs, a report without
    ``statistics.local`` or given twice (naming which), and when no measure could be pooled.
    """
    if len(reports) < 2 or len(names) != len(reports):
        raise DataError(f"pooling needs two or more reports and one name per report (got {len(reports)} report(s) "
                        f"and {len(names)} name(s))")
    blocks: list[Mapping[str, Any]] = []
    for name, rep in zip(names, reports):
        stats = rep.get("statistics") if isinstance(rep, Mapping) else None
        local = stats.get("local") if isinstance(stats, Mapping) else None
        if not isinstance(local, Mapping):
            raise DataError(f"{name}: the report has no statistics.local (is it a pivotrl report.json?)")
        same = next((other for other, blk in zip(names, blocks) if blk == local), None)
        if same is not None:
            raise DataError(f"{name}: the same results as {same} (pooling a run with itself counts its items twice)")
        blocks.append(local)
    measures: dict[str, list[dict[str, Any]]] = {}
    not_pooled: dict[str, str] = {}
    for measure in blocks[0]:
        if any(not isinstance(blk.get(measure), Mapping) for blk in blocks):
            not_pooled[measure] = "not in every report"
            continue
        rows = []
        for pair in blocks[0][measure].get("pairs", []):
            a, b = pair["a"], pair["b"]
            found = [next((q for q in blk[measure].get("pairs", []) if {q["a"], q["b"]} == {a, b}), None)
                     for blk in blocks]
            if any(q is None for q in found):
                continue
            other = next((q for q in found if q.get("test") != MCNEMAR or "only_a" not in q), None)
            if other is not None:
                not_pooled[measure] = f"its test is not the exact McNemar test ({other.get('test')})"
                break
            tables = [_table(blk[measure], q, a, b) for blk, q in zip(blocks, found)]
            if any(t is None for t in tables):
                not_pooled[measure] = (f"a report lacks the whole 2×2 table of {a} − {b} (a policy scored on items "
                                       "the other was not)")
                break
            both, only_a, only_b, neither = (sum(t[i] for t in tables) for i in range(4))
            n = both + only_a + only_b + neither
            low, high = paired_difference_interval(both, only_a, only_b, neither)
            rows.append({"a": a, "b": b, "n": n, "difference": (only_a - only_b) / n if n else float("nan"),
                         "low": low, "high": high, "p_value": mcnemar_exact(only_a, only_b), "only_a": only_a,
                         "only_b": only_b,
                         "per_run": [{"run": name, "n": sum(t), "difference": (t[1] - t[2]) / sum(t) if sum(t) else
                                      float("nan"), "p_value": mcnemar_exact(t[1], t[2])}
                                     for name, t in zip(names, tables)]})
        if rows and measure not in not_pooled:
            measures[measure] = rows
    if not measures:
        why = "; ".join(f"{m}: {w}" for m, w in not_pooled.items()) or "no paired comparison in the reports"
        raise DataError(f"nothing to pool ({why})")
    return {"runs": list(names), "measures": measures, "not_pooled": not_pooled}


def pooled_markdown(pooled: Mapping[str, Any]) -> list[str]:
    """Markdown lines: per measure, one table row per pair (each run's Δ and p, then the pooled n,
    Δ with its interval and p), then the measures not pooled and why."""
    runs = pooled["runs"]
    lines = [f"# Paired comparisons pooled over {len(runs)} runs ({', '.join(runs)})", "",
             "A − B per item, exact McNemar test on the pooled discordant items, Newcombe's 95 % interval.", ""]
    for measure, rows in pooled["measures"].items():
        lines += [f"## {measure}", "",
                  "| A − B | " + " | ".join(f"{r}: Δ (p)" for r in runs) + " | pooled n | pooled Δ (95 % CI) | pooled p |",
                  "|---|" + "---|" * (len(runs) + 3)]
        for row in rows:
            per = " | ".join(f"{x['difference']:+.3f} ({x['p_value']:.2g}), n = {x['n']}" for x in row["per_run"])
            lines.append(f"| {row['a']} − {row['b']} | {per} | {row['n']} | {row['difference']:+.3f} "
                         f"({row['low']:+.3f} to {row['high']:+.3f}) | {row['p_value']:.2g} |")
        lines.append("")
    for measure, why in pooled["not_pooled"].items():
        lines.append(f"- {measure}: not pooled, {why}.")
    return lines
