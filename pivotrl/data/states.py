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
  "text_no_rule" (see :mod:`pivotrl.verifiers.text_rules`; :func:`candidate_kinds_for_pivots`).
"""

from __future__ import annotations

import json
from typing import Any, Sequence

import pandas as pd

from pivotrl.data.schema import Trajectory, TurnState
from pivotrl.errors import DataError

__all__ = [
    "STATE_COLUMNS",
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
    from pivotrl.verifiers.text_rules import validate_rule

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
                messages=traj.messages[:pos],
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


def frame_to_states(df: pd.DataFrame) -> list[TurnState]:
    """Turn states from a table written by :func:`states_to_frame` (e.g. read back from Parquet).

    Raises DataError naming the missing column, or the row (state id) and column of a bad cell.
    """
    missing = [c for c in STATE_COLUMNS if c not in df.columns]
    if missing:
        raise DataError(f"turn-state table: column(s) {', '.join(missing)} missing")
    out: list[TurnState] = []
    for i, row in enumerate(df[list(STATE_COLUMNS)].itertuples(index=False, name=None)):
        rec = dict(zip(STATE_COLUMNS, row))
        where = f"turn-state table row {i} (state {rec['state_id']!r})"
        for c in _JSON_COLUMNS:
            try:
                rec[c] = json.loads(rec[c])
            except (TypeError, json.JSONDecodeError) as e:
                raise DataError(f"{where}.{c}: not a JSON string ({e})") from None
        try:
            out.append(TurnState.from_dict(rec))
        except (KeyError, TypeError, ValueError) as e:
            if isinstance(e, DataError):
                raise DataError(f"{where}: {e}") from None
            raise DataError(f"{where}: {type(e).__name__}: {e}") from None
    return out
