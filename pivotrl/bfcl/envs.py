"""BFCL's simulated multi-turn tool environments (file system, math, messages, posts, tickets,
trading, travel, vehicle), driven by :class:`~pivotrl.data.schema.ToolCall` objects.

The environment classes come from the extracted ``bfcl-eval`` wheel (see
:func:`pivotrl.bfcl.wheel.ensure_bfcl`); ``bfcl_root`` is the directory that contains ``bfcl_eval/``.
It is put on ``sys.path`` so the simulators can import their own helper modules.

Execution follows BFCL's rules: a call is dispatched by method name to the involved instance that
has that public method, with keyword arguments (strings are never evaluated); a ``str`` result is
kept, a ``dict`` result is written with ``json.dumps`` (``str`` if that fails), anything else with
``str``; an exception inside the tool becomes ``"Error during execution: <message>"``.

Determinism. Every simulator that draws random numbers (messages, trading, travel, vehicle) owns a
``random.Random`` seeded from its scenario (``random_seed`` or the class default), so replaying the
same calls from the same ``initial_config`` gives the same outputs and states; :meth:`copy` deep-copies
the generators with the instances, so branches continue identically. Wall-clock time enters only in
three places, none of which reaches :meth:`snapshot` or (in practice) a tool output: the file
system's private ``_last_modified`` stamps (private attributes are not compared); trading
transaction stamps, which are the fixed ``2024-09-01 10:30`` plus a seeded offset (converted there
and back through local time, so independent of the time zone except across a daylight-saving
change); the travel simulator's age check for ``verify_traveler_information``, which uses today's
date (only a traveller within days of their 18th birthday could change outcome).
"""

from __future__ import annotations

import copy
import importlib
import inspect
import json
import math
import sys
from pathlib import Path
from typing import Any, Iterable, Mapping, Sequence

from pivotrl.data.schema import ToolCall
from pivotrl.core.errors import DataError, ToolExecutionError

__all__ = [
    "BFCL_CLASSES",
    "STATELESS_CLASSES",
    "BFCLEnvironment",
    "GroundTruthChecker",
    "bfcl_class",
    "method_parameter_names",
    "replay",
]

_MODULE_PREFIX = "bfcl_eval.eval_checker.multi_turn_eval.func_source_code"

#: class name → (simulator module under ``func_source_code``, tool-schema file under
#: ``data/multi_turn_func_doc``), for the eight classes of BFCL's multi-turn categories.
BFCL_CLASSES: dict[str, tuple[str, str]] = {
    "GorillaFileSystem": ("gorilla_file_system", "gorilla_file_system.json"),
    "MathAPI": ("math_api", "math_api.json"),
    "MessageAPI": ("message_api", "message_api.json"),
    "TwitterAPI": ("posting_api", "posting_api.json"),
    "TicketAPI": ("ticket_api", "ticket_api.json"),
    "TradingBot": ("trading_bot", "trading_bot.json"),
    "TravelAPI": ("travel_booking", "travel_booking.json"),
    "VehicleControlAPI": ("vehicle_control", "vehicle_control.json"),
}

#: Classes with no state: they are not loaded from ``initial_config``.
STATELESS_CLASSES: frozenset[str] = frozenset({"MathAPI"})

ERROR_PREFIX = "Error during execution: "


def _ensure_on_path(bfcl_root: str | Path) -> None:
    root = Path(bfcl_root).expanduser().resolve()
    if not (root / "bfcl_eval").is_dir():
        raise DataError(f"bfcl_root {str(root)!r}: no 'bfcl_eval' directory inside (see ensure_bfcl)")
    if str(root) not in sys.path:
        sys.path.insert(0, str(root))


