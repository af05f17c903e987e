"""BFCL's Python decoder and ``ast_checker``, imported from the pinned wheel, and the decoding of model text.

:func:`bfcl_decode` reads a model's raw text as BFCL's prompting runner does:
``bfcl_eval/model_handler/utils.py:default_decode_ast_prompting`` (strip backticks, newlines and
spaces at both ends, add the missing ``[``/``]``, ``ast.parse``, keyword arguments only), then
``bfcl_eval/utils.py:is_function_calling_format_output``; it returns the calls as
``[{name: {param: value}}]`` or an :class:`AstVerdict` naming the failure as BFCL does
(``"ast_decoder:decoder_failed"``, ``"ast_decoder:decoder_wrong_output_format"``).
:func:`bfcl_modules` hands out the decoder, the format check and ``ast_checker`` of the wheel at
``bfcl_root`` (imported once, under a lock).

Importing BFCL's decoder and checker from the wheel: ``ast_checker`` imports
``bfcl_eval.constants.model_config`` (which imports every LLM SDK) only for
``MODEL_CONFIG_MAPPING[model].underscore_to_dot``; it is replaced by a module whose mapping answers
``underscore_to_dot=False`` for any model (a prompting model writes dotted names as they are, which
is what BFCL does for its prompting handlers). ``model_handler/utils.py`` imports the Java and
JavaScript decoders, which need ``tree_sitter==0.21.3`` (not a dependency of pivotrl); when they do
not import they are replaced by modules whose functions raise (only Python is decoded here).

BFCL's decoder ``eval``-uates binary operations and lambdas in the text
(``resolve_ast_by_type``). Model text is never evaluated here: a text holding a binary operation
on anything but number or string literals, a power, or a lambda is counted as a decoder failure
(``"ast_decoder:unsafe_expression"``) without calling BFCL's decoder (BFCL would raise a
NameError for a name; a lambda would fail its type check).

Where pivotrl's action parser (:func:`pivotrl.format.actions.parse_action`) and BFCL's decoder read a text
differently, :func:`decoder_difference` names the kind (:data:`DECODER_DIFFERENCES`).
"""

from __future__ import annotations

import ast
import importlib
import sys
import threading
import types
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from pivotrl.bfcl.envs import bfcl_class
from pivotrl.core.errors import ActionParseError
from pivotrl.format.actions import parse_action

__all__ = ["DECODER_DIFFERENCES", "AstVerdict", "bfcl_decode", "bfcl_modules", "decoder_difference"]

#: Kinds of texts that pivotrl's action parser and BFCL's Python decoder read differently, in the
#: order they are tested (a text counts once, as its first kind).
DECODER_DIFFERENCES: tuple[str, ...] = (
    "code_fence",        # the calls inside a ``` fence: BFCL strips the backticks and may read them
    "no_brackets",       # calls without [ ]: BFCL adds the brackets, pivotrl reads a text answer
    "positional_args",   # pivotrl names positional values from the schema, BFCL drops them
    "tuple_values",      # a tuple value: pivotrl reads a list, BFCL keeps a tuple
    "only_pivotrl_reads",  # pivotrl reads calls, BFCL's decoder fails (e.g. **{'from': ...})
    "only_bfcl_reads",   # BFCL decodes calls, pivotrl's parser rejects the text
    "other",             # both read calls, different ones
)

_LOCK = threading.Lock()


@dataclass(frozen=True)
class AstVerdict:
    """BFCL's verdict on one answer: ``valid``; ``error_type`` (BFCL's, "" when valid); ``detail``
    (BFCL's first error message, shortened)."""

    valid: bool
    error_type: str = ""
    detail: str = ""


class _AnyModel(dict):
    """``MODEL_CONFIG_MAPPING`` stand-in: every model name maps to a config without
    ``underscore_to_dot`` (dotted function names are kept as written)."""

    def __missing__(self, key: str) -> Any:
        return types.SimpleNamespace(underscore_to_dot=False)


def _install_stubs() -> None:
    name = "bfcl_eval.constants.model_config"
    if name not in sys.modules:
        stub = types.ModuleType(name)
        stub.MODEL_CONFIG_MAPPING = _AnyModel()  # type: ignore[attr-defined]
        sys.modules[name] = stub
    for mod, func in (("java_parser", "parse_java_function_call"), ("js_parser", "parse_javascript_function_call")):
        full = f"bfcl_eval.model_handler.parser.{mod}"
        if full in sys.modules:
            continue
        try:
            importlib.import_module(full)
        except Exception:  # noqa: BLE001 - tree_sitter missing or of another version: Python only here
            stub = types.ModuleType(full)

            def unsupported(*_: Any, _lang: str = mod) -> Any:
                raise NotImplementedError(f"BFCL's {_lang} decoder needs tree_sitter==0.21.3")

            setattr(stub, func, unsupported)
            sys.modules[full] = stub


