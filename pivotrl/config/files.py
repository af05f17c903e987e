"""The files a run config names, checked on the machine that runs it (``pivotrl config``, and the
pre-run check of ``pivotrl run``/``probe``/``compare``): the config's schema cannot, since a config
is validated on other machines too.

Covered here: ``prompt.chat_template`` (a local Jinja file) and ``training.hostfile`` (a DeepSpeed
hostfile: ``<host> slots=<n>`` a line, ``#`` comments; as many hosts as ``training.nnodes`` and
``training.nproc_per_node`` slots on each). The model source and the ``data.sources`` are checked
by :func:`pivotrl.runtime.models.check_model_source` and :func:`pivotrl.data.sources.check_sources_exist`.
"""

from __future__ import annotations

import os
import re
from typing import Any

#: A documented hostfile to copy (infra/README.md, "Training on several machines").
HOSTFILE_EXAMPLE = "infra/multinode/hostfile.example"
_HOST_LINE = re.compile(r"^(\S+)\s+slots=(\d+)\s*$")


def _local(path: str) -> str | None:
    """The local path of ``path``, or None for a URL (checked where it is read)."""
    return None if "://" in path else os.path.expanduser(path)


def _not_found(local: str, what: str = "") -> str:
    """``no such file`` with ``what`` the file is and, for a relative path, the directory it was
    resolved against: ``no such file (a Jinja chat template; a relative path, resolved against …)``."""
    from pivotrl.storage.files import relative_note

    notes = [n for n in (what, relative_note(local)) if n]
    return "no such file" + (f" ({'; '.join(notes)})" if notes else "")


def hostfile_problems(path: str, nnodes: int, nproc_per_node: int) -> list[str]:
    """What is wrong with the DeepSpeed hostfile at ``path`` for ``nnodes`` × ``nproc_per_node``
    ranks: [] when nothing is. Each problem is one line starting ``training.hostfile = '<path>'``."""
    head = f"training.hostfile = {path!r}"
    local = _local(path)
    if local is None:
        return []
    if not os.path.isfile(local):
        what = "a directory, not a file" if os.path.isdir(local) else _not_found(local)
        return [f"{head}: {what}; the DeepSpeed launcher reads the nodes from it ('<host> slots=<GPUs>' a line): "
                f"copy {HOSTFILE_EXAMPLE} to {path} and list your {nnodes} node(s)"]
    try:
        with open(local, encoding="utf-8") as f:
            text = f.read()
    except (OSError, UnicodeDecodeError) as e:
        return [f"{head}: cannot read it ({e})"]
    hosts: list[tuple[int, str, int]] = []
    bad: list[str] = []
    for n, raw in enumerate(text.splitlines(), 1):
        line = raw.split("#", 1)[0].strip()
        if not line:
            continue
        m = _HOST_LINE.match(line)
        if m is None:
            bad.append(f"{head} line {n}: {line!r} is not '<host> slots=<n>'")
        else:
            hosts.append((n, m.group(1), int(m.group(2))))
    if bad:
        return bad
    problems = []
    if len(hosts) != nnodes:
        problems.append(f"{head}: lists {len(hosts)} host(s), but training.nnodes = {nnodes}")
    names = [h for _, h, _ in hosts]
    for h in sorted({h for h in names if names.count(h) > 1}):
        problems.append(f"{head}: host {h!r} is listed {names.count(h)} times")
    for n, h, slots in hosts:
        if slots != nproc_per_node:
            problems.append(f"{head} line {n}: {h} has slots={slots}, but training.nproc_per_node = {nproc_per_node}")
    return problems


def named_file_problems(cfg: Any) -> list[str]:
    """Every problem with a local file ``cfg`` names (module docstring), one line each; [] if none."""
    problems: list[str] = []
    template = cfg.prompt.chat_template
    if template and (local := _local(template)) is not None and not os.path.isfile(local):
        problems.append(f"prompt.chat_template = {template!r}: {_not_found(local, 'a Jinja chat template')}")
    tr = cfg.training
    if tr.hostfile:
        problems += hostfile_problems(tr.hostfile, tr.nnodes, tr.nproc_per_node)
    return problems
