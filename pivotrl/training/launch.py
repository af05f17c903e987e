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

Launch config keys (a mapping, e.g. the ``launch`` section of a run config)::

    launcher: inprocess | torchrun | deepspeed   (default: inprocess when world size is 1, else torchrun)
    nnodes: 1            nproc_per_node: 1        node_rank: 0
    world_size: (optional; must equal nnodes × nproc_per_node)
    master_addr: 127.0.0.1                        master_port: 29500
    hostfile: null       no_ssh: false            omp_num_threads: 1

Both multi-process launchers set ``OMP_NUM_THREADS`` (default 1) for the ranks.
"""

from __future__ import annotations

import argparse
import importlib
import json
import os
import subprocess
import sys
import tempfile
from dataclasses import fields, is_dataclass
from pathlib import Path
from typing import Any, Mapping, Sequence, TypeVar

from pivotrl.errors import ConfigError, TrainingError

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
ENTRIES = ("sft", "pivotrl", "rl_stage")
_KEYS = ("launcher", "world_size", "nnodes", "nproc_per_node", "node_rank", "master_addr", "master_port", "hostfile", "no_ssh", "omp_num_threads")

S = TypeVar("S")


class LaunchConfig:
    """Validated launch settings (see the module docstring for the keys and defaults)."""

    def __init__(self, cfg: Mapping[str, Any]) -> None:
        unknown = sorted(set(cfg) - set(_KEYS))
        if unknown:
            raise ConfigError(f"unknown launch key(s) {unknown}; valid: {', '.join(_KEYS)}")
        self.nnodes = self._int(cfg, "nnodes", 1, 1)
        self.nproc_per_node = self._int(cfg, "nproc_per_node", 1, 1)
        self.node_rank = self._int(cfg, "node_rank", 0, 0)
        if self.node_rank >= self.nnodes:
            raise ConfigError(f"launch.node_rank={self.node_rank} must be < nnodes={self.nnodes}")
        self.master_addr = str(cfg.get("master_addr", "127.0.0.1"))
        self.master_port = self._int(cfg, "master_port", 29500, 1)
        self.hostfile = cfg.get("hostfile")
        self.no_ssh = bool(cfg.get("no_ssh", False))
        self.omp_num_threads = self._int(cfg, "omp_num_threads", 1, 1)
        if "world_size" in cfg and cfg["world_size"] != self.world_size:
            raise ConfigError(
                f"launch.world_size={cfg['world_size']!r} must equal nnodes × nproc_per_node = "
                f"{self.nnodes} × {self.nproc_per_node} = {self.world_size}"
            )
        default = "inprocess" if self.world_size == 1 else "torchrun"
        self.launcher = str(cfg.get("launcher", default))
        if self.launcher not in LAUNCHERS:
            raise ConfigError(f"launch.launcher must be one of {LAUNCHERS}, got {self.launcher!r}")
        if self.launcher == "inprocess" and self.world_size != 1:
            raise ConfigError(
                f"launch.launcher='inprocess' runs one process, but nnodes × nproc_per_node = {self.world_size}; "
                "use 'torchrun' or 'deepspeed'"
            )

    @staticmethod
    def _int(cfg: Mapping[str, Any], key: str, default: int, lo: int) -> int:
        v = cfg.get(key, default)
        if isinstance(v, bool) or not isinstance(v, int) or v < lo:
            raise ConfigError(f"launch.{key} must be an integer >= {lo}, got {v!r}")
        return v

    @property
    def world_size(self) -> int:
        return self.nnodes * self.nproc_per_node


def _module(entry: str) -> str:
    if entry not in ENTRIES:
        raise ConfigError(f"unknown trainer entry {entry!r}; valid: {', '.join(ENTRIES)}")
    return f"pivotrl.training.{entry}"


def render_launch_command(
    cfg: Mapping[str, Any], *, entry: str, spec_path: str | os.PathLike[str], python: str | None = None
) -> list[str]:
    """The argv that runs ``pivotrl.training.<entry> --spec <spec_path>`` under the configured launcher.

    Pure: nothing is started. ``python`` defaults to this interpreter. For ``"inprocess"`` the
    command is the plain single-process equivalent (``python -m pivotrl.training.<entry> ...``).
    Raises ConfigError for an unknown entry or bad launch keys.
    """
    lc = LaunchConfig(cfg)
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


def launch_env(cfg: Mapping[str, Any], base: Mapping[str, str] | None = None) -> dict[str, str]:
    """Environment for the launched ranks: ``base`` (default os.environ) + OMP_NUM_THREADS.

    Launcher variables of this process (RANK, WORLD_SIZE, ...) are removed so the child launcher
    sets its own.
    """
    lc = LaunchConfig(cfg)
    env = dict(os.environ if base is None else base)
    for key in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(key, None)
    env["OMP_NUM_THREADS"] = str(lc.omp_num_threads)
    return env


def launch(
    cfg: Mapping[str, Any],
    *,
    entry: str,
    spec: Mapping[str, Any],
    workdir: str | os.PathLike[str],
    timeout_s: float | None = None,
) -> int:
    """Write ``spec`` to ``<workdir>/<entry>-spec.json`` and run the entry under the configured launcher.

    ``"inprocess"`` calls ``pivotrl.training.<entry>.main`` here; the others run the rendered
    command as a subprocess (its output goes to ``<workdir>/<entry>-launch.log``). Returns 0.
    Raises TrainingError (naming the log file) if the run fails or exceeds ``timeout_s``.
    """
    lc = LaunchConfig(cfg)
    wd = Path(workdir)
    wd.mkdir(parents=True, exist_ok=True)
    spec_path = wd / f"{entry}-spec.json"
    fd, tmp = tempfile.mkstemp(prefix=f".{entry}-spec.", dir=wd)
    with os.fdopen(fd, "w") as f:
        json.dump(dict(spec), f, indent=2, sort_keys=True)
    os.replace(tmp, spec_path)
    if lc.launcher == "inprocess":
        mod = importlib.import_module(_module(entry))
        return int(mod.main(["--spec", str(spec_path)]))
    cmd = render_launch_command(cfg, entry=entry, spec_path=spec_path)
    log_path = wd / f"{entry}-launch.log"
    with open(log_path, "w") as log:
        try:
            proc = subprocess.run(cmd, stdout=log, stderr=subprocess.STDOUT, env=launch_env(cfg), timeout=timeout_s)
        except subprocess.TimeoutExpired:
            raise TrainingError(f"{entry} launch exceeded {timeout_s} s; see {log_path}") from None
    if proc.returncode != 0:
        raise TrainingError(f"{entry} launch exited with {proc.returncode}; see {log_path}")
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


def launch_settings(training: Mapping[str, Any]) -> dict[str, Any]:
    """The launch keys of a run config's ``training`` section (a dict), for :class:`LaunchConfig`."""
    return {k: training[k] for k in _KEYS if k in training}
