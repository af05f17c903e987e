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

from pivotrl.provenance.code_digest import STAGE_MODULES, code_digest, stage_code_digest, stage_code_modules
from pivotrl.core.errors import ConfigError, StorageError

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


#: Modules whose code decides probe rewards: parsers, renderers, environments, retry, sampling.
PROBE_CODE = ["format/actions.py", "format/tool_parsers.py", "format/prompts.py", "format/chat_format.py", "format/chat_render.py", "format/tool_render.py",
              "bfcl/envs.py", "envs/sandbox_worker.py", "core/retry.py", "rollout/base.py"]


@pytest.mark.parametrize("module", PROBE_CODE)
def test_parser_renderer_environment_and_sampling_code_are_in_the_probe_key(edited, module):
    base, after = edited["base"], edited["edits"][module]
    assert after["probe"] != base["probe"]


def test_every_stage_digest_is_stable_and_distinct():
    digests = {s: stage_code_digest(s) for s in STAGE_MODULES}
    assert all(len(d) == 64 for d in digests.values())
    assert len(set(digests.values())) == len(digests)
    assert code_digest(stage_code_modules("probe")) == digests["probe"]


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


#: module (a path under pivotrl/) → the stages whose code digest must change when it is edited.
DIGEST_CASES = {
    # The warm start is keyed by its own code only: train/evaluate edits never re-run it.
    "pipeline/reference.py": {"reference"},
    "pipeline/train.py": {"train"},
    "pipeline/evaluate.py": {"evaluate"},
    "pipeline/evaluate_stage.py": {"evaluate"},
    "evaluation/aggregate.py": {"evaluate"},
    "training/loop.py": {"train"},
    # Read by every stage that loads a published checkpoint (pipeline.common.local_checkpoint).
    "training/checkpoints.py": {"reference", "probe", "train", "evaluate"},
    "training/sft.py": {"reference"},
    "training/e2e.py": set(),
    # sample → score decides probing, training and local evaluation alike
    "rollout/scoring.py": {"probe", "train", "evaluate"},
    # the drift re-probe and the held-out state selection of the evaluation (and of the training's
    # learning curve) run probe.py's code
    "pipeline/probe.py": {"probe", "train", "evaluate"},
    # the tool-call parsers: how every sampled action is read, and the load-time audit that every
    # demonstrated action reads back with the run's parser
    "format/tool_parsers.py": {"demonstrations", "reference", "probe", "train", "evaluate"},
    # the template renderer: what every model sees
    "format/chat_render.py": {"reference", "probe", "train", "evaluate"},
    "format/chat_format.py": {"reference", "probe", "train", "evaluate"},
    # what prints, tracks or reports never re-runs a stage before it
    "core/progress.py": set(),
    "tracking/record.py": set(),
    "evaluation/report.py": {"evaluate"},
}

#: One child process over a copy of the package: the keys and stage digests of the unedited copy,
#: then, for each module in turn, after appending a comment to it (undone before the next one).
#: ``code_digest`` caches per process; clearing its cache between edits makes each computation
#: read the files again, as the next run's fresh process would.
EDITS = """
import json, sys
from pathlib import Path
from pivotrl.provenance.code_digest import STAGE_MODULES, code_digest, stage_code_digest, stage_code_modules
from pivotrl.config import RunConfig
from pivotrl.pipeline.demos import demos_key
from pivotrl.pipeline.probe import probe_key
cfg = RunConfig()

def state():
    code_digest.cache_clear()
    return {"probe": probe_key("c" * 64, "r" * 64, cfg.probing.model_dump(mode="json"),
                               cfg.verifier.model_dump(mode="json"), cfg.prompt.model_dump(mode="json"),
                               {"engine": "hf"}),
            "demos": demos_key(cfg), "digests": {s: stage_code_digest(s) for s in STAGE_MODULES}}

result = {"base": state(), "edits": {}}
for module in json.loads(sys.argv[1]):
    f = Path("pivotrl") / module
    text = f.read_text()
    f.write_text(text + "\\n# changed\\n")
    result["edits"][module] = state()
    f.write_text(text)
assert state() == result["base"]  # every edit was undone
print(json.dumps(result))
"""


@pytest.fixture(scope="module")
def edited(tmp_path_factory):
    """Keys and stage digests of a copy of the package before and after editing each module of
    PROBE_CODE and DIGEST_CASES (one child process for all of them)."""
    import json

    tree = tmp_path_factory.mktemp("tree")
    shutil.copytree(REPO / "pivotrl", tree / "pivotrl", ignore=shutil.ignore_patterns("__pycache__"))
    modules = sorted(set(PROBE_CODE) | set(DIGEST_CASES))
    out = subprocess.run([sys.executable, "-c", EDITS, json.dumps(modules)], capture_output=True, text=True,
                         cwd=tree, timeout=120,
                         env={"PATH": "/usr/bin:/bin", "PYTHONPATH": str(tree), "HOME": str(tree)})
    assert out.returncode == 0, out.stderr[-2000:]
    return json.loads(out.stdout)


