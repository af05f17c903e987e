"""BFCL's single-turn verdicts applied to a local evaluation table, and the report's section on them.

:func:`rejudge_local` runs :class:`~pivotrl.bfcl.single.BFCLSingleTurnJudge` over every sample of
the BFCL single-turn states of a local evaluation table (:func:`pivotrl.evaluation.local.evaluate_local`),
makes BFCL's verdict the judge of record there, keeps pivotrl's verifier's beside it and counts
where the two agree (:data:`AGREEMENT`) and where their parsers read the text differently
(:data:`~pivotrl.bfcl.ast_decoder.DECODER_DIFFERENCES`); :func:`single_turn_judge_markdown` renders
those counts per policy and measure, with what still differs from BFCL's leaderboard
(:data:`LEADERBOARD_DIFFERENCES`).
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping, Sequence
from typing import Any

from pivotrl.bfcl.ast_decoder import DECODER_DIFFERENCES, decoder_difference
from pivotrl.bfcl.single import BFCLSingleTurnJudge
from pivotrl.core.errors import ActionParseError

__all__ = ["AGREEMENT", "AGREEMENT_KEYS", "DIFFERENCE_KEYS", "LEADERBOARD_DIFFERENCES", "rejudge_local",
           "single_turn_judge_markdown"]

#: Agreement of the two verdicts on one sample: key → (BFCL accepts, pivotrl accepts).
AGREEMENT: dict[str, tuple[bool, bool]] = {
    "both_accept": (True, True), "only_bfcl": (True, False), "only_pivotrl": (False, True),
    "neither": (False, False),
}

#: Summary keys :func:`rejudge_local` adds (all numeric, so per-seed summaries average them).
AGREEMENT_KEYS = tuple(f"agree_{k}" for k in AGREEMENT)
DIFFERENCE_KEYS = tuple(f"decoder_diff_{k}" for k in DECODER_DIFFERENCES)


def rejudge_local(frame: Any, summary: Mapping[str, Any], states: Sequence[Any],
                  judge: BFCLSingleTurnJudge) -> tuple[Any, dict[str, Any]]:
    """A local evaluation table (:func:`pivotrl.evaluation.local.evaluate_local`) with BFCL's
    verdict as the judge of record on its BFCL single-turn states.

    For each "ok" row whose state ``judge.judges``: every sample's text is judged by BFCL
    (:meth:`BFCLSingleTurnJudge.judge`); ``n_accepted`` and ``accuracy`` become BFCL's, and the row
    gets ``judge`` = "bfcl_ast" (else "pivotrl"), ``pivotrl_accepted`` (the verifier's count, kept
    beside), ``bfcl_errors`` (JSON {BFCL error_type: count}), ``agreement`` (JSON {:data:`AGREEMENT`
    key: samples}) and ``decoder_differences`` (JSON {kind: samples}, pythonic parser only); each
    sample in ``samples`` gets ``bfcl_valid``, ``bfcl_error_type`` and ``decoder_difference``.

    Returns ``(frame, summary)``: ``summary`` with n_accepted, accuracy, mean_state_accuracy and
    any_accepted_rate recomputed from the new table, plus ``judge_of_record``, ``bfcl_decoder``,
    ``bfcl_judged_states``, ``bfcl_judged_samples``, ``pivotrl_accuracy`` (the verifier's accuracy
    over all states), :data:`AGREEMENT_KEYS` and :data:`DIFFERENCE_KEYS` (sample counts over the
    judged states).
    """
    from pivotrl.format.tool_parsers import get_tool_parser

    parser = None if judge.tool_parser == "pythonic" else get_tool_parser(judge.tool_parser)
    by_id = {s.state_id: s for s in states}
    df = frame.copy()
    df["judge"] = "pivotrl"
    df["pivotrl_accepted"] = df["n_accepted"]
    for col in ("bfcl_errors", "agreement", "decoder_differences"):
        df[col] = "{}"
    agree = {k: 0 for k in AGREEMENT}
    diffs = {k: 0 for k in DECODER_DIFFERENCES}
    judged_states = judged_samples = 0
    for idx in df.index:
        state = by_id.get(df.at[idx, "state_id"])
        if df.at[idx, "status"] != "ok" or state is None or not judge.judges(state):
            continue
        samples = json.loads(df.at[idx, "samples"])
        row_agree = {k: 0 for k in AGREEMENT}
        row_diffs: dict[str, int] = {}
        errors: dict[str, int] = {}
        accepted = 0
        for s in samples:
            text = s["text"]
            calls = None
            if parser is not None:
                try:
                    calls = parser.parse(text, state.tools).tool_calls or None
                except ActionParseError:
                    calls = None
            verdict = judge.judge(state, text, calls)
            ours = float(s.get("reward", 0.0)) == 1.0
            key = next(k for k, v in AGREEMENT.items() if v == (verdict.valid, ours))
            row_agree[key] += 1
            accepted += verdict.valid
            if not verdict.valid:
                errors[verdict.error_type] = errors.get(verdict.error_type, 0) + 1
            kind = decoder_difference(text, state.tools, judge.root) if parser is None else None
            if kind is not None:
                row_diffs[kind] = row_diffs.get(kind, 0) + 1
            s.update(bfcl_valid=verdict.valid, bfcl_error_type=verdict.error_type, decoder_difference=kind)
        n = len(samples)
        df.at[idx, "samples"] = json.dumps(samples, ensure_ascii=False)
        df.at[idx, "judge"] = "bfcl_ast"
        df.at[idx, "n_accepted"] = accepted
        df.at[idx, "accuracy"] = accepted / n if n else float("nan")
        df.at[idx, "bfcl_errors"] = json.dumps(errors, sort_keys=True)
        df.at[idx, "agreement"] = json.dumps(row_agree)
        df.at[idx, "decoder_differences"] = json.dumps(row_diffs, sort_keys=True)
        judged_states += 1
        judged_samples += n
        for k, v in row_agree.items():
            agree[k] += v
        for k, v in row_diffs.items():
            diffs[k] += v
    ok = df[df["status"] == "ok"]
    n_samples = int(ok["n_samples"].sum())
    n_accepted = int(ok["n_accepted"].sum())
    out = dict(summary)
    out.update(
        n_accepted=n_accepted,
        accuracy=n_accepted / n_samples if n_samples else float("nan"),
        mean_state_accuracy=float(ok["accuracy"].mean()) if len(ok) else float("nan"),
        any_accepted_rate=float((ok["n_accepted"] > 0).mean()) if len(ok) else float("nan"),
        judge_of_record="BFCL ast_checker on BFCL single-turn states, pivotrl's verifier on the others"
        if judged_states else "pivotrl's verifier (no BFCL single-turn state)",
        bfcl_decoder=judge.decoder,
        bfcl_judged_states=judged_states,
        bfcl_judged_samples=judged_samples,
        pivotrl_accuracy=int(ok["pivotrl_accepted"].sum()) / n_samples if n_samples else float("nan"),
        **{f"agree_{k}": v for k, v in agree.items()},
        **{f"decoder_diff_{k}": v for k, v in diffs.items()},
    )
    return df, out


#: What still differs from BFCL's leaderboard for a score judged by BFCL's AST checker here.
LEADERBOARD_DIFFERENCES = (
    ("prompt: pivotrl's renderer and action-format instruction, not BFCL's system prompt "
    "(default_prompts.py) and its function-document layout"),
    ("handler: pivotrl's engine and sampling settings (greedy, rollout.max_tokens, the policy's own context "
    "budget), not a BFCL model handler; states whose prompt does not fit are skipped, BFCL would score them"),
    "subset: the held-out states and the out-of-domain records evaluated here, not every record of a category",
)


def _rate(x: Any) -> str:
    return "n/a" if not isinstance(x, (int, float)) or math.isnan(x) else f"{x:.3f}"


def single_turn_judge_markdown(results: Mapping[str, Mapping[str, Any]]) -> list[str]:
    """Report lines "BFCL single-turn judge": per policy and measure (held-out greedy ``local``,
    ``out_of_domain``), BFCL's and pivotrl's accuracy, their agreement and the decoder differences
    by kind (from :func:`rejudge_local` summaries); empty when no summary was judged by BFCL."""
    rows, diff_rows, decoder = [], [], ""
    for policy, res in results.items():
        for section, label in (("local", "held-out, greedy"), ("out_of_domain", "out-of-domain, greedy")):
            s = (res or {}).get(section) or {}
            if not s.get("bfcl_judged_samples"):
                continue
            decoder = s.get("bfcl_decoder", decoder)
            acc, pacc = _rate(s.get("accuracy")), _rate(s.get("pivotrl_accuracy"))
            rows.append(f"| {policy} | {label} | {s['bfcl_judged_states']:g} | {s['bfcl_judged_samples']:g} | {acc} | "
                        f"{pacc} | " + " | ".join(f"{s.get(k, 0):g}" for k in AGREEMENT_KEYS) + " |")
            diff_rows.append(f"| {policy} | {label} | " + " | ".join(f"{s.get(k, 0):g}" for k in DIFFERENCE_KEYS) + " |")
    if not rows:
        return []
    lines = ["## BFCL single-turn judge", "",
             "Local accuracy on BFCL single-turn states (held-out and out-of-domain, greedy) is BFCL's own "
             "`ast_checker` (from the pinned wheel) on the model's raw text, decoded by " + decoder + ", against "
             "the record's `possible_answer`; pivotrl's verifier's verdict is kept beside it. Other states keep "
             "pivotrl's verifier. Accuracy columns are over all states of the measure; agreement counts samples "
             "of BFCL single-turn states.", "",
             ("| policy | measure | BFCL states | BFCL samples | accuracy (judge of record) | pivotrl verifier | "
             "both accept | only BFCL | only pivotrl | neither |"),
             "|---|---|---|---|---|---|---|---|---|---|", *rows, "",
             "Texts that pivotrl's action parser and BFCL's decoder read differently (samples, by kind: "
             + ", ".join(DECODER_DIFFERENCES) + "):", "",
             "| policy | measure | " + " | ".join(k.replace("_", " ") for k in DECODER_DIFFERENCES) + " |",
             "|---|---|" + "---|" * len(DECODER_DIFFERENCES), *diff_rows, "",
             "Not the leaderboard's score: it differs from BFCL's own run in", ""]
    lines += [f"- {d}" for d in LEADERBOARD_DIFFERENCES]
    lines += [f"- parser: {decoder}; BFCL's `underscore_to_dot` name conversion is off (a prompting model's)", ""]
    return lines
