"""The tool environments of a full-task evaluation and what its judge compares of them.

A task is played in a :class:`ToolSession` built by an :data:`EnvFactory` from the trajectory's
``env`` context: in-process BFCL simulators by default (:func:`default_factory`), or sandbox
workers (:func:`sandbox_executor`, :class:`SandboxSession`). :func:`split_user_turns` cuts a
demonstration into the user turns the evaluation plays; :func:`public_state`,
:func:`missing_outputs` and :func:`state_differences` are the state and response checks of
pivotrl's own judge (see :mod:`pivotrl.evaluation.full_task`).
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass
from os import PathLike
from typing import Any, Callable, Mapping, Protocol, Sequence

from pivotrl.data.schema import Message, ToolCall, Trajectory
from pivotrl.core.errors import ConfigError, DataError, ToolExecutionError

__all__ = [
    "SANDBOX_FUNCTIONS", "EnvFactory", "SandboxSession", "ToolSession", "UserTurn", "default_factory",
    "missing_outputs", "pivotrl_judge", "public_state", "sandbox_executor", "sandbox_replay", "split_user_turns",
    "state_differences",
]


class ToolSession(Protocol):
    """A live tool environment of one task (e.g. :class:`pivotrl.bfcl.envs.BFCLEnvironment`)."""

    def execute_all(self, calls: Sequence[ToolCall]) -> list[str]:
        """Execute ``calls`` in order; one output string per call."""
        ...

    def snapshot(self) -> dict[str, Any]:
        """JSON-able state: ``{class name: {attribute: value}}`` of every involved instance."""
        ...


# Builds a fresh session from a trajectory's ``env`` context. The default builds an in-process
# ``BFCLEnvironment``; a caller can pass a factory whose sessions run the calls elsewhere (e.g. in
# the sandbox of ``pivotrl.envs.sandbox``). A session may raise ToolExecutionError.
EnvFactory = Callable[[Mapping[str, Any]], ToolSession]


@dataclass(frozen=True)
class UserTurn:
    """One user turn of a demonstration: the user message(s) opening it and the demo's calls in it."""

    user_messages: tuple[Message, ...]
    demo_calls: tuple[ToolCall, ...]


def split_user_turns(trajectory: Trajectory) -> tuple[tuple[Message, ...], list[UserTurn]]:
    """Split a demonstration into its opening system message(s) and its user turns.

    A user turn starts at a user message that follows a non-user message (consecutive user
    messages open one turn together) and runs until the next such message; its ``demo_calls`` are
    the tool calls of every assistant message in it, in order (BFCL's per-turn ground truth).

    Returns ``(system_messages, turns)``. Raises DataError (naming the trajectory) when a message
    other than a system message comes before the first user message, or there is no user message.
    """
    system: list[Message] = []
    turns: list[tuple[list[Message], list[ToolCall]]] = []
    prev_role = ""
    for i, msg in enumerate(trajectory.messages):
        if msg.role == "user":
            if prev_role == "user":
                turns[-1][0].append(msg)
            else:
                turns.append(([msg], []))
        elif not turns:
            if msg.role != "system":
                raise DataError(
                    f"trajectory {trajectory.id!r}.messages[{i}]: a {msg.role} message comes before the "
                    "first user message; a full task must start with system message(s) and a user message"
                )
            system.append(msg)
        elif msg.role == "assistant":
            turns[-1][1].extend(msg.tool_calls)
        prev_role = msg.role
    if not turns:
        raise DataError(f"trajectory {trajectory.id!r}.messages: no user message, nothing to evaluate")
    return tuple(system), [UserTurn(tuple(u), tuple(c)) for u, c in turns]


def public_state(snapshot: Mapping[str, Any]) -> dict[str, Any]:
    """The part of an environment snapshot BFCL's state check compares.

    ``snapshot`` maps each involved class name to its attributes; attributes whose name starts with
    ``_`` are private and dropped (BFCL compares public attributes only). Keys of the snapshot that
    start with ``_`` (environment-level extras) are dropped as well.
    """
    out: dict[str, Any] = {}
    for cls_name, attrs in snapshot.items():
        if str(cls_name).startswith("_"):
            continue
        if isinstance(attrs, Mapping):
            out[cls_name] = {k: v for k, v in attrs.items() if not str(k).startswith("_")}
        else:
            out[cls_name] = attrs
    return out


