"""BFCL's own multi-turn judge, imported from the pinned ``bfcl-eval`` wheel (never re-implemented).

The judge of record for BFCL multi-turn tasks is ``multi_turn_checker`` of
``bfcl_eval/eval_checker/multi_turn_eval/multi_turn_checker.py``. It imports only
``multi_turn_utils`` and ``bfcl_eval.constants.executable_backend_config``, neither of which pulls an
LLM SDK, so no stub is needed for it. (``ast_checker`` and ``eval_runner`` import every SDK through
``bfcl_eval.constants.model_config``; they are not used here: BFCL's single-turn judge,
:mod:`pivotrl.bfcl.single`, imports ``ast_checker`` with that module replaced in
:mod:`pivotrl.bfcl.ast_decoder`.)

What this module adds is glue, each piece mirroring a named BFCL file:

* the model's executed calls, per turn and per step, are written as BFCL call strings with the
  product's own formatter (:func:`pivotrl.format.actions.format_call`: keyword arguments, Python literals);
  steps without calls are left out, as ``eval_runner._evaluate_single_multi_turn_entry`` drops
  empty decoded steps;
* a task whose model result has fewer turns than its ground truth is ``"multi_turn:force_terminated"``
  (the same function's length check), which is how BFCL fails a task whose turn exceeded
  :data:`BFCL_STEP_LIMIT` executing steps (``model_handler/base_handler.py``: after each executing
  step ``count += 1``; ``count > MAXIMUM_STEP_LIMIT`` quits the whole task);
* BFCL's checker executes the call strings with ``eval`` inside its simulators. Only calls whose
  name is a public method of an involved class are passed as written; any other name is replaced by
  a call of an undefined name (:data:`UNKNOWN_TOOL`), which BFCL turns into an
  ``"Error during execution: ..."`` output, so a model can never reach a Python builtin through it.
  Argument values are literals (``format_value``), so nothing else is evaluated.

BFCL keeps every simulator instance it creates in the module globals of ``multi_turn_utils``, keyed by
model name and task id; each check here uses a fresh model name and removes its instances afterwards
(a lock serialises checks).
"""

from __future__ import annotations

import importlib
import itertools
import threading
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType
from typing import Any, Mapping, Sequence

from pivotrl.format.actions import format_call
from pivotrl.data.schema import ToolCall, Trajectory
from pivotrl.bfcl.envs import bfcl_class
from pivotrl.core.errors import DataError

__all__ = [
    "BFCL_STEP_LIMIT",
    "BFCLVerdict",
    "REASON_OF_ERROR_TYPE",
    "UNKNOWN_TOOL",
    "bfcl_check",
    "bfcl_step_limit",
    "bfcl_test_entry",
    "call_strings",
]

#: BFCL's ``MAXIMUM_STEP_LIMIT`` (``bfcl_eval/constants/default_prompts.py`` of bfcl-eval 2026.3.23);
#: a test checks it against the wheel.
BFCL_STEP_LIMIT = 20

#: The name a call of an unknown tool is given before BFCL's checker evaluates it.
UNKNOWN_TOOL = "pivotrl_unknown_tool"

#: BFCL ``error_type`` → the short reason used in pivotrl's per-task table.
REASON_OF_ERROR_TYPE: dict[str, str] = {
    "multi_turn:empty_turn_model_response": "empty_turn",
    "multi_turn:instance_state_mismatch": "state_mismatch",
    "multi_turn:execution_response_mismatch": "response_mismatch",
    "multi_turn:force_terminated": "force_terminated",
}

_CHECKER = "bfcl_eval.eval_checker.multi_turn_eval.multi_turn_checker"
_UTILS = "bfcl_eval.eval_checker.multi_turn_eval.multi_turn_utils"
_LOCK = threading.Lock()
_COUNTER = itertools.count()


@dataclass(frozen=True)
class BFCLVerdict:
    """BFCL's verdict on one task (or on its first ``turns_checked`` turns).

    ``valid``: BFCL accepts; ``error_type``: BFCL's ``error_type`` ("" when valid); ``reason``: its
    short name (:data:`REASON_OF_ERROR_TYPE`); ``detail``: a readable summary of BFCL's details.
    """

    valid: bool
    error_type: str = ""
    reason: str = ""
    detail: str = ""
    turns_checked: int = 0


def _modules(bfcl_root: str | Path) -> tuple[ModuleType, ModuleType]:
    bfcl_class("MathAPI", bfcl_root)  # puts bfcl_root on sys.path (and checks the layout)
    return importlib.import_module(_CHECKER), importlib.import_module(_UTILS)


