"""BFCL (Berkeley Function-Calling Leaderboard) as a demonstration source.

Data come from the pinned ``bfcl-eval==2026.3.23`` wheel (Apache-2.0), fetched with
``pip download --no-deps``, checked against its sha256 and unzipped (never installed); see
:func:`ensure_bfcl`. Files used: ``bfcl_eval/data/BFCL_v4_<category>.json`` (JSON Lines),
``bfcl_eval/data/possible_answer/BFCL_v4_<category>.json`` (ground truth) and, for multi-turn,
``bfcl_eval/data/multi_turn_func_doc/<class file>.json`` (tool schemas) plus the simulators
(:mod:`pivotrl.bfcl.envs`).

How a record becomes a :class:`~pivotrl.data.schema.Trajectory` (:func:`load_bfcl`):

Single-turn categories (``simple_python``, ``multiple``, ``parallel``, ``parallel_multiple``)
    messages = the record's question messages, then one assistant message whose tool calls are the
    ground truth, each parameter set to its *first* acceptable value (a parameter whose list starts
    with ``""``, i.e. "may be omitted", is left out; nested dicts are resolved the same way).
    ``meta["possible_answers"]`` = ``[{"name": fname, "arguments": {param: [acceptable values]}}]``
    (BFCL semantics). No tool messages: nothing is executed.

``multi_turn_base``
    For each user turn: the user message; one assistant message per ground-truth call (one call
    each, in order); after each, a tool message holding the real output of that call in BFCL's
    simulator (``tool_call_id`` matching); after the turn's last call, a closing assistant message
    with the text :data:`CLOSING_TEXT` (``"Done."``). The closing message teaches the policy to end
    its turn: the full-task evaluation ends a turn when the policy answers with text. A turn whose
    ground truth is empty (3 turns in 2 records: the user asks for something that cannot or need not
    be done) is the user message followed by the closing message only. Positional arguments in
    ground-truth strings are named from the simulator method's signature. ``env`` =
    ``{"kind": "bfcl", "initial_config", "involved_classes"}``; tools = the schemas of the involved
    classes; ``meta["ground_truth"]`` = the per-turn call strings; ``meta["stop_text"]`` = "Done."
    (the closing turns are stop decisions, :mod:`pivotrl.data.text_rules`). The gold calls are
    replayed twice: failing calls and replays that do not reproduce are listed in
    ``meta["audit_flags"]`` (:mod:`pivotrl.data.audit`), and so are *no-op* gold calls: a call of a
    method that changes the environment's state in some gold replay of the category's file but
    leaves it unchanged here (logging in when logged in, adding a stock already on the watchlist,
    setting a budget to its value, "Already retweeted").

Tool schemas: BFCL writes object types as ``"dict"``; they are rewritten to JSON-schema ``"object"``
(everywhere in the schema). Other BFCL type names (``"float"``, ``"tuple"``, ``"any"``) are kept.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import shutil
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path
from typing import Any, Literal, Mapping, Sequence

from pivotrl.format.actions import format_call, parse_call
from pivotrl.data.audit import (
    AUDIT_FLAGS_KEY,
    audit_bfcl_replay,
    audit_bfcl_turn,
    failure_status,
    not_in_history_flags,
)
from pivotrl.data.schema import Message, ToolCall, ToolSpec, Trajectory
from pivotrl.core.hashing import file_sha256, json_problem
from pivotrl.data.sources import validate_trajectory
from pivotrl.bfcl.envs import (
    BFCL_CLASSES,
    BFCLEnvironment,
    GroundTruthChecker,
    method_parameter_names,
)
from pivotrl.core.errors import ActionParseError, ConfigError, DataError, StorageError
from pivotrl.storage.files import atomic_dir

__all__ = [
    "BFCL_VERSION",
    "BFCL_WHEEL_SHA256",
    "CLOSING_TEXT",
    "MULTI_TURN_CATEGORIES",
    "SINGLE_TURN_CATEGORIES",
    "ensure_bfcl",
    "load_bfcl",
]

log = logging.getLogger(__name__)

BFCL_VERSION = "2026.3.23"
BFCL_WHEEL_SHA256 = "3bb6dfa5f0c68ad403c9ec50b00db2bb3b4cc9b38ab1ff33f48fe30d853d3a0a"
SINGLE_TURN_CATEGORIES: tuple[str, ...] = ("simple_python", "multiple", "parallel", "parallel_multiple")
MULTI_TURN_CATEGORIES: tuple[str, ...] = ("multi_turn_base",)
CLOSING_TEXT = "Done."
SOURCE = "bfcl"

_DONE_MARKER = ".sha256"


# ----------------------------------------------------------------------------------------- download


def ensure_bfcl(cache_dir: str | os.PathLike[str], wheel: str | os.PathLike[str] | None = None) -> Path:
    """Directory containing ``bfcl_eval/`` from the pinned, sha256-checked ``bfcl-eval`` wheel.

    ``<cache_dir>/bfcl_eval-<version>`` is reused when present; otherwise the wheel is fetched
    with ``python -m pip download --no-deps bfcl-eval==<version>`` (or taken from ``wheel``, a local
    file), checked, unzipped into a temporary directory and renamed into place, so a partial copy is
    never visible. Raises StorageError if the download or extraction fails, DataError if the wheel's
    sha256 is not :data:`BFCL_WHEEL_SHA256`.
    """
    cache = Path(cache_dir).expanduser()
    root = cache / f"bfcl_eval-{BFCL_VERSION}"
    if (root / _DONE_MARKER).is_file() and (root / "bfcl_eval").is_dir():
        return root
    cache.mkdir(parents=True, exist_ok=True)
    if root.exists() and not (root / _DONE_MARKER).is_file():
        shutil.rmtree(root)  # an incomplete earlier copy (no marker)
    with tempfile.TemporaryDirectory(prefix=".bfcl-tmp-", dir=cache) as work:
        if wheel is None:
            dl = Path(work) / "download"
            cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--disable-pip-version-check",
                   f"bfcl-eval=={BFCL_VERSION}", "-d", str(dl)]
            proc = subprocess.run(cmd, capture_output=True, text=True)
            wheels = sorted(dl.glob("*.whl")) if dl.is_dir() else []
            if proc.returncode != 0 or len(wheels) != 1:
                raise StorageError(
                    f"pip download of bfcl-eval=={BFCL_VERSION} failed (exit {proc.returncode}): "
                    f"{proc.stderr.strip()[-2000:]}"
                )
            wheel_path = wheels[0]
        else:
            wheel_path = Path(wheel)
            if not wheel_path.is_file():
                raise StorageError(f"bfcl wheel {str(wheel_path)!r}: no such file")
        digest = file_sha256(wheel_path)
        if digest != BFCL_WHEEL_SHA256:
            raise DataError(
                f"{wheel_path.name}: sha256 {digest} does not match the pinned {BFCL_WHEEL_SHA256}"
            )
        # Renamed into place whole; a concurrent writer that published first wins (its marker is there).
        with atomic_dir(root, already_published=lambda r: (r / _DONE_MARKER).is_file()) as extract:
            try:
                with zipfile.ZipFile(wheel_path) as zf:
                    zf.extractall(extract)
            except (zipfile.BadZipFile, OSError) as e:
                raise StorageError(f"{wheel_path.name}: cannot unzip ({e})") from e
            (extract / _DONE_MARKER).write_text(digest + "\n")
    return root


# ------------------------------------------------------------------------------------------ helpers


def _read_jsonl(path: Path) -> list[dict[str, Any]]:
    if not path.is_file():
        raise DataError(f"{path.name}: missing from the BFCL data")
    out = []
    with open(path, encoding="utf-8") as f:
        for lineno, line in enumerate(f, start=1):
            if line.strip():
                try:
                    out.append(json.loads(line))
                except json.JSONDecodeError as e:
                    raise DataError(f"{path.name} line {lineno}: malformed JSON ({json_problem(e)})") from None
    return out


def normalise_schema(schema: Any) -> Any:
    """Copy of a BFCL parameter schema with every ``"type": "dict"`` rewritten to ``"object"``."""
    if isinstance(schema, Mapping):
        out = {k: normalise_schema(v) for k, v in schema.items()}
        if out.get("type") == "dict":
            out["type"] = "object"
        return out
    if isinstance(schema, list):
        return [normalise_schema(v) for v in schema]
    return schema


def _tool_spec(doc: Mapping[str, Any], where: str) -> ToolSpec:
    if not isinstance(doc, Mapping) or not isinstance(doc.get("name"), str):
        raise DataError(f"{where}.name: missing")
    return ToolSpec(
        name=doc["name"],
        description=str(doc.get("description") or ""),
        parameters=normalise_schema(doc.get("parameters") or {}),
    )


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


def _question_messages(record: Mapping[str, Any], turn: int, where: str) -> list[Message]:
    turns = record.get("question")
    if not isinstance(turns, list) or turn >= len(turns) or not isinstance(turns[turn], list):
        raise DataError(f"{where}.question[{turn}]: missing")
    return [Message.from_dict(m, f"{where}.question[{turn}][{i}]") for i, m in enumerate(turns[turn])]


# ---------------------------------------------------------------------------------------- single-turn


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


def _single_turn(record: Mapping[str, Any], answer: Mapping[str, Any], category: str, where: str) -> Trajectory:
    questions = record.get("question")
    if not isinstance(questions, list) or len(questions) != 1:
        raise DataError(f"{where}.question: expected exactly one turn in a single-turn category")
    messages = _question_messages(record, 0, where)
    funcs = record.get("function")
    if not isinstance(funcs, list) or not funcs:
        raise DataError(f"{where}.function: missing or empty")
    tools = tuple(_tool_spec(f, f"{where}.function[{i}]") for i, f in enumerate(funcs))
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
            if not isinstance(acceptable, list) or not acceptable:
                raise DataError(f"{where}.ground_truth[{i}].{fname}.{p}: expected a non-empty list of values")
            if declared is not None and p not in declared:
                continue  # an answer key the function does not declare: BFCL rejects a call that passes it
            given = [v for v in acceptable if v != ""]
            # "" = may be omitted; a required parameter still gets its first real value (BFCL requires it)
            if given and (acceptable[0] != "" or p in required):
                args[p] = _demo_value(given[0])
        calls.append(ToolCall(name=fname, arguments=args, id=f"call_{i}"))
        possible.append({"name": fname, "arguments": {p: list(v) for p, v in params.items()}})
    messages.append(Message(role="assistant", tool_calls=tuple(calls)))
    return Trajectory(
        id=str(record["id"]),
        messages=tuple(messages),
        tools=tools,
        source=SOURCE,
        category=category,
        env=None,
        meta={"possible_answers": possible},
    )


# ----------------------------------------------------------------------------------------- multi-turn


class _FuncDocs:
    """Tool schemas of the BFCL classes and the positional parameter order of their methods."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self._docs: dict[str, tuple[ToolSpec, ...]] = {}
        self._sigs: dict[str, dict[str, ToolSpec]] = {}

    def tools(self, class_name: str) -> tuple[ToolSpec, ...]:
        if class_name not in self._docs:
            if class_name not in BFCL_CLASSES:
                raise DataError(f"involved_classes: unknown BFCL class {class_name!r}")
            path = self.root / "bfcl_eval" / "data" / "multi_turn_func_doc" / BFCL_CLASSES[class_name][1]
            docs = _read_jsonl(path)
            self._docs[class_name] = tuple(_tool_spec(d, f"{path.name}[{i}]") for i, d in enumerate(docs))
        return self._docs[class_name]

    def signatures(self, class_name: str) -> dict[str, ToolSpec]:
        """Method name → ToolSpec whose property order is the method's signature order."""
        if class_name not in self._sigs:
            self._sigs[class_name] = {
                t.name: ToolSpec(
                    name=t.name,
                    parameters={"properties": {p: {} for p in method_parameter_names(class_name, t.name, self.root)}},
                )
                for t in self.tools(class_name)
            }
        return self._sigs[class_name]


