"""Config errors point into the file: each problem's line, keys written twice."""

from __future__ import annotations

import pytest

from pivotrl.config import load_config
from pivotrl.core.errors import ConfigError


def test_a_key_written_twice_is_an_error_naming_both_lines(tmp_path):
    path = tmp_path / "dup.yaml"
    path.write_text("training:\n  lr: 1.0e-5\n  beta: 0.1\n  lr: 2.0e-5\nprobing:\n  num_probes: 4\n"
                    "training:\n  epochs: 1\n", encoding="utf-8")
    with pytest.raises(ConfigError) as e:
        load_config(str(path))
    lines = str(e.value).splitlines()
    assert lines[0] == f"config {path}: 2 keys written twice (YAML would keep the last one silently; remove the other)"
    assert lines[1:] == ["  - line 4: training.lr (also at line 2)", "  - line 7: training (also at line 1)"]


def test_each_problem_names_its_line_in_the_file_unless_an_override_set_it(tmp_path):
    path = tmp_path / "bad.yaml"
    path.write_text(
        "# a comment\n"
        "training:\n  lr: fast\n  beta: 0.01\n  bogus_key: 3\n"   # lines 2-5
        "data:\n  sources:\n    - kind: chat\n      url: a.jsonl\n      nonsense: 1\n"  # lines 6-10
        "probing:\n  num_probes: 8\n  lambda_diff: 0\n",  # lines 11-13
        encoding="utf-8",
    )
    with pytest.raises(ConfigError) as e:
        load_config(str(path))
    got = [line[4:] for line in str(e.value).splitlines() if line.startswith("  - ")]
    assert got == [  # in the file's order (the schema puts data and probing before training)
        "line 3: training.lr = 'fast': must be a number",
        next(g for g in got if g.startswith("line 5: training.bogus_key = 3: unknown key")),
        next(g for g in got if g.startswith("line 10: data.sources[0].nonsense = 1: unknown key")),
        "line 13: probing.lambda_diff = 0: must be > 0 (μ̂ < lambda_diff keeps nothing when lambda_diff ≤ 0)",
    ]
    # An overridden value's problem is not the file's: no line; the file's other problems keep theirs.
    with pytest.raises(ConfigError) as e:
        load_config(str(path), ["training.lr=slow", "probing.lambda_diff=-1"])
    got = [line[4:] for line in str(e.value).splitlines() if line.startswith("  - ")]
    assert "training.lr = 'slow': must be a number" in got
    assert any(g.startswith("probing.lambda_diff = -1: must be > 0") for g in got)
    assert any(g.startswith("line 5: training.bogus_key = 3") for g in got)
    assert [g[:7] for g in got[:2]] == ["line 5:", "line 10"]  # the file's lines first, the overrides' after
    # A missing key is located at its section's entry (the list item here).
    path.write_text("data:\n  sources:\n    - kind: chat\n", encoding="utf-8")
    with pytest.raises(ConfigError, match=r"line 3: data\.sources\[0\]\.url: required key is missing"):
        load_config(str(path))


def test_a_config_error_with_one_problem_is_one_line(tmp_path):
    """Faults end in one line: one problem is ``invalid config FILE: line N: …``, not a header and a
    list of one; several keep the header and a line each."""
    path = tmp_path / "one.yaml"
    path.write_text("probing:\n  num_probes: 1\n", encoding="utf-8")
    with pytest.raises(ConfigError) as e:
        load_config(str(path))
    assert str(e.value) == f"invalid config {path}: line 2: probing.num_probes = 1: must be ≥ 2 (σ̂² needs two probes)"
    with pytest.raises(ConfigError) as e:
        load_config(None, ["probing.num_probes=1"])
    assert str(e.value) == ("invalid config (defaults) with overrides of probing.num_probes: probing.num_probes = 1: "
                            "must be ≥ 2 (σ̂² needs two probes)")
    path.write_text("training:\n  lr: 1.0e-5\n  lr: 2.0e-5\n", encoding="utf-8")
    with pytest.raises(ConfigError) as e:
        load_config(str(path))
    assert str(e.value) == (f"config {path}: a key written twice (YAML would keep the last one silently; remove the "
                            "other): line 3: training.lr (also at line 2)")
    path.write_text("probing:\n  num_probes: 1\n  lambda_diff: 0\n", encoding="utf-8")
    with pytest.raises(ConfigError) as e:
        load_config(str(path))
    assert str(e.value).splitlines()[0] == f"invalid config {path}: 2 problems" and len(str(e.value).splitlines()) == 3
    # the command line prints it as it is: one line
    from typer.testing import CliRunner

    from pivotrl.flows.cli import app

    out = CliRunner().invoke(app, ["config", "--set", "probing.num_probes=1"])
    assert out.exit_code == 2 and out.output.strip().count("\n") == 0, out.output
