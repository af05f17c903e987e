"""Reading and writing demonstrations (OpenAI chat + tools format) at any fsspec URL.

Formats, chosen by the file name:

* JSON Lines (``.jsonl``, ``.json``, optionally compressed, e.g. ``.jsonl.gz``): one
  :meth:`Trajectory.to_dict`-shaped object per line (``id``, ``messages``, ``tools``, and optionally
  ``source``, ``category``, ``env``, ``meta``); blank lines are skipped.
* Parquet (``.parquet``, ``.pq``): one row per trajectory, columns ``id``, ``messages`` and
  optionally ``tools``, ``source``, ``category``, ``env``, ``meta``; the structured columns hold either
  a JSON string or the nested value itself.

Every record is checked (:func:`validate_trajectory`, then the audit of
:func:`pivotrl.data.audit.audit_chat_record`: no NaN/Infinity, actions parse, JSON-Schema tools and
arguments). A bad record raises DataError naming the
file, the record (line number or row, and id when known) and the field; with
``on_invalid="quarantine"`` it is skipped instead and described in the ``quarantine`` list.
"""

from __future__ import annotations

import codecs
import json
import logging
import os
import re
from typing import Any, Iterable, Iterator, Literal

import fsspec

from pivotrl.format.actions import is_action_name
from pivotrl.data.audit import audit_chat_record
from pivotrl.data.schema import Trajectory
from pivotrl.core.hashing import json_problem
from pivotrl.core.errors import ConfigError, DataError, SourceNotFoundError, StorageAccessError, StorageError
from pivotrl.data.nemo import is_nemo_row, row_to_record

__all__ = ["check_sources_exist", "load_trajectories", "save_trajectories_jsonl", "validate_trajectory"]

log = logging.getLogger(__name__)

OnInvalid = Literal["error", "quarantine"]
_PARQUET_SUFFIXES = (".parquet", ".pq")
_JSON_COLUMNS = ("messages", "tools", "env", "meta")

#: Largest record (bytes of one JSON line, or of a Parquet row's ``messages`` JSON, or of a
#: trajectory's canonical JSON in the trajectory table) a demonstration may have. Parsing a record
#: takes several times its size in memory and the trajectory table keeps it as one Arrow string;
#: a bigger record is a DataError naming the file and record, read no further.
MAX_RECORD_BYTES = 256 << 20
_LEADING_ID = re.compile(rb'\A\s*\{\s*"id"\s*:\s*(?:"((?:[^"\\]|\\.){0,200})"|(\d{1,40}))')


def check_sources_exist(sources: Iterable[Any]) -> None:
    """Cheap check of the ``data.sources`` of a config before a run starts: every ``chat`` source
    on the local file system (a path or a ``file://`` URL) must be an existing file. Remote URLs
    (``s3://`` …) and BFCL sources pass; they are read, and checked, by the demonstrations stage.

    Raises:
        SourceNotFoundError: naming every missing source (``data.sources[i]``) and its URL, one a line.
    """
    missing = []
    for i, src in enumerate(sources):
        url = getattr(src, "url", None)
        if getattr(src, "kind", None) != "chat" or not url:
            continue
        protocol, path = fsspec.core.split_protocol(url)
        if protocol not in (None, "file", "local"):
            continue
        local = os.path.expanduser(path if protocol is None else fsspec.core.strip_protocol(url))
        if not os.path.isfile(local):
            what = "is a directory, not a file" if os.path.isdir(local) else f"no such file{_relative(local)}"
            missing.append(f"data.sources[{i}] (chat): {url}: {what}")
    if missing:
        raise SourceNotFoundError("\n".join(missing))


def _relative(url: str) -> str:
    """`` (a relative path, resolved against the current directory …)`` for a relative local ``url``."""
    from pivotrl.storage.files import relative_note

    note = "" if "://" in url else relative_note(url)
    return f" ({note})" if note else ""


