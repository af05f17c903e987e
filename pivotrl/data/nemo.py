"""Pivot sets as NeMo Gym / NeMo RL PivotRL rows, and such rows read back as demonstrations.

NVIDIA's PivotRL recipe trains from JSONL rows for the single-step tool-use resources server: the
model-call input before the pivot action, the expected action, and routing. pivotrl writes one row
per pivot (:func:`pivot_row`)::

    {"responses_create_params": {"input": [...], "tools": [...]},   # Responses-API style
     "expected_action": {"type": "function_call", "name": "...", "arguments": "<JSON>"}
                      | {"type": "function_call_batch", "calls": [...]} | {"type": "message", "content": "..."},
     "agent_ref": {"type": "responses_api_agents", "name": "<agent>"},
     "pivot_id": "<state id>", "trajectory_id": "...", "decision_index": <assistant turn, 0-based>,
     "profiling": {"num_probes": m, "rewards": [...], "mean_reward": μ̂, "reward_variance": σ̂²,
                   "lambda_diff": λ, "verifier": ..., "verifier_hash": ..., "chat_template_hash": ...,
                   "reference_hash": ..., "pivots_sha256": ...},
     "pivotrl": {"category": ..., "env": ..., "meta": ...}}         # what a round trip needs

Input items: ``{"role", "content"}`` messages (system, user, assistant text), ``{"type":
"function_call", "call_id", "name", "arguments"}`` for each call of an earlier assistant turn, and
``{"type": "function_call_output", "call_id", "output"}`` for each tool result. Tools:
``{"type": "function", "name", "description", "parameters"}``. Null fields are omitted.

:func:`row_to_record` turns such a row back into a demonstration (trajectory id = ``pivot_id``; its
last assistant message is the expected action), so an exported set is a valid ``kind: chat``
source; the data loaders call it for any record with ``responses_create_params``.
"""

from __future__ import annotations

import json
from typing import Any, Mapping

from pivotrl.data.schema import Message, ToolCall, TurnState
from pivotrl.core.hashing import json_problem
from pivotrl.core.errors import DataError

__all__ = ["pivot_row", "row_to_record", "is_nemo_row", "DEFAULT_AGENT"]

#: Agent name rows are routed to unless told otherwise (the single-step tool-use agent).
DEFAULT_AGENT = "single_step_tool_use_with_argument_comparison_agent"


def _call_id(call: ToolCall, pos: int, k: int) -> str:
    return call.id or f"call_{pos}_{k}"


def _input_items(messages: tuple[Message, ...]) -> list[dict[str, Any]]:
    items: list[dict[str, Any]] = []
    pending: list[str] = []  # call ids of the last assistant turn, for tool results without an id
    for pos, m in enumerate(messages):
        if m.role == "tool":
            call_id = m.tool_call_id or (pending.pop(0) if pending else f"call_{pos}")
            items.append({"type": "function_call_output", "call_id": call_id, "output": m.content})
            continue
        if m.content or not m.tool_calls:
            items.append({"role": m.role, "content": m.content})
        if m.tool_calls:
            pending = []
            for k, c in enumerate(m.tool_calls):
                cid = _call_id(c, pos, k)
                pending.append(cid)
                items.append({"type": "function_call", "call_id": cid, "name": c.name,
                              "arguments": json.dumps(dict(c.arguments), ensure_ascii=False)})
    return items


def _expected_action(action: Message) -> dict[str, Any]:
    calls = [{"type": "function_call", "name": c.name, "arguments": json.dumps(dict(c.arguments), ensure_ascii=False)}
             for c in action.tool_calls]
    if not calls:
        return {"type": "message", "content": action.content}
    return calls[0] if len(calls) == 1 else {"type": "function_call_batch", "calls": calls}


def pivot_row(state: TurnState, profiling: Mapping[str, Any], *, env: Any = None, meta: Mapping[str, Any] | None = None,
              agent: str = DEFAULT_AGENT) -> dict[str, Any]:
    """One NeMo Gym PivotRL row for the pivot ``state`` (see the module docstring)."""
    params: dict[str, Any] = {"input": _input_items(state.messages)}
    tools = [{"type": "function", "name": t.name, "description": t.description, "parameters": dict(t.parameters)}
             for t in state.tools]
    if tools:
        params["tools"] = tools
    extra = {"category": state.category, "env": env, "meta": dict(meta or {})}
    return {"responses_create_params": params, "expected_action": _expected_action(state.demo_action),
            "agent_ref": {"type": "responses_api_agents", "name": agent}, "pivot_id": state.state_id,
            "trajectory_id": state.trajectory_id, "decision_index": state.turn_index,
            "profiling": dict(profiling), "pivotrl": {k: v for k, v in extra.items() if v is not None}}


