"""Validation of a run config: pydantic errors turned into one ConfigError naming key, value and rule."""

from __future__ import annotations

import difflib
import types
import typing
from typing import Annotated, Any, Mapping, Sequence, Union

from pydantic import BaseModel, ValidationError

from pivotrl.config.base import show_value
from pivotrl.config.schema import RunConfig
from pivotrl.core.hashing import canonical_json
from pivotrl.core.errors import ConfigError


def _type_members(tp: Any) -> list[Any]:
    """Flatten Annotated / Optional / Union into their member types."""
    origin = typing.get_origin(tp)
    if origin is Annotated:
        return _type_members(typing.get_args(tp)[0])
    if origin is Union or origin is types.UnionType:
        out: list[Any] = []
        for arg in typing.get_args(tp):
            out.extend(_type_members(arg))
        return out
    return [tp]


def models_of(tp: Any) -> list[type[BaseModel]]:
    return [t for t in _type_members(tp) if isinstance(t, type) and issubclass(t, BaseModel)]


def item_type(tp: Any) -> Any:
    for t in _type_members(tp):
        if typing.get_origin(t) in (list, Sequence) and typing.get_args(t):
            return typing.get_args(t)[0]
    return None


def _walk_loc(loc: Sequence[Any]) -> tuple[str, str, type[BaseModel] | None, Any]:
    """Resolve a pydantic error location: (dotted path, parent path, parent model, field info)."""
    tp: Any = RunConfig
    path = ""
    parent_path = ""
    parent: type[BaseModel] | None = None
    info = None
    for el in loc:
        if isinstance(el, int):
            path += f"[{el}]"
            tp = item_type(tp)
            info = None
            continue
        models = models_of(tp)
        owner = next((m for m in models if el in m.model_fields), None)
        if owner is None:
            tagged = [m for m in models if "kind" in m.model_fields and m.model_fields["kind"].default == el]
            if tagged:  # discriminated-union tag inserted by pydantic; not a key of the file
                tp = tagged[0]
                continue
            parent, parent_path = (models[0] if models else None), path
            path = f"{path}.{el}" if path else str(el)
            tp, info = None, None
            continue
        parent, parent_path = owner, path
        info = owner.model_fields[el]
        path = f"{path}.{el}" if path else str(el)
        tp = info.annotation
    return path, parent_path, parent, info


def _num(x: Any) -> Any:
    return int(x) if isinstance(x, float) and x.is_integer() else x


# Errors of a value's bounds or pattern: the only ones a field's "why" explains (not type errors).
_CONSTRAINT_ERRORS = frozenset({"greater_than", "greater_than_equal", "less_than", "less_than_equal",
                                "string_pattern_mismatch", "multiple_of"})
_RULES = {
    "greater_than_equal": lambda c: f"must be ≥ {_num(c['ge'])}",
    "greater_than": lambda c: f"must be > {_num(c['gt'])}",
    "less_than_equal": lambda c: f"must be ≤ {_num(c['le'])}",
    "less_than": lambda c: f"must be < {_num(c['lt'])}",
    "literal_error": lambda c: f"must be one of {c['expected']}",
    "int_parsing": lambda c: "must be an integer",
    "int_type": lambda c: "must be an integer",
    "int_from_float": lambda c: "must be an integer",
    "float_parsing": lambda c: "must be a number",
    "float_type": lambda c: "must be a number",
    "finite_number": lambda c: "must be a finite number (not inf or nan)",
    "bool_parsing": lambda c: "must be true or false",
    "bool_type": lambda c: "must be true or false",
    "string_type": lambda c: "must be a string",
    "list_type": lambda c: "must be a list",
    "dict_type": lambda c: "must be a mapping",
    "model_type": lambda c: "must be a mapping of keys",
    "model_attributes_type": lambda c: "must be a mapping of keys",
    "string_pattern_mismatch": lambda c: f"must match {c['pattern']}",
    "string_too_short": lambda c: f"must have at least {c['min_length']} character(s)",
    "too_short": lambda c: f"must have at least {c['min_length']} item(s)",
    "missing": lambda c: "required key is missing",
    "union_tag_invalid": lambda c: f"kind {c['tag']!r} is not one of {c['expected_tags']}",
    "union_tag_not_found": lambda c: f"needs a {c['discriminator']} key",
}


def did_you_mean(name: str, valid: Sequence[str]) -> str:
    """`` (did you mean 'storage_root'?)`` for the valid key closest to an unknown ``name``; "" when none is
    close. The one suggestion of an unknown key, in a config file and in an override."""
    hint = difflib.get_close_matches(name, list(valid), n=1)
    return f" (did you mean {hint[0]!r}?)" if hint else ""


