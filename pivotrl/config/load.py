"""Loading, overriding, hashing and dumping a run config (YAML file or fsspec URL)."""

from __future__ import annotations

import hashlib
import json
import re
import textwrap
from typing import Any, Mapping, Sequence

import yaml

from pivotrl.config.schema import RunConfig
from pivotrl.config.validate import did_you_mean, item_type, models_of, parse_config
from pivotrl.core.hashing import canonical_json
from pivotrl.core.errors import ConfigError


def key_lines(text: str, duplicates: list[str] | None = None) -> dict[tuple[Any, ...], int]:
    """Key path (mapping keys and list indexes, as in the parsed data) → the 1-based line of that
    key (or list item) in YAML ``text``; {} for text that does not compose (aliases included).
    ``duplicates`` (when given) receives ``"line 7: training.lr (also at line 3)"`` for every key
    written twice in one mapping (YAML keeps the last silently)."""
    try:
        root = yaml.compose(text, Loader=yaml.SafeLoader)
    except yaml.YAMLError:
        return {}
    out: dict[tuple[Any, ...], int] = {}

    def walk(node: Any, path: tuple[Any, ...]) -> None:
        if isinstance(node, yaml.MappingNode):
            for key, value in node.value:
                if isinstance(key, yaml.ScalarNode):
                    here = (*path, key.value)
                    if here in out and duplicates is not None:
                        name = "".join(f"[{k}]" if isinstance(k, int) else f".{k}" for k in here).lstrip(".")
                        duplicates.append(f"line {key.start_mark.line + 1}: {name} (also at line {out[here]})")
                    out.setdefault(here, key.start_mark.line + 1)
                    walk(value, here)
        elif isinstance(node, yaml.SequenceNode):
            for i, item in enumerate(node.value):
                out.setdefault((*path, i), item.start_mark.line + 1)
                walk(item, (*path, i))

    walk(root, ())
    return out


def _read_text(path_or_url: str) -> str:
    import fsspec  # local import: only needed when a file is read

    if "://" in path_or_url and not path_or_url.startswith(("file://", "local://")):
        # A remote config: credentials, endpoint and the object checked first, with short timeouts
        # and one line naming what to set (StorageAccessError / SourceNotFoundError / StorageError).
        from pivotrl.storage.check import check_source

        check_source(path_or_url, what=f"config {path_or_url}")
    try:
        with fsspec.open(path_or_url, "r", encoding="utf-8") as f:
            text = f.read()
    except FileNotFoundError:
        from pivotrl.storage.files import relative_note

        note = "" if "://" in path_or_url else relative_note(path_or_url)
        raise ConfigError(f"config file not found: {path_or_url}" + (f" ({note})" if note else "")) from None
    except OSError as e:
        raise ConfigError(f"cannot read config {path_or_url}: {e}") from None
    return text


def _parse_yaml(text: str, path_or_url: str) -> Any:
    try:
        return yaml.safe_load(text)
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None)
        at = f" at line {mark.line + 1}, column {mark.column + 1}" if mark is not None else ""
        raise ConfigError(f"config {path_or_url} is not valid YAML{at}: {getattr(e, 'problem', e)}") from None


def _apply_override(data: dict[str, Any], override: str) -> None:
    if "=" not in override:
        raise ConfigError(f"override {override!r}: expected dotted.key=value")
    dotted, raw = override.split("=", 1)
    dotted = dotted.strip()
    keys = dotted.split(".")
    if not dotted or any(not k for k in keys):
        raise ConfigError(f"override {override!r}: empty key")
    try:
        value = yaml.safe_load(raw) if raw.strip() else None
    except yaml.YAMLError as e:
        problem = getattr(e, "problem", None) or str(e).splitlines()[0]
        raise ConfigError(f"override {override!r}: value is not valid YAML ({problem})") from None

    tp: Any = RunConfig
    node: Any = data
    shown = ""  # the key so far as every message writes it: a list index in brackets (data.sources[0])
    for i, key in enumerate(keys):
        last = i == len(keys) - 1
        parent = shown
        here = shown = f"{shown}[{key}]" if isinstance(node, list) else f"{shown}.{key}" if shown else key
        if isinstance(node, list):
            if not key.isdigit() or int(key) >= len(node):
                raise ConfigError(f"override {override!r}: {here} is not an index of a list of {len(node)}")
            idx = int(key)
            if last:
                node[idx] = value
                return
            node[idx] = dict(node[idx]) if isinstance(node[idx], Mapping) else node[idx]
            node, tp = node[idx], None  # union item: pydantic checks its keys
            continue
        if not isinstance(node, dict):
            raise ConfigError(f"override {override!r}: {parent} is not a mapping")
        models = models_of(tp) if tp is not None else []
        if models:
            owner = next((m for m in models if key in m.model_fields), None)
            if owner is None:
                valid = list(models[0].model_fields)
                section = parent or "the top level"
                raise ConfigError(f"override {override!r}: unknown key {here!r}; valid keys of {section}: "
                                  f"{', '.join(valid)}" + did_you_mean(key, valid))
            tp = owner.model_fields[key].annotation
        else:
            tp = None  # free-form mapping (e.g. training.deepspeed.extra)
        if last:
            node[key] = value
            return
        child = node.get(key)
        if child is None:
            if item_type(tp) is not None:
                default = _default_of(keys[: i + 1])
                child = default if isinstance(default, list) else []
            else:
                child = {}
        elif isinstance(child, Mapping):
            child = dict(child)
        elif isinstance(child, list):
            child = [dict(c) if isinstance(c, Mapping) else c for c in child]
        node[key] = child
        node = child


def _default_of(keys: Sequence[str]) -> Any:
    obj: Any = RunConfig().model_dump(mode="json")
    for k in keys:
        obj = obj[k]
    return obj