def missing_outputs(ground_truth: Sequence[str], model: Sequence[str]) -> list[str]:
    """Ground-truth outputs not found among the model's, matched as an unordered multiset.

    Each model output can match one ground-truth output only: ``missing_outputs(["a", "a"], ["a"])``
    is ``["a"]``. An empty result means the response check passes (BFCL's subset rule).
    """
    pool = Counter(model)
    missing: list[str] = []
    for item in ground_truth:
        if pool[item] > 0:
            pool[item] -= 1
        else:
            missing.append(item)
    return missing


def state_differences(model: Mapping[str, Any], truth: Mapping[str, Any]) -> list[str]:
    """``class.attribute`` names whose values differ (ground truth's attributes drive the check)."""
    diffs: list[str] = []
    for cls_name, gt_attrs in truth.items():
        m_attrs = model.get(cls_name)
        if not isinstance(gt_attrs, Mapping) or not isinstance(m_attrs, Mapping):
            if m_attrs != gt_attrs:
                diffs.append(str(cls_name))
            continue
        diffs.extend(f"{cls_name}.{k}" for k, v in gt_attrs.items() if m_attrs.get(k, _MISSING) != v)
    return diffs


_MISSING = object()


# ------------------------------------------------------------------------------ sandboxed execution

#: The worker function to allow-list in a ``pivotrl.envs.sandbox.SandboxPool`` used for evaluation:
#: ``SandboxPool(..., bfcl_root=root, functions=SANDBOX_FUNCTIONS)``.
SANDBOX_FUNCTIONS: dict[str, str] = {"evaluation.bfcl_replay": "pivotrl.evaluation.task_env:sandbox_replay"}


def sandbox_replay(payload: Mapping[str, Any], settings: Mapping[str, Any]) -> dict[str, Any]:
    """Worker side of :class:`SandboxSession`: rebuild the environment and run the new calls.

    ``payload`` = ``{"ctx": env context, "prior_calls": [ToolCall dicts], "calls": [ToolCall dicts]}``;
    the prior calls are replayed (the simulators are deterministic), then ``calls`` are executed.
    Returns ``{"outputs": [one string per new call], "snapshot": state after them}``.
    """
    from pivotrl.bfcl.envs import BFCLEnvironment

    env = BFCLEnvironment.from_context(payload["ctx"], settings["bfcl_root"])
    for i, d in enumerate(payload["prior_calls"]):
        env.execute(ToolCall.from_dict(d, where=f"prior_calls[{i}]"))
    calls = [ToolCall.from_dict(d, where=f"calls[{i}]") for i, d in enumerate(payload["calls"])]
    return {"outputs": env.execute_all(calls), "snapshot": env.snapshot()}


class SandboxSession:
    """A task's environment living in sandbox workers (see ``pivotrl.envs.sandbox.SandboxPool``).

    Workers are stateless between requests, so each :meth:`execute_all` sends the context, every
    call executed so far and the new calls; the worker replays and returns the new outputs and the
    resulting snapshot (kept here for :meth:`snapshot`). Costs O(calls²) tool executions per task,
    a few milliseconds for BFCL tasks. Failures raise ToolExecutionError (``SandboxError``).
    """

    def __init__(self, pool: Any, ctx: Mapping[str, Any]) -> None:
        self._pool = pool
        self._ctx = dict(ctx)
        self._calls: list[dict[str, Any]] = []
        self._snapshot: dict[str, Any] | None = None

    def execute_all(self, calls: Sequence[ToolCall]) -> list[str]:
        new = [c.to_dict() for c in calls]
        reply = self._pool.call(
            "evaluation.bfcl_replay", {"ctx": self._ctx, "prior_calls": self._calls, "calls": new}
        )
        self._calls.extend(new)
        self._snapshot = reply["snapshot"]
        return [str(o) for o in reply["outputs"]]

    def snapshot(self) -> dict[str, Any]:
        if self._snapshot is None:  # nothing executed yet: fetch the initial state
            self.execute_all([])
        return dict(self._snapshot or {})


