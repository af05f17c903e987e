"""The pure core imports without Prefect, vLLM or DeepSpeed (and, where it needs no tensors, torch).

Every module of the core packages is imported in a fresh interpreter in which any import of a
blocked backend fails, so a stray top-level import anywhere in the core breaks this test.
"""

from __future__ import annotations

import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
PKG = REPO / "pivotrl"

#: The core: math, data model, verifiers, parsers, renderers, config, storage — the source modules of
#: the core's import contract in pyproject.toml (one list; test_import_contracts.py checks it covers
#: every module with the rest of the contracts).
CORE = tuple(m.removeprefix("pivotrl.") for m in next(
    c for c in tomllib.loads((REPO / "pyproject.toml").read_text())["tool"]["importlinter"]["contracts"]
    if c["type"] == "forbidden")["source_modules"])


def _modules(name: str) -> list[str]:
    path = PKG / name
    if path.is_dir():
        return sorted("pivotrl." + ".".join(p.relative_to(PKG).with_suffix("").parts).removesuffix(".__init__")
                      for p in path.rglob("*.py"))
    return [f"pivotrl.{name}"]


CORE_MODULES = sorted({m for name in CORE for m in _modules(name)})


def _import_blocked(modules: list[str], blocked: tuple[str, ...]) -> subprocess.CompletedProcess:
    code = (
        "import importlib, sys\n"
        f"for name in {blocked!r}:\n"
        "    sys.modules[name] = None  # any import of them now fails\n"
        f"for m in {modules!r}:\n"
        "    importlib.import_module(m)\n"
        "print('ok')\n"
    )
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=REPO, timeout=120)


def test_the_core_list_covers_real_modules():
    assert len(CORE_MODULES) >= 25
    for m in CORE_MODULES:
        assert (PKG / Path(*m.split(".")[1:])).with_suffix(".py").exists() or (PKG / Path(*m.split(".")[1:])).is_dir()


def test_every_core_module_imports_without_prefect_vllm_deepspeed():
    out = _import_blocked(CORE_MODULES, ("prefect", "vllm", "deepspeed"))
    assert out.returncode == 0, out.stderr[-3000:]
    assert out.stdout.strip() == "ok"


@pytest.mark.parametrize("blocked", [("prefect",), ("vllm",), ("deepspeed",)])
def test_a_blocked_backend_really_fails_to_import(blocked):
    # The blocking mechanism itself works: importing the blocked package fails.
    out = _import_blocked(list(blocked), blocked)
    assert out.returncode != 0 and "import of " + blocked[0] + " halted" in out.stderr


#: Core modules that need no tensors: they import without torch and transformers too.
TENSOR_FREE = sorted({m for name in ("core", "data", "verifiers", "envs", "bfcl", "pivots.diff", "format.actions",
                                     "format.action_prefix", "format.tool_parsers", "format.tool_render",
                                     "format.chatml", "format.prompts", "config", "storage", "runtime.faults",
                                     "runtime.ledger", "provenance.code_digest", "provenance.lineage")
                      for m in _modules(name)})


def test_tensor_free_core_imports_without_torch_or_transformers():
    out = _import_blocked(TENSOR_FREE, ("prefect", "vllm", "deepspeed", "torch", "transformers"))
    assert out.returncode == 0, out.stderr[-3000:]
    assert out.stdout.strip() == "ok"


#: The packages split out of single modules: each of their modules must import first, on its own
#: (an import cycle between them would otherwise hide behind the order of CORE_MODULES).
SPLIT = sorted({m for name in ("core", "config", "storage", "envs", "bfcl", "pivots", "format", "provenance")
                for m in _modules(name)})

_EACH_FIRST = """
import importlib, os, sys
for name in ("prefect", "vllm", "deepspeed"):
    sys.modules[name] = None
import fsspec, pydantic, tenacity, yaml  # third-party only: every child below starts without pivotrl
failed = []
for m in MODULES:
    pid = os.fork()
    if pid == 0:
        try:
            importlib.import_module(m)
            os._exit(0)
        except BaseException as e:
            sys.stderr.write(f"{m}: {type(e).__name__}: {e}\\n")
            os._exit(1)
    if os.waitpid(pid, 0)[1]:
        failed.append(m)
print(failed)
"""


def test_each_split_module_imports_first_on_its_own():
    code = _EACH_FIRST.replace("MODULES", repr(SPLIT))
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=REPO, timeout=120)
    assert out.returncode == 0, out.stderr[-3000:]
    assert len(SPLIT) >= 15 and out.stdout.strip() == "[]", out.stderr[-3000:]


def test_every_module_stays_within_400_lines():
    """A module is one concept with one public face; past 400 lines it is usually two."""
    sizes = {p.relative_to(PKG).as_posix(): len(p.read_text().splitlines()) for p in PKG.rglob("*.py")}
    assert len(sizes) >= 150
    assert {k: n for k, n in sizes.items() if n > 400} == {}
