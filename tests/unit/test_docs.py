"""The manual builds and the README stays a front page.

The site (``mkdocs.yml``, ``docs/``, the API pages mkdocstrings renders from the docstrings) is built
with ``--strict`` into a temporary folder: a broken link, a missing page or anchor, a reference that
does not resolve or a docstring the parser cannot read is a warning, and a warning fails the build.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
README = REPO / "README.md"


def test_the_site_builds_strictly(tmp_path):
    site = tmp_path / "site"
    out = subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict", "--config-file",
                          str(REPO / "mkdocs.yml"), "--site-dir", str(site)],
                         cwd=REPO, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stdout[-4000:] + out.stderr[-4000:]
    assert "WARNING" not in out.stderr, out.stderr[-4000:]
    assert (site / "index.html").is_file()
    # The manual's pages and the API reference of the public packages are in the site.
    for page in ("configuration", "data", "method", "storage", "tracking", "scale-out", "nightly", "results"):
        assert (site / page / "index.html").is_file(), page
    for package in ("core", "format", "pivots", "objective", "verifiers", "config", "storage"):
        html = (site / "api" / package / "index.html").read_text(encoding="utf-8")
        assert f'id="pivotrl.{package}' in html, f"no API entries rendered for pivotrl.{package}"


def test_the_readme_is_a_front_page():
    lines = README.read_text(encoding="utf-8").splitlines()
    assert len(lines) <= 150, f"README.md has {len(lines)} lines; the manual belongs in docs/"
    head = "\n".join(lines[:40])
    assert "make test" in head and "make run" in head, "the two commands must be near the top of the README"


def test_every_docs_page_is_in_the_nav():
    """A page left out of ``nav`` is unreachable from the site's menu (mkdocs only logs it)."""
    import yaml

    def pages(node):
        if isinstance(node, str):
            yield node
        elif isinstance(node, dict):
            for v in node.values():
                yield from pages(v)
        elif isinstance(node, list):
            for v in node:
                yield from pages(v)

    nav = set(pages(yaml.safe_load((REPO / "mkdocs.yml").read_text(encoding="utf-8"))["nav"]))
    on_disk = {str(p.relative_to(REPO / "docs")) for p in (REPO / "docs").rglob("*.md")}
    assert on_disk == nav, f"not in nav: {sorted(on_disk - nav)}; in nav, not on disk: {sorted(nav - on_disk)}"
