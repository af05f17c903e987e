"""Stage keys cover the code that decides the stage's output, and resume never mistakes a storage
outage for "no checkpoint".

A verifier edited in place (same commit, same config) must give a new probe key, or probing would
reuse stale rewards; an edit to code the probe stage does not run (the report) must not.
"""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from pivotrl.code_digest import STAGE_CODE, code_digest, stage_code_digest
from pivotrl.errors import ConfigError, StorageError

REPO = Path(__file__).resolve().parents[2]

KEYS = """
import json
from pivotrl.config import RunConfig
from pivotrl.pipeline.demos import demos_key
from pivotrl.pipeline.probe import probe_key
cfg = RunConfig()
print(json.dumps({"probe": probe_key("c" * 64, "r" * 64, cfg.probing.model_dump(mode="json"),
                                     cfg.verifier.model_dump(mode="json"), cfg.prompt.model_dump(mode="json"),
                                     {"engine": "hf"}),
                  "demos": demos_key(cfg)}))
"""


def _keys(tree: Path) -> dict[str, str]:
    import json

    out = subprocess.run([sys.executable, "-c", KEYS], capture_output=True, text=True, cwd=tree, timeout=120,
                         env={"PATH": "/usr/bin:/bin", "PYTHONPATH": str(tree), "HOME": str(tree)})
    assert out.returncode == 0, out.stderr[-2000:]
    return json.loads(out.stdout)


@pytest.fixture()
def tree(tmp_path):
    """A copy of the package to edit (the checkout itself is never touched)."""
    shutil.copytree(REPO / "pivotrl", tmp_path / "pivotrl", ignore=shutil.ignore_patterns("__pycache__"))
    return tmp_path


def test_editing_a_verifier_changes_the_probe_key_and_nothing_else_does(tree):
    before = _keys(tree)
    report = tree / "pivotrl" / "evaluation" / "report.py"
    report.write_text(report.read_text() + "\n# a report-only change\n")
    store = tree / "pivotrl" / "storage" / "store.py"
    store.write_text(store.read_text() + "\n# how bytes reach the store, not what they are\n")
    assert _keys(tree) == before  # the probe stage does not run the report; storage code decides no payload

    verifier = tree / "pivotrl" / "verifiers" / "tool_name.py"
    verifier.write_text(verifier.read_text() + "\n# a changed acceptance rule\n")
    after = _keys(tree)
    assert after["probe"] != before["probe"]
    assert after["demos"] == before["demos"]  # loading demonstrations does not run verifiers


@pytest.mark.parametrize("module", ["actions.py", "prompts.py", "envs/bfcl.py", "envs/sandbox_worker.py",
                                    "storage/retry.py", "rollout/base.py"])
def test_parser_renderer_environment_and_sampling_code_are_in_the_probe_key(tree, module):
    before = _keys(tree)["probe"]
    f = tree / "pivotrl" / module
    f.write_text(f.read_text() + "\n# changed\n")
    assert _keys(tree)["probe"] != before


def test_every_stage_digest_is_stable_and_distinct():
    digests = {s: stage_code_digest(s) for s in STAGE_CODE}
    assert all(len(d) == 64 for d in digests.values())
    assert len(set(digests.values())) == len(digests)
    assert code_digest(STAGE_CODE["probe"]) == digests["probe"]


def test_unknown_stage_or_module_names_the_valid_ones():
    with pytest.raises(ConfigError, match="valid: demonstrations, reference, probe, train, evaluate"):
        stage_code_digest("nope")
    with pytest.raises(ConfigError, match="pivotrl.nope"):
        code_digest(("pivotrl.nope",))


class _Flaky:
    """A file system whose listing fails with a transient error (a storage outage)."""

    def __init__(self, fs):
        self._fs, self.calls = fs, 0

    def find(self, *a, **k):
        self.calls += 1
        raise ConnectionError("connection reset by peer")

    def __getattr__(self, name):
        return getattr(self._fs, name)