@pytest.mark.parametrize("module", DIGEST_CASES)
def test_each_stage_digest_covers_the_modules_that_hold_its_code(edited, module):
    before, after = edited["base"]["digests"], edited["edits"][module]["digests"]
    assert {s for s in before if before[s] != after[s]} == DIGEST_CASES[module]


def test_the_train_digest_covers_every_training_module_but_baselines_and_entries():
    """The train stage's code is derived from its imports: a training module written tomorrow is in
    it the day the loop imports it. Only the ``pivotrl compare`` baselines and the offline entry
    point (pre-collected batches) stay out."""
    import pivotrl.training as training_pkg
    from pathlib import Path

    names = {p.stem for p in Path(training_pkg.__file__).parent.glob("*.py")} - {"__init__"}
    derived = {m.rsplit(".", 1)[1] for m in stage_code_modules("train") if m.startswith("pivotrl.training.")}
    assert names - derived == {"e2e", "sft", "offline"}


# ---------------------------------------------------------------- the Prefect cache key per stage
STAGES = ("demonstrations", "reference", "probe", "train", "evaluate", "sft_baseline", "e2e_baseline", "compare_evaluate")
COMPARE = {"sft_baseline", "e2e_baseline", "compare_evaluate"}


def _chain(cfg, store):
    """Every stage's key for ``cfg``, each stage's result built from the key before it as the
    stages build theirs (content-addressed tables written where the stages write them)."""
    import hashlib

    import pandas as pd

    from pivotrl.pipeline.keys import stage_key
    from pivotrl.pipeline.results import ProbeResult, ReferenceResult, TrainResult

    keys = {"demonstrations": stage_key("demonstrations", cfg, store)}
    demos = {"key": keys["demonstrations"]}
    store.write_artifact(f"{demos['key']}/candidates.parquet", pd.DataFrame({"state_id": ["s1", "s2"]}),
                         kind="candidates")
    keys["reference"] = stage_key("reference", cfg, store, {"demos": demos})
    # a new warm start gives new weights (π_ref's checkpoint hash); the same one, the same weights
    ref = ReferenceResult("/base", "b" * 64, keys["reference"], hashlib.sha256(keys["reference"].encode()).hexdigest(),
                          None, {"template_hash": "t" * 16})
    keys["probe"] = stage_key("probe", cfg, store, {"demos": demos, "reference": ref})
    pivots = keys["probe"]
    store.write_artifact(f"{pivots}/pivots.parquet", pd.DataFrame({"state_id": ["s1"]}), kind="pivots")
    probe = ProbeResult(pivots.split("-")[0].replace("pivots/", "probes/"), "", pivots, store.url(f"{pivots}/pivots.parquet"), {})
    keys["train"] = stage_key("train", cfg, store, {"probe": probe.to_dict(), "reference": ref.to_dict()})
    train = TrainResult(keys["train"], None, store.url(f"{keys['train']}/metrics.parquet"))
    keys["evaluate"] = stage_key("evaluate", cfg, store, {"demos": demos, "reference": ref, "probe": probe,
                                                          "train": train})
    keys["sft_baseline"] = stage_key("sft_baseline", cfg, store, {"demos": demos, "reference": ref, "probe": probe,
                                                                  "train": train})
    keys["e2e_baseline"] = stage_key("e2e_baseline", cfg, store, {"demos": demos, "reference": ref, "probe": probe,
                                                                  "train": train})
    keys["compare_evaluate"] = stage_key("compare_evaluate", cfg, store, {
        "demos": demos, "reference": ref, "probe": probe, "train": train, "sft": {"key": keys["sft_baseline"]},
        "e2e": {"key": keys["e2e_baseline"]}})
    return keys


@pytest.fixture()
def smoke(tmp_path):
    from pivotrl.config import load_config
    from pivotrl.storage import ArtifactStore

    def cfg(*overrides):
        return load_config(str(REPO / "configs" / "smoke.yaml"), [f"run.storage_root={tmp_path / 'root'}", *overrides])

    return cfg, ArtifactStore(str(tmp_path / "root"))


@pytest.mark.parametrize("override, changed", [
    ("training.lr=2e-5", {"train", "evaluate"} | COMPARE),
    ("training.max_steps=3", {"train", "evaluate"} | COMPARE),
    ("evaluation.num_tasks=3", {"evaluate", "compare_evaluate"}),
    # the same pivot set selected again (this table): training and evaluation stay cached
    ("probing.lambda_diff=0.5", {"probe"}),
    ("warm_start.epochs=2", {"reference", "probe", "train", "evaluate"} | COMPARE),
    ("data.split.seed=7", set(STAGES)),
    ("tracking.backend=mlflow", set()),  # where a run is recorded changes no result
    # a baseline's own settings re-key that baseline and the comparison's evaluation only
    ("compare.sft_lr=1e-3", {"sft_baseline", "compare_evaluate"}),
    ("compare.e2e_max_steps=3", {"e2e_baseline", "compare_evaluate"}),
    ("compare.num_tasks=3", {"compare_evaluate"}),
])
def test_a_change_re_keys_its_stage_and_the_later_ones_only(smoke, override, changed):
    cfg, store = smoke
    before, after = _chain(cfg(), store), _chain(cfg(override), store)
    assert {s for s in STAGES if before[s] != after[s]} == changed