def _describe(err: Mapping[str, Any]) -> str:
    path, parent_path, parent, info = _walk_loc(err["loc"])
    etype, ctx, value = err["type"], err.get("ctx") or {}, err.get("input")
    if etype == "pivotrl_rule":
        full = f"{path}.{ctx['key']}" if path else ctx["key"]
        return f"{full} = {ctx['value']}: {ctx['rule']}"
    if etype == "extra_forbidden":
        valid = list(parent.model_fields) if parent is not None else []
        name = path.rsplit(".", 1)[-1]
        section = parent_path or "the top level"
        text = f"{path} = {show_value(value)}: unknown key; valid keys of {section}: {', '.join(valid)}"
        return text + did_you_mean(name, valid)
    if etype in _RULES:
        try:
            rule = _RULES[etype](ctx)
        except KeyError:
            rule = err["msg"]
    else:
        rule = str(err["msg"]).removeprefix("Value error, ")
    extra = getattr(info, "json_schema_extra", None)
    why = extra.get("why") if isinstance(extra, dict) else None
    if isinstance(why, dict):  # one reason per violated bound, keyed by pydantic's error type
        why = why.get(etype)
    if why and etype in _CONSTRAINT_ERRORS:
        rule += f" ({why})"
    if etype == "missing":
        return f"{path}: {rule}"
    return f"{path or '(top level)'} = {show_value(value)}: {rule}"


def _file_path(loc: Sequence[Any], data: Any) -> tuple[Any, ...]:
    """The keys and indexes of ``loc`` that ``data`` holds, in order: pydantic's union tags and a
    missing key are skipped (so a missing key locates at its section)."""
    path: list[Any] = []
    node = data
    for el in loc:
        if isinstance(node, Mapping) and el in node:
            node = node[el]
        elif isinstance(node, list) and isinstance(el, int) and 0 <= el < len(node):
            node = node[el]
        elif isinstance(node, Mapping) and isinstance(el, str):
            continue
        else:
            break
        path.append(el)
    return tuple(path)


def _line_of(err: Mapping[str, Any], data: Any, lines: Mapping[tuple[Any, ...], int]) -> int | None:
    """The file line of an error: the deepest key of its location that the file holds."""
    path = _file_path(err["loc"], data)
    if err["type"] == "pivotrl_rule":
        path = _file_path([*err["loc"], err["ctx"]["key"]], data)
    while path:
        if path in lines:
            return lines[path]
        path = path[:-1]
    return None


def _config_error(exc: ValidationError, source: str | None, data: Any = None,
                  lines: Mapping[tuple[Any, ...], int] | None = None) -> ConfigError:
    located = []
    for e in exc.errors():
        line = _line_of(e, data, lines) if lines else None
        located.append((line, (f"line {line}: " if line else "") + _describe(e)))
    # In file order (pydantic lists them by schema field); problems with no line of the file
    # (an override's value) after them, in the order found.
    located.sort(key=lambda lp: (lp[0] is None, lp[0] or 0))
    problems = [text for _, text in located]
    where = f" {source}" if source else ""
    if len(problems) == 1:  # one fault, one line
        return ConfigError(f"invalid config{where}: {problems[0]}")
    return ConfigError(f"invalid config{where}: {len(problems)} problems\n  - " + "\n  - ".join(problems))


# --------------------------------------------------------------------------------- loading
#: canonical JSON of a mapping → the RunConfig it validated to, in this process. A run config
#: crosses process and Prefect-task boundaries as a JSON dict; each boundary calls
#: :func:`parse_config`, which validates a given config once per process and then answers from here
#: (RunConfig is frozen, so sharing it is safe). The validated config's own JSON dump is recorded
#: too, so ``parse_config(cfg.model_dump(mode="json"))`` is no second validation.
_VALIDATED: dict[str, RunConfig] = {}
_VALIDATED_MAX = 16


def _remember(key: str, cfg: RunConfig) -> None:
    while len(_VALIDATED) >= _VALIDATED_MAX:
        _VALIDATED.pop(next(iter(_VALIDATED)), None)
    _VALIDATED[key] = cfg


def parse_config(data: Mapping[str, Any] | None, source: str | None = None,
                 lines: Mapping[tuple[Any, ...], int] | None = None) -> RunConfig:
    """Validate a config mapping (as read from YAML) into a :class:`RunConfig`.

    The same mapping (by canonical JSON) is validated once per process; later calls return the
    same frozen RunConfig. Raises ConfigError listing every problem (key path, value, rule);
    one problem is one line (``invalid config FILE: line 3: key = value: rule``), several a header
    and a line each; ``source`` names the file, ``lines`` (key path → 1-based line, from
    :func:`pivotrl.config.load.key_lines`) puts the file's line before each problem it locates.
    """
    if data is None:
        data = {}
    if not isinstance(data, Mapping):
        raise ConfigError(f"invalid config {source or ''}: the top level must be a mapping of sections, "
                          f"got {type(data).__name__}")
    # A section written as an empty key ("probing:" with every field commented out) means defaults.
    data = {k: v for k, v in data.items() if not (v is None and k in RunConfig.model_fields)}
    try:
        key: str | None = canonical_json(data)
    except (TypeError, ValueError):  # values JSON cannot encode (only ever a mistake): no memo
        key = None
    if key is not None and (known := _VALIDATED.get(key)) is not None:
        return known
    try:
        cfg = RunConfig.model_validate(data)
    except ValidationError as exc:
        raise _config_error(exc, source, data, lines) from None
    if key is not None:
        _remember(key, cfg)
        _remember(canonical_json(cfg.model_dump(mode="json")), cfg)
    return cfg
