"""Base of the config schema: the Section model, strict numbers, credential names, rule errors."""

from __future__ import annotations

import json

from typing import Annotated, Any

from pydantic import BaseModel, BeforeValidator, ConfigDict
from pydantic_core import PydanticCustomError

from pivotrl.core.redact import is_credential_key

__all__ = ["Float", "Int", "Section", "bound_error", "is_credential_key", "show_value"]


def _reject_bool(value: Any) -> Any:
    # YAML `true` would otherwise be read as the number 1.
    if isinstance(value, bool):
        raise PydanticCustomError("bool_not_number", "must be a number, not true/false")
    return value


Int = Annotated[int, BeforeValidator(_reject_bool)]
Float = Annotated[float, BeforeValidator(_reject_bool)]

def bound_error(key: str, value: Any, rule: str) -> PydanticCustomError:
    """A cross-field error; ``key`` is relative to the model that raises it."""
    ctx = {"key": key, "value": show_value(value), "rule": rule}
    return PydanticCustomError("pivotrl_rule", "{key} = {value}: {rule}", ctx)


class Section(BaseModel):
    """Base of every config section: unknown keys are errors, values are immutable, and every number
    is finite (``inf``/``nan``, YAML ``.inf``/``.nan``, are refused for every numeric setting)."""

    model_config = ConfigDict(extra="forbid", frozen=True, validate_default=True, allow_inf_nan=False)


# ----------------------------------------------------------------------------------------- run


def show_value(value: Any, limit: int = 80) -> str:
    if isinstance(value, str):
        text = repr(value)
    elif isinstance(value, float) and value != value or value in (float("inf"), float("-inf")):
        text = repr(value)  # inf, -inf, nan (JSON would say Infinity)
    else:
        try:
            text = json.dumps(value, ensure_ascii=False, default=str)
        except (TypeError, ValueError):
            text = repr(value)
    return text if len(text) <= limit else text[: limit - 3] + "..."