def _state(env: BFCLEnvironment) -> str:
    return json.dumps(env.snapshot(), sort_keys=True, default=str)


def _multi_turn(
    record: Mapping[str, Any], answer: Mapping[str, Any], category: str, where: str, docs: _FuncDocs,
    mutating: frozenset[str] | None = None, effects: list[tuple[str, bool]] | None = None,
    against_ground_truth: bool = True,
) -> Trajectory:
    """One multi-turn task (module docstring). ``mutating``: the methods that change the state in
    some gold replay of the category (a call of one that changes nothing is flagged a no-op);
    ``effects``, when given, gets (method, changed the state) for each gold call;
    ``against_ground_truth``: compare every turn with BFCL's checker and flag gold values the
    history does not hold (:mod:`pivotrl.data.audit`)."""
    classes = record.get("involved_classes")
    if not isinstance(classes, list) or not classes:
        raise DataError(f"{where}.involved_classes: missing or empty")
    tools: list[ToolSpec] = []
    sigs: dict[str, ToolSpec] = {}
    for c in classes:
        tools.extend(docs.tools(c))
        sigs.update(docs.signatures(c))
    tool_props = {t.name: t.parameters.get("properties") or {} for t in tools}
    env_ctx = {"kind": "bfcl", "initial_config": record.get("initial_config") or {}, "involved_classes": list(classes)}
    env = BFCLEnvironment.from_context(env_ctx, docs.root)
    questions = record.get("question")
    gt = answer.get("ground_truth")
    if not isinstance(gt, list) or not isinstance(questions, list) or len(gt) != len(questions):
        raise DataError(f"{where}.ground_truth: expected one call list per question turn ({len(questions or [])})")
    messages: list[Message] = []
    n_call = 0
    gold: list[ToolCall] = []
    outputs: list[str] = []
    call_where: list[str] = []
    noops: list[str] = []
    turn_flags: list[str] = []
    # The text the model has seen before each gold call (pivotrl.data.audit, "Not in the history").
    visible = [json.dumps([{"name": t.name, "description": t.description, "parameters": t.parameters}
                           for t in tools])]
    # BFCL's checker on the ground truth, turn by turn (its instances are released on leaving).
    ground_truth = GroundTruthChecker(env_ctx, str(record.get("id")), docs.root) if against_ground_truth else None
    with ground_truth or contextlib.nullcontext() as checker:
        for turn, turn_calls in enumerate(gt):
            question = _question_messages(record, turn, where)
            messages.extend(question)
            visible.extend(m.content or "" for m in question)
            if not isinstance(turn_calls, list):
                raise DataError(f"{where}.ground_truth[{turn}]: expected a list of call strings")
            for k, text in enumerate(turn_calls):
                field = f"{where}.ground_truth[{turn}][{k}]"
                try:
                    parsed = parse_call(text, list(sigs.values()))
                except ActionParseError as e:
                    raise DataError(f"{field}: {text!r} is not a call ({e})") from None
                unknown = [a for a in parsed.arguments if a not in tool_props.get(parsed.name, {})]
                if parsed.name not in tool_props or unknown:
                    raise DataError(f"{field}: {text!r} calls an unknown tool or parameter ({unknown or parsed.name})")
                call = ToolCall(name=parsed.name, arguments=parsed.arguments, id=f"call_{n_call}")
                n_call += 1
                if checker is not None:
                    turn_flags.extend(not_in_history_flags(f"turn {turn} call {k}", format_call(call),
                                                           call.arguments, "\n".join(visible)))
                before = _state(env)
                output = env.execute(call)
                changed = _state(env) != before
                if effects is not None:
                    effects.append((call.name, changed))
                if mutating is not None and call.name in mutating and not changed and not failure_status(output):
                    noops.append(f"turn {turn} call {k} {format_call(call)!r}: no-op: {call.name} changes the "
                                 f"environment in other gold replays, not here (output: {output[:120]})")
                gold.append(call)
                outputs.append(output)
                call_where.append(f"turn {turn} call {k}")
                messages.append(Message(role="assistant", tool_calls=(call,)))
                messages.append(Message(role="tool", content=output, tool_call_id=call.id, name=call.name))
                visible.extend([json.dumps(dict(call.arguments)), output])
            messages.append(Message(role="assistant", content=CLOSING_TEXT))
            if checker is not None:
                theirs = checker.turn(turn_calls)
                turn_flags.extend(audit_bfcl_turn(turn, checker.state_differences(env),
                                                  checker.missing_outputs(outputs, theirs, turn)))
    again = BFCLEnvironment.from_context(env_ctx, docs.root)
    flags = audit_bfcl_replay((outputs, env.snapshot()), (again.execute_all(gold), again.snapshot()),
                              call_where, [format_call(c) for c in gold]) + noops + turn_flags
    meta: dict[str, Any] = {"ground_truth": [list(t) for t in gt], "stop_text": CLOSING_TEXT}
    if flags:
        meta[AUDIT_FLAGS_KEY] = flags
    if record.get("excluded_function"):
        meta["excluded_function"] = list(record["excluded_function"])
    return Trajectory(
        id=str(record["id"]),
        messages=tuple(messages),
        tools=tuple(tools),
        source=SOURCE,
        category=category,
        env=env_ctx,
        meta=meta,
    )


