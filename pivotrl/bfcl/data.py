"""BFCL (Berkeley Function-Calling Leaderboard) as a demonstration source.

Data come from the pinned ``bfcl-eval`` wheel (:func:`pivotrl.bfcl.wheel.ensure_bfcl`). Files used:
``bfcl_eval/data/BFCL_v4_<category>.json`` (JSON Lines), ``bfcl_eval/data/possible_answer/BFCL_v4_<category>.json``
(ground truth) and, for multi-turn, ``bfcl_eval/data/multi_turn_func_doc/<class file>.json`` (tool
schemas) plus the simulators (:mod:`pivotrl.bfcl.envs`).

How a record becomes a :class:`~pivotrl.data.schema.Trajectory` (:func:`load_bfcl`):

Single-turn categories (``simple_python``, ``multiple``, ``parallel``, ``parallel_multiple``)
    messages = the record's question messages, then one assistant message whose tool calls are the
    ground truth, each parameter set to its *first* acceptable value (a parameter whose list starts
    with ``""``, i.e. "may be omitted", is left out; nested dicts are resolved the same way).
    ``meta["possible_answers"]`` = ``[{"name": fname, "arguments": {param: [acceptable values]}}]``
    (BFCL semantics). No tool messages: nothing is executed.

``multi_turn_base``
    Every gold call executed in BFCL's simulators, each user turn closed by
    :data:`~pivotrl.bfcl.multi_turn.CLOSING_TEXT`; see :mod:`pivotrl.bfcl.multi_turn`.

Tool schemas: BFCL writes object types as ``"dict"``; they are rewritten to JSON-schema ``"object"``
(:func:`pivotrl.bfcl.records.normalise_schema`).
"""

from __future__ import annotations

import logging
import os
from typing import Any, Literal, Mapping, Sequence

from pivotrl.bfcl.multi_turn import FuncDocs, multi_turn_trajectory, mutating_methods
from pivotrl.bfcl.languages import language_of, root_modules, source_text
from pivotrl.bfcl.records import SOURCE, question_messages, read_jsonl, tool_spec
from pivotrl.bfcl.wheel import ensure_bfcl
from pivotrl.core.errors import ConfigError, DataError
from pivotrl.data.schema import Message, ToolCall, Trajectory
from pivotrl.data.sources import validate_trajectory

__all__ = [
    "AST_CATEGORIES", "IRRELEVANCE_CATEGORIES", "MULTI_TURN_CATEGORIES", "NO_CALL_RULE", "NO_CALL_TEXT",
    "REFUSED_CATEGORIES", "SINGLE_TURN_CATEGORIES", "load_bfcl",
]

log = logging.getLogger(__name__)

#: Categories whose gold is one assistant message of calls, judged by BFCL's ``ast_checker``.
AST_CATEGORIES: tuple[str, ...] = (
    "simple_python", "multiple", "parallel", "parallel_multiple", "live_simple", "live_multiple",
    "live_parallel", "live_parallel_multiple", "simple_java", "simple_javascript",
)
#: Categories whose right answer is no call at all (BFCL's relevance runner: any answer that does not
#: decode to a call is correct).
IRRELEVANCE_CATEGORIES: tuple[str, ...] = ("irrelevance", "live_irrelevance")
SINGLE_TURN_CATEGORIES: tuple[str, ...] = AST_CATEGORIES + IRRELEVANCE_CATEGORIES
MULTI_TURN_CATEGORIES: tuple[str, ...] = ("multi_turn_base", "multi_turn_miss_param", "multi_turn_long_context")

#: The gold answer of an irrelevance record (BFCL has none: any text without a call is right).
NO_CALL_TEXT = "None of the available functions can do this."
#: Its acceptance rule: any text (a call is rejected before the rule is read).
NO_CALL_RULE: dict[str, Any] = {"regex": "(?s).*"}

#: Categories of the pinned wheel that are not loaded, and why (the loader's and the config's error).
REFUSED_CATEGORIES: dict[str, str] = {
    "multi_turn_miss_func": "a function is withheld until a later turn (missed_function) and pivotrl's "
                            "trajectories hold one tool list for every turn, so its 'no call' turns would be "
                            "taught with the missing function on offer",
    "live_relevance": "no ground truth: BFCL only checks that some call is made, so there is no demonstrated "
                      "action to train on or verify against",
    "format_sensitivity": "not records: an index of other categories' record ids re-run under varied prompt "
                          "formats",
    "memory": "needs a prerequisite conversation to fill BFCL's memory backends and its free-text answers are "
              "judged by BFCL's agentic checker, which pivotrl does not run",
    "web_search": "needs live web search (BFCL's WebSearchAPI calls an online search service); nothing to "
                  "execute offline",
}


# ---------------------------------------------------------------------------------------- single-turn


