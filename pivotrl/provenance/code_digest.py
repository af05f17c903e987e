"""Content digests of the code that decides a stage's output, for the stages' content keys.

A stage key must change when the code that determines the stage's artifact changes — a verifier,
the tool-call parser, the prompt renderer, an environment, the sampling code — or a rerun would
find the old artifact under the unchanged key and reuse, say, stale rewards. The git commit is not
enough (an edited, uncommitted verifier has the same commit) and the whole package is too much
(editing the report would re-run probing).

So a stage's code is **derived**, never listed: the import closure of its stage module
(:data:`STAGE_MODULES`) — every ``pivotrl`` module it imports, at module level or inside a
function, and every module named in a ``"pivotrl.x.y:attr"`` registry string, transitively — except
what does not decide an artifact:

* the other stages' modules (:data:`STAGE_MODULES`): an upstream stage's code is covered by its own
  key, which enters this stage's key through its inputs;
* :data:`NOT_DECIDING`: modules that print, log, track, lock or time a run but never change what it
  writes.

A module written tomorrow is covered the day a stage imports it. Source files are located with
``importlib.util.find_spec`` and parsed (``ast``), never imported: the digest of a stage that uses
vLLM can be computed where vLLM is not installed. Pure core: standard library only.
"""

from __future__ import annotations

import ast
import functools
import hashlib
import importlib.util
import re
from pathlib import Path

from pivotrl.core.errors import ConfigError

__all__ = ["NOT_DECIDING", "STAGE_MODULES", "code_digest", "import_closure", "module_digest", "stage_code_digest",
           "stage_code_modules"]

#: The module of each stage of the nightly flow (``pivotrl.pipeline.stages`` runs them).
STAGE_MODULES: dict[str, str] = {
    "demonstrations": "pivotrl.pipeline.demos",
    "reference": "pivotrl.pipeline.reference",
    "probe": "pivotrl.pipeline.probe_stage",
    "train": "pivotrl.pipeline.train",
    "evaluate": "pivotrl.pipeline.evaluate_stage",
}

#: Modules (a package: all of it) whose code never decides an artifact, with the reason.
NOT_DECIDING: dict[str, str] = {
    "pivotrl.core.progress": "progress lines on the console",
    "pivotrl.pipeline.console": "console output of stage processes",
    "pivotrl.pipeline.processes": "starting, stopping and reaping stage processes",
    "pivotrl.tracking": "experiment trackers (MLflow): records of a run, never its inputs",
    "pivotrl.storage.lease": "the lock that keeps two runs from computing one stage at once",
    "pivotrl.runtime.ledger": "cost accounting (wall time, memory, counts) beside the artifacts",
    "pivotrl.storage.check": "the pre-run check of the storage root",
    **{f"pivotrl.storage.{m}": "how bytes reach the store, not what they are"
       for m in ("store", "files", "dirs", "manifest", "open")},
    "pivotrl.provenance.code_digest": "this module",
    "pivotrl.testing": "test helpers",
}

_REGISTRY_STRING = re.compile(r"^(pivotrl(?:\.\w+)+):\w+$")


def _source(module: str) -> Path | None:
    """The source file of ``module`` (a package's ``__init__.py``), or None if it is not a pivotrl module."""
    try:
        spec = importlib.util.find_spec(module)
    except (ImportError, ValueError):
        return None
    if spec is None or spec.origin is None or not spec.origin.endswith(".py"):
        return None
    return Path(spec.origin)


def _is_module(name: str) -> bool:
    return _source(name) is not None


