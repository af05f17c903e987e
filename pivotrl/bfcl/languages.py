"""BFCL's Java and JavaScript categories: gold values written as source text, checked by BFCL's checker.

BFCL's ``ast_checker`` judges ``simple_java`` and ``simple_javascript`` answers whose argument values
are *strings of source text* (``"true"``, ``"42L"``, ``"new ArrayList<>(Arrays.asList(1, 2))"``,
``"{key: 'v'}"``): for every parameter type in ``JAVA_TYPE_CONVERSION`` / ``JS_TYPE_CONVERSION`` a
non-string value is a type error, and the string is read with the wheel's ``java_type_converter`` /
``js_type_converter`` before it is compared with the possible answers (plain Python values). BFCL's
function-calling handlers hand the checker the argument strings the model's API returned (BFCL's
language hint tells the model each such parameter is "in string representation"); its prompting
handlers decode Java/JavaScript call syntax with tree-sitter, which pivotrl does not depend on. So in
pivotrl the model writes a pythonic call whose values are those strings, and the calls pivotrl's
parser reads are handed to ``ast_checker`` with the category's language.

:func:`source_text` writes one acceptable value as source text: candidates per type (scalars,
arrays, maps, strings with and without quotes), the first that BFCL's own checker accepts for that
parameter alone (:func:`accepted_alone`). :func:`language_of` maps a category to BFCL's
``Language`` name.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Mapping

__all__ = ["LANGUAGE_CATEGORIES", "accepted_alone", "language_of", "source_text"]

#: Category → BFCL language (``bfcl_eval.constants.enums.Language`` member name).
LANGUAGE_CATEGORIES: dict[str, str] = {"simple_java": "JAVA", "simple_javascript": "JAVASCRIPT"}


def language_of(category: str) -> str:
    """BFCL's language of a category: JAVA, JAVASCRIPT or PYTHON (``eval_runner.ast_file_runner``)."""
    return LANGUAGE_CATEGORIES.get(category, "PYTHON")


def _scalar_candidates(value: Any, language: str) -> list[str]:
    if isinstance(value, bool):
        return ["true" if value else "false"]
    if isinstance(value, int):
        return [str(value), f"{value}L", f"{value}n"] if language == "JAVA" else [str(value), f"{value}n"]
    if isinstance(value, float):
        plain = repr(value)
        return [plain, f"{plain}f", str(int(value)) if value.is_integer() else plain]
    if isinstance(value, str):
        return [value, json.dumps(value), f"'{value}'"]
    return [str(value)]


def _element(value: Any, language: str, quoted: bool, item: str | None = None) -> str:
    if isinstance(value, str):
        return json.dumps(value) if quoted else value
    if language == "JAVA" and item == "long" and isinstance(value, int) and not isinstance(value, bool):
        return f"{value}L"
    if language == "JAVA" and item == "float" and isinstance(value, (int, float)) and not isinstance(value, bool):
        return f"{value}f"
    if isinstance(value, list):
        return "[" + ", ".join(_element(v, language, quoted) for v in value) + "]"
    if isinstance(value, Mapping):
        return _js_object(value, quoted)
    return _scalar_candidates(value, language)[0]


def _first(acceptable: Any) -> Any:
    """A nested answer dict's value: its first acceptable value ("" = omitted is skipped)."""
    if isinstance(acceptable, list):
        given = [v for v in acceptable if v != ""]
        return given[0] if given else None
    return acceptable


def _plain(value: Any) -> Any:
    if isinstance(value, Mapping):
        return {k: _plain(_first(v)) for k, v in value.items() if _first(v) is not None}
    return value


def _js_object(value: Mapping[str, Any], quoted: bool) -> str:
    return "{" + ", ".join(f"{k}: {_element(_plain(v), 'JAVASCRIPT', quoted)}" for k, v in value.items()) + "}"


def _candidates(value: Any, schema: Mapping[str, Any], language: str) -> list[str]:
    kind = schema.get("type")
    items = (schema.get("items") or {}).get("type") if isinstance(schema.get("items"), Mapping) else None
    if isinstance(value, list):
        if language == "JAVA":
            java_item = {"integer": "int", "String": "String", "boolean": "boolean", "double": "double",
                         "float": "float", "long": "long"}.get(items or "", "Object")
            out = []
            for quoted in (True, False):
                body = ", ".join(_element(v, language, quoted, items) for v in value)
                out += [f"new {java_item}[]{{{body}}}", f"new ArrayList<>(Arrays.asList({body}))"]
            return out
        return [_element(value, language, True), _element(value, language, False),
                json.dumps(value)]
    if isinstance(value, Mapping):
        plain = _plain(value)
        if language == "JAVA":
            puts = " ".join(f"put({json.dumps(k)}, {_element(v, language, True)});" for k, v in plain.items())
            return [f"new HashMap<String, Object>() {{{{ {puts} }}}}"]
        return [_js_object(value, False), _js_object(value, True), json.dumps(plain)]
    if kind in ("String", "any") and isinstance(value, str):
        return [value, json.dumps(value)]
    return _scalar_candidates(value, language)


def accepted_alone(b: Any, language: str, fname: str, param: str, schema: Mapping[str, Any],
                   acceptable: list[Any], text: str) -> bool:
    """Whether BFCL's ``ast_checker`` accepts ``fname(param=text)`` against this parameter's
    possible answers alone (``b``: :func:`pivotrl.bfcl.ast_decoder.bfcl_modules`)."""
    doc = {"name": fname, "parameters": {"type": "dict", "properties": {param: dict(schema)}, "required": [param]}}
    try:
        result = b.ast_checker([doc], [{fname: {param: text}}], [{fname: {param: list(acceptable)}}],
                               getattr(b.languages, language), "simple", "pivotrl")
    except Exception:  # noqa: BLE001 - a converter that cannot read the candidate rejects it
        return False
    return bool(result.get("valid"))


def source_text(b: Any, language: str, fname: str, param: str, schema: Mapping[str, Any],
                acceptable: list[Any]) -> str | None:
    """The first source text of an acceptable value that BFCL's checker accepts for ``param``
    (None when none does)."""
    for value in acceptable:
        if value == "":
            continue
        for text in _candidates(value, schema, language):
            if accepted_alone(b, language, fname, param, schema, acceptable, text):
                return text
    return None


def root_modules(root: str | Path) -> Any:
    """BFCL's checker modules with the ``Language`` enum as ``languages`` (imported lazily)."""
    import importlib

    from pivotrl.bfcl.ast_decoder import bfcl_modules

    b = bfcl_modules(root)
    b.languages = importlib.import_module("bfcl_eval.constants.enums").Language
    return b