def _demo_value(value: Any) -> Any:
    """First acceptable value, resolving BFCL's nested "dict of acceptable lists" form."""
    if isinstance(value, Mapping):
        out = {}
        for k, acceptable in value.items():
            if isinstance(acceptable, list):
                if acceptable and acceptable[0] != "":
                    out[k] = _demo_value(acceptable[0])
            else:
                out[k] = _demo_value(acceptable)
        return out
    if isinstance(value, list):
        return [_demo_value(v) if isinstance(v, Mapping) else v for v in value]
    return value


def _declared_parameters(funcs: Sequence[Any], name: str) -> tuple[set[str] | None, set[str]]:
    """The parameter names function ``name`` of a record declares (None when it is not listed or
    lists no properties) and those it requires."""
    for f in funcs:
        if isinstance(f, Mapping) and f.get("name") == name:
            params = f.get("parameters") or {}
            props = params.get("properties") if isinstance(params, Mapping) else None
            req = params.get("required") if isinstance(params, Mapping) else None
            return (set(props) if isinstance(props, Mapping) else None,
                    set(req) if isinstance(req, list) else set())
    return None, set()


def _no_call(record: Mapping[str, Any], category: str, where: str) -> Trajectory:
    """An irrelevance record: the question, then the text :data:`NO_CALL_TEXT` (module docstring)."""
    questions = record.get("question")
    if not isinstance(questions, list) or len(questions) != 1:
        raise DataError(f"{where}.question: expected exactly one turn in a single-turn category")
    messages = question_messages(record, 0, where)
    funcs = record.get("function")
    if not isinstance(funcs, list):  # an empty list is a task with no tool at all: the answer is text
        raise DataError(f"{where}.function: missing")
    tools = tuple(tool_spec(f, f"{where}.function[{i}]") for i, f in enumerate(funcs))
    messages.append(Message(role="assistant", content=NO_CALL_TEXT))
    return Trajectory(id=str(record["id"]), messages=tuple(messages), tools=tools, source=SOURCE,
                      category=category, env=None, meta={"answer_rule": dict(NO_CALL_RULE)})


class UnscorableRecord(DataError):
    """A record BFCL's own checker rejects every answer to (a defect of the data: a required parameter
    missing from the ground truth, an empty list of acceptable values, ...). Always skipped and
    listed, whatever ``on_invalid`` says."""


def _check_gold(record: Mapping[str, Any], gt: list[Any], calls: list[ToolCall], category: str, where: str,
                root: Any) -> None:
    """UnscorableRecord unless BFCL's ``ast_checker`` accepts the demonstrated calls."""
    if root is None:
        return
    b = root_modules(root)
    decoded = [{c.name: dict(c.arguments)} for c in calls]
    try:
        result = b.ast_checker(record["function"], decoded, gt, getattr(b.languages, language_of(category)),
                               category, "pivotrl")
    except Exception as e:  # noqa: BLE001 - the checker crashing on the gold is the same defect
        result = {"valid": False, "error": [f"{type(e).__name__}: {e}"]}
    if not result.get("valid"):
        raise UnscorableRecord(f"{where}: BFCL's checker rejects its own ground truth "
                               f"({str((result.get('error') or [''])[0])[:200]})")


def _param_schema(funcs: Sequence[Any], name: str, param: str) -> dict[str, Any]:
    for f in funcs:
        if isinstance(f, Mapping) and f.get("name") == name:
            props = (f.get("parameters") or {}).get("properties") or {}
            if isinstance(props.get(param), Mapping):
                return dict(props[param])
    return {}


