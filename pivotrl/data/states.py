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
  trajectory has an ``env``.
"""

from __future__ import annotations

import json
from typing import Any, Sequence

import pandas as pd

from pivotrl.data.schema import Trajectory, TurnState
from pivotrl.errors import DataError

__all__ = ["STATE_COLUMNS", "extract_turn_states", "frame_to_states", "states_to_frame"]

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