def test_resume_retries_then_raises_on_a_storage_outage_never_restarts_from_step_0(tmp_path):
    from pivotrl.training.checkpoints import latest_checkpoint as _latest_checkpoint
    from pivotrl.storage import ArtifactStore, RetryPolicy

    store = ArtifactStore("memory://resume-outage", retry=RetryPolicy(attempts=3, base_delay_s=0.0))
    store.write_json("train/k/checkpoints/step-000002/ranks.json", {"world_size": 1})
    assert _latest_checkpoint(store, "train/k/checkpoints") == "train/k/checkpoints/step-000002"
    assert _latest_checkpoint(store, "train/other/checkpoints") is None  # none yet: a fresh start

    store.fs = _Flaky(store.fs)
    with pytest.raises(StorageError, match="after 3 attempts"):
        _latest_checkpoint(store, "train/k/checkpoints")
    assert store.fs.calls == 3


DIGESTS = """
import json
from pivotrl.code_digest import STAGE_CODE, stage_code_digest
print(json.dumps({s: stage_code_digest(s) for s in STAGE_CODE}))
"""


def _digests(tree: Path) -> dict[str, str]:
    import json

    out = subprocess.run([sys.executable, "-c", DIGESTS], capture_output=True, text=True, cwd=tree, timeout=120,
                         env={"PATH": "/usr/bin:/bin", "PYTHONPATH": str(tree), "HOME": str(tree)})
    assert out.returncode == 0, out.stderr[-2000:]
    return json.loads(out.stdout)


def _changed(tree: Path, module: str) -> set[str]:
    """The stages whose code digest changes when ``module`` (a path under pivotrl/) is edited."""
    before = _digests(tree)
    f = tree / "pivotrl" / module
    f.write_text(f.read_text() + "\n# changed\n")
    after = _digests(tree)
    f.write_text(f.read_text().removesuffix("\n# changed\n"))
    return {s for s in before if before[s] != after[s]}


@pytest.mark.parametrize("module, stages", [
    # The warm start is keyed by its own code only: train/evaluate edits never re-run it.
    ("pipeline/reference.py", {"reference"}),
    ("pipeline/train.py", {"train"}),
    ("pipeline/evaluate.py", {"evaluate"}),
    ("pipeline/eval_shards.py", {"evaluate"}),
    ("evaluation/aggregate.py", {"evaluate"}),
    ("training/loop.py", {"train"}),
    ("training/checkpoints.py", {"train"}),
    ("training/sft.py", {"reference", "train"}),
    # sample → score decides probing, training and local evaluation alike
    ("rollout/scoring.py", {"probe", "train", "evaluate"}),
    # the drift re-probe and the held-out state selection of the evaluation run probe.py's code
    ("pipeline/probe.py", {"probe", "evaluate"}),
])
def test_each_stage_digest_covers_the_modules_that_hold_its_code(tree, module, stages):
    assert _changed(tree, module) == stages


def test_the_training_package_imports_no_pipeline_module():
    """``pivotrl.training`` (the loop, checkpoints, trainer) imports nothing of ``pivotrl.pipeline``;
    the launcher shim ``training/rl_stage.py`` reaches it only at run time, inside ``main``."""
    import ast

    offenders = []
    for f in sorted((REPO / "pivotrl" / "training").glob("*.py")):
        for node in ast.walk(ast.parse(f.read_text())):
            names = ([a.name for a in node.names] if isinstance(node, ast.Import)
                     else [node.module or ""] if isinstance(node, ast.ImportFrom) else [])
            if any(n.startswith("pivotrl.pipeline") for n in names):
                offenders.append(f"{f.name}:{node.lineno}")
    assert offenders == ["rl_stage.py:" + str(next(
        i for i, line in enumerate((REPO / "pivotrl/training/rl_stage.py").read_text().splitlines(), 1)
        if "from pivotrl.pipeline" in line))]
    code = ("import sys; sys.modules['pivotrl.pipeline'] = None\n"
            "import pivotrl.training.loop, pivotrl.training.checkpoints, pivotrl.training.rl_stage\nprint('ok')")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=REPO, timeout=120)
    assert out.returncode == 0 and out.stdout.strip() == "ok", out.stderr[-2000:]