def bfcl_step_limit(bfcl_root: str | Path) -> int:
    """``MAXIMUM_STEP_LIMIT`` read from the wheel at ``bfcl_root``."""
    bfcl_class("MathAPI", bfcl_root)
    return int(importlib.import_module("bfcl_eval.constants.default_prompts").MAXIMUM_STEP_LIMIT)


def bfcl_test_entry(trajectory: Trajectory) -> tuple[dict[str, Any], list[list[str]]]:
    """``(test_entry, ground_truth)`` for BFCL's checker from a BFCL multi-turn trajectory.

    ``test_entry`` = ``{"id", "initial_config", "involved_classes"}`` (from ``trajectory.env``);
    ``ground_truth`` = ``trajectory.meta["ground_truth"]`` (one list of call strings per user turn).
    Raises DataError naming the trajectory when either is missing.
    """
    env, meta = trajectory.env, trajectory.meta or {}
    if not isinstance(env, Mapping) or env.get("kind") != "bfcl":
        raise DataError(f"trajectory {trajectory.id!r}.env: BFCL's judge needs a BFCL environment")
    gt = meta.get("ground_truth")
    if not isinstance(gt, list) or not all(isinstance(t, list) for t in gt):
        raise DataError(f"trajectory {trajectory.id!r}.meta.ground_truth: missing; BFCL's judge needs it")
    entry = {"id": trajectory.id, "initial_config": dict(env.get("initial_config") or {}),
             "involved_classes": list(env["involved_classes"])}
    return entry, [[str(c) for c in t] for t in gt]


def call_strings(calls: Sequence[ToolCall], tool_names: set[str] | frozenset[str]) -> list[str]:
    """BFCL call strings for one step: ``format_call`` for known tools, :data:`UNKNOWN_TOOL` otherwise."""
    out = []
    for call in calls:
        if call.name in tool_names:
            out.append(format_call(call))
        else:
            out.append(f"{UNKNOWN_TOOL}()")
    return out


def _detail(result: Mapping[str, Any]) -> str:
    message = str(result.get("error_message", ""))
    details = result.get("details") or {}
    if "differences" in details:
        cls = message.split("Model instance for ", 1)[-1].split(" ", 1)[0]
        return f"{message} differs: " + ", ".join(f"{cls}.{k}" for k in details["differences"])
    if "missing_items" in details:
        missing = [str(m) for m in details["missing_items"]]
        shown = "; ".join(m if len(m) <= 120 else m[:117] + "..." for m in missing[:3])
        return f"{message} {len(missing)} ground-truth output(s) missing: {shown}"
    return message


def bfcl_check(
    test_entry: Mapping[str, Any],
    ground_truth: Sequence[Sequence[str]],
    model_steps: Sequence[Sequence[Sequence[str]]],
    bfcl_root: str | Path,
    category: str = "multi_turn_base",
) -> BFCLVerdict:
    """BFCL's verdict on the model's executed calls.

    Args:
        test_entry: ``{"id", "initial_config", "involved_classes"}`` (see :func:`bfcl_test_entry`).
        ground_truth: ``[turn][call string]``; pass a prefix of the turns to judge only those.
        model_steps: ``[turn][step][call string]`` of the model (steps with no call left out); a
            list shorter than ``ground_truth`` means the task was force-terminated.
        bfcl_root: directory containing ``bfcl_eval/``.
        category: BFCL test category (BFCL itself derives it from the id).

    Returns a :class:`BFCLVerdict`; ``turns_checked`` = ``len(ground_truth)``.
    """
    n = len(ground_truth)
    if len(model_steps) != n:
        return BFCLVerdict(False, "multi_turn:force_terminated", "force_terminated",
                           f"model result has {len(model_steps)} turns, ground truth {n}", n)
    checker, utils = _modules(bfcl_root)
    steps = [[[str(c) for c in step] for step in turn if step] for turn in model_steps]
    with _LOCK:
        name = f"pivotrl_{next(_COUNTER)}"
        try:
            result = checker.multi_turn_checker(steps, [list(t) for t in ground_truth], dict(test_entry),
                                                category, name)
        finally:
            for key in [k for k in vars(utils) if k.startswith(name + "_")]:
                del vars(utils)[key]
    if result.get("valid"):
        return BFCLVerdict(True, turns_checked=n)
    etype = str(result.get("error_type", "multi_turn:unknown"))
    return BFCLVerdict(False, etype, REASON_OF_ERROR_TYPE.get(etype, etype), _detail(result), n)