def sandbox_executor(pool: Any) -> EnvFactory:
    """An :data:`EnvFactory` running every tool call in ``pool``'s sandbox workers.

    ``pool`` must be a ``SandboxPool`` built with ``bfcl_root`` and ``functions=SANDBOX_FUNCTIONS``;
    raises ConfigError otherwise.
    """
    missing = [name for name in SANDBOX_FUNCTIONS if name not in getattr(pool, "functions", {})]
    if missing:
        raise ConfigError(
            f"sandbox pool does not allow {missing}; build it with functions=SANDBOX_FUNCTIONS "
            "(from pivotrl.evaluation.task_env)"
        )

    def build(ctx: Mapping[str, Any]) -> ToolSession:
        return SandboxSession(pool, ctx)

    return build


def default_factory(bfcl_root: str | PathLike[str] | None) -> EnvFactory:
    from pivotrl.bfcl.envs import BFCLEnvironment

    if bfcl_root is None:
        raise ConfigError("evaluate_full_tasks: bfcl_root is required when no executor is given")

    def build(ctx: Mapping[str, Any]) -> ToolSession:
        return BFCLEnvironment.from_context(dict(ctx), bfcl_root)

    return build


def pivotrl_judge(model_env: ToolSession, truth_env: ToolSession, turn: UserTurn, calls_in_turn: int,
                  outputs_so_far: Sequence[str], truth_outputs: Sequence[str]) -> tuple[str, str]:
    """pivotrl's judge of one user turn (BFCL's per-turn rules) → ``(reason, detail)``; ``("", "")``
    when the turn passes. ``model_env`` / ``truth_env``: the policy's and the ground truth's
    environments after the turn; ``calls_in_turn``: calls the policy executed in it;
    ``outputs_so_far``: every tool output of the policy, all turns so far.

    pivotrl's own judge (``judge="pivotrl"``, for environments run elsewhere, e.g. in the sandbox) follows
    BFCL's checker on the environment snapshots, turn by turn (``tests/integration/test_bfcl_judge.py`` measures where
    it and BFCL's disagree):
    
    1. the demonstration's calls of the turn are replayed in a separate ground-truth environment that
       persists across turns, as the model's does;
    2. a turn whose ground truth has no calls is not checked (BFCL leaves it to its irrelevance checker)
       and counts as passed;
    3. otherwise the policy must have executed at least one call in the turn (``"empty_turn"``);
    4. state check: every involved instance's public attributes must equal the ground truth's
       (``"state_mismatch"``); private attributes (leading ``_``, e.g. the file system's current
       directory) are ignored, as BFCL does;
    5. response check: every ground-truth output of the turn must occur among the policy's tool
       outputs *of all turns so far*, as an unordered multiset (each policy output matches at most one
       ground-truth output) (``"response_mismatch"``). BFCL uses the outputs of all turns so far so that
       a call made one turn early still counts.
    """
    if not turn.demo_calls:
        return "", ""
    if calls_in_turn == 0:
        return "empty_turn", f"no tool call in a turn whose ground truth has {len(turn.demo_calls)}"
    try:
        model_state = public_state(model_env.snapshot())
        truth_state = public_state(truth_env.snapshot())
    except ToolExecutionError as e:
        return "tool_error", f"snapshot failed: {e}"
    diffs = state_differences(model_state, truth_state)
    if diffs:
        return "state_mismatch", "differs: " + ", ".join(diffs[:8])
    missing = missing_outputs(truth_outputs, outputs_so_far)
    if missing:
        shown = "; ".join(m if len(m) <= 120 else m[:117] + "..." for m in missing[:3])
        return "response_mismatch", f"{len(missing)} ground-truth output(s) missing: {shown}"
    return "", ""