def _too_big(url: str, loc: str, size: int, rid: str = "") -> DataError:
    return DataError(f"{url} {loc}{f' {rid!r}' if rid else ''}: the record is {size / 2**20:.0f} MiB, more than "
                     f"the {MAX_RECORD_BYTES / 2**20:.0f} MiB one demonstration may hold; split it into "
                     "shorter trajectories")


def validate_trajectory(traj: Trajectory, where: str = "") -> None:
    """Check the invariants every demonstration must hold; DataError naming ``where`` and the field.

    * at least one message and at least one assistant message (else nothing to learn from);
    * every tool message answers an earlier assistant tool call (``tool_call_id`` matches a call id);
    * every called tool is one of the trajectory's ``tools``;
    * tool-call ids are unique within the trajectory;
    * every tool name can be written in the action format (:func:`pivotrl.format.actions.is_action_name`);
    * every answer rule in ``meta`` (``answer_rule``, ``answer_rules``) is well formed
      (:func:`pivotrl.data.text_rules.validate_rule`: keys, types, regular expressions).
    """
    from pivotrl.data.text_rules import validate_rule

    where = where or f"trajectory {traj.id!r}"
    if not traj.messages:
        raise DataError(f"{where}.messages: empty trajectory")
    if not any(m.role == "assistant" for m in traj.messages):
        raise DataError(f"{where}.messages: no assistant message (nothing to learn from)")
    for k, t in enumerate(traj.tools):
        if not is_action_name(t.name):
            raise DataError(
                f"{where}.tools[{k}].function.name: {t.name!r} cannot be written as an action "
                "(identifiers joined by dots only)"
            )
    tool_names = {t.name for t in traj.tools}
    call_ids: set[str] = set()
    for i, m in enumerate(traj.messages):
        for j, c in enumerate(m.tool_calls):
            if not tool_names:
                raise DataError(f"{where}.tools: missing or empty, but messages[{i}].tool_calls[{j}] calls {c.name!r}")
            if c.name not in tool_names:
                raise DataError(
                    f"{where}.messages[{i}].tool_calls[{j}].function.name: {c.name!r} is not one of the "
                    f"trajectory's tools ({len(tool_names)} declared)"
                )
            if c.id:
                if c.id in call_ids:
                    raise DataError(f"{where}.messages[{i}].tool_calls[{j}].id: duplicate call id {c.id!r}")
                call_ids.add(c.id)
        if m.role == "tool" and m.tool_call_id not in call_ids:
            raise DataError(
                f"{where}.messages[{i}].tool_call_id: {m.tool_call_id!r} does not match any earlier tool call"
            )
    meta = traj.meta or {}
    if meta.get("answer_rule") is not None:
        validate_rule(meta["answer_rule"], f"{where}.meta.answer_rule")
    rules = meta.get("answer_rules")
    if rules is not None:
        if not isinstance(rules, dict):
            raise DataError(f"{where}.meta.answer_rules: expected an object of turn index -> rule")
        for turn, rule in rules.items():
            validate_rule(rule, f"{where}.meta.answer_rules.{turn}")


def _field_of(message: str, where: str) -> str:
    """The field path of a DataError message that starts with ``where`` (``"record"`` if none)."""
    rest = message[len(where):] if message.startswith(where) else ""
    rest = re.sub(r"^ \(id '[^']*'\)|^ '[^']*'", "", rest)
    head = rest.split(":", 1)[0] if ":" in rest else ""
    return head.strip().lstrip(".") or "record"


def _is_storage_failure(e: BaseException) -> bool:
    from pivotrl.core.retry import is_transient
    from pivotrl.storage.check import access_problem

    return access_problem(e) is not None or is_transient(e)


def _read_error(url: str, e: BaseException) -> StorageError:
    """The one-line error of a source that cannot be read: StorageAccessError (never retried) when
    the store refuses us (no credentials, access denied), else StorageError."""
    from pivotrl.storage.check import CREDENTIALS_HOW_TO, access_problem

    if (reason := access_problem(e)) is not None:
        return StorageAccessError(f"{url}: cannot read: access refused ({reason}); {CREDENTIALS_HOW_TO}")
    return StorageError(f"{url}: cannot read ({type(e).__name__}: {e})")


