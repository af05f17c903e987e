"""Launching a trainer entry point: ``python -m pivotrl.training.<entry> --spec <json file>``.

Three launchers, chosen by ``launcher`` in the launch config:

* ``"inprocess"``: call the entry's ``main`` in this process (world size 1 only). The process
  group is created by the trainer itself (see ``deepspeed_utils.ensure_dist_env``).
* ``"torchrun"``: ``python -m torch.distributed.run`` with ``nnodes``, ``nproc_per_node``,
  ``node_rank``, ``master_addr``, ``master_port`` (run the same command on every node, each with
  its own ``node_rank``).
* ``"deepspeed"``: ``python -m deepspeed.launcher.runner``; with a ``hostfile`` it starts every
  node itself (over ssh, or ``no_ssh: true`` to run this node only with ``node_rank``), without
  one it runs ``nproc_per_node`` local ranks.

The launch settings are a :class:`LaunchConfig`, built from the validated ``training`` section of
a run config (``launcher``, ``nnodes``, ``nproc_per_node``, ``master_addr``, ``master_port``,
``hostfile``; the schema checks them, nothing here checks them again) plus what only the node
running the command knows: ``node_rank`` (default 0), ``no_ssh`` (default false) and
``omp_num_threads`` (default 1).

Both multi-process launchers set ``OMP_NUM_THREADS`` (default 1) for the ranks.
"""

from __future__ import annotations

import argparse
import importlib
import json
import os
import subprocess
import sys
from dataclasses import dataclass, fields, is_dataclass
from pathlib import Path
from typing import Any, Mapping, Sequence, TypeVar

from pivotrl.config import TrainingSection

from pivotrl.core.errors import ConfigError, TrainingError
from pivotrl.storage.files import atomic_file

__all__ = [
    "ENTRIES",
    "LAUNCHERS",
    "LaunchConfig",
    "launch",
    "launch_env",
    "read_spec",
    "render_launch_command",
]

LAUNCHERS = ("inprocess", "torchrun", "deepspeed")
#: Process entries a launcher can start, by name: the module run with ``python -m`` on every rank.
ENTRIES = {"sft": "pivotrl.training.sft", "offline": "pivotrl.training.offline",
           "rl_stage": "pivotrl.pipeline.rl_stage"}

S = TypeVar("S")


@dataclass(frozen=True)
class LaunchConfig:
    """How to start the ranks: the launch keys of a validated ``training`` section (see
    :meth:`of`) and this node's ``node_rank``, ``no_ssh`` and ``omp_num_threads``."""

    launcher: str = "inprocess"
    nnodes: int = 1
    nproc_per_node: int = 1
    master_addr: str = "127.0.0.1"
    master_port: int = 29500
    hostfile: str | None = None
    node_rank: int = 0
    no_ssh: bool = False
    omp_num_threads: int = 1

    def __post_init__(self) -> None:
        # node_rank is not a config field: it is the one value checked here.
        if not 0 <= self.node_rank < self.nnodes:
            raise ConfigError(f"launch node_rank={self.node_rank} must be in [0, nnodes={self.nnodes})")

    @classmethod
    def of(cls, training: TrainingSection, *, node_rank: int = 0, no_ssh: bool = False,
           omp_num_threads: int = 1, **overrides: Any) -> LaunchConfig:
        """The launch settings of a validated ``training`` section; ``overrides`` replace its launch
        keys (e.g. ``launcher="torchrun", hostfile=None`` to render another launcher's command)."""
        keys = dict(launcher=training.launcher, nnodes=training.nnodes, nproc_per_node=training.nproc_per_node,
                    master_addr=training.master_addr, master_port=training.master_port, hostfile=training.hostfile)
        keys.update(overrides)
        return cls(**keys, node_rank=node_rank, no_ssh=no_ssh, omp_num_threads=omp_num_threads)

    @classmethod
    def from_keys(cls, **keys: Any) -> LaunchConfig:
        """The launch settings from ``training`` section keys (validated by the schema; the unset
        ones take its defaults) and the node keys ``node_rank``, ``no_ssh``, ``omp_num_threads``.

        Raises ConfigError naming every bad key."""
        from pivotrl.training.settings import training_section

        node = {k: keys.pop(k) for k in ("node_rank", "no_ssh", "omp_num_threads") if k in keys}
        return cls.of(training_section(**keys), **node)

    @property
    def world_size(self) -> int:
        return self.nnodes * self.nproc_per_node


def _module(entry: str) -> str:
    if entry not in ENTRIES:
        raise ConfigError(f"unknown trainer entry {entry!r}; valid: {', '.join(ENTRIES)}")
    return ENTRIES[entry]


