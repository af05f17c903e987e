"""The parallel suite (``make test``: pytest-xdist with ``--dist loadfile``) runs the modules holding
long tests first (tests/conftest.py), and the Makefile asks for that distribution."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
MAKEFILE = (REPO / "Makefile").read_text()


def _recipe(target: str) -> str:
    found = re.search(rf"^{target}: .*\n\t(.*)$", MAKEFILE, re.M)
    assert found is not None, f"the Makefile has no {target} target"
    return found.group(1)


def test_make_test_keeps_a_module_on_one_worker():
    assert "-n $(TEST_WORKERS)" in _recipe("test") and "--dist loadfile" in _recipe("test")


def test_a_parallel_run_puts_the_modules_with_long_tests_first(request):
    if not hasattr(request.config, "workerinput"):
        pytest.skip("orders the modules of a parallel run (make test); this is one process")
    # the long tests are the ones make test-fast leaves out
    long_marks = re.findall(r"not (\w+)", _recipe("test-fast"))
    conftest = request.config.pluginmanager.getplugin(str(REPO / "tests" / "conftest.py"))
    assert long_marks and set(long_marks) == set(conftest.LONG_MARKS)
    items = request.session.items
    modules = [i.nodeid.split("::", 1)[0] for i in items]
    long_modules = {m for m, i in zip(modules, items) if any(i.get_closest_marker(k) for k in long_marks)}
    # one block per module: xdist's loadfile scope sends each block to one worker
    blocks = [m for n, m in enumerate(modules) if n == 0 or modules[n - 1] != m]
    assert len(blocks) == len(set(blocks))
    first_short = next((n for n, m in enumerate(blocks) if m not in long_modules), len(blocks))
    assert not long_modules & set(blocks[first_short:]), "a module with long tests is scheduled after a short one"
