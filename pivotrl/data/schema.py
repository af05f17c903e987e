"""The demonstration data model: OpenAI chat messages with tool calls, trajectories, turn states.

All classes are frozen dataclasses holding JSON-compatible values only, so every object
round-trips through ``to_dict``/``from_dict`` (and through Parquet as JSON strings) unchanged.

Terms (PivotRL §3): a *trajectory* is one expert demonstration; a *turn state* ``s`` is the complete
history before one assistant (model) call; the *demo action* is the assistant message of that call.
"""

from __future__ import annotations

import itertools
import json
from dataclasses import dataclass, field
from typing import Any, Iterator, Literal, Mapping, Sequence

from pivotrl.core.errors import DataError
from pivotrl.core.hashing import canonical_json, content_hash, json_problem

Role = Literal["system", "user", "assistant", "tool"]
ROLES: tuple[str, ...] = ("system", "user", "assistant", "tool")


def _function_of(d: Mapping[str, Any], where: str, shape: str) -> Mapping[str, Any]:
    """The ``function`` object of an OpenAI tool call or tool (``d`` itself in the flat form, whose
    ``name`` is at the top); DataError naming ``where.function`` when there is none or it is not an
    object, ``where.function.name`` when its name is missing."""
    if "function" not in d and "name" not in d:
        raise DataError(f"{where}.function: missing (expected {shape})")
    fn = d.get("function", d)
    if not isinstance(fn, Mapping):
        raise DataError(f"{where}.function: expected an object, got {type(fn).__name__}")
    if not isinstance(fn.get("name"), str) or not fn["name"]:
        raise DataError(f"{where}.function.name: missing or not a non-empty string")
    return fn


@dataclass(frozen=True)
class ToolCall:
    """One function call inside an assistant message.

    ``arguments`` maps parameter name → JSON value (positional arguments are resolved to names
    by the parser or the data source before a ToolCall exists).
    """

    name: str
    arguments: Mapping[str, Any] = field(default_factory=dict)
    id: str = ""

    def to_dict(self) -> dict[str, Any]:
        # OpenAI chat format: {"id", "type": "function", "function": {"name", "arguments": json str}}
        return {
            "id": self.id,
            "type": "function",
            "function": {"name": self.name, "arguments": canonical_json(dict(self.arguments))},
        }

    @classmethod
    def from_dict(cls, d: Mapping[str, Any], where: str = "tool_call") -> "ToolCall":
        if not isinstance(d, Mapping):
            raise DataError(f"{where}: expected an object, got {type(d).__name__}")
        fn = _function_of(d, where, '{"type": "function", "function": {"name": ..., "arguments": ...}}')
        args = fn.get("arguments", {})
        if isinstance(args, str):
            try:
                args = json.loads(args) if args.strip() else {}
            except json.JSONDecodeError as e:
                raise DataError(f"{where}.function.arguments: not valid JSON ({json_problem(e)})") from None
        if not isinstance(args, Mapping):
            raise DataError(f"{where}.function.arguments: expected an object, got {type(args).__name__}")
        call_id = d.get("id", "") or ""
        if not isinstance(call_id, str):
            raise DataError(f"{where}.id: expected a string")
        return cls(name=fn["name"], arguments=dict(args), id=call_id)