def is_nemo_row(obj: Any) -> bool:
    return isinstance(obj, Mapping) and "responses_create_params" in obj and "expected_action" in obj


def _arguments(raw: Any, where: str) -> dict[str, Any]:
    if isinstance(raw, Mapping):
        return dict(raw)
    try:
        args = json.loads(raw) if isinstance(raw, str) and raw.strip() else {}
    except json.JSONDecodeError as e:
        raise DataError(f"{where}.arguments: not valid JSON ({json_problem(e)})") from None
    if not isinstance(args, Mapping):
        raise DataError(f"{where}.arguments: expected a JSON object")
    return dict(args)


def _call(d: Mapping[str, Any], call_id: str, where: str) -> dict[str, Any]:
    if not isinstance(d.get("name"), str) or not d["name"]:
        raise DataError(f"{where}.name: missing or not a non-empty string")
    return {"id": call_id, "type": "function",
            "function": {"name": d["name"], "arguments": json.dumps(_arguments(d.get("arguments"), where))}}


def row_to_record(row: Mapping[str, Any], where: str = "row") -> dict[str, Any]:
    """A NeMo Gym PivotRL row → a demonstration record (the dict ``Trajectory.from_dict`` reads).

    Raises DataError naming ``where`` and the field for a malformed row.
    """
    params = row.get("responses_create_params")
    if not isinstance(params, Mapping) or not isinstance(params.get("input"), (list, str)):
        raise DataError(f"{where}.responses_create_params.input: missing (expected a list of input items)")
    items = [{"role": "user", "content": params["input"]}] if isinstance(params["input"], str) else params["input"]
    messages: list[dict[str, Any]] = []
    names: dict[str, str] = {}
    for i, it in enumerate(items):
        w = f"{where}.responses_create_params.input[{i}]"
        if not isinstance(it, Mapping):
            raise DataError(f"{w}: expected an object")
        kind = it.get("type", "message")
        if kind == "function_call":
            call = _call(it, str(it.get("call_id") or f"call_{i}"), w)
            names[call["id"]] = call["function"]["name"]
            last = messages[-1] if messages else None
            if last is not None and last["role"] == "assistant":  # calls of the same assistant turn
                last.setdefault("tool_calls", []).append(call)
            else:
                messages.append({"role": "assistant", "content": "", "tool_calls": [call]})
        elif kind == "function_call_output":
            cid = str(it.get("call_id") or "")
            out = it.get("output", "")
            messages.append({"role": "tool", "content": out if isinstance(out, str) else json.dumps(out),
                             "tool_call_id": cid, "name": names.get(cid, "")})
        elif kind == "message":
            role = {"developer": "system"}.get(it.get("role"), it.get("role"))
            messages.append({"role": role, "content": it.get("content") or ""})
        else:
            raise DataError(f"{w}.type: {kind!r} is not one of message, function_call, function_call_output")
    act = row.get("expected_action")
    w = f"{where}.expected_action"
    if not isinstance(act, Mapping):
        raise DataError(f"{w}: missing")
    if act.get("type") == "message":
        messages.append({"role": "assistant", "content": str(act.get("content") or "")})
    elif act.get("type") in ("function_call", "function_call_batch"):
        calls = [act] if act["type"] == "function_call" else list(act.get("calls") or [])
        if not calls:
            raise DataError(f"{w}.calls: empty")
        n_prev = sum(1 for m in messages for _ in m.get("tool_calls", []))
        messages.append({"role": "assistant", "content": "",
                         "tool_calls": [_call(c, str(c.get("call_id") or f"call_{n_prev + k}"), f"{w}.calls[{k}]")
                                        for k, c in enumerate(calls)]})
    else:
        raise DataError(f"{w}.type: {act.get('type')!r} is not one of message, function_call, function_call_batch")
    tools = []
    for i, t in enumerate(params.get("tools") or []):
        fn = t.get("function", t) if isinstance(t, Mapping) else None
        if not isinstance(fn, Mapping):
            raise DataError(f"{where}.responses_create_params.tools[{i}]: expected an object")
        tools.append({"type": "function", "function": {"name": fn.get("name"), "description": fn.get("description") or "",
                                                        "parameters": fn.get("parameters") or {}}})
    extra = row.get("pivotrl") if isinstance(row.get("pivotrl"), Mapping) else {}
    pid = row.get("pivot_id") or row.get("id")
    if not pid:
        raise DataError(f"{where}.pivot_id: missing")
    return {"id": str(pid), "source": "nemo_gym", "category": str(extra.get("category") or ""),
            "messages": messages, "tools": tools, "env": extra.get("env"),
            "meta": {**dict(extra.get("meta") or {}), "nemo_pivot": {
                "trajectory_id": row.get("trajectory_id"), "decision_index": row.get("decision_index"),
                "profiling": row.get("profiling")}}}
