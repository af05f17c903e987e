"""Claim 3 of the paper read off two held-out learning curves against the rollout turns each method
sampled: PivotRL's (probe samples + training samples) and end-to-end RL's (model calls in its
episodes), both measured greedily on the same held-out states (:mod:`pivotrl.pipeline.curve`).

:func:`turns_to_target` finds the first measured point of each curve at or above π_ref + the
smaller final gain and the ratio of their rollout turns; :func:`turns_sentence` and
:func:`turns_markdown` write it for ``pivotrl compare``'s report. Pure: no engine, no Prefect.
"""

from __future__ import annotations

from typing import Any, Mapping, Sequence

__all__ = ["NAMES", "first_reach", "turns_markdown", "turns_sentence", "turns_to_target"]

_EPS = 1e-9
#: The two methods' names in sentences, tables and plots.
NAMES = {"pivotrl": "PivotRL", "e2e": "E2E RL"}

def first_reach(points: Sequence[Mapping[str, Any]], target: float) -> dict[str, Any] | None:
    """The first measured point of a curve (in step order) whose accuracy is at or above
    ``target``: ``{step, rollout_turns, accuracy}``, or None when none is (no interpolation
    between points)."""
    for q in points:
        if q["accuracy"] >= target - _EPS:
            return {"step": q["step"], "rollout_turns": q["rollout_turns"], "accuracy": q["accuracy"]}
    return None


def turns_to_target(pivotrl: Sequence[Mapping[str, Any]], e2e: Sequence[Mapping[str, Any]], *,
                    budget_turns: int | None = None) -> dict[str, Any]:
    """Claim 3 read from the two held-out curves (points of
    :func:`pivotrl.evaluation.learning_curve.learning_curve`: step, rollout_turns, accepted, n,
    accuracy, low, high), each against the rollout turns it had sampled.

    π_ref's accuracy is PivotRL's step-0 point (E2E RL's step 0 measures the same weights on the same
    states; ``e2e_start`` is kept). Each method's final gain is its last point's accuracy − π_ref's.
    The target is π_ref + the smaller of the gains when both gained; when one alone gained, π_ref +
    its gain (the other is read against it); when neither gained there is none. For each curve the
    first point at or above the target (:func:`first_reach`), and ``ratio`` = E2E RL's turns there
    / PivotRL's (None unless both reached it). ``budget_turns``: the equal turn budget when E2E RL's
    was PivotRL's rollout turns (``compare.e2e_budget = rollout_turns``), else None.

    Returns {"status" ("both_gained" | "pivotrl_only" | "e2e_only" | "none_gained" | "no_curve"),
    "reason" (no_curve), "n_states" (min, max per point), "reference_accuracy", "e2e_start",
    "final" {method: {step, rollout_turns, accuracy, gain}}, "target", "reached" {method: point or
    None}, "ratio", "budget_turns", "curves" {method: points}} with "sentence"
    (:func:`turns_sentence`).
    """
    curves = {"pivotrl": [dict(q) for q in pivotrl if q.get("rollout_turns") is not None],
              "e2e": [dict(q) for q in e2e if q.get("rollout_turns") is not None]}
    out: dict[str, Any] = {"status": "no_curve", "reason": None, "n_states": None, "reference_accuracy": None,
                           "e2e_start": None, "final": {}, "target": None, "reached": {}, "ratio": None,
                           "budget_turns": budget_turns, "curves": curves}
    missing = [m for m, c in curves.items() if not c or c[0]["step"] != 0 or len(c) < 2]
    if missing:
        out["reason"] = ("no held-out curve with rollout turns for " + " and ".join(NAMES[m] for m in missing)
                         + " (training.eval_every = 0, no held-out state, or a run that predates the turn counts)")
        out["sentence"] = turns_sentence(out)
        return out
    ns = [q["n"] for c in curves.values() for q in c]
    ref = curves["pivotrl"][0]["accuracy"]
    out.update(n_states=[min(ns), max(ns)], reference_accuracy=ref, e2e_start=curves["e2e"][0]["accuracy"])
    for m, c in curves.items():
        last = c[-1]
        out["final"][m] = {"step": last["step"], "rollout_turns": last["rollout_turns"], "accuracy": last["accuracy"],
                           "gain": last["accuracy"] - ref}
    gained = {m: f["gain"] for m, f in out["final"].items() if f["gain"] > _EPS}
    if not gained:
        out["status"] = "none_gained"
    else:
        out["status"] = "both_gained" if len(gained) == 2 else f"{next(iter(gained))}_only"
        out["target"] = ref + min(gained.values())
        out["reached"] = {m: first_reach(c, out["target"]) for m, c in curves.items()}
        p, e = out["reached"]["pivotrl"], out["reached"]["e2e"]
        if p is not None and e is not None and p["rollout_turns"] > 0:
            out["ratio"] = e["rollout_turns"] / p["rollout_turns"]
    out["sentence"] = turns_sentence(out)
    return out