@dataclass(frozen=True)
class Message:
    """One chat message. ``tool_calls`` only on assistant messages; ``tool_call_id`` only on tool ones."""

    role: Role
    content: str = ""
    tool_calls: tuple[ToolCall, ...] = ()
    tool_call_id: str = ""
    name: str = ""

    def to_dict(self) -> dict[str, Any]:
        d: dict[str, Any] = {"role": self.role, "content": self.content}
        if self.tool_calls:
            d["tool_calls"] = [c.to_dict() for c in self.tool_calls]
        if self.tool_call_id:
            d["tool_call_id"] = self.tool_call_id
        if self.name:
            d["name"] = self.name
        return d

    @classmethod
    def from_dict(cls, d: Mapping[str, Any], where: str = "message") -> "Message":
        if not isinstance(d, Mapping):
            raise DataError(f"{where}: expected an object, got {type(d).__name__}")
        role = d.get("role")
        if role not in ROLES:
            raise DataError(f"{where}.role: {role!r} is not one of {', '.join(ROLES)}")
        content = d.get("content") or ""
        if not isinstance(content, str):
            if isinstance(content, list):  # OpenAI content parts: keep the text parts
                content = "".join(p.get("text", "") for p in content if isinstance(p, Mapping))
            else:
                raise DataError(f"{where}.content: expected a string, got {type(content).__name__}")
        raw_calls = d.get("tool_calls") or []
        if not isinstance(raw_calls, list):
            raise DataError(f"{where}.tool_calls: expected a list")
        if raw_calls and role != "assistant":
            raise DataError(f"{where}.tool_calls: only assistant messages may call tools (role={role})")
        calls = tuple(ToolCall.from_dict(c, f"{where}.tool_calls[{i}]") for i, c in enumerate(raw_calls))
        return cls(
            role=role,
            content=content,
            tool_calls=calls,
            tool_call_id=str(d.get("tool_call_id") or ""),
            name=str(d.get("name") or ""),
        )


@dataclass(frozen=True)
class ToolSpec:
    """A tool (function) schema as in OpenAI's ``tools=[{"type": "function", "function": {...}}]``.

    ``parameters`` is a JSON-schema object; the order of ``parameters["properties"]`` is the
    positional order used when an action passes arguments positionally.
    """

    name: str
    description: str = ""
    parameters: Mapping[str, Any] = field(default_factory=dict)

    def to_dict(self) -> dict[str, Any]:
        return {
            "type": "function",
            "function": {"name": self.name, "description": self.description, "parameters": dict(self.parameters)},
        }

    @classmethod
    def from_dict(cls, d: Mapping[str, Any], where: str = "tool") -> "ToolSpec":
        if not isinstance(d, Mapping):
            raise DataError(f"{where}: expected an object")
        fn = _function_of(d, where, '{"type": "function", "function": {"name": ..., "parameters": ...}}')
        params = fn.get("parameters") or {}
        if not isinstance(params, Mapping):
            raise DataError(f"{where}.function.parameters: expected an object")
        return cls(name=fn["name"], description=str(fn.get("description") or ""), parameters=dict(params))


@dataclass(frozen=True)
class Trajectory:
    """One expert demonstration.

    ``env`` describes the tool environment the demonstration ran in (JSON), e.g. for BFCL
    ``{"kind": "bfcl", "initial_config": {...}, "involved_classes": [...]}``; ``None`` if the tools
    cannot be executed. ``meta`` holds source-specific ground truth (e.g. BFCL possible answers).
    """

    id: str
    messages: tuple[Message, ...]
    tools: tuple[ToolSpec, ...] = ()
    source: str = ""
    category: str = ""
    env: Mapping[str, Any] | None = None
    meta: Mapping[str, Any] = field(default_factory=dict)

    def to_dict(self) -> dict[str, Any]:
        return {
            "id": self.id,
            "source": self.source,
            "category": self.category,
            "messages": [m.to_dict() for m in self.messages],
            "tools": [t.to_dict() for t in self.tools],
            "env": None if self.env is None else dict(self.env),
            "meta": dict(self.meta),
        }

    @classmethod
    def from_dict(cls, d: Mapping[str, Any], where: str = "trajectory") -> "Trajectory":
        if not isinstance(d, Mapping):
            raise DataError(f"{where}: expected an object, got {type(d).__name__}")
        tid = d.get("id")
        if not isinstance(tid, (str, int)) or str(tid) == "":
            raise DataError(f"{where}.id: missing")
        where = f"{where} {tid!r}"
        msgs = d.get("messages")
        if msgs is not None and not isinstance(msgs, list):
            raise DataError(f"{where}.messages: expected a list of messages, got {type(msgs).__name__}")
        if not msgs:
            raise DataError(f"{where}.messages: missing or empty")
        tools = d.get("tools") or []
        if not isinstance(tools, list):
            raise DataError(f"{where}.tools: expected a list")
        return cls(
            id=str(tid),
            messages=tuple(Message.from_dict(m, f"{where}.messages[{i}]") for i, m in enumerate(msgs)),
            tools=tuple(ToolSpec.from_dict(t, f"{where}.tools[{i}]") for i, t in enumerate(tools)),
            source=str(d.get("source") or ""),
            category=str(d.get("category") or ""),
            env=d.get("env"),
            meta=dict(d.get("meta") or {}),
        )


