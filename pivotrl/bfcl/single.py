"""BFCL's own AST checker as the judge of record for BFCL's single-turn categories (never re-implemented).

With ``quality.judge: bfcl`` every greedy held-out and out-of-domain state of a BFCL single-turn
category (``simple_python``, ``multiple``, ``parallel``, ``parallel_multiple``) is judged as BFCL's
``eval_runner._ast_file_runner`` judges a prompting model's answer:

* the model's raw text is decoded by BFCL's own Python decoder,
  ``bfcl_eval/model_handler/utils.py:default_decode_ast_prompting`` (strip backticks, newlines and
  spaces at both ends, add the missing ``[``/``]``, ``ast.parse``, keyword arguments only), then
  checked with ``bfcl_eval/utils.py:is_function_calling_format_output``; a failure is
  ``"ast_decoder:decoder_failed"`` / ``"ast_decoder:decoder_wrong_output_format"`` as in BFCL;
* the decoded calls are judged by ``bfcl_eval/eval_checker/ast_eval/ast_checker.py:ast_checker``
  against the record's own ``function`` list and ``possible_answer`` ground truth, read from the
  pinned wheel by record id (language Python, the record's category).

When the run's tool-call parser is not pythonic (``hermes``, ``llama3_json``) BFCL's Python decoder
cannot read the text at all; then the calls pivotrl's parser read are handed to ``ast_checker`` (as
BFCL's function-calling handlers hand it the calls their API returned), and the report says so.

Importing BFCL's decoder and checker from the wheel: ``ast_checker`` imports
``bfcl_eval.constants.model_config`` (which imports every LLM SDK) only for
``MODEL_CONFIG_MAPPING[model].underscore_to_dot``; it is replaced by a module whose mapping answers
``underscore_to_dot=False`` for any model (a prompting model writes dotted names as they are, which
is what BFCL does for its prompting handlers). ``model_handler/utils.py`` imports the Java and
JavaScript decoders, which need ``tree_sitter==0.21.3`` (not a dependency of pivotrl); when they do
not import they are replaced by modules whose functions raise (only Python is decoded here).

BFCL's decoder ``eval``-uates binary operations and lambdas in the text
(``resolve_ast_by_type``). Model text is never evaluated here: a text holding a binary operation
on anything but number or string literals, a power, or a lambda is counted as a decoder failure
(``"ast_decoder:unsafe_expression"``) without calling BFCL's decoder (BFCL would raise a
NameError for a name; a lambda would fail its type check).

Where pivotrl's action parser (:func:`pivotrl.format.actions.parse_action`) and BFCL's decoder read a text
differently, :func:`decoder_difference` names the kind (:data:`DECODER_DIFFERENCES`).
"""

from __future__ import annotations

import ast
import importlib
import json
import math
import sys
import threading
import types
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from pivotrl.format.actions import parse_action
from pivotrl.bfcl.data import SINGLE_TURN_CATEGORIES
from pivotrl.core.hashing import json_problem
from pivotrl.bfcl.envs import bfcl_class
from pivotrl.core.errors import ActionParseError, DataError

__all__ = [
    "AGREEMENT",
    "DECODER_DIFFERENCES",
    "AstVerdict",
    "BFCLSingleTurnJudge",
    "bfcl_decode",
    "decoder_difference",
]

#: Kinds of texts that pivotrl's action parser and BFCL's Python decoder read differently, in the
#: order they are tested (a text counts once, as its first kind).
DECODER_DIFFERENCES: tuple[str, ...] = (
    "code_fence",        # the calls inside a ``` fence: BFCL strips the backticks and may read them
    "no_brackets",       # calls without [ ]: BFCL adds the brackets, pivotrl reads a text answer
    "positional_args",   # pivotrl names positional values from the schema, BFCL drops them
    "tuple_values",      # a tuple value: pivotrl reads a list, BFCL keeps a tuple
    "only_pivotrl_reads",  # pivotrl reads calls, BFCL's decoder fails (e.g. **{'from': ...})
    "only_bfcl_reads",   # BFCL decodes calls, pivotrl's parser rejects the text
    "other",             # both read calls, different ones
)

