"""The layer rules of ARCHITECTURE.md, checked as import contracts, and no import cycle.

The contracts live in ``pyproject.toml`` (``[tool.importlinter]``) and are checked by import-linter
over every import of the package, at module level or inside a function. Every pivotrl module must
fall under a contract or be named below as outside them, so a new module cannot slip past.
"""

from __future__ import annotations

import graphlib
import subprocess
import sys
import tomllib
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]

#: Modules under no contract, and why.
OUTSIDE_CONTRACTS = {
    "pivotrl": "the package root",
    "pivotrl.testing": "test helpers: tiny models and tokenizers (tests and benchmarks only)",
}


def _graph():
    import grimp

    return grimp.build_graph("pivotrl", cache_dir=None)


def test_the_import_contracts_are_kept():
    out = subprocess.run([str(Path(sys.executable).parent / "lint-imports"), "--no-cache"], capture_output=True,
                         text=True, cwd=REPO, timeout=300)
    assert out.returncode == 0, out.stdout[-4000:] + out.stderr[-2000:]
    assert "0 broken" in out.stdout


def test_every_module_is_under_a_contract_or_named_as_outside():
    tool = tomllib.loads((REPO / "pyproject.toml").read_text())["tool"]["importlinter"]["contracts"]
    covered: set[str] = set()
    for c in tool:
        covered.update(c.get("source_modules", []))
        for container in c.get("containers", [""]):
            for layer in c.get("layers", []):
                covered.update(".".join(filter(None, [container, p.strip()])) for p in layer.replace(":", "|").split("|"))
    covered.update(OUTSIDE_CONTRACTS)
    modules = sorted(m for m in _graph().modules if m.startswith("pivotrl"))
    loose = [m for m in modules if not any(m == c or m.startswith(c + ".") for c in covered)]
    assert loose == [], f"modules under no import contract (add them to one, or to OUTSIDE_CONTRACTS): {loose}"
    assert [m for m in OUTSIDE_CONTRACTS if m not in modules] == []  # the list names real modules


def test_no_import_cycle():
    """No two pivotrl modules import each other, directly or through others, at module level or
    inside a function (a cycle is a split that left one concept in two modules)."""
    graph = _graph()
    deps = {m: {d for d in graph.find_modules_directly_imported_by(m) if d.startswith("pivotrl")}
            for m in graph.modules if m.startswith("pivotrl")}
    # A package's __init__ importing its own submodules is not a cycle between concepts.
    deps = {m: {d for d in ds if not m.startswith(d + ".")} for m, ds in deps.items()}
    try:
        order = list(graphlib.TopologicalSorter(deps).static_order())
    except graphlib.CycleError as e:
        raise AssertionError(f"import cycle: {' -> '.join(e.args[1])}") from None
    assert len(order) == len(deps) > 100


def test_no_loose_module_under_the_package_root():
    """Every module lives in a capability package; the root holds only its ``__init__``/``__main__``."""
    root = REPO / "pivotrl"
    loose = sorted(p.name for p in root.glob("*.py") if p.name not in {"__init__.py", "__main__.py"})
    assert loose == []
    packages = sorted(p.parent.name for p in root.glob("*/__init__.py"))
    tool = tomllib.loads((REPO / "pyproject.toml").read_text())["tool"]["importlinter"]["contracts"]
    layered = {p.strip() for c in tool for layer in c.get("layers", []) for p in layer.replace(":", "|").split("|")}
    # every package is a layer of the one layers contract, or named as outside the contracts
    assert [p for p in packages if p not in layered and f"pivotrl.{p}" not in OUTSIDE_CONTRACTS] == []