def _iter_jsonl(url: str) -> Iterator[tuple[str, str, Any]]:
    """Yield (record location, record id or "", decoded object or the DataError to report)."""
    try:
        with fsspec.open(url, "rb", compression="infer") as f:
            data = f.read()
    except FileNotFoundError:
        raise SourceNotFoundError(f"{url}: no such file{_relative(url)}") from None
    except Exception as e:  # noqa: BLE001 - OSError, or a driver's own (botocore's NoCredentialsError…)
        raise _read_error(url, e) from e
    # A UTF-8 byte-order mark (written by some Windows editors) starts the file, not its first record.
    data = data.removeprefix(codecs.BOM_UTF8)
    for lineno, raw in enumerate(data.split(b"\n"), start=1):
        if not raw.strip():
            continue
        loc = f"line {lineno}"
        if len(raw) > MAX_RECORD_BYTES:  # before decoding: json.loads would take ~10x this in memory
            m = _LEADING_ID.match(raw[:4096])
            rid = (m.group(1) or m.group(2) or b"").decode("utf-8", "replace") if m else ""
            yield loc, rid, _too_big(url, loc, len(raw), rid)
            continue
        try:
            text = raw.decode("utf-8")
        except UnicodeDecodeError as e:
            yield loc, "", DataError(f"{url} {loc}: not valid UTF-8 (byte {e.start} of the line)")
            continue
        try:
            obj = json.loads(text)
        except json.JSONDecodeError as e:
            yield loc, "", DataError(f"{url} {loc}: malformed JSON ({json_problem(e)})")
            continue
        except RecursionError:
            yield loc, "", DataError(f"{url} {loc}: JSON nested too deeply to read")
            continue
        rid = str(obj.get("id", "")) if isinstance(obj, dict) else ""
        yield loc, rid, obj


def _iter_parquet(url: str) -> Iterator[tuple[str, str, Any]]:
    import pyarrow.parquet as pq

    try:
        with fsspec.open(url, "rb") as f:
            table = pq.read_table(f)
    except FileNotFoundError:
        raise SourceNotFoundError(f"{url}: no such file{_relative(url)}") from None
    except Exception as e:  # noqa: BLE001 - pyarrow raises several types for unreadable files
        if _is_storage_failure(e):
            raise _read_error(url, e) from e
        raise DataError(f"{url}: not a readable Parquet file ({type(e).__name__}: {e})") from e
    missing = [c for c in ("id", "messages") if c not in table.column_names]
    if missing:
        raise DataError(f"{url}: Parquet column(s) {', '.join(missing)} missing (have {', '.join(table.column_names)})")
    for i, row in enumerate(table.to_pylist()):
        loc = f"row {i}"
        rid = "" if row.get("id") is None else str(row["id"])
        obj = dict(row)
        bad = None
        for col in _JSON_COLUMNS:
            v = obj.get(col)
            if isinstance(v, str) and len(v) > MAX_RECORD_BYTES:
                bad = _too_big(url, f"{loc} column {col}", len(v), rid)
                break
            if isinstance(v, str):
                try:
                    obj[col] = json.loads(v) if v.strip() else None
                except json.JSONDecodeError as e:
                    bad = DataError(f"{url} {loc} {rid!r}.{col}: malformed JSON ({json_problem(e)})")
                    break
                except RecursionError:
                    bad = DataError(f"{url} {loc} {rid!r}.{col}: JSON nested too deeply to read")
                    break
        yield loc, rid, bad if bad is not None else obj