def bfcl_class(class_name: str, bfcl_root: str | Path) -> type:
    """Import and return the simulator class ``class_name`` (one of :data:`BFCL_CLASSES`).

    Raises DataError for an unknown class name or a root without ``bfcl_eval/``; ToolExecutionError
    if the simulator module cannot be imported.
    """
    if class_name not in BFCL_CLASSES:
        raise DataError(f"involved_classes: unknown BFCL class {class_name!r}; valid: {', '.join(BFCL_CLASSES)}")
    _ensure_on_path(bfcl_root)
    module_name = f"{_MODULE_PREFIX}.{BFCL_CLASSES[class_name][0]}"
    try:
        module = importlib.import_module(module_name)
    except Exception as e:  # noqa: BLE001 - any import failure means the tools cannot run
        raise ToolExecutionError(f"cannot import BFCL simulator {module_name}: {type(e).__name__}: {e}") from e
    return getattr(module, class_name)


def method_parameter_names(class_name: str, method: str, bfcl_root: str | Path) -> list[str]:
    """Parameter names of a simulator method in declaration order (``self`` excluded).

    Used to name the positional arguments of BFCL ground-truth calls. Raises DataError if the class
    has no public method ``method``.
    """
    cls = bfcl_class(class_name, bfcl_root)
    fn = getattr(cls, method, None)
    if method.startswith("_") or not callable(fn):
        raise DataError(f"BFCL class {class_name} has no public method {method!r}")
    params = list(inspect.signature(fn).parameters.values())
    return [
        p.name
        for p in params[1:]
        if p.kind in (inspect.Parameter.POSITIONAL_OR_KEYWORD, inspect.Parameter.POSITIONAL_ONLY)
    ]


def _public_methods(instance: Any) -> list[str]:
    return [
        name
        for name, _ in inspect.getmembers(instance, predicate=inspect.ismethod)
        if not name.startswith("_")
    ]


def _to_json(value: Any, stack: tuple[int, ...] = ()) -> Any:
    """JSON-able copy of a simulator value: objects become their public attributes (recursively);
    a reference back to an object being converted (e.g. a directory's parent) becomes
    ``{"__ref__": <its name or class>}``; sets become sorted lists; other scalars their ``str``; dict
    keys their :func:`_key`."""
    if value is None or isinstance(value, (bool, int, str)):
        return value
    if isinstance(value, float):
        return value if math.isfinite(value) else str(value)
    if id(value) in stack:
        return {"__ref__": str(getattr(value, "name", type(value).__name__))}
    inner = stack + (id(value),)
    if isinstance(value, Mapping):
        return {_key(k): _to_json(v, inner) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_to_json(v, inner) for v in value]
    if isinstance(value, (set, frozenset)):
        items = [_to_json(v, inner) for v in value]
        return sorted(items, key=lambda x: json.dumps(x, sort_keys=True))
    if hasattr(value, "__dict__"):
        out: dict[str, Any] = {"__class__": type(value).__name__}
        for k, v in vars(value).items():
            if not k.startswith("_"):
                out[k] = _to_json(v, inner)
        return out
    return str(value)


def _key(key: Any) -> str:
    """A dict key as a string; an integral float key is written as the int it equals (``2.0`` → ``"2"``),
    so states equal under Python's ``==`` (BFCL's state check: ``{2: x} == {2.0: x}``) give equal snapshots."""
    if isinstance(key, float) and key.is_integer():
        return str(int(key))
    return str(key)


def _tool_output(result: Any) -> str:
    if type(result) is str:
        return result
    if type(result) is dict:
        try:
            return json.dumps(result)
        except (TypeError, ValueError):
            return str(result)
    return str(result)