#: Agreement of the two verdicts on one sample: key → (BFCL accepts, pivotrl accepts).
AGREEMENT: dict[str, tuple[bool, bool]] = {
    "both_accept": (True, True), "only_bfcl": (True, False), "only_pivotrl": (False, True),
    "neither": (False, False),
}

_MODEL_NAME = "pivotrl"
_LOCK = threading.Lock()


@dataclass(frozen=True)
class AstVerdict:
    """BFCL's verdict on one answer: ``valid``; ``error_type`` (BFCL's, "" when valid); ``detail``
    (BFCL's first error message, shortened)."""

    valid: bool
    error_type: str = ""
    detail: str = ""


class _AnyModel(dict):
    """``MODEL_CONFIG_MAPPING`` stand-in: every model name maps to a config without
    ``underscore_to_dot`` (dotted function names are kept as written)."""

    def __missing__(self, key: str) -> Any:
        return types.SimpleNamespace(underscore_to_dot=False)


def _install_stubs() -> None:
    name = "bfcl_eval.constants.model_config"
    if name not in sys.modules:
        stub = types.ModuleType(name)
        stub.MODEL_CONFIG_MAPPING = _AnyModel()  # type: ignore[attr-defined]
        sys.modules[name] = stub
    for mod, func in (("java_parser", "parse_java_function_call"), ("js_parser", "parse_javascript_function_call")):
        full = f"bfcl_eval.model_handler.parser.{mod}"
        if full in sys.modules:
            continue
        try:
            importlib.import_module(full)
        except Exception:  # noqa: BLE001 - tree_sitter missing or of another version: Python only here
            stub = types.ModuleType(full)

            def unsupported(*_: Any, _lang: str = mod) -> Any:
                raise NotImplementedError(f"BFCL's {_lang} decoder needs tree_sitter==0.21.3")

            setattr(stub, func, unsupported)
            sys.modules[full] = stub


def _bfcl(bfcl_root: str | Path) -> types.SimpleNamespace:
    """BFCL's Python decoder, output-format check and ``ast_checker`` from the wheel at ``bfcl_root``."""
    bfcl_class("MathAPI", bfcl_root)  # puts bfcl_root on sys.path (and checks the layout)
    with _LOCK:
        _install_stubs()
        utils = importlib.import_module("bfcl_eval.model_handler.utils")
        checker = importlib.import_module("bfcl_eval.eval_checker.ast_eval.ast_checker")
        top = importlib.import_module("bfcl_eval.utils")
        enums = importlib.import_module("bfcl_eval.constants.enums")
    return types.SimpleNamespace(decode=utils.default_decode_ast_prompting, ast_checker=checker.ast_checker,
                                 is_format=top.is_function_calling_format_output, python=enums.Language.PYTHON)


# ------------------------------------------------------------------------------------------ decoding

_SAFE_OPERANDS = (ast.Constant, ast.UnaryOp, ast.BinOp, ast.operator, ast.unaryop)


def _unsafe(text: str) -> bool:
    """Whether BFCL's decoder would ``eval`` something other than arithmetic on literals."""
    stripped = text.strip("`\n ")
    stripped = stripped if stripped.startswith("[") else "[" + stripped
    stripped = stripped if stripped.endswith("]") else stripped + "]"
    try:
        tree = ast.parse(stripped.strip().strip("'"), mode="eval")
    except (SyntaxError, ValueError):
        return False  # BFCL's decoder fails the same way
    for node in ast.walk(tree):
        if isinstance(node, ast.Lambda):
            return True
        if isinstance(node, ast.BinOp):
            for sub in ast.walk(node):
                if not isinstance(sub, _SAFE_OPERANDS) or isinstance(sub, ast.Pow):
                    return True
                if isinstance(sub, ast.Constant) and not isinstance(sub.value, (int, float, complex, str)):
                    return True
    return False


