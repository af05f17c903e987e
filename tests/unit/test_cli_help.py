"""``pivotrl --help`` as a person reads it: no internal type tags (``<bool>``, ``<str>``), no
``{uri}`` in a usage line, no raw reStructuredText double backticks (flows/cli.py)."""

from __future__ import annotations

import re

import pytest
from typer.testing import CliRunner

from pivotrl.flows.cli import app

COMMANDS = [[], ["run"], ["compare"], ["probe"], ["demos"], ["config"], ["lineage"], ["pool"], ["rollouts"], ["pivots"],
            ["pivots", "diff"], ["pivots", "export"]]


@pytest.mark.parametrize("cmd", COMMANDS, ids=lambda c: " ".join(c) or "pivotrl")
def test_help_has_no_type_tags_braces_or_double_backticks(cmd):
    out = CliRunner().invoke(app, [*cmd, "--help"], env={"COLUMNS": "120", "NO_COLOR": "1"}, color=False)
    assert out.exit_code == 0, out.output
    text = out.output
    assert "Show this message and exit." in text
    assert not re.search(r"<(bool|str|int|float|list\[[a-z]+\]|path)>", text), text
    assert "{" not in text and "}" not in text, text
    assert "``" not in text, text


def test_help_names_values_by_what_they_are():
    runner = CliRunner()
    run = runner.invoke(app, ["run", "--help"], env={"COLUMNS": "120"}, color=False).output
    assert re.search(r"--config\s+-c\s+PATH\s+YAML run config", run)
    assert re.search(r"--set\s+-s\s+KEY=VALUE\s+Override a config key", run)
    lineage = runner.invoke(app, ["lineage", "--help"], env={"COLUMNS": "120"}, color=False).output
    assert "lineage [OPTIONS] URI" in lineage and re.search(r"--json\s+Print the tree as JSON", lineage)
    rollouts = runner.invoke(app, ["rollouts", "--help"], env={"COLUMNS": "120"}, color=False).output
    assert re.search(r"--step\s+N\s+Only this step", rollouts)