class BFCLEnvironment:
    """The simulator instances of one BFCL multi-turn task, executing calls and exposing state.

    Build with :meth:`from_context`; ``instances`` maps class name → simulator instance.
    """

    def __init__(self, instances: Mapping[str, Any]) -> None:
        self._instances: dict[str, Any] = dict(instances)
        self._owner: dict[str, str] = {}
        for class_name, inst in self._instances.items():
            for method in _public_methods(inst):
                self._owner[method] = class_name  # a later class wins, as in BFCL

    @classmethod
    def from_context(cls, ctx: Mapping[str, Any], bfcl_root: str | Path) -> "BFCLEnvironment":
        """Fresh environment from ``{"kind": "bfcl", "initial_config": {...}, "involved_classes": [...]}``.

        Each stateful class is loaded from a deep copy of its part of ``initial_config``
        (``_load_scenario(config, long_context=ctx.get("long_context", False))``: true for
        ``multi_turn_long_context``, as BFCL's checker loads it). Raises DataError for a malformed context.
        """
        if not isinstance(ctx, Mapping) or ctx.get("kind") != "bfcl":
            kind = ctx.get("kind") if isinstance(ctx, Mapping) else ctx
            raise DataError(f"env context: expected kind 'bfcl', got {kind!r}")
        classes = ctx.get("involved_classes")
        if not isinstance(classes, list) or not classes:
            raise DataError("env context.involved_classes: expected a non-empty list of class names")
        config = ctx.get("initial_config") or {}
        if not isinstance(config, Mapping):
            raise DataError("env context.initial_config: expected an object")
        instances: dict[str, Any] = {}
        for class_name in classes:
            inst = bfcl_class(class_name, bfcl_root)()
            if class_name not in STATELESS_CLASSES:
                part = config.get(class_name, {})
                try:
                    inst._load_scenario(copy.deepcopy(part), long_context=bool(ctx.get("long_context", False)))
                except Exception as e:  # noqa: BLE001 - simulator rejects the scenario
                    raise DataError(
                        f"env context.initial_config.{class_name}: rejected by the simulator ({type(e).__name__}: {e})"
                    ) from e
            instances[class_name] = inst
        return cls(instances)

    @property
    def instances(self) -> dict[str, Any]:
        """Class name → the live simulator instance (a new dict; the instances are not copied)."""
        return dict(self._instances)

    @property
    def class_names(self) -> list[str]:
        """Involved class names, in context order."""
        return list(self._instances)

    @property
    def tool_names(self) -> list[str]:
        """Every callable tool (public method) name, sorted."""
        return sorted(self._owner)

    def execute(self, call: ToolCall) -> str:
        """Run one call and return its output string (BFCL's conversion; tool errors as
        ``"Error during execution: ..."``, including an unknown tool name). Arguments are deep-copied."""
        class_name = self._owner.get(call.name)
        if class_name is None:
            return f"{ERROR_PREFIX}no tool named {call.name!r} in {', '.join(self._instances)}"
        method = getattr(self._instances[class_name], call.name)
        try:
            result = method(**copy.deepcopy(dict(call.arguments)))
        except Exception as e:  # noqa: BLE001 - a failing tool is an output, as in BFCL
            return f"{ERROR_PREFIX}{e}"
        return _tool_output(result)

    def execute_all(self, calls: Iterable[ToolCall]) -> list[str]:
        """Run calls in order; one output string per call."""
        return [self.execute(c) for c in calls]

    def snapshot(self) -> dict[str, Any]:
        """JSON-able state: ``{class name: {public attribute: value}}`` (objects converted through
        their public attributes), plus ``"_current_dir"`` (path from the root, ``/``-joined) for
        the file system, whose current directory is private in BFCL."""
        out: dict[str, Any] = {}
        for class_name, inst in self._instances.items():
            state = {k: _to_json(v) for k, v in vars(inst).items() if not k.startswith("_")}
            if class_name == "GorillaFileSystem":
                state["_current_dir"] = _directory_path(getattr(inst, "_current_dir", None))
            out[class_name] = state
        return out

    def copy(self) -> "BFCLEnvironment":
        """Independent deep copy (instances and their random generators)."""
        return BFCLEnvironment(copy.deepcopy(self._instances))


def _directory_path(directory: Any) -> str:
    names: list[str] = []
    seen: set[int] = set()
    while directory is not None and id(directory) not in seen:
        seen.add(id(directory))
        names.append(str(getattr(directory, "name", "")))
        directory = getattr(directory, "parent", None)
    return "/".join(reversed(names))