def bfcl_decode(text: str, bfcl_root: str | Path) -> tuple[list[dict[str, Any]] | None, AstVerdict | None]:
    """``(calls, None)``: BFCL's decoding of ``text`` as ``[{name: {param: value}}]``; or
    ``(None, verdict)``: the decoder's failure, as BFCL reports it."""
    if _unsafe(text):
        return None, AstVerdict(False, "ast_decoder:unsafe_expression",
                                "the text holds an expression BFCL's decoder would evaluate; not evaluated")
    b = _bfcl(bfcl_root)
    try:
        decoded = b.decode(text)
    except Exception as e:  # noqa: BLE001 - BFCL's runner catches every decoder exception the same way
        return None, AstVerdict(False, "ast_decoder:decoder_failed",
                                f"Invalid syntax. Failed to decode AST. {type(e).__name__}: {e}"[:300])
    if not b.is_format(decoded):
        return None, AstVerdict(False, "ast_decoder:decoder_wrong_output_format",
                                "Did not output in the specified format.")
    return decoded, None


def _plain(value: Any) -> Any:
    """``value`` with tuples read as lists (how pivotrl's parser reads them)."""
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    if isinstance(value, dict):
        return {k: _plain(v) for k, v in value.items()}
    return value


def _has_tuple(value: Any) -> bool:
    if isinstance(value, tuple):
        return True
    if isinstance(value, list):
        return any(_has_tuple(v) for v in value)
    if isinstance(value, dict):
        return any(_has_tuple(v) for v in value.values())
    return False


def _has_positional(text: str) -> bool:
    try:
        tree = ast.parse(text.strip(), mode="eval")
    except (SyntaxError, ValueError):
        return False
    body = tree.body
    calls = body.elts if isinstance(body, (ast.List, ast.Tuple)) else [body]
    return any(isinstance(c, ast.Call) and c.args for c in calls)


def decoder_difference(text: str, tools: Sequence[Any] | None, bfcl_root: str | Path) -> str | None:
    """The kind (:data:`DECODER_DIFFERENCES`) of a text that pivotrl's pythonic action parser and
    BFCL's Python decoder read differently, or None when they read the same calls (or both read no
    call). ``tools``: the state's ToolSpecs (pivotrl names positional values from them)."""
    try:
        message = parse_action(text, tools)
        ours = [{c.name: dict(c.arguments)} for c in message.tool_calls] or None
    except ActionParseError:
        ours = None
    theirs, _ = bfcl_decode(text, bfcl_root)
    theirs = theirs or None  # [] is no call
    if ours is None and theirs is None:
        return None
    if ours is not None and theirs is not None and ours == theirs:
        return None
    if text.strip().startswith("```"):
        return "code_fence"
    if theirs is not None and not text.strip().startswith("["):
        return "no_brackets"
    if ours is not None and theirs is not None:
        if _has_positional(text):
            return "positional_args"
        if _has_tuple(theirs) and _plain(theirs) == ours:
            return "tuple_values"
        return "other"
    if _has_positional(text) and theirs is not None:
        return "positional_args"
    return "only_pivotrl_reads" if ours is not None else "only_bfcl_reads"


# --------------------------------------------------------------------------------------------- judge


