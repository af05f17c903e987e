"""Turn states (pivot candidates) from demonstrations, and their table form.

PivotRL §3: every assistant message of a trajectory is one candidate state ``s``: the complete
history before it (``messages``), the tools, and the demonstration's action (``demo_action``).
``state_id = f"{trajectory_id}#{turn_index}"`` where ``turn_index`` counts assistant messages from 0.

``verifier_context`` (read by the verifiers):

* ``"demo_calls"``: the demo action's calls as ``ToolCall.to_dict()`` dicts (empty for text);
* ``"default_verifier"``: ``"tool_name"`` for a text action; for tool calls ``"execution"`` when the
  trajectory has an executable environment (``env`` set, e.g. BFCL multi-turn), else ``"arguments"``;
* ``"possible_answers"``: copied from ``trajectory.meta`` when present (single-turn BFCL);
* ``"env"`` and ``"prior_calls"`` (every call of the earlier assistant messages, in order) when the
  trajectory has an ``env``;
* ``"candidate_kind"``: "call", "stop" (the text equals ``meta["stop_text"]``, e.g. BFCL's closing
  "Done."), "text_rule" (``meta["answer_rules"][str(turn_index)]`` or, for the last assistant
  message, ``meta["answer_rule"]`` gives an acceptance rule, copied to ``"answer_rule"``) or
  "text_no_rule" (see :mod:`pivotrl.data.text_rules`; :func:`candidate_kinds_for_pivots`).

Two table forms. The *full* form (:func:`states_to_frame`, columns :data:`STATE_COLUMNS`; the pivot
set) stores each state's history as JSON. The *candidates* form (:func:`candidates_frame`, columns
:data:`CANDIDATE_COLUMNS`; every assistant turn of every trajectory) stores ``history_len`` (the
number of messages before the demo action) instead, and leaves out ``prior_calls``, which is derived
from that history: a state refers to its trajectory and position, so the table grows linearly with
a trajectory's length, not with its square. :func:`frame_to_states` reads either form (the second
with the trajectories' messages); :func:`expand_candidates` turns candidate rows into the full form.
"""

from __future__ import annotations

import dataclasses
import json
from typing import Any, Mapping, Sequence

import numpy as np
import pandas as pd

from pivotrl.data.schema import Message, MessagePrefix, Trajectory, TurnState
from pivotrl.core.errors import DataError

__all__ = [
    "CANDIDATE_COLUMNS",
    "STATE_COLUMNS",
    "candidates_frame",
    "expand_candidates",
    "candidate_kinds_for_pivots",
    "extract_turn_states",
    "frame_to_states",
    "states_to_frame",
    "text_kind",
]


def candidate_kinds_for_pivots(include_stop_decisions: bool = False) -> tuple[str, ...]:
    """Kinds of states that may be probed and become pivots: calls and text with an explicit rule,
    plus stop decisions when asked. "text_no_rule" never is."""
    return ("call", "text_rule", "stop") if include_stop_decisions else ("call", "text_rule")


def text_kind(traj: Trajectory, turn_index: int, content: str, is_last: bool) -> tuple[str, dict[str, Any] | None]:
    """``(kind, answer rule or None)`` of a text assistant message (module docstring). Raises
    DataError naming the trajectory and field for a malformed rule."""
    from pivotrl.data.text_rules import validate_rule

    meta = traj.meta or {}
    stop = meta.get("stop_text")
    if isinstance(stop, str) and content.strip() == stop.strip():
        return "stop", None
    rules = meta.get("answer_rules") or {}
    if not isinstance(rules, dict):
        raise DataError(f"trajectory {traj.id!r}.meta.answer_rules: expected an object of turn index -> rule")
    if str(turn_index) in rules:
        return "text_rule", validate_rule(rules[str(turn_index)], f"trajectory {traj.id!r}.meta.answer_rules.{turn_index}")
    if is_last and meta.get("answer_rule") is not None:
        return "text_rule", validate_rule(meta["answer_rule"], f"trajectory {traj.id!r}.meta.answer_rule")
    return "text_no_rule", None

#: Columns of :func:`states_to_frame`; the last four hold JSON strings.
STATE_COLUMNS: tuple[str, ...] = (
    "state_id",
    "trajectory_id",
    "turn_index",
    "category",
    "messages",
    "tools",
    "demo_action",
    "verifier_context",
)
_JSON_COLUMNS = ("messages", "tools", "demo_action", "verifier_context")

#: Columns of :func:`candidates_frame`: ``history_len`` (int64) in the place of ``messages``.
CANDIDATE_COLUMNS: tuple[str, ...] = tuple("history_len" if c == "messages" else c for c in STATE_COLUMNS)


