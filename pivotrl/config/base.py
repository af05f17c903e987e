"""Base of the config schema: the Section model, strict numbers, credential names, rule errors."""

from __future__ import annotations

import json
import re
from typing import Annotated, Any

from pydantic import BaseModel, BeforeValidator, ConfigDict
from pydantic_core import PydanticCustomError


def _reject_bool(value: Any) -> Any:
    # YAML `true` would otherwise be read as the number 1.
    if isinstance(value, bool):
        raise PydanticCustomError("bool_not_number", "must be a number, not true/false")
    return value


Int = Annotated[int, BeforeValidator(_reject_bool)]
Float = Annotated[float, BeforeValidator(_reject_bool)]

_CREDENTIAL_PARTS = frozenset({"secret", "password", "passwd", "token", "credential", "credentials", "sas"})
_CREDENTIAL_NAMES = frozenset({"key", "key_id", "access_key", "account_key", "private_key", "api_key", "apikey"})


def is_credential_key(name: str) -> bool:
    """True for option names that hold secrets (``secret``, ``aws_session_token``, ``key``, ``api_key``...).

    Names are split on ``_``/``-``; ``max_tokens`` is not a credential, ``session_token`` is.
    """
    lowered = str(name).lower()
    parts = re.split(r"[_\-.]", lowered)
    if lowered in _CREDENTIAL_NAMES or any(p in _CREDENTIAL_PARTS for p in parts):
        return True
    return any(lowered.endswith("_" + n) for n in _CREDENTIAL_NAMES)


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