def render_launch_command(
    lc: LaunchConfig, *, entry: str, spec_path: str | os.PathLike[str], python: str | None = None
) -> list[str]:
    """The argv that runs ``pivotrl.training.<entry> --spec <spec_path>`` under the configured launcher.

    Pure: nothing is started. ``python`` defaults to this interpreter. For ``"inprocess"`` the
    command is the plain single-process equivalent (``python -m pivotrl.training.<entry> ...``).
    Raises ConfigError for an unknown entry.
    """
    py = python or sys.executable
    target = ["-m", _module(entry), "--spec", str(spec_path)]
    if lc.launcher == "inprocess":
        return [py, *target]
    if lc.launcher == "torchrun":
        return [
            py,
            "-m",
            "torch.distributed.run",
            f"--nnodes={lc.nnodes}",
            f"--nproc-per-node={lc.nproc_per_node}",
            f"--node-rank={lc.node_rank}",
            f"--master-addr={lc.master_addr}",
            f"--master-port={lc.master_port}",
            *target,
        ]
    cmd = [py, "-m", "deepspeed.launcher.runner"]
    if lc.hostfile:
        cmd += [f"--hostfile={lc.hostfile}", f"--num_nodes={lc.nnodes}"]
        if lc.no_ssh:
            cmd += ["--no_ssh", f"--node_rank={lc.node_rank}"]
    cmd += [
        f"--num_gpus={lc.nproc_per_node}",
        f"--master_addr={lc.master_addr}",
        f"--master_port={lc.master_port}",
        "--module",
        _module(entry),
        "--spec",
        str(spec_path),
    ]
    return cmd


def launch_env(lc: LaunchConfig, base: Mapping[str, str] | None = None) -> dict[str, str]:
    """Environment for the launched ranks: ``base`` (default os.environ) + OMP_NUM_THREADS.

    Launcher variables of this process (RANK, WORLD_SIZE, ...) are removed so the child launcher
    sets its own.
    """
    env = dict(os.environ if base is None else base)
    for key in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(key, None)
    env["OMP_NUM_THREADS"] = str(lc.omp_num_threads)
    return env


def launch(
    lc: LaunchConfig,
    *,
    entry: str,
    spec: Mapping[str, Any],
    workdir: str | os.PathLike[str],
    timeout_s: float | None = None,
    stream: bool = False,
) -> int:
    """Write ``spec`` to ``<workdir>/<entry>-spec.json`` and run the entry under the configured launcher.

    ``"inprocess"`` calls ``pivotrl.training.<entry>.main`` here; the others run the rendered
    command as a subprocess, whose output goes to ``<workdir>/<entry>-launch.log`` (``stream``:
    to this process's stdout instead). Returns 0. Raises TrainingError (naming the log file, or
    saying the output is above) if the run fails or exceeds ``timeout_s``.
    """
    wd = Path(workdir)
    wd.mkdir(parents=True, exist_ok=True)
    spec_path = wd / f"{entry}-spec.json"
    with atomic_file(spec_path) as tmp:
        tmp.write_text(json.dumps(dict(spec), indent=2, sort_keys=True))
    if lc.launcher == "inprocess":
        mod = importlib.import_module(_module(entry))
        return int(mod.main(["--spec", str(spec_path)]))
    cmd = render_launch_command(lc, entry=entry, spec_path=spec_path)
    log_path = wd / f"{entry}-launch.log"
    where = "its output is above" if stream else f"see {log_path}"
    with open(os.devnull if stream else log_path, "w") as log:
        try:
            proc = subprocess.run(cmd, stdout=None if stream else log, stderr=subprocess.STDOUT,
                                  env=launch_env(lc), timeout=timeout_s)
        except subprocess.TimeoutExpired:
            raise TrainingError(f"{entry} launch exceeded {timeout_s} s; {where}") from None
    if proc.returncode != 0:
        raise TrainingError(f"{entry} launch exited with {proc.returncode}; {where}")
    return 0


def read_spec(argv: Sequence[str] | None, spec_cls: type[S]) -> S:
    """Parse ``--spec <json file>`` and build ``spec_cls`` (a dataclass) from it.

    Raises ConfigError naming the file and the unknown or missing keys.
    """
    parser = argparse.ArgumentParser()
    parser.add_argument("--spec", required=True, help="JSON file with the run's spec")
    parser.add_argument("--local_rank", type=int, default=None, help=argparse.SUPPRESS)  # deepspeed launcher
    args = parser.parse_args(argv)
    path = Path(args.spec)
    try:
        raw = json.loads(path.read_text())
    except (OSError, json.JSONDecodeError) as err:
        raise ConfigError(f"cannot read spec {path}: {err}") from err
    if not is_dataclass(spec_cls):
        raise TypeError(f"{spec_cls!r} is not a dataclass")
    names = {f.name for f in fields(spec_cls)}
    unknown = sorted(set(raw) - names)
    if unknown:
        raise ConfigError(f"spec {path}: unknown key(s) {unknown}; valid: {', '.join(sorted(names))}")
    try:
        return spec_cls(**raw)
    except TypeError as err:
        raise ConfigError(f"spec {path}: {err}") from None