class MessagePrefix(Sequence[Message]):
    """The first ``n`` messages of a shared message tuple (a trajectory's), without copying them.

    Behaves as the tuple ``base[:n]``: indexing, slicing (a slice is a plain tuple), iteration,
    ``len`` and equality with any sequence of the same messages. Every turn state of a trajectory
    holds one of these over the same tuple, so the states of an N-message trajectory take O(N)
    memory instead of O(N²). Raises ValueError if ``n`` is outside ``0..len(base)``.
    """

    __slots__ = ("_base", "_n")

    def __init__(self, base: tuple[Message, ...], n: int) -> None:
        if not 0 <= n <= len(base):
            raise ValueError(f"a prefix of {n} messages of a {len(base)}-message history")
        self._base = base
        self._n = n

    def __len__(self) -> int:
        return self._n

    def __getitem__(self, i: Any) -> Any:
        if isinstance(i, slice):
            start, stop, step = i.indices(self._n)
            return self._base[start:stop:step] if step > 0 else self._base[: self._n][i]
        if not -self._n <= i < self._n:
            raise IndexError("message index out of range")
        return self._base[i % self._n]

    def __iter__(self) -> Iterator[Message]:
        return itertools.islice(self._base, self._n)

    def __eq__(self, other: object) -> bool:
        if isinstance(other, MessagePrefix) and other._base is self._base:
            return other._n == self._n
        if not isinstance(other, Sequence) or isinstance(other, (str, bytes)):
            return NotImplemented
        return len(other) == self._n and all(a == b for a, b in zip(self, other))

    def __hash__(self) -> int:
        return hash(tuple(self))

    def __repr__(self) -> str:
        return f"MessagePrefix({self._n} of {len(self._base)} messages)"


@dataclass(frozen=True)
class TurnState:
    """A pivot candidate: the history before one assistant call, and that call (the demo action).

    ``messages``: every message before the call (system, user, assistant, tool), in order; a
    :class:`MessagePrefix` of the trajectory's messages when extracted or read from a candidates
    table (shared, not copied), a tuple otherwise.
    ``turn_index``: index of the demo action among the trajectory's assistant messages (0-based).
    ``verifier_context``: JSON data the verifiers need (acceptable values, environment + the calls
    executed before this state, the demonstration's calls). ``state_id`` is
    ``f"{trajectory_id}#{turn_index}"``.
    """

    state_id: str
    trajectory_id: str
    turn_index: int
    messages: Sequence[Message]
    tools: tuple[ToolSpec, ...]
    demo_action: Message
    category: str = ""
    verifier_context: Mapping[str, Any] = field(default_factory=dict)

    def to_dict(self) -> dict[str, Any]:
        return {
            "state_id": self.state_id,
            "trajectory_id": self.trajectory_id,
            "turn_index": self.turn_index,
            "category": self.category,
            "messages": [m.to_dict() for m in self.messages],
            "tools": [t.to_dict() for t in self.tools],
            "demo_action": self.demo_action.to_dict(),
            "verifier_context": dict(self.verifier_context),
        }

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> "TurnState":
        where = f"turn state {d.get('state_id')!r}"
        return cls(
            state_id=str(d["state_id"]),
            trajectory_id=str(d["trajectory_id"]),
            turn_index=int(d["turn_index"]),
            category=str(d.get("category") or ""),
            messages=tuple(Message.from_dict(m, f"{where}.messages[{i}]") for i, m in enumerate(d["messages"])),
            tools=tuple(ToolSpec.from_dict(t, f"{where}.tools[{i}]") for i, t in enumerate(d["tools"])),
            demo_action=Message.from_dict(d["demo_action"], f"{where}.demo_action"),
            verifier_context=dict(d.get("verifier_context") or {}),
        )
