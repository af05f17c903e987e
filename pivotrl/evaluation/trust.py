"""What a reader needs to trust the report: the judge and what the metric may be called, the data
audit, and the candidate kinds (report sections as markdown lines; pure functions)."""

from __future__ import annotations

from typing import Any, Mapping, Sequence

from pivotrl.bfcl.judge import BFCL_STEP_LIMIT

__all__ = ["BFCL_METRIC", "full_task_metric", "out_of_domain_states", "trust_sections"]

#: The leaderboard's name; used only when every setting matches BFCL's.
BFCL_METRIC = "BFCL multi_turn_base accuracy"

#: What always differs from BFCL's own inference (pivotrl's prompt renderer and action parser).
_ALWAYS_DIFFERENT = (
    "prompt: pivotrl's renderer and action format, not BFCL's system prompt and handler",
    "model text: read by pivotrl's action parser, not BFCL's decoder (tuples are read as lists; "
    "text around the call list is a format error)",
)


def full_task_metric(judge: str, max_steps_per_turn: int, n_tasks: int, n_category: int = 200,
                     same_prompt_and_decoder: bool = False) -> tuple[str, list[str]]:
    """``(name, differences)``: :data:`BFCL_METRIC` only when judge, step limit, task set, prompt
    and decoder all match BFCL's; otherwise "full-task success" and every difference."""
    diffs: list[str] = []
    if judge != "bfcl":
        diffs.append(f"judge: pivotrl's own (quality.judge={judge!r}), not BFCL's multi_turn_checker")
    if max_steps_per_turn != BFCL_STEP_LIMIT:
        diffs.append(f"step limit: {max_steps_per_turn} per turn, BFCL's is {BFCL_STEP_LIMIT}")
    if n_tasks != n_category:
        diffs.append(f"subset: {n_tasks} held-out task{'s' if n_tasks != 1 else ''} of the {n_category}")
    if not same_prompt_and_decoder:
        diffs.extend(_ALWAYS_DIFFERENT)
    return (BFCL_METRIC if not diffs else "full-task success (BFCL's checker)" if judge == "bfcl"
            else "full-task success (pivotrl's judge)"), diffs


def trust_sections(cfg: Any, counts: Mapping[str, Any], heldout: Sequence[Any], bfcl_total: int = 200) -> list[str]:
    """Markdown lines: "Judge and metric name", "Data audit", "Candidate kinds"."""
    name, diffs = full_task_metric(cfg.quality.judge, cfg.evaluation.max_steps_per_turn, len(heldout), bfcl_total)
    lines = ["## Judge and metric name", "",
             f"Full-task success is decided by {'BFCL' if cfg.quality.judge == 'bfcl' else 'pivotrl'}'s judge "
             f"({cfg.evaluation.max_steps_per_turn} executing steps per turn). Reported as: **{name}**."]
    if diffs:
        lines += ["", f"Not named \"{BFCL_METRIC}\" because it differs from BFCL's setting in:", ""]
        lines += [f"- {d}" for d in diffs]
    flagged = counts.get("flagged", 0)
    lines += ["", "## Data audit", "",
              f"- records quarantined at load: {counts.get('quarantined', 0)}",
              f"- tasks flagged (pivotrl.data.audit): {flagged}"
              + (f" ({', '.join(counts.get('flagged_ids', []))})" if flagged else ""),
              "- flags by kind: " + (", ".join(f"{k} {v}" for k, v in (counts.get("flags_by_kind") or {}).items())
                                     or "none"),
              f"- flagged tasks {'kept (quality.keep_flagged)' if counts.get('flagged_kept') else 'kept out of warm start, pivots and evaluation'}",
              "", "## Candidate kinds", ""]
    kinds = counts.get("candidates_per_kind") or {}
    lines += ["| kind | states |", "|---|---|"] + [f"| {k} | {v} |" for k, v in sorted(kinds.items())]
    lines += ["",
              "Stop decisions (BFCL's closing \"Done.\") accept any answer without a tool call; they are "
              + ("pivot candidates (quality.include_stop_decisions)" if cfg.quality.include_stop_decisions
                 else "not pivot candidates")
              + " and are scored apart (local accuracy: stop_decisions_greedy). Text turns with no acceptance "
              f"rule are never candidates: {counts.get('text_turns_skipped_no_rule', 0)} skipped.", ""]
    return lines


def out_of_domain_states(cfg: Any, cache_dir: Any) -> list[Any]:
    """Turn states of the ``quality.out_of_domain`` BFCL categories (first ``out_of_domain_limit``
    records each). Raises ConfigError when such a category is also a training source: an
    out-of-domain category must be one that neither the warm start nor training sees."""
    from pivotrl.bfcl.data import load_bfcl
    from pivotrl.data.states import extract_turn_states
    from pivotrl.core.errors import ConfigError

    ood = list(cfg.quality.out_of_domain)
    if not ood:
        return []
    seen = {c for src in cfg.data.sources if src.kind == "bfcl" for c in src.categories}
    overlap = sorted(set(ood) & seen)
    if overlap:
        raise ConfigError(f"quality.out_of_domain = {ood}: {overlap} also in data.sources; an out-of-domain "
                          "category must never be seen by the warm start or training (remove it from one of them)")
    trajs = load_bfcl(ood, cache_dir, limit_per_category=cfg.quality.out_of_domain_limit)
    return [s for t in trajs for s in extract_turn_states(t)]