def replay(ctx: Mapping[str, Any], prior_calls: Sequence[Mapping[str, Any]], bfcl_root: str | Path) -> BFCLEnvironment:
    """Fresh environment with ``prior_calls`` (``ToolCall.to_dict()`` dicts) executed in order.

    The state before a multi-turn turn state (``verifier_context["prior_calls"]``). Raises DataError
    for a malformed context or call dict.
    """
    env = BFCLEnvironment.from_context(ctx, bfcl_root)
    for i, d in enumerate(prior_calls):
        env.execute(ToolCall.from_dict(d, where=f"prior_calls[{i}]"))
    return env


class GroundTruthChecker:
    """BFCL's own multi-turn checker (``bfcl_eval.eval_checker.multi_turn_eval``) run on one task's
    ground truth, turn by turn, to compare another replay of the task with it.

    :meth:`turn` executes one turn's ground-truth call strings exactly as BFCL's ``multi_turn_checker``
    does (its ``execute_multi_turn_func_call``: the strings are evaluated by BFCL's code, the
    instances are loaded from ``initial_config`` on the first turn and kept for the next);
    :meth:`state_differences` applies BFCL's ``state_checker`` (public attributes compared with
    ``!=``) to each class; :meth:`missing_outputs` applies its ``response_checker`` (every
    ground-truth output of the turn must be among the other replay's outputs so far). BFCL keeps the
    checker's instances in a module-level dict under a name built from ``model_name`` and the task
    id; :meth:`close` (or leaving the ``with`` block) removes this checker's entries.
    """

    def __init__(self, ctx: Mapping[str, Any], task_id: str, bfcl_root: str | Path) -> None:
        import uuid

        _ensure_on_path(bfcl_root)
        try:
            from bfcl_eval.eval_checker.multi_turn_eval import (
                multi_turn_checker,
                multi_turn_utils,
            )
        except Exception as e:  # noqa: BLE001 - any import failure means the checker cannot run
            raise ToolExecutionError(f"cannot import BFCL's multi-turn checker: {type(e).__name__}: {e}") from e
        self._checker, self._utils = multi_turn_checker, multi_turn_utils
        self._ctx, self._task_id = ctx, str(task_id)
        self._model = f"pivotrl_audit_{uuid.uuid4().hex}"
        self._instances: dict[str, Any] = {}

    def turn(self, calls: Sequence[str]) -> list[str]:
        """Execute one turn's ground-truth call strings in BFCL's checker; their output strings."""
        outputs, self._instances = self._utils.execute_multi_turn_func_call(
            func_call_list=list(calls), initial_config=dict(self._ctx.get("initial_config") or {}),
            involved_classes=list(self._ctx["involved_classes"]), model_name=self._model,
            test_entry_id=self._task_id, long_context=bool(self._ctx.get("long_context", False)),
            is_evaL_run=True)
        return list(outputs)

    def state_differences(self, env: BFCLEnvironment) -> dict[str, list[str]]:
        """Class name → the public attributes where ``env``'s instance differs from the ground
        truth's after the last :meth:`turn` (BFCL's ``state_checker``); empty when they agree."""
        mine = env.instances
        out: dict[str, list[str]] = {}
        for class_name, theirs in self._instances.items():
            if class_name not in mine:
                out[class_name] = ["(class missing)"]
                continue
            result = self._checker.state_checker({class_name: mine[class_name]}, {class_name: theirs})
            if not result["valid"]:
                out[class_name] = sorted(result["details"]["differences"])
        return out

    def missing_outputs(self, outputs_so_far: Sequence[str], turn_outputs: Sequence[str], turn: int) -> list[str]:
        """The ground-truth outputs of turn ``turn`` (:meth:`turn`'s result) that are not among
        ``outputs_so_far`` (BFCL's ``response_checker``: unordered, with multiplicity)."""
        result = self._checker.response_checker(list(outputs_so_far), list(turn_outputs), turn)
        return [] if result["valid"] else [str(x) for x in result["details"]["missing_items"]]

    def close(self) -> None:
        """Remove this checker's instances from BFCL's module-level store."""
        store = vars(self._utils)
        for name in [n for n in store if n.startswith(self._model)]:
            del store[name]
        self._instances = {}

    def __enter__(self) -> "GroundTruthChecker":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()
