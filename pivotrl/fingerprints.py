"""Short content hashes of what decides a reward and what the model sees, recorded at probing time
and compared again on export (``pivotrl pivots export``) and in tracker tags.

* :func:`verifier_hash`: the verifier's name and config section, and the source of the verifiers and
  the action parser — a change to any of them can change a reward;
* :func:`verifier_code_hash`: the source part alone;
* :func:`chat_template_hash`: the tokenizer's chat template string and pivotrl's prompt settings
  (``prompt`` section) — together they fix the tokens of a rendered state.

All return 16 hex digits of a sha256.
"""

from __future__ import annotations

import functools
import hashlib
from pathlib import Path
from typing import Any, Mapping

from pivotrl.data.schema import canonical_json

__all__ = ["verifier_code_hash", "verifier_hash", "chat_template_hash", "capture_hashes"]


@functools.lru_cache(maxsize=1)
def verifier_code_hash() -> str:
    """sha256 of the sources of ``pivotrl/verifiers/*.py`` and ``pivotrl/actions.py`` (16 hex)."""
    pkg = Path(__file__).resolve().parent
    digest = hashlib.sha256()
    for f in sorted((pkg / "verifiers").glob("*.py")) + [pkg / "actions.py"]:
        digest.update(f.name.encode() + b"\0" + f.read_bytes() + b"\0")
    return digest.hexdigest()[:16]


def verifier_hash(verifier_section: Mapping[str, Any], code_hash: str | None = None) -> str:
    """Hash of a verifier as configured (its config section as JSON) and coded (16 hex)."""
    payload = {"verifier": dict(verifier_section), "code": code_hash or verifier_code_hash()}
    return hashlib.sha256(canonical_json(payload).encode()).hexdigest()[:16]


def chat_template_hash(tokenizer: Any, prompt_section: Mapping[str, Any]) -> str:
    """Hash of ``tokenizer.chat_template`` (None → "") and the ``prompt`` config section (16 hex)."""
    template = getattr(tokenizer, "chat_template", None) or ""
    if not isinstance(template, str):  # a dict of named templates
        template = canonical_json(template)
    payload = {"chat_template": template, "prompt": dict(prompt_section)}
    return hashlib.sha256(canonical_json(payload).encode()).hexdigest()[:16]


def capture_hashes(cfg: Any, tokenizer: Any) -> dict[str, str]:
    """What a probe table's manifest records (``extra``) so that an export can check it later:
    ``verifier_hash``, ``verifier_code_hash``, ``chat_template_hash`` of a RunConfig + tokenizer."""
    return {"verifier_hash": verifier_hash(cfg.verifier.model_dump(mode="json")),
            "verifier_code_hash": verifier_code_hash(),
            "chat_template_hash": chat_template_hash(tokenizer, cfg.prompt.model_dump(mode="json"))}