def load_config(path_or_url: str | None, overrides: Sequence[str] = ()) -> RunConfig:
    """Read a YAML config (local path or fsspec URL; None = schema defaults) and apply overrides.

    ``overrides`` are ``"dotted.key=value"`` strings whose value is parsed as YAML
    (``"training.beta=0.01"``, ``"evaluation.seeds=[0, 1]"``, ``"data.sources.0.limit_per_category=5"``),
    applied in order. Raises ConfigError for an unreadable or empty file, invalid YAML, an unknown override key
    (naming it and the valid keys) or any invalid value (every problem listed).
    """
    text = _read_text(path_or_url) if path_or_url is not None else ""
    data = _parse_yaml(text, path_or_url) if path_or_url is not None else {}
    duplicates: list[str] = []
    file_lines = key_lines(text, duplicates)
    if len(duplicates) == 1:
        raise ConfigError(f"config {path_or_url}: a key written twice (YAML would keep the last one silently; "
                          f"remove the other): {duplicates[0]}")
    if duplicates:
        raise ConfigError(f"config {path_or_url}: {len(duplicates)} keys written twice (YAML would keep the "
                          "last one silently; remove the other)\n  - " + "\n  - ".join(duplicates))
    if data is None and path_or_url is not None:
        # An empty file (or one of comments only) loads as None: never taken for the full default run.
        raise ConfigError(f"config {path_or_url}: empty config file (no settings); a run on it would be the "
                          "full default run — pass no --config for that")
    if data is None:
        data = {}
    if not isinstance(data, Mapping):
        raise ConfigError(f"config {path_or_url}: the top level must be a mapping of sections, "
                          f"got {type(data).__name__}")
    data = json.loads(json.dumps(data, default=str))  # deep copy, plain containers
    for override in overrides:
        _apply_override(data, override)
    # Name the overridden keys, never their values (a value could be a secret pasted by mistake).
    keys = ", ".join(re.sub(r"\.(\d+)(?=\.|$)", r"[\1]", o.split("=", 1)[0].strip()) for o in overrides)
    source = path_or_url if not overrides else f"{path_or_url or '(defaults)'} with overrides of {keys}"
    # Lines of the file's keys, except where an override replaced the value (its line is not the cause).
    changed = [tuple(int(k) if k.isdigit() else k for k in o.split("=", 1)[0].strip().split(".")) for o in overrides]
    lines = {p: n for p, n in file_lines.items()
             if not any(p[:len(c)] == c or c[:len(p)] == p and len(c) > len(p) for c in changed)}
    return parse_config(data, source, lines)


# ---------------------------------------------------------------------------------- hashing
def public_config(cfg: RunConfig) -> dict[str, Any]:
    """The config as JSON-compatible data without ``run.storage_options`` and ``tracking`` (what hashes and
    manifests see)."""
    return cfg.public_dict()


def config_hash(cfg: RunConfig) -> str:
    """sha256 hex digest of the canonical JSON of :func:`public_config` (storage options excluded)."""
    return hashlib.sha256(canonical_json(public_config(cfg)).encode("utf-8")).hexdigest()


def section_hash(cfg: RunConfig, *sections: str) -> str:
    """sha256 of the named sections only (dotted names allowed, e.g. ``"training.deepspeed"``).

    Used as a cache key: a stage depends only on the sections it reads. Raises ConfigError for an
    unknown section name.
    """
    if not sections:
        raise ConfigError("section_hash needs at least one section name")
    data = public_config(cfg)
    picked: dict[str, Any] = {}
    for name in sections:
        obj: Any = data
        for part in name.split("."):
            if not isinstance(obj, dict) or part not in obj:
                valid = ", ".join(data)
                raise ConfigError(f"section_hash: unknown section {name!r}; valid sections: {valid}")
            obj = obj[part]
        picked[name] = obj
    return hashlib.sha256(canonical_json(picked).encode("utf-8")).hexdigest()


# ---------------------------------------------------------------------------------- dumping
def _scalar(value: Any) -> str:
    text = yaml.safe_dump([value], default_flow_style=True, allow_unicode=True, width=1 << 30).strip()
    return text[1:-1]


def _emit(tp: Any, data: Mapping[str, Any], indent: int, lines: list[str], comments: bool) -> None:
    models = models_of(tp)
    model = models[0]
    if len(models) > 1 and "kind" in data:
        model = next((m for m in models if m.model_fields["kind"].default == data["kind"]), model)
    pad = " " * indent
    for name, info in model.model_fields.items():
        if name not in data:
            continue
        value = data[name]
        if comments and info.description:
            for line in textwrap.wrap(info.description, width=max(40, 100 - indent - 2)):
                lines.append(f"{pad}# {line}")
        item = item_type(info.annotation)
        if models_of(info.annotation) and isinstance(value, Mapping):
            lines.append(f"{pad}{name}:")
            _emit(info.annotation, value, indent + 2, lines, comments)
        elif item is not None and models_of(item) and value:
            lines.append(f"{pad}{name}:")
            for entry in value:
                start = len(lines)
                _emit(item, entry, indent + 4, lines, comments)
                first = next(j for j in range(start, len(lines)) if not lines[j].lstrip().startswith("#"))
                lines[first] = f"{pad}  - " + lines[first][indent + 4 :]
        else:
            lines.append(f"{pad}{name}: {_scalar(value)}")


def dump_config(cfg: RunConfig, *, comments: bool = False) -> str:
    """YAML text of the whole config (section order as in the schema); ``load_config`` reads it back equal.

    With ``comments=True`` each field's description is written as a comment above it (the manual).
    """
    lines: list[str] = []
    _emit(RunConfig, cfg.model_dump(mode="json"), 0, lines, comments)
    return "\n".join(lines) + "\n"