def _single_turn(record: Mapping[str, Any], answer: Mapping[str, Any], category: str, where: str,
                 root: Any = None) -> Trajectory:
    language = language_of(category)
    checker = root_modules(root) if language != "PYTHON" else None
    questions = record.get("question")
    if not isinstance(questions, list) or len(questions) != 1:
        raise DataError(f"{where}.question: expected exactly one turn in a single-turn category")
    messages = question_messages(record, 0, where)
    funcs = record.get("function")
    if not isinstance(funcs, list) or not funcs:
        raise DataError(f"{where}.function: missing or empty")
    tools = tuple(tool_spec(f, f"{where}.function[{i}]") for i, f in enumerate(funcs))
    gt = answer.get("ground_truth")
    if not isinstance(gt, list) or not gt:
        raise DataError(f"{where}.ground_truth: missing or empty")
    calls, possible = [], []
    for i, entry in enumerate(gt):
        if not isinstance(entry, Mapping) or len(entry) != 1:
            raise DataError(f"{where}.ground_truth[{i}]: expected {{function name: {{param: [values]}}}}")
        (fname, params), = entry.items()
        if not isinstance(params, Mapping):
            raise DataError(f"{where}.ground_truth[{i}].{fname}: expected an object of parameters")
        declared, required = _declared_parameters(funcs, fname)
        args = {}
        for p, acceptable in params.items():
            if not isinstance(acceptable, list):
                raise DataError(f"{where}.ground_truth[{i}].{fname}.{p}: expected a list of values")
            if not acceptable:
                raise UnscorableRecord(f"{where}.ground_truth[{i}].{fname}.{p}: no acceptable value (BFCL's "
                                       "checker rejects every answer)")
            if declared is not None and p not in declared:
                continue  # an answer key the function does not declare: BFCL rejects a call that passes it
            given = [v for v in acceptable if v != ""]
            # "" = may be omitted; a required parameter still gets its first real value (BFCL requires it)
            if checker is not None:  # Java / JavaScript: values are source text (pivotrl.bfcl.languages)
                schema = _param_schema(funcs, fname, p)
                texts = list(dict.fromkeys(t for t in (source_text(checker, language, fname, p, schema, [v])
                                                       or source_text(checker, language, fname, p, schema, given)
                                                       for v in given) if t is not None))
                if given and not texts:
                    raise UnscorableRecord(f"{where}.ground_truth[{i}].{fname}.{p}: no source text of an acceptable "
                                           f"value is read back by BFCL's {language} type converter")
                acceptable = texts + ([""] if "" in acceptable else [])
                given = texts
            if given and (acceptable[0] != "" or p in required):
                args[p] = given[0] if checker is not None else _demo_value(given[0])
            if checker is not None:
                params = {**params, p: acceptable}
        calls.append(ToolCall(name=fname, arguments=args, id=f"call_{i}"))
        possible.append({"name": fname, "arguments": {p: list(v) for p, v in params.items()}})
    messages.append(Message(role="assistant", tool_calls=tuple(calls)))
    _check_gold(record, gt, calls, category, where, root)
    return Trajectory(
        id=str(record["id"]),
        messages=tuple(messages),
        tools=tools,
        source=SOURCE,
        category=category,
        env=None,
        meta={"possible_answers": possible},
    )


# --------------------------------------------------------------------------------------------- load


def load_bfcl(
    categories: Sequence[str],
    cache_dir: str | os.PathLike[str],
    limit_per_category: int | None = None,
    on_invalid: Literal["error", "quarantine"] = "error",
    quarantine: list[dict[str, Any]] | None = None,
) -> list[Trajectory]:
    """Demonstrations from BFCL categories (see the module docstring for the conversion).

    ``limit_per_category`` keeps the first N records of each category (file order). Bad records
    raise DataError naming the file, the record id and the field; with ``on_invalid="quarantine"``
    they are skipped and described in ``quarantine`` as ``{"source", "record", "error"}`` dicts.
    Raises ConfigError for an unknown category or option. Multi-turn categories execute every
    ground-truth call in BFCL's simulators.
    """
    if on_invalid not in ("error", "quarantine"):
        raise ConfigError(f"on_invalid={on_invalid!r}: must be 'error' or 'quarantine'")
    valid = SINGLE_TURN_CATEGORIES + MULTI_TURN_CATEGORIES
    for c in categories:
        if c in REFUSED_CATEGORIES:
            raise ConfigError(f"BFCL category {c!r} is not supported: {REFUSED_CATEGORIES[c]}")
        if c not in valid:
            raise ConfigError(f"unknown BFCL category {c!r}; valid: {', '.join(valid)}")
    if limit_per_category is not None and limit_per_category < 0:
        raise ConfigError(f"limit_per_category={limit_per_category}: must be >= 0 or None")
    root = ensure_bfcl(cache_dir)
    data = root / "bfcl_eval" / "data"
    docs = FuncDocs(root)
    out: list[Trajectory] = []
    for category in categories:
        fname = f"BFCL_v4_{category}.json"
        records = read_jsonl(data / fname)
        answers = ({} if category in IRRELEVANCE_CATEGORIES
                   else {a.get("id"): a for a in read_jsonl(data / "possible_answer" / fname)})
        mutating = mutating_methods(records, answers, category, fname, docs) \
            if category in MULTI_TURN_CATEGORIES else None
        if limit_per_category is not None:
            records = records[:limit_per_category]
        for record in records:
            rid = record.get("id")
            where = f"{fname} {rid!r}"
            try:
                if category in IRRELEVANCE_CATEGORIES:
                    traj = _no_call(record, category, where)
                elif rid not in answers:
                    raise DataError(f"{where}: no ground truth in possible_answer/{fname}")
                elif category in MULTI_TURN_CATEGORIES:
                    traj = multi_turn_trajectory(record, answers[rid], category, where, docs, mutating=mutating)
                else:
                    traj = _single_turn(record, answers[rid], category, where, root)
                validate_trajectory(traj, where=where)
            except UnscorableRecord as e:
                if quarantine is not None:
                    quarantine.append({"source": f"bfcl:{fname}", "record": str(rid), "error": str(e)})
                log.warning("skipped %s", e)
                continue
            except DataError as e:
                if on_invalid == "error":
                    raise
                if quarantine is not None:
                    quarantine.append({"source": f"bfcl:{fname}", "record": str(rid), "error": str(e)})
                log.warning("skipped %s", e)
                continue
            out.append(traj)
    return out
