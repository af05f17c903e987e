"""The config a run computes with, prepared the same way by every entry point.

The nightly and probe flows, ``pivotrl compare`` and the multi-node launcher
(``infra/multinode/launch_train.py prepare``) all start from :func:`prepared_config`, so the same
config file and overrides give the same stage keys — and the same artifacts — whichever of them ran.
The command line loads and validates the config once, checks it before anything starts, and hands
the validated RunConfig to :func:`prepared_config` (``loaded``, ``checked``), whose result it passes on
to the flow: the file is read and validated once per command.
"""

from __future__ import annotations

from typing import Any, Callable, Sequence

from pivotrl.config import RunConfig, load_config
from pivotrl.runtime.sizing import sized_config
from pivotrl.storage.check import check_cache_dir, check_sources, check_storage


def prepared_config(config_path: str | None, overrides: Sequence[str] | None = None, *,
                    loaded: RunConfig | None = None, checked: bool = False,
                    echo: Callable[[str], Any] | None = print) -> RunConfig:
    """The validated config at ``config_path`` with ``--set``-style ``overrides``, after checking its
    storage root and its remote demonstration sources (credentials, endpoint, bucket, read and write
    access; StorageAccessError, never retried) and that the local cache folder takes a write, sized to this
    machine (``run.sizing``, :func:`pivotrl.runtime.sizing.sized_config`; ``echo`` prints the decision).

    ``loaded``: that config already loaded and validated (``load_config(config_path, overrides)``),
    which is then not read again; ``checked``: its storage root, cache folder and sources were
    already checked (the command line's preflight), which are then not checked again. The overrides
    still name the keys the sizing leaves as given.

    Raises ConfigError naming the key and file line of an invalid value, StorageAccessError for a
    storage root that cannot work.
    """
    cfg = loaded if loaded is not None else load_config(config_path, list(overrides or []))
    if not checked:
        check_storage(cfg.run.storage_root, cfg.run.storage_options)
        check_cache_dir(cfg.run.local_cache())  # the calibration below is written there
        check_sources(cfg.data.sources)  # remote chat sources: credentials, endpoint, read access
    return sized_config(cfg, list(overrides or []), echo=echo)
