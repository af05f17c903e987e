"""BFCL's multi-turn records (``multi_turn_base``, ``_miss_param``, ``_long_context``) as trajectories, every gold call executed in BFCL's simulators.

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
setting a budget to its value, "Already retweeted"), gold values the history does not hold, and
gold free text that contradicts what it says it is (:mod:`pivotrl.data.claims`).

:func:`multi_turn_trajectory` converts one record (DataError naming the record and field when it does
not convert); :func:`mutating_methods` finds, over a category's whole file, the methods whose gold
calls change the state (the no-op rule above); :class:`FuncDocs` reads the involved classes' tool
schemas (``bfcl_eval/data/multi_turn_func_doc/``) once per class.
"""

from __future__ import annotations

import contextlib
import json
from pathlib import Path
from typing import Any, Mapping, Sequence

from pivotrl.bfcl.envs import BFCL_CLASSES, BFCLEnvironment, GroundTruthChecker, method_parameter_names
from pivotrl.bfcl.records import SOURCE, question_messages, read_jsonl, tool_spec
from pivotrl.core.errors import ActionParseError, DataError
from pivotrl.data.audit import (
    AUDIT_FLAGS_KEY,
    audit_bfcl_replay,
    audit_bfcl_turn,
    failure_status,
    not_in_history_flags,
)
from pivotrl.data.claims import claim_flags
from pivotrl.data.schema import Message, ToolCall, ToolSpec, Trajectory
from pivotrl.format.actions import format_call, parse_call

__all__ = ["CLOSING_TEXT", "FuncDocs", "multi_turn_trajectory", "mutating_methods"]

CLOSING_TEXT = "Done."


class FuncDocs:
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
            docs = read_jsonl(path)
            self._docs[class_name] = tuple(tool_spec(d, f"{path.name}[{i}]") for i, d in enumerate(docs))
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


def multi_turn_trajectory(
    record: Mapping[str, Any], answer: Mapping[str, Any], category: str, where: str, docs: FuncDocs,
    mutating: frozenset[str] | None = None, effects: list[tuple[str, bool]] | None = None,
    against_ground_truth: bool = True,
) -> Trajectory:
    """One multi-turn task (module docstring). ``mutating``: the methods that change the state in
    some gold replay of the category (a call of one that changes nothing is flagged a no-op);
    ``effects``, when given, gets (method, changed the state) for each gold call;
    ``against_ground_truth``: compare every turn with BFCL's checker, flag gold values the history
    does not hold (:mod:`pivotrl.data.audit`) and free text that contradicts what it says it is
    (:mod:`pivotrl.data.claims`)."""
    classes = record.get("involved_classes")
    if not isinstance(classes, list) or not classes:
        raise DataError(f"{where}.involved_classes: missing or empty")
    tools: list[ToolSpec] = []
    sigs: dict[str, ToolSpec] = {}
    for c in classes:
        tools.extend(docs.tools(c))
        sigs.update(docs.signatures(c))
    tool_props = {t.name: t.parameters.get("properties") or {} for t in tools}
    env_ctx: dict[str, Any] = {"kind": "bfcl", "initial_config": record.get("initial_config") or {},
                               "involved_classes": list(classes)}
    if "long_context" in category:  # BFCL's checker loads these scenarios with long_context=True
        env_ctx["long_context"] = True
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
    users: list[str] = []  # the user turns so far, and (tool, output) of every call so far (pivotrl.data.claims)
    earlier: list[tuple[str, str]] = []
    # BFCL's checker on the ground truth, turn by turn (its instances are released on leaving).
    ground_truth = GroundTruthChecker(env_ctx, str(record.get("id")), docs.root) if against_ground_truth else None
    with ground_truth or contextlib.nullcontext() as checker:
        for turn, turn_calls in enumerate(gt):
            question = question_messages(record, turn, where)
            messages.extend(question)
            visible.extend(m.content or "" for m in question)
            users.extend(m.content or "" for m in question if m.role == "user")
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
                    turn_flags.extend(claim_flags(f"turn {turn} call {k}", format_call(call), call.arguments,
                                                  users, earlier))
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
                earlier.append((call.name, output))
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


def mutating_methods(records: Sequence[Mapping[str, Any]], answers: Mapping[Any, Mapping[str, Any]],
                     category: str, fname: str, docs: FuncDocs) -> frozenset[str]:
    """The methods whose gold calls change the environment's state in some task of the category's
    whole file (whatever ``limit_per_category`` keeps; records that do not convert are skipped)."""
    effects: list[tuple[str, bool]] = []
    for record in records:
        rid = record.get("id")
        if rid in answers:
            try:
                multi_turn_trajectory(record, answers[rid], category, f"{fname} {rid!r}", docs,
                                      effects=effects, against_ground_truth=False)
            except DataError:
                continue
    return frozenset(name for name, changed in effects if changed)
