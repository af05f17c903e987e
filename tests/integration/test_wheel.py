"""The wheel a work pool installs (``pip install .``, not editable) holds every module of the
source tree, ``pivotrl.tasks`` and ``pivotrl.flows`` included, and each of them imports from it."""

from __future__ import annotations

import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]

pytestmark = pytest.mark.integration


def _source_modules() -> set[str]:
    """Module names of the source tree: pivotrl/, and tasks/ and flows/ as pivotrl.tasks/.flows."""
    out = set()
    for top, name in (("pivotrl", "pivotrl"), ("tasks", "pivotrl.tasks"), ("flows", "pivotrl.flows")):
        for f in (REPO / top).rglob("*.py"):
            parts = f.relative_to(REPO / top).with_suffix("").parts
            out.add(".".join((name, *parts)).removesuffix(".__init__"))
    return out


def test_the_wheel_holds_and_imports_every_module(tmp_path):
    # Built from a copy of the checkout (a build writes build/ and *.egg-info beside its sources).
    src = tmp_path / "src"
    shutil.copytree(REPO, src, ignore=shutil.ignore_patterns(".git", ".venv*", "runs", "build", "dist", "*.egg-info",
                                                            "__pycache__", ".pytest_cache", ".hypothesis"))
    built = subprocess.run([sys.executable, "-m", "pip", "wheel", str(src), "--no-deps", "--no-build-isolation",
                            "-q", "-w", str(tmp_path / "dist")], capture_output=True, text=True, timeout=300,
                           cwd=tmp_path)
    assert built.returncode == 0, built.stderr[-3000:]
    (wheel,) = (tmp_path / "dist").glob("pivotrl-*.whl")
    with zipfile.ZipFile(wheel) as z:
        names = z.namelist()
        z.extractall(tmp_path / "site")
    in_wheel = {n.removesuffix(".py").replace("/", ".").removesuffix(".__init__") for n in names if n.endswith(".py")}
    assert sorted(_source_modules() - in_wheel) == []
    assert "pivotrl/py.typed" in names and not any(n.startswith(("tasks/", "flows/")) for n in names)
    # Every module imports from the unpacked wheel, ahead of the source tree (which is not on the path).
    code = ("import importlib, sys, pivotrl\n"
            f"assert pivotrl.__file__.startswith({str(tmp_path / 'site')!r}), pivotrl.__file__\n"
            f"for m in {sorted(in_wheel)!r}:\n"
            "    if m.endswith('__main__'):\n        continue\n"
            "    mod = importlib.import_module(m)\n"
            f"    assert mod.__file__.startswith({str(tmp_path / 'site')!r}), (m, mod.__file__)\n"
            "print('ok')\n")
    env = {"PATH": "/usr/bin:/bin", "HOME": str(tmp_path), "PYTHONPATH": str(tmp_path / "site"),
           "DS_ACCELERATOR": "cpu", "DO_NOT_TRACK": "1"}
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=600, cwd=tmp_path,
                         env=env)
    assert out.returncode == 0 and out.stdout.strip().endswith("ok"), out.stderr[-3000:]
