"""Which option names hold secrets: never hashed, never written to a manifest, never printed."""

from __future__ import annotations

import re

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