def extract_turn_states(traj: Trajectory) -> list[TurnState]:
    """One TurnState per assistant message of ``traj`` (in order; see the module docstring).

    Raises DataError if an assistant message has no history before it (the first message).
    """
    states: list[TurnState] = []
    prior_calls: list[dict[str, Any]] = []
    turn_index = 0
    last = max((i for i, m in enumerate(traj.messages) if m.role == "assistant"), default=-1)
    for pos, msg in enumerate(traj.messages):
        if msg.role != "assistant":
            continue
        if pos == 0:
            raise DataError(f"trajectory {traj.id!r}.messages[0]: an assistant message with no history before it")
        demo_calls = [c.to_dict() for c in msg.tool_calls]
        if not msg.tool_calls:
            default = "tool_name"
        elif traj.env is not None:
            default = "execution"
        else:
            default = "arguments"
        ctx: dict[str, Any] = {"demo_calls": demo_calls, "default_verifier": default}
        if msg.tool_calls:
            ctx["candidate_kind"] = "call"
        else:
            ctx["candidate_kind"], rule = text_kind(traj, turn_index, msg.content, pos == last)
            if rule is not None:
                ctx["answer_rule"] = rule
        if "possible_answers" in traj.meta:
            ctx["possible_answers"] = traj.meta["possible_answers"]
        if traj.env is not None:
            ctx["env"] = dict(traj.env)
            ctx["prior_calls"] = list(prior_calls)
        states.append(
            TurnState(
                state_id=f"{traj.id}#{turn_index}",
                trajectory_id=traj.id,
                turn_index=turn_index,
                messages=MessagePrefix(traj.messages, pos),
                tools=traj.tools,
                demo_action=msg,
                category=traj.category,
                verifier_context=ctx,
            )
        )
        prior_calls.extend(demo_calls)
        turn_index += 1
    return states


def _dumps(obj: Any) -> str:
    # Key order is kept (not sorted): a tool's property order is its positional-argument order.
    return json.dumps(obj, ensure_ascii=False, separators=(",", ":"))


def states_to_frame(states: Sequence[TurnState]) -> pd.DataFrame:
    """Table of turn states, one row each, columns :data:`STATE_COLUMNS` (structured ones as JSON
    strings, key order preserved). ``frame_to_states`` inverts it exactly."""
    rows = []
    for s in states:
        d = s.to_dict()
        rows.append({c: (_dumps(d[c]) if c in _JSON_COLUMNS else d[c]) for c in STATE_COLUMNS})
    df = pd.DataFrame(rows, columns=list(STATE_COLUMNS))
    return df.astype({"turn_index": "int64"})


def _prior_calls(history: Sequence[Message]) -> list[dict[str, Any]]:
    """Every call of the assistant messages of ``history``, in order (``verifier_context["prior_calls"]``)."""
    return [c.to_dict() for m in history if m.role == "assistant" for c in m.tool_calls]


def candidates_frame(states: Sequence[TurnState]) -> pd.DataFrame:
    """The candidates form of ``states`` (module docstring): columns :data:`CANDIDATE_COLUMNS`, one
    row per state, ``history_len`` = ``len(state.messages)``, the other structured columns as JSON.

    ``verifier_context["prior_calls"]`` is left out where the context has an ``env``, it is the last
    key and equals the calls of the history (as :func:`extract_turn_states` builds it);
    :func:`frame_to_states` and :func:`expand_candidates` restore it.
    Size: O(states + tools and demo actions), independent of the histories' lengths.
    """
    rows = []
    for s in states:
        ctx = dict(s.verifier_context)
        calls = ctx.get("prior_calls")
        if ("env" in ctx and isinstance(calls, list) and list(ctx)[-1] == "prior_calls"
                and calls == _prior_calls(s.messages)):
            del ctx["prior_calls"]
        rows.append({"state_id": s.state_id, "trajectory_id": s.trajectory_id, "turn_index": s.turn_index,
                     "category": s.category, "history_len": len(s.messages),
                     "tools": _dumps([t.to_dict() for t in s.tools]), "demo_action": _dumps(s.demo_action.to_dict()),
                     "verifier_context": _dumps(ctx)})
    df = pd.DataFrame(rows, columns=list(CANDIDATE_COLUMNS))
    return df.astype({"turn_index": "int64", "history_len": "int64"})


def _history(bases: dict[str, tuple[Message, ...]], histories: Mapping[str, Sequence[Message]] | None,
             tid: str, n: Any, where: str) -> MessagePrefix:
    """The first ``n`` messages of trajectory ``tid`` (``bases`` caches each trajectory's tuple)."""
    if tid not in bases:
        if histories is None:
            raise DataError(f"{where}: a candidates-table row (history_len) needs its trajectory's messages")
        if histories.get(tid) is None:
            raise DataError(f"{where}: trajectory {tid!r} is not among the trajectories given")
        bases[tid] = tuple(histories[tid])
    base = bases[tid]
    if isinstance(n, bool) or not isinstance(n, (int, np.integer)) or not 0 < n < len(base):
        raise DataError(f"{where}.history_len: {n!r}, but trajectory {tid!r} has {len(base)} messages "
                        "(expected 1 to one less than that)")
    return MessagePrefix(base, int(n))