def load_trajectories(
    url: str,
    on_invalid: OnInvalid = "error",
    quarantine: list[dict[str, Any]] | None = None,
    tool_parser: str = "pythonic",
) -> list[Trajectory]:
    """Read and validate demonstrations from a JSONL or Parquet file at an fsspec URL; every
    demonstration action must parse with ``tool_parser`` (the run's, see
    :func:`pivotrl.data.audit.audit_parser`).

    Returns the valid trajectories in file order. With ``on_invalid="error"`` the first bad record
    raises DataError (``"<url> line 7 (id 'x').messages[2].tool_call_id: ..."``); with
    ``"quarantine"`` bad records are skipped and described as ``{"source": url, "record": "line 7",
    "id": ..., "field": ..., "error": message}`` dicts appended to ``quarantine`` (their number is
    logged). Raises StorageError if the file cannot be read, ConfigError for a bad ``on_invalid``.
    """
    if on_invalid not in ("error", "quarantine"):
        raise ConfigError(f"on_invalid={on_invalid!r}: must be 'error' or 'quarantine'")
    path = url.lower()
    for ext in (".gz", ".bz2", ".xz", ".zst"):
        if path.endswith(ext):
            path = path[: -len(ext)]
    records = _iter_parquet(url) if path.endswith(_PARQUET_SUFFIXES) else _iter_jsonl(url)
    out: list[Trajectory] = []
    seen: dict[str, str] = {}
    n_bad = 0
    for loc, rid, obj in records:
        where = f"{url} {loc}"
        try:
            if isinstance(obj, DataError):
                raise obj
            if not isinstance(obj, dict):
                raise DataError(f"{where}: expected a JSON object, got {type(obj).__name__}")
            if is_nemo_row(obj):  # a NeMo Gym PivotRL row (e.g. from `pivotrl pivots export`)
                obj = row_to_record(obj, where)
            traj = Trajectory.from_dict(obj, where=where)
            validate_trajectory(traj, where=f"{where} {traj.id!r}")
            audit_chat_record(traj, where=f"{where} {traj.id!r}", tool_parser=tool_parser)
            if traj.id in seen:
                raise DataError(
                    f"{where} {traj.id!r}.id: duplicate trajectory id {traj.id!r} (first at {seen[traj.id]})"
                )
            seen[traj.id] = loc
        except RecursionError:
            err = DataError(f"{where}{f' {rid!r}' if rid else ''}: record nested too deeply to read")
            if on_invalid == "error":
                raise err from None
            n_bad += 1
            if quarantine is not None:
                quarantine.append({"source": url, "record": loc, "id": rid, "field": "record", "error": str(err)})
            continue
        except DataError as e:
            if on_invalid == "error":
                raise
            n_bad += 1
            msg = str(e)
            if quarantine is not None:
                quarantine.append(
                    {"source": url, "record": loc, "id": rid, "field": _field_of(msg, where), "error": msg}
                )
            continue
        out.append(traj)
    if n_bad:
        log.warning("%s: %d invalid record(s) quarantined, %d kept", url, n_bad, len(out))
    return out


def save_trajectories_jsonl(trajectories: Iterable[Trajectory], url: str) -> int:
    """Write trajectories as JSON Lines to an fsspec URL, atomically, streamed: a local path through
    :func:`pivotrl.storage.files.atomic_file` (temporary sibling, then rename), any other URL
    through the artifact store's publish (temporary key, then move). A reader sees the whole file
    or the previous one, never a part.

    Returns the number written. Raises StorageError naming the URL if the file cannot be written.
    """
    from pivotrl.storage import ArtifactStore
    from pivotrl.storage.files import atomic_file

    written = 0

    def lines() -> Iterator[bytes]:
        nonlocal written
        for t in trajectories:
            yield (json.dumps(t.to_dict(), ensure_ascii=False) + "\n").encode("utf-8")
            written += 1

    fs, path = fsspec.core.url_to_fs(url)
    protocols = fs.protocol if isinstance(fs.protocol, (tuple, list)) else (fs.protocol,)
    if "file" in protocols or "local" in protocols:
        try:
            with atomic_file(path) as tmp, open(tmp, "wb") as f:
                for line in lines():
                    f.write(line)
        except OSError as e:
            raise StorageError(f"{url}: cannot write ({e})") from e
        return written
    parent, _, name = url.rstrip("/").rpartition("/")
    if not name or not parent or parent.endswith(":/"):
        raise StorageError(f"{url}: not a file URL (expected <scheme>://<bucket or folder>/<name>.jsonl)")
    ArtifactStore(parent).write_bytes(name, lines())  # one attempt: the stream cannot be replayed
    return written