def bfcl_modules(bfcl_root: str | Path) -> types.SimpleNamespace:
    """BFCL's Python decoder, output-format check and ``ast_checker`` from the wheel at ``bfcl_root``."""
    bfcl_class("MathAPI", bfcl_root)  # puts bfcl_root on sys.path (and checks the layout)
    with _LOCK:
        _install_stubs()
        utils = importlib.import_module("bfcl_eval.model_handler.utils")
        checker = importlib.import_module("bfcl_eval.eval_checker.ast_eval.ast_checker")
        top = importlib.import_module("bfcl_eval.utils")
        enums = importlib.import_module("bfcl_eval.constants.enums")
    return types.SimpleNamespace(decode=utils.default_decode_ast_prompting, ast_checker=checker.ast_checker,
                                 is_format=top.is_function_calling_format_output, python=enums.Language.PYTHON)


# ------------------------------------------------------------------------------------------ decoding

_SAFE_OPERANDS = (ast.Constant, ast.UnaryOp, ast.BinOp, ast.operator, ast.unaryop)


def _unsafe(text: str) -> bool:
    """Whether BFCL's decoder would ``eval`` something other than arithmetic on literals."""
    stripped = text.strip("`\n ")
    stripped = stripped if stripped.startswith("[") else "[" + stripped
    stripped = stripped if stripped.endswith("]") else stripped + "]"
    try:
        tree = ast.parse(stripped.strip().strip("'"), mode="eval")
    except (SyntaxError, ValueError):
        return False  # BFCL's decoder fails the same way
    for node in ast.walk(tree):
        if isinstance(node, ast.Lambda):
            return True
        if isinstance(node, ast.BinOp):
            for sub in ast.walk(node):
                if not isinstance(sub, _SAFE_OPERANDS) or isinstance(sub, ast.Pow):
                    return True
                if isinstance(sub, ast.Constant) and not isinstance(sub.value, (int, float, complex, str)):
                    return True
    return False


def bfcl_decode(text: str, bfcl_root: str | Path) -> tuple[list[dict[str, Any]] | None, AstVerdict | None]:
    """``(calls, None)``: BFCL's decoding of ``text`` as ``[{name: {param: value}}]``; or
    ``(None, verdict)``: the decoder's failure, as BFCL reports it."""
    if _unsafe(text):
        return None, AstVerdict(False, "ast_decoder:unsafe_expression",
                                "the text holds an expression BFCL's decoder would evaluate; not evaluated")
    b = bfcl_modules(bfcl_root)
    try:
        decoded = b.decode(text)
    except Exception as e:  # noqa: BLE001 - BFCL's runner catches every decoder exception the same way
        return None, AstVerdict(False, "ast_decoder:decoder_failed",
                                f"Invalid syntax. Failed to decode AST. {type(e).__name__}: {e}"[:300])
    if not b.is_format(decoded):
        return None, AstVerdict(False, "ast_decoder:decoder_wrong_output_format",
                                "Did not output in the specified format.")
    return decoded, None


def _plain(value: Any) -> Any:
    """``value`` with tuples read as lists (how pivotrl's parser reads them)."""
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    if isinstance(value, dict):
        return {k: _plain(v) for k, v in value.items()}
    return value


def _has_tuple(value: Any) -> bool:
    if isinstance(value, tuple):
        return True
    if isinstance(value, list):
        return any(_has_tuple(v) for v in value)
    if isinstance(value, dict):
        return any(_has_tuple(v) for v in value.values())
    return False


def _has_positional(text: str) -> bool:
    try:
        tree = ast.parse(text.strip(), mode="eval")
    except (SyntaxError, ValueError):
        return False
    body = tree.body
    calls = body.elts if isinstance(body, (ast.List, ast.Tuple)) else [body]
    return any(isinstance(c, ast.Call) and c.args for c in calls)


def decoder_difference(text: str, tools: Sequence[Any] | None, bfcl_root: str | Path) -> str | None:
    """The kind (:data:`DECODER_DIFFERENCES`) of a text that pivotrl's pythonic action parser and
    BFCL's Python decoder read differently, or None when they read the same calls (or both read no
    call). ``tools``: the state's ToolSpecs (pivotrl names positional values from them)."""
    try:
        message = parse_action(text, tools)
        ours = [{c.name: dict(c.arguments)} for c in message.tool_calls] or None
    except ActionParseError:
        ours = None
    theirs, _ = bfcl_decode(text, bfcl_root)
    theirs = theirs or None  # [] is no call
    if ours is None and theirs is None:
        return None
    if ours is not None and theirs is not None and ours == theirs:
        return None
    if text.strip().startswith("```"):
        return "code_fence"
    if theirs is not None and not text.strip().startswith("["):
        return "no_brackets"
    if ours is not None and theirs is not None:
        if _has_positional(text):
            return "positional_args"
        if _has_tuple(theirs) and _plain(theirs) == ours:
            return "tuple_values"
        return "other"
    if _has_positional(text) and theirs is not None:
        return "positional_args"
    return "only_pivotrl_reads" if ours is not None else "only_bfcl_reads"