class BFCLSingleTurnJudge:
    """BFCL's ``ast_checker`` on BFCL single-turn records (module docstring).

    ``bfcl_root``: directory containing ``bfcl_eval/`` (:func:`pivotrl.bfcl.wheel.ensure_bfcl`);
    ``tool_parser``: the run's tool-call parser name (``pivotrl.format.tool_parsers``); with "pythonic"
    BFCL's decoder reads the raw text, otherwise pivotrl's parser does.
    """

    def __init__(self, bfcl_root: str | Path, tool_parser: str = "pythonic") -> None:
        self.root = Path(bfcl_root)
        self.tool_parser = tool_parser
        self._records: dict[str, dict[str, tuple[list[Any], list[Any]]]] = {}

    @property
    def decoder(self) -> str:
        """Which decoder reads the model's text (for the report)."""
        return ("BFCL's Python decoder (default_decode_ast_prompting)" if self.tool_parser == "pythonic"
                else f"pivotrl's {self.tool_parser} parser (BFCL's Python decoder cannot read {self.tool_parser} text)")

    def _category(self, category: str) -> dict[str, tuple[list[Any], list[Any]]]:
        if category not in self._records:
            data = self.root / "bfcl_eval" / "data"
            fname = f"BFCL_v4_{category}.json"
            records: dict[str, tuple[list[Any], list[Any]]] = {}
            answers = {}
            for path, into in ((data / fname, "record"), (data / "possible_answer" / fname, "answer")):
                if not path.is_file():
                    raise DataError(f"{path.name}: missing from the BFCL data (BFCL's single-turn judge)")
                with open(path, encoding="utf-8") as f:
                    for lineno, line in enumerate(f, start=1):
                        if not line.strip():
                            continue
                        try:
                            obj = json.loads(line)
                        except json.JSONDecodeError as e:
                            raise DataError(f"{path.name} line {lineno}: malformed JSON ({json_problem(e)})") from None
                        if into == "answer":
                            answers[str(obj.get("id"))] = obj.get("ground_truth")
                        else:
                            records[str(obj.get("id"))] = (obj.get("function"), [])
            self._records[category] = {rid: (funcs, answers[rid]) for rid, (funcs, _) in records.items()
                                       if rid in answers}
        return self._records[category]

    def judges(self, state: Any) -> bool:
        """Whether ``state`` is the answer of a BFCL single-turn record (its category is one of
        :data:`~pivotrl.bfcl.data.SINGLE_TURN_CATEGORIES` and its trajectory id a record of it)."""
        category = getattr(state, "category", "")
        return (category in SINGLE_TURN_CATEGORIES and state.turn_index == 0
                and str(state.trajectory_id) in self._category(category))

    def judge(self, state: Any, text: str, parsed_calls: Sequence[Any] | None = None) -> AstVerdict:
        """BFCL's verdict on ``text``, the model's answer at ``state`` (``judges(state)`` must hold).

        ``parsed_calls``: pivotrl's parse of the text (ToolCalls), used only when the run's tool
        parser is not pythonic (None: the text did not parse). Raises DataError for a state that is
        not a BFCL single-turn record.
        """
        if not self.judges(state):
            raise DataError(f"turn state {state.state_id!r}: not a BFCL single-turn record; BFCL's AST judge cannot judge it")
        functions, possible = self._category(state.category)[str(state.trajectory_id)]
        if self.tool_parser == "pythonic":
            decoded, failure = bfcl_decode(text, self.root)
            if failure is not None:
                return failure
        elif parsed_calls is None:
            return AstVerdict(False, "ast_decoder:decoder_failed", f"pivotrl's {self.tool_parser} parser read no call")
        else:
            decoded = [{c.name: dict(c.arguments)} for c in parsed_calls]
        b = _bfcl(self.root)
        try:
            result = b.ast_checker(functions, decoded, possible, b.python, state.category, _MODEL_NAME)
        except Exception as e:  # noqa: BLE001 - a checker crash on odd model output rejects it, as a failure
            return AstVerdict(False, "ast_checker:crashed", f"{type(e).__name__}: {e}"[:300])
        if result.get("valid"):
            return AstVerdict(True)
        errors = result.get("error") or [""]
        return AstVerdict(False, str(result.get("error_type", "ast_checker:unknown")), str(errors[0])[:300])


# ------------------------------------------------------------------------------------ local tables

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