def expand_candidates(df: pd.DataFrame, histories: Mapping[str, Sequence[Message]]) -> pd.DataFrame:
    """Candidate rows (:func:`candidates_frame`, any extra columns such as ``split``) in the full form
    of :func:`states_to_frame`: ``messages`` (the history as JSON) in the place of ``history_len``,
    ``prior_calls`` restored; the extra columns kept, in order. Byte for byte the JSON
    :func:`states_to_frame` writes for the same states.

    ``histories``: trajectory id → its messages. Size: the histories of these rows only (use it on a
    selection, e.g. the pivot set). Raises DataError naming the row for an unknown trajectory.
    """
    if "history_len" not in df.columns:
        return df
    bases: dict[str, tuple[Message, ...]] = {}
    parts: dict[str, list[str]] = {}  # per trajectory, each message's JSON once
    messages, contexts = [], []
    for i, (sid, tid, n, ctx) in enumerate(zip(df["state_id"], df["trajectory_id"], df["history_len"],
                                                df["verifier_context"])):
        where = f"candidates table row {i} (state {sid!r})"
        tid = str(tid)
        hist = _history(bases, histories, tid, n, where)
        if tid not in parts:
            parts[tid] = [_dumps(m.to_dict()) for m in bases[tid]]
        messages.append("[" + ",".join(parts[tid][: len(hist)]) + "]")
        contexts.append(_with_prior_calls(ctx, hist, where))
    out = df.copy()
    pos = list(out.columns).index("history_len")
    out = out.drop(columns=["history_len"])
    # The string dtype of the other JSON columns (pandas' default string type), as the full form has.
    out.insert(pos, "messages", pd.Series(messages, index=out.index, dtype=df["tools"].dtype))
    out["verifier_context"] = pd.Series(contexts, index=out.index, dtype=df["verifier_context"].dtype)
    return out


def _with_prior_calls(ctx_json: str, history: Sequence[Message], where: str) -> str:
    """``ctx_json`` with ``prior_calls`` (the history's calls) appended when it has ``env`` but no
    ``prior_calls`` (left out by :func:`candidates_frame`)."""
    try:
        ctx = json.loads(ctx_json)
    except (TypeError, json.JSONDecodeError) as e:
        raise DataError(f"{where}.verifier_context: not a JSON string ({e})") from None
    if not isinstance(ctx, dict) or "env" not in ctx or "prior_calls" in ctx:
        return ctx_json
    ctx["prior_calls"] = _prior_calls(history)
    return _dumps(ctx)


def frame_to_states(df: pd.DataFrame, histories: Mapping[str, Sequence[Message]] | None = None) -> list[TurnState]:
    """Turn states from a table of either form (module docstring), e.g. read back from Parquet.

    The full form (:func:`states_to_frame`) is self-contained. The candidates form
    (:func:`candidates_frame`) needs ``histories`` (trajectory id → its messages, e.g.
    :func:`pivotrl.pipeline.demos.read_histories`); each state's ``messages`` is then a
    :class:`MessagePrefix` of its trajectory's tuple, shared by all its states, and
    ``verifier_context["prior_calls"]`` is restored.
    Raises DataError naming the missing column, or the row (state id) and column of a bad cell.
    """
    compact = "history_len" in df.columns and "messages" not in df.columns
    cols = CANDIDATE_COLUMNS if compact else STATE_COLUMNS
    missing = [c for c in cols if c not in df.columns]
    if missing:
        raise DataError(f"turn-state table: column(s) {', '.join(missing)} missing")
    bases: dict[str, tuple[Message, ...]] = {}
    out: list[TurnState] = []
    for i, row in enumerate(df[list(cols)].itertuples(index=False, name=None)):
        rec = dict(zip(cols, row))
        where = f"turn-state table row {i} (state {rec['state_id']!r})"
        hist = None
        if compact:
            hist = _history(bases, histories, str(rec["trajectory_id"]), rec.pop("history_len"), where)
            rec["verifier_context"] = _with_prior_calls(rec["verifier_context"], hist, where)
            rec["messages"] = "[]"
        for c in _JSON_COLUMNS:
            try:
                rec[c] = json.loads(rec[c])
            except (TypeError, json.JSONDecodeError) as e:
                raise DataError(f"{where}.{c}: not a JSON string ({e})") from None
        try:
            state = TurnState.from_dict(rec)
        except (KeyError, TypeError, ValueError) as e:
            if isinstance(e, DataError):
                raise DataError(f"{where}: {e}") from None
            raise DataError(f"{where}: {type(e).__name__}: {e}") from None
        out.append(state if hist is None else dataclasses.replace(state, messages=hist))
    return out