# --------------------------------------------------------------------------------------------- load


def _mutating_methods(records: Sequence[Mapping[str, Any]], answers: Mapping[Any, Mapping[str, Any]],
                      category: str, fname: str, docs: _FuncDocs) -> frozenset[str]:
    """The methods whose gold calls change the environment's state in some task of the category's
    whole file (whatever ``limit_per_category`` keeps; records that do not convert are skipped)."""
    effects: list[tuple[str, bool]] = []
    for record in records:
        rid = record.get("id")
        if rid in answers:
            try:
                _multi_turn(record, answers[rid], category, f"{fname} {rid!r}", docs, effects=effects,
                            against_ground_truth=False)
            except DataError:
                continue
    return frozenset(name for name, changed in effects if changed)


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
        if c not in valid:
            raise ConfigError(f"unknown BFCL category {c!r}; valid: {', '.join(valid)}")
    if limit_per_category is not None and limit_per_category < 0:
        raise ConfigError(f"limit_per_category={limit_per_category}: must be >= 0 or None")
    root = ensure_bfcl(cache_dir)
    data = root / "bfcl_eval" / "data"
    docs = _FuncDocs(root)
    out: list[Trajectory] = []
    for category in categories:
        fname = f"BFCL_v4_{category}.json"
        records = _read_jsonl(data / fname)
        answers = {a.get("id"): a for a in _read_jsonl(data / "possible_answer" / fname)}
        mutating = _mutating_methods(records, answers, category, fname, docs) \
            if category in MULTI_TURN_CATEGORIES else None
        if limit_per_category is not None:
            records = records[:limit_per_category]
        for record in records:
            rid = record.get("id")
            where = f"{fname} {rid!r}"
            try:
                if rid not in answers:
                    raise DataError(f"{where}: no ground truth in possible_answer/{fname}")
                if category in MULTI_TURN_CATEGORIES:
                    traj = _multi_turn(record, answers[rid], category, where, docs, mutating=mutating)
                else:
                    traj = _single_turn(record, answers[rid], category, where)
                validate_trajectory(traj, where=where)
            except DataError as e:
                if on_invalid == "error":
                    raise
                if quarantine is not None:
                    quarantine.append({"source": f"bfcl:{fname}", "record": str(rid), "error": str(e)})
                log.warning("skipped %s", e)
                continue
            out.append(traj)
    return out