def test_a_task_looks_up_and_leases_its_stage_key_and_reuse_misses_once_an_artifact_is_deleted(smoke):
    from pivotrl.pipeline.demos import build_demonstrations
    from pivotrl.pipeline.keys import cached_result
    from pivotrl.tasks.stages import lease_key

    cfg, store = smoke
    config = cfg().model_dump(mode="json")
    keys = _chain(cfg(), store)
    assert lease_key("demonstrations", config, None) == keys["demonstrations"]
    changed = cfg("training.lr=2e-5").model_dump(mode="json")
    assert lease_key("demonstrations", changed, None) == lease_key("demonstrations", config, None)
    # reuse is the stage's own check of its artifacts under that key
    assert cached_result("demonstrations", cfg(), store) is None
    built = build_demonstrations(cfg(), store)
    assert cached_result("demonstrations", cfg(), store) == built
    store.delete(f"{keys['demonstrations']}/candidates.parquet")
    assert cached_result("demonstrations", cfg(), store) is None
    # the comparison's stages are keyed by their own content keys too
    from pivotrl.pipeline.keys import stage_key

    demos = {"key": keys["demonstrations"]}
    with pytest.raises(ConfigError, match="needs the results of \\['probe', 'train'\\]"):
        lease_key("sft_baseline", config, {"demos": demos, "reference": {}})
    from pivotrl.pipeline.results import ReferenceResult

    ref = ReferenceResult("/base", "b" * 64, keys["reference"], "c" * 64, None, {}).to_dict()
    probe = {"probes_key": "probes/x", "probes": "", "pivots_key": "pivots/x", "pivots": "", "stats": {}}
    inputs = {"demos": demos, "reference": ref, "probe": probe,
              "train": {"train_key": keys["train"]}}
    assert lease_key("sft_baseline", config, inputs) == stage_key("sft_baseline", cfg(), store, inputs)
    num_tasks = cfg("evaluation.num_tasks=3").model_dump(mode="json")
    assert lease_key("sft_baseline", num_tasks, inputs) == lease_key("sft_baseline", config, inputs)
    assert cached_result("sft_baseline", cfg(), store, inputs) is None


def test_every_stage_result_field_is_documented_and_shown_with_its_meaning():
    import dataclasses

    from pivotrl.pipeline.results import EvalResult, ProbeResult, ReferenceResult, TrainResult

    for cls in (ReferenceResult, ProbeResult, TrainResult, EvalResult):
        docs = cls.field_docs()
        assert set(docs) == {f.name for f in dataclasses.fields(cls)}, cls.__name__  # none undocumented
        assert all(len(d) > 8 for d in docs.values())
    res = ProbeResult("probes/ab", "file:///r/probes/ab/probes.parquet", "pivots/ab-cd",
                      "file:///r/pivots/ab-cd/pivots.parquet", {"total": {"kept": 3}}, "a | b\n" * 100)
    md = res.markdown()
    assert md.startswith("## ProbeResult\n\nThe probe stage: the probe table and the pivot set")
    assert "| `pivots_key` | pivots/ab-cd | store key prefix of `pivots.parquet`, `stats.json`, `summary.md`. |" in md
    assert '| `stats` | {"total": {"kept": 3}} | the pivot statistics' in md
    assert "a \\| b" in md and " …" in md  # cut, and a | in a value does not break the table


def test_every_list_of_stages_is_the_registry():
    """The stage names are written once (pivotrl.pipeline.registry.STAGES); the lists elsewhere are
    read from it or checked here against it."""
    from pivotrl.pipeline import entry, keys, registry
    from pivotrl.tracking.record import STAGES as TRACKED

    assert {n: registry.STAGES[n].module for n in STAGE_MODULES} == STAGE_MODULES
    assert tuple(registry.STAGES)[:5] == registry.NIGHTLY_STAGES == TRACKED == tuple(STAGE_MODULES)
    assert tuple(keys.STAGE_INPUTS) == tuple(registry.STAGES)
    assert entry.STAGES == tuple(registry.STAGES) + entry.SHARD_STAGES
    with pytest.raises(ConfigError, match="valid: demonstrations, reference, probe, train, evaluate, sft_baseline"):
        registry.stage_spec("nope")


def test_the_architecture_page_lists_the_registry():
    """ARCHITECTURE.md's stage table is the registry's: each stage with its module and inputs."""
    from pivotrl.pipeline.registry import STAGES

    page = (REPO / "ARCHITECTURE.md").read_text()
    rows = [line for line in page.splitlines() if line.startswith("| `") and "`pivotrl.pipeline." in line]
    expected = [f"| `{s.name}` | `{s.module}` | {', '.join(s.inputs) or '—'} |" for s in STAGES.values()]
    assert rows == expected
