"""Docs that match the code: every repository path that the READMEs, ARCHITECTURE.md, the manual's
pages (``docs/*.md``) and the shipped configs name exists in the repository.

A path is a backticked token (in markdown) or a word (in a config's comments and values) whose first
component is a top-level entry of the repository (``pivotrl/…``, ``configs/…``, ``Makefile``) or,
for a document in a subdirectory, an entry of that directory (``multinode/…`` in
``infra/README.md``); ``path:attribute`` (an entry point) names the path. A bare file name with a
code or config suffix (``report.py``, ``serve.sh``) must be the name of some file of the repository.
Placeholders (``<key>``, ``…``, ``*``) are not paths.
"""

from __future__ import annotations

import re
import subprocess
from pathlib import Path, PurePosixPath

import pytest

REPO = Path(__file__).resolve().parents[2]
DOCS = ["README.md", "infra/README.md", "ARCHITECTURE.md"] + sorted(
    str(p.relative_to(REPO)) for p in (REPO / "docs").glob("*.md")) + sorted(
    str(p.relative_to(REPO)) for p in (REPO / "configs").glob("*.yaml"))

#: Named on purpose although not in the repository, each with its reason.
EXCLUDE = {
    # multinode-gpu.yaml's hostfile: written by the operator for their nodes
    # (infra/multinode/hostfile.example is the template the docs point to).
    "configs/hostfile",
}

_CODE_SUFFIXES = (".py", ".sh", ".yaml", ".yml", ".toml", ".cfg", ".ini")


def _repo_files() -> set[str]:
    """Tracked files (plus untracked, not ignored ones); the file system when there is no git."""
    try:
        out = subprocess.run(["git", "ls-files", "--cached", "--others", "--exclude-standard"], cwd=REPO,
                             capture_output=True, text=True, check=True, timeout=60).stdout
        files = {f for f in out.splitlines() if (REPO / f).exists()}
        if files:
            return files
    except (OSError, subprocess.SubprocessError):
        pass
    return {str(p.relative_to(REPO)) for p in REPO.rglob("*") if p.is_file() and ".git" not in p.parts
            and ".venv" not in p.parts}


FILES = _repo_files()
DIRS = {str(parent) for f in FILES for parent in PurePosixPath(f).parents if str(parent) != "."}
NAMES = {PurePosixPath(f).name for f in FILES}
TOP = {PurePosixPath(f).parts[0] for f in FILES}


def _tokens(doc: str, text: str) -> set[str]:
    if doc.endswith(".md"):
        found = set(re.findall(r"`([^`\s]+)`", text))
        # fenced code blocks: the words of their command lines
        for block in re.findall(r"```[a-z]*\n(.*?)```", text, flags=re.S):
            found |= set(block.split())
        return found
    return set(re.findall(r"[\w./:-]+", text))


def _candidates(doc: str) -> list[tuple[str, str]]:
    """(token as written, repository path it names) for every path-like token of ``doc``."""
    text = (REPO / doc).read_text(encoding="utf-8")
    here = str(PurePosixPath(doc).parent)
    out = []
    for tok in sorted(_tokens(doc, text)):
        if any(c in tok for c in "<>…*{}$|") or "://" in tok or tok.startswith(("-", "/", "~")):
            continue
        path = tok.split(":", 1)[0].strip(".,;()'\"").rstrip("/") if not tok.startswith(".") else \
            tok.split(":", 1)[0].strip(",;()'\"").rstrip("/")
        if not path or path in (".", ".."):
            continue
        first = PurePosixPath(path).parts[0]
        if "/" in path or path in TOP:
            if first in TOP and (here == "." or first not in {p.split("/")[0] for p in _entries(here)}):
                out.append((tok, path))
            elif here != "." and first in _entries(here):
                out.append((tok, f"{here}/{path}"))
        elif path.endswith(_CODE_SUFFIXES) and re.fullmatch(r"[\w.-]+", path):
            out.append((tok, f"*/{path}"))
    return out


def _entries(directory: str) -> set[str]:
    prefix = directory.rstrip("/") + "/"
    return {f[len(prefix):].split("/")[0] for f in FILES if f.startswith(prefix)}


def _exists(path: str) -> bool:
    if path.startswith("*/"):
        return path[2:] in NAMES
    return path in FILES or path in DIRS


@pytest.mark.parametrize("doc", DOCS)
def test_every_path_a_doc_names_exists(doc):
    cands = _candidates(doc)
    missing = sorted({f"{tok} (→ {path})" for tok, path in cands if not _exists(path) and path not in EXCLUDE})
    assert not missing, f"{doc} names paths that are not in the repository: {missing}"


def test_the_path_check_finds_paths_and_missing_ones(tmp_path):
    """The extraction sees the kinds of paths the docs use (so the test above cannot pass empty)."""
    readme = {path for _, path in _candidates("README.md")}
    assert {"configs/showcase.yaml", "pivotrl/core", ".ci/run"} <= readme
    results = {path for _, path in _candidates("docs/results.md")}
    assert {"pivotrl/evaluation/stats.py", "benchmarks/RESULTS.md"} <= results
    assert {"configs/default.yaml", "infra/README.md"} <= {path for _, path in _candidates("docs/scale-out.md")} | {
        path for _, path in _candidates("docs/nightly.md")}
    infra = {path for _, path in _candidates("infra/README.md")}
    assert {"infra/serve.sh", "infra/multinode/launch_train.py", "flows/nightly.py"} <= infra
    assert any(path.startswith("pivotrl/") for _, path in _candidates("configs/default.yaml"))
    assert "docs/method.md" in DOCS and len([d for d in DOCS if d.startswith("docs/")]) >= 8
    method = {path for _, path in _candidates("docs/method.md")}
    assert {"pivotrl/pivots/filter.py", "pivotrl/objective/tis.py"} <= method
    assert not _exists("pivotrl/config.py") and _exists("pivotrl/config") and _exists("*/report.py")
    assert not _exists("*/no_such_module.py")
