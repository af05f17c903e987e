"""Bounds of the run configuration: every number finite."""

from __future__ import annotations

import math

import pytest
from pydantic import BaseModel, ValidationError

from pivotrl.config import RunConfig, load_config
from pivotrl.config.validate import _type_members
from pivotrl.core.errors import ConfigError
from test_config import _all_models  # the config's models, walked as the config tests walk them


def _numeric_fields() -> list[tuple[type[BaseModel], str]]:
    out = []
    for model in sorted(_all_models(RunConfig), key=lambda m: m.__name__):
        for name, info in model.model_fields.items():
            members = _type_members(info.annotation)
            if any(t in (int, float) for t in members) and bool not in members:
                out.append((model, name))
    return out


def test_the_walk_finds_the_numeric_settings():
    names = {f"{m.__name__}.{n}" for m, n in _numeric_fields()}
    assert {"TrainingSection.beta", "TrainingSection.lr", "TrainingSection.epochs"} <= names
    assert len(names) > 40


@pytest.mark.parametrize("value", [math.inf, -math.inf, math.nan])
def test_every_numeric_setting_refuses_a_non_finite_value(value):
    accepted = []
    for model, name in _numeric_fields():
        try:
            model.model_validate({name: value})
        except ValidationError as e:
            if any(err["loc"] == (name,) and err["type"] in ("finite_number",) for err in e.errors()):
                continue
        accepted.append(f"{model.__name__}.{name}")
    assert accepted == []


@pytest.mark.parametrize("override, shown", [("training.beta=.inf", "inf"), ("training.lr=inf", "'inf'"),
                                             ("training.epsilon=-.inf", "-inf"), ("probing.num_probes=.nan", "nan")])
def test_a_non_finite_override_is_a_config_error_naming_the_key(override, shown):
    key = override.split("=")[0]
    with pytest.raises(ConfigError) as e:
        load_config(None, [override])
    assert str(e.value) == (f"invalid config (defaults) with overrides of {key}: {key} = {shown}: must be a finite "
                            "number (not inf or nan)")  # one problem, one line


def test_pivotrl_config_exits_2_on_an_infinite_beta():
    from typer.testing import CliRunner

    from pivotrl.flows.cli import app

    out = CliRunner().invoke(app, ["config", "--set", "training.beta=.inf"])
    assert out.exit_code == 2
    assert "training.beta = inf: must be a finite number" in out.output
