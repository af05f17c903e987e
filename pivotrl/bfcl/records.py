"""Reading BFCL's data files and the parts every converted record shares.

:func:`read_jsonl` reads one of the wheel's ``bfcl_eval/data/*.json`` files (JSON Lines: one record
per line; DataError naming the file and line when it is missing or malformed);
:func:`normalise_schema` rewrites BFCL's ``"type": "dict"`` to JSON-schema ``"object"`` everywhere in
a parameter schema (other BFCL type names such as ``"float"``, ``"tuple"``, ``"any"`` are kept);
:func:`tool_spec` turns a function document into a :class:`~pivotrl.data.schema.ToolSpec`;
:func:`question_messages` reads one turn of a record's ``question`` as messages. :data:`SOURCE` is the
``source`` of every BFCL trajectory.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Mapping

from pivotrl.core.errors import DataError
from pivotrl.core.hashing import json_problem
from pivotrl.data.schema import Message, ToolSpec

__all__ = ["SOURCE", "normalise_schema", "question_messages", "read_jsonl", "tool_spec"]

SOURCE = "bfcl"


def read_jsonl(path: Path) -> list[dict[str, Any]]:
    if not path.is_file():
        raise DataError(f"{path.name}: missing from the BFCL data")
    out = []
    with open(path, encoding="utf-8") as f:
        for lineno, line in enumerate(f, start=1):
            if line.strip():
                try:
                    out.append(json.loads(line))
                except json.JSONDecodeError as e:
                    raise DataError(f"{path.name} line {lineno}: malformed JSON ({json_problem(e)})") from None
    return out


def normalise_schema(schema: Any) -> Any:
    """Copy of a BFCL parameter schema with every ``"type": "dict"`` rewritten to ``"object"``."""
    if isinstance(schema, Mapping):
        out = {k: normalise_schema(v) for k, v in schema.items()}
        if out.get("type") == "dict":
            out["type"] = "object"
        return out
    if isinstance(schema, list):
        return [normalise_schema(v) for v in schema]
    return schema


def tool_spec(doc: Mapping[str, Any], where: str) -> ToolSpec:
    if not isinstance(doc, Mapping) or not isinstance(doc.get("name"), str):
        raise DataError(f"{where}.name: missing")
    return ToolSpec(
        name=doc["name"],
        description=str(doc.get("description") or ""),
        parameters=normalise_schema(doc.get("parameters") or {}),
    )


def question_messages(record: Mapping[str, Any], turn: int, where: str) -> list[Message]:
    turns = record.get("question")
    if not isinstance(turns, list) or turn >= len(turns) or not isinstance(turns[turn], list):
        raise DataError(f"{where}.question[{turn}]: missing")
    return [Message.from_dict(m, f"{where}.question[{turn}][{i}]") for i, m in enumerate(turns[turn])]