def _n_states(r: Mapping[str, Any]) -> str:
    lo, hi = r["n_states"]
    return f"n = {lo} held-out states per point" if lo == hi else f"n = {lo}–{hi} held-out states per point"


def turns_sentence(r: Mapping[str, Any]) -> str:
    """One phrase of :func:`turns_to_target`'s reading (claim 3's sentence and the report section)."""
    if r["status"] == "no_curve":
        return f"the held-out curves against rollout turns cannot be read: {r['reason']}"
    fin = r["final"]
    head = (f"on the held-out curves (greedy, {_n_states(r)}; π_ref {r['reference_accuracy']:.3f}"
            + (f", {r['e2e_start']:.3f} on E2E RL's engine" if abs(r["e2e_start"] - r["reference_accuracy"]) > _EPS
               else "") + ")")
    ends = ", ".join(f"{NAMES[m]} {fin[m]['gain']:+.3f} at {fin[m]['rollout_turns']:,} rollout turns"
                     for m in ("pivotrl", "e2e"))
    if r["budget_turns"] is not None:
        budget = f"equal turn budget {r['budget_turns']:,}"
    else:
        budget = "E2E RL's budget was not PivotRL's rollout turns"
    if r["status"] == "none_gained":
        return f"{head} neither method gained over π_ref by the end of its curve ({ends}; {budget})"
    gain = min(fin[m]["gain"] for m in ("pivotrl", "e2e") if fin[m]["gain"] > _EPS)
    if r["status"] == "both_gained":
        what = f"π_ref + the smaller final gain ({gain:+.3f}) = {r['target']:.3f}"
    else:
        alone = "pivotrl" if r["status"] == "pivotrl_only" else "e2e"
        other = "e2e" if alone == "pivotrl" else "pivotrl"
        what = (f"only {NAMES[alone]} gained ({NAMES[other]} ended at {fin[other]['gain']:+.3f}); "
                f"π_ref + {NAMES[alone]}'s gain ({gain:+.3f}) = {r['target']:.3f}")
    parts = []
    for m in ("pivotrl", "e2e"):
        hit = r["reached"].get(m)
        parts.append(f"{NAMES[m]} reached it at {hit['rollout_turns']:,} rollout turns (step {hit['step']})" if hit
                     else f"{NAMES[m]} never reached it within {fin[m]['rollout_turns']:,} turns")
    ratio = f"; E2E RL / PivotRL turns = {r['ratio']:.1f}×" if r["ratio"] is not None else ""
    return f"{head} {what}: {', '.join(parts)}{ratio} (final gains: {ends}; {budget})"


def turns_markdown(turns: Mapping[str, Any] | None, plot: str | None) -> list[str]:
    """The report's section on the held-out curves against rollout turns."""
    if not turns:
        return []
    lines = ["## Held-out accuracy against rollout turns", "",
             "Greedy accuracy on the same held-out states, measured before training, every "
             "`training.eval_every` steps and after the last, against the rollout turns (model calls) each "
             "method had sampled: PivotRL's probe samples and training samples, E2E RL's model calls in its "
             "episodes. A target is read off the first measured point at or above it (no interpolation).", "",
             turns["sentence"][0].upper() + turns["sentence"][1:] + ".", ""]
    rows = [(m, q) for m in ("pivotrl", "e2e") for q in (turns.get("curves") or {}).get(m, [])]
    if rows:
        lines += ["| method | step | rollout turns | accuracy (95% Wilson) |", "|---|---|---|---|"]
        lines += [f"| {NAMES[m]} | {q['step']} | {q['rollout_turns']:,} | {q['accuracy']:.3f} ({q['accepted']}/{q['n']}, "
                  f"{q['low']:.3f}–{q['high']:.3f}) |" for m, q in rows]
        lines.append("")
    if plot:
        lines += [f"![held-out accuracy against rollout turns]({plot})", ""]
    return lines