@functools.lru_cache(maxsize=None)
def _imports(module: str) -> tuple[str, ...]:
    """The pivotrl modules ``module`` names: imports anywhere in its source (``from a import b``
    counts ``a`` and, when it is a module, ``a.b``) and ``"pivotrl.x.y:attr"`` registry strings."""
    path = _source(module)
    if path is None:
        return ()
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_bytes(), filename=str(path))):
        if isinstance(node, ast.Import):
            found.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            found.add(node.module)
            found.update(f"{node.module}.{a.name}" for a in node.names)
        elif isinstance(node, ast.Constant) and isinstance(node.value, str):
            m = _REGISTRY_STRING.match(node.value)
            if m:
                found.add(m.group(1))
    names = {n for n in found if n == "pivotrl" or n.startswith("pivotrl.")}
    return tuple(sorted(n for n in names if _is_module(n)))


def _parents(module: str) -> set[str]:
    """The packages above ``module`` (their ``__init__`` runs when it is imported)."""
    parts = module.split(".")
    return {".".join(parts[:i]) for i in range(1, len(parts))}


def _excluded(module: str, stops: frozenset[str]) -> bool:
    return any(module == s or module.startswith(s + ".") for s in stops)


@functools.lru_cache(maxsize=None)
def import_closure(root: str, stops: frozenset[str] = frozenset()) -> tuple[str, ...]:
    """Every pivotrl module ``root`` reaches through imports (see :func:`_imports`), ``root``
    included, not entering modules in ``stops`` (a package name stops all of it), and the packages
    above each (their ``__init__`` runs; its own imports are followed only when the package itself
    is imported). Sorted.

    Raises ConfigError naming ``root`` when it is not a pivotrl module."""
    if not _is_module(root):
        raise ConfigError(f"code digest: module {root!r} not found")
    seen, todo = {root}, [root]
    while todo:
        for dep in _imports(todo.pop()):
            if dep not in seen and not _excluded(dep, stops):
                seen.add(dep)
                todo.append(dep)
    parents = {p for m in seen for p in _parents(m) if not _excluded(p, stops) and _is_module(p)}
    return tuple(sorted(seen | parents))


@functools.lru_cache(maxsize=None)
def code_digest(modules: tuple[str, ...]) -> str:
    """sha256 (hex) over the relative path and bytes of the source file of every module in
    ``modules`` (a package: its ``__init__.py``). Computed once per process per module set.

    Raises ConfigError for an unknown module."""
    h = hashlib.sha256()
    files = set()
    for m in modules:
        path = _source(m)
        if path is None:
            raise ConfigError(f"code digest: module {m!r} not found")
        files.add(path.resolve())
    top = Path(importlib.util.find_spec("pivotrl").origin).resolve().parent.parent  # type: ignore[arg-type]
    for f in sorted(files):
        rel = f.relative_to(top) if f.is_relative_to(top) else f
        h.update(str(rel).encode() + b"\0" + f.read_bytes() + b"\0")
    return h.hexdigest()


def stage_code_modules(stage: str) -> tuple[str, ...]:
    """The modules whose code decides ``stage``'s artifact: the import closure of its module
    (:data:`STAGE_MODULES`) without the other stages' modules and :data:`NOT_DECIDING`.

    Raises ConfigError naming the valid stages for an unknown one."""
    try:
        root = STAGE_MODULES[stage]
    except KeyError:
        raise ConfigError(f"code digest: unknown stage {stage!r}; valid: {', '.join(STAGE_MODULES)}") from None
    others = frozenset(m for s, m in STAGE_MODULES.items() if s != stage)
    return import_closure(root, others | frozenset(NOT_DECIDING))


def module_digest(root: str, *, exclude: tuple[str, ...] = ()) -> str:
    """:func:`code_digest` of the import closure of ``root`` without :data:`NOT_DECIDING` and
    ``exclude`` (e.g. the stage modules whose outputs enter through keys)."""
    return code_digest(import_closure(root, frozenset(NOT_DECIDING) | frozenset(exclude)))


def stage_code_digest(stage: str) -> str:
    """:func:`code_digest` of :func:`stage_code_modules`. Raises ConfigError for an unknown stage."""
    return code_digest(stage_code_modules(stage))
