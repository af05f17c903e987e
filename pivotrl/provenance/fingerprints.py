"""Short content hashes of what decides a reward and what the model sees, recorded at probing time
and compared again on export (``pivotrl pivots export``) and in tracker tags.

* :func:`verifier_hash`: the verifier's name and config section, and the code of the verifiers and
  everything they import (parsers, action format, environments) — a change to any of them can
  change a reward;
* :func:`verifier_code_hash`: the source part alone;
* :func:`chat_template_hash`: the tokenizer's chat template string and pivotrl's prompt settings
  (``prompt`` section) — together they fix the tokens of a rendered state.

All return 16 hex digits of a sha256. And the identity of what a run reads from outside its config:

* :func:`path_fingerprint`: size, modification time and ETag of the files behind a URL;
* :func:`inputs_fingerprint`: the model source, every demonstration file, the chat template and the
  dtype ``model.dtype`` resolves to on this machine.
"""

from __future__ import annotations

import hashlib
import os
from typing import Any, Mapping

import fsspec

from pivotrl.provenance.code_digest import module_digest
from pivotrl.config import RunConfig
from pivotrl.core.hashing import canonical_json
from pivotrl.runtime.precision import run_precision

__all__ = ["verifier_code_hash", "verifier_hash", "chat_template_hash", "capture_hashes", "inputs_fingerprint",
           "path_fingerprint"]


def verifier_code_hash() -> str:
    """The digest of the verifiers' code (16 hex): the import closure of ``pivotrl.verifiers`` —
    the acceptance rules, the tool-call parsers and action format they read samples with, the
    environments they execute in (:func:`pivotrl.provenance.code_digest.module_digest`)."""
    return module_digest("pivotrl.verifiers")[:16]


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


def path_fingerprint(url: str, storage_options: dict[str, Any] | None = None) -> dict[str, Any]:
    """A cheap identity of a file or directory at ``url``: size, modification time and ETag of each
    file (sorted), never its bytes. Changes whenever the content is replaced in place. A URL that
    does not exist, or a non-path string (an HF repo id, ``pypi:<pinned wheel>``), is returned as is
    (pinned sources are identified by their pin)."""
    if url.startswith("pypi:"):
        return {"source": url}
    try:
        fs, path = fsspec.core.url_to_fs(os.path.expanduser(url), **(storage_options or {}))
        if not fs.exists(path):
            return {"source": url}
        infos = fs.find(path, detail=True, withdirs=False) if fs.isdir(path) else {path: fs.info(path)}
    except Exception:  # not something fsspec can look at: identified by its string
        return {"source": url}
    keep = ("size", "mtime", "LastModified", "ETag", "created")
    return {"source": url,
            "files": {str(k)[len(str(path)):] or ".": {f: str(v[f]) for f in keep if v.get(f) is not None}
                      for k, v in sorted(infos.items())}}


def inputs_fingerprint(cfg: RunConfig) -> dict[str, Any]:
    """Identity of everything a run reads from outside its config: the model source and every
    demonstration file (see :func:`path_fingerprint`) — and the compute dtype ``model.dtype`` resolves
    to on this machine (``auto`` is bf16 on one machine and fp32 on another; results differ)."""
    return {
        "precision": run_precision(cfg).dtype,
        "model": path_fingerprint(cfg.model.source),
        "data": [path_fingerprint(s.url) if s.kind == "chat" else {"source": f"bfcl:{','.join(s.categories)}"}
                 for s in cfg.data.sources],
        "chat_template": path_fingerprint(cfg.prompt.chat_template) if cfg.prompt.chat_template else None,
    }
