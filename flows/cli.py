"""The ``pivotrl`` command line.

    pivotrl run     --config configs/default.yaml [--set training.beta=0.01 ...]   the nightly flow
    pivotrl compare --config ... [--set ...] PivotRL vs SFT vs end-to-end RL from the same π_ref
    pivotrl probe   --config ...            demonstrations → warm start → probes → pivot set
    pivotrl demos   --config ... [--lengths] write demonstrations + candidates, print counts
    pivotrl config  --config ... [--set ...] validate and print the config a run here would use
    pivotrl lineage URI                     the tree of an artifact's inputs back to the raw sources
    pivotrl pivots diff A B                 states that entered/left between two pivot sets, and why
    pivotrl pivots export PIVOTS --out F    the pivot set as NeMo Gym PivotRL rows (flows/cli_records.py)
    pivotrl rollouts URI [--step N] [--state ID]  every sampled action, per step (flows/cli_records.py)
"""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any, Optional

import typer

app = typer.Typer(add_completion=False, no_args_is_help=True, help="PivotRL post-training pipeline.")


def _help_without_type_tags() -> None:
    """``--help`` as a person reads it: Typer 0.29 prints a ``<bool>`` beside every flag (``--help``
    included), ``<str>``/``<list[str]>`` beside every value, and a required argument as ``{uri}`` in
    the usage line. Flags get no tag, a value its metavar (``PATH``, ``KEY=VALUE``) when it has one
    and none otherwise, an argument its upper-case name (``URI``, as click writes it). Applied to
    Typer's parameter classes in this (command-line) process only; a Typer without these hooks is
    left as it is."""
    from typer import core

    def display_type_rich(self: Any, ctx: Any) -> str | None:
        if getattr(self, "is_flag", False) or getattr(self, "count", False):
            return None
        return self.metavar

    def usage_name(self: Any) -> str:
        name = (self.metavar or self.name or "").upper()
        name = name if self.required else f"[{name}]"
        return name + ("..." if self.nargs != 1 else "")

    for cls in (getattr(core, "TyperOption", None), getattr(core, "TyperArgument", None)):
        if cls is not None and hasattr(cls, "display_type_rich"):
            cls.display_type_rich = display_type_rich
    if hasattr(getattr(core, "TyperArgument", None), "_usage_display_name"):
        core.TyperArgument._usage_display_name = usage_name


_help_without_type_tags()


def _version(value: bool) -> None:
    if value:
        from importlib.metadata import version

        from pivotrl.storage import code_version

        typer.echo(f"pivotrl {version('pivotrl')} (code {code_version()})")
        raise typer.Exit()


@app.callback()
def _main(show_version: bool = typer.Option(False, "--version", callback=_version, is_eager=True,
                                            help="Print the version and exit.")) -> None:
    """PivotRL post-training pipeline."""

def _default_config() -> str:
    """``configs/default.yaml`` of the working directory when it has one, else the checkout's own
    (the embedded default config, wherever the command runs)."""
    here = Path("configs/default.yaml")
    shipped = Path(__file__).resolve().parents[1] / "configs" / "default.yaml"
    return str(here) if here.is_file() or not shipped.is_file() else str(shipped)


ConfigOpt = typer.Option(_default_config(), "--config", "-c", metavar="PATH",
                         help="YAML run config (path or fsspec URL).")
SetOpt = typer.Option(None, "--set", "-s", metavar="KEY=VALUE",
                      help="Override a config key: --set training.beta=0.01 (repeatable).")


def _load(config: str, overrides: Optional[list[str]]):
    from pivotrl.config import load_config
    from pivotrl.core.errors import ConfigError

    try:
        return load_config(config, overrides or [])
    except ConfigError as e:
        typer.echo(f"config error: {e}", err=True)
        raise typer.Exit(2)


def _prepared(config: str, overrides: Optional[list[str]], cfg) -> dict[str, Any]:
    """The config ``_load`` returned, already checked by ``_preflight``, prepared for a flow (sized to
    this machine: pivotrl.pipeline.prepare) as the JSON the flow's tasks take: the flow neither reads
    nor validates the file again."""
    from pivotrl.pipeline.prepare import prepared_config

    return prepared_config(config, overrides or [], loaded=cfg, checked=True,
                           echo=typer.echo).model_dump(mode="json")


def _preflight(cfg, storage: bool = True, model: bool = True) -> None:
    """Checks that need no stage to run: the model source (``model``), the local demonstration files and every
    other local file the config names (chat template, hostfile: pivotrl.config.files) exist, the local
    cache folder takes a write (pivotrl.storage.check.check_cache_dir), and
    (``storage``) the storage root's credentials, endpoint and bucket work and take a write, and the
    remote chat sources can be read (pivotrl.storage.check) — before Prefect starts."""
    from pivotrl.config.files import named_file_problems
    from pivotrl.data.sources import check_sources_exist
    from pivotrl.core.errors import ModelError, SourceNotFoundError, StorageError
    from pivotrl.runtime.models import check_model_source
    from pivotrl.storage.check import check_cache_dir, check_sources, check_storage

    problems = []
    try:
        if model:
            check_model_source(cfg.model.source)
    except ModelError as e:
        smoke = Path(cfg.model.source).as_posix().rstrip("/").endswith("runs/models/tiny")
        problems.append(f"model error: {e}" + ("\n(the smoke config's tiny model is created by `make smoke`)"
                                               if smoke else ""))
    try:
        check_sources_exist(cfg.data.sources)
    except SourceNotFoundError as e:
        problems += [f"data error: {line}" for line in str(e).splitlines()]
    problems += [f"config error: {line}" for line in named_file_problems(cfg)]  # chat template, hostfile
    try:  # downloads, converted models and the calibration (written before any stage, by the sizing)
        check_cache_dir(cfg.run.local_cache())
    except StorageError as e:
        problems.append(f"storage error: {e}")
    if problems:  # every missing input at once
        typer.echo("\n".join(problems), err=True)
        raise typer.Exit(2)
    if not storage:
        return
    try:
        check_storage(cfg.run.storage_root, cfg.run.storage_options)
    except StorageError as e:
        problems.append(f"storage error: {e}")
    try:  # remote chat sources (s3://…): credentials, endpoint, read access
        check_sources(cfg.data.sources)
    except StorageError as e:
        problems += [f"data error: {line}" for line in str(e).splitlines()]
    if problems:
        typer.echo("\n".join(problems), err=True)
        raise typer.Exit(2)


@app.command()
def run(config: str = ConfigOpt, overrides: Optional[list[str]] = SetOpt) -> None:
    """Run the whole nightly pipeline once, now, and print where the report is."""
    cfg = _load(config, overrides)
    _preflight(cfg)  # fail fast on a bad config, before Prefect starts
    _console(cfg)
    prepared = _prepared(config, overrides, cfg)
    t0 = time.time()
    result = _nightly()(config_path=config, overrides=overrides or [], config=prepared)
    typer.echo(f"\nPivotRL run finished in {time.time() - t0:.0f} s")
    typer.echo(f"report: {result['report_md']}")
    typer.echo(f"report data: {result['report_json']}")


def _console(cfg) -> None:
    """Precision line, clean stop on Ctrl-C/SIGTERM, one-line stage errors (pivotrl.pipeline.console)."""
    from pivotrl.pipeline.console import start_run_console

    start_run_console(cfg, typer.echo)


def _nightly():
    from pivotrl.flows.nightly import nightly

    return nightly


@app.command()
def compare(config: str = ConfigOpt, overrides: Optional[list[str]] = SetOpt) -> None:
    """PivotRL beside SFT and end-to-end RL baselines (shared stages cached); print the report."""
    cfg = _load(config, overrides)
    _preflight(cfg)
    _console(cfg)
    prepared = _prepared(config, overrides, cfg)
    from pivotrl.flows.compare import compare as compare_flow

    t0 = time.time()
    result = compare_flow(config_path=config, overrides=overrides or [], config=prepared)
    typer.echo("\n".join(result["report"]["claims"]))
    typer.echo(f"\ncomparison finished in {time.time() - t0:.0f} s\nreport: {result['report_md']}")


@app.command()
def probe(config: str = ConfigOpt, overrides: Optional[list[str]] = SetOpt) -> None:
    """Build the pivot set (no training) and print its statistics."""
    cfg = _load(config, overrides)
    _preflight(cfg)
    _console(cfg)
    prepared = _prepared(config, overrides, cfg)
    from pivotrl.flows.nightly import probe_only

    t0 = time.time()
    out = probe_only(config_path=config, overrides=overrides or [], config=prepared)
    typer.echo(out["summary_md"])
    typer.echo(f"pivots: {out['pivots']}\nprobes: {out['probes']}\nwall time: {time.time() - t0:.1f} s")


@app.command()
def demos(config: str = ConfigOpt, overrides: Optional[list[str]] = SetOpt,
          lengths: bool = typer.Option(False, help="Also report rendered state lengths in model tokens.")) -> None:
    """Write the demonstration set and candidate table to the storage root; print counts."""
    from pivotrl.pipeline.common import make_store
    from pivotrl.pipeline.demos import build_demonstrations

    cfg = _load(config, overrides)
    _preflight(cfg, model=lengths)  # as run and probe do; the model only when --lengths tokenizes with it
    store = make_store(cfg)
    out = build_demonstrations(cfg, store)
    typer.echo(json.dumps(out["counts"], indent=2))
    typer.echo(f"trajectories: {out['trajectories']}\ncandidates: {out['candidates']}")
    if out["quarantine"]:
        typer.echo(f"quarantine: {out['quarantine']}")
    if out.get("flagged"):
        typer.echo(f"flagged by the data audit ({out['counts']['flagged']}): {out['flagged']}")
    if lengths:
        typer.echo(json.dumps(_state_lengths(cfg, store, out["key"]), indent=2))


def _state_lengths(cfg: Any, store: Any, key: str) -> dict[str, Any]:
    import numpy as np

    from pivotrl.data.states import frame_to_states
    from pivotrl.runtime.models import load_tokenizer
    from pivotrl.pipeline.common import prompt_kwargs, resolve_base_model
    from pivotrl.pipeline.demos import cache_dir, category_name, read_histories
    from pivotrl.format.prompts import encode_state

    tok = load_tokenizer(resolve_base_model(cfg, cache_dir(cfg)))
    df = store.read_parquet(f"{key}/candidates.parquet")
    out: dict[str, Any] = {}
    for cat, g in df.groupby("category"):
        states = frame_to_states(g, read_histories(store, key, g["trajectory_id"]))
        n = [len(encode_state(s, tok, max_len=10**9, **prompt_kwargs(cfg))) for s in states]
        q = np.percentile(n, [0, 50, 90, 100])
        out[category_name(cat)] = {"states": len(n), "min": int(q[0]), "median": int(q[1]), "p90": int(q[2]),
                                   "max": int(q[3]), "over_context": int(sum(x > cfg.model.max_context for x in n))}
    return out


@app.command("config")
def show_config(config: str = ConfigOpt, overrides: Optional[list[str]] = SetOpt) -> None:
    """Validate a config and print the values a run on this machine would use, with its hash.

    Checks that the model source and the local demonstration files exist; sizes the config by
    run.sizing (the calibration kept in CACHE_DIR/calibration.json, or measured in about three seconds;
    the sizing line says which) and marks each scaled size with what the config said and why, and
    run.cache_dir with the folder in use when PIVOTRL_CACHE_DIR takes its place."""
    from pivotrl.config import config_hash, dump_config
    from pivotrl.pipeline.console import precision_lines
    from pivotrl.runtime.sizing import annotate_dump, apply_sizing

    cfg = _load(config, overrides)
    _preflight(cfg, storage=False)  # the model and local data files exist (the storage root is not touched)
    sized, sizing = apply_sizing(cfg, [o.split("=", 1)[0] for o in overrides or []])
    used, configured = cfg.run.local_cache(), Path(cfg.run.cache_dir).expanduser()
    notes = {"run.cache_dir": f"in use: {used} (PIVOTRL_CACHE_DIR takes its place)"} if used != configured else {}
    typer.echo(annotate_dump(dump_config(sized), sizing, notes))
    typer.echo(f"# {sizing.line()}")
    for line in precision_lines(sized, measure=False):
        typer.echo(f"# {line}")
    typer.echo(f"# config hash: {config_hash(sized)}"
               + (f" (as configured, before sizing: {config_hash(cfg)})" if sized is not cfg else ""))


@app.command()
def lineage(uri: str = typer.Argument(..., help="URI of an artifact (its manifest sits beside it)."),
            as_json: bool = typer.Option(False, "--json", help="Print the tree as JSON.")) -> None:
    """Print the lineage tree of an artifact back to the raw sources (with reference and verifier)."""
    from pivotrl.core.errors import StorageError
    from pivotrl.provenance.lineage import lineage_tree, open_artifact, render_tree

    try:
        store, key = open_artifact(uri)
        tree = lineage_tree(store, key)
    except StorageError as e:
        typer.echo(f"lineage: {e}", err=True)
        raise typer.Exit(2)
    typer.echo(json.dumps(tree, indent=2) if as_json else "\n".join(render_tree(tree)))


@app.command()
def pool(reports: list[str] = typer.Argument(..., help="report.json of each run (path or fsspec URL), two or more."),
         names: Optional[list[str]] = typer.Option(None, "--name", metavar="NAME",
                                                   help="Label of each report, in order (default: run 1, run 2, ...)."),
         as_json: bool = typer.Option(False, "--json", help="Print the pooled comparisons as JSON.")) -> None:
    """Paired comparisons pooled over runs of one config (e.g. split seeds 0 and 1), beside each run's own."""
    import os

    import fsspec

    from pivotrl.core.errors import DataError
    from pivotrl.evaluation.pooled import pool_reports, pooled_markdown

    parsed = []
    for uri in reports:
        try:
            with fsspec.open(os.path.expanduser(uri), "rt") as f:
                parsed.append(json.load(f))
        except (OSError, ValueError) as e:
            typer.echo(f"pool: {uri}: {e}", err=True)
            raise typer.Exit(2)
    try:
        pooled = pool_reports(parsed, list(names or [f"run {i + 1}" for i in range(len(reports))]))
    except DataError as e:
        typer.echo(f"pool: {e}", err=True)
        raise typer.Exit(2)
    typer.echo(json.dumps(pooled, indent=2) if as_json else "\n".join(pooled_markdown(pooled)))


pivots_app = typer.Typer(add_completion=False, no_args_is_help=True, help="Inspect pivot sets.")
app.add_typer(pivots_app, name="pivots")


@pivots_app.command("diff")
def pivots_diff(a: str = typer.Argument(..., help="URI of the first pivots.parquet (A)."),
                b: str = typer.Argument(..., help="URI of the second pivots.parquet (B)."),
                as_json: bool = typer.Option(False, "--json", help="Print the diff as JSON.")) -> None:
    """Which states entered (+) or left (-) the pivot set from A to B, and why."""
    import dataclasses

    from pivotrl.core.errors import StorageError
    from pivotrl.provenance.lineage import diff_pivots, open_artifact, render_diff

    try:
        store_a, key_a = open_artifact(a)
        store_b, key_b = open_artifact(b)
        diff = diff_pivots(store_a, key_a, store_b, key_b)
    except StorageError as e:
        typer.echo(f"pivots diff: {e}", err=True)
        raise typer.Exit(2)
    if as_json:
        typer.echo(json.dumps({"a": diff.a, "b": diff.b, "unchanged": diff.kept,
                               "changes": [dataclasses.asdict(c) for c in diff.changes]}, indent=2))
    else:
        typer.echo("\n".join(render_diff(diff)))


from pivotrl.flows.cli_records import register as _register_records  # noqa: E402 - rollouts, pivots export

_register_records(app, pivots_app)


def main() -> None:
    """Console-script entry point (import-safe: vLLM starts its engine processes with spawn).

    Errors of pivotrl's own tree (bad data, storage, models, a failed stage) are printed as one
    message naming the place, without a traceback, and exit with status 2.
    """
    import os

    from pivotrl.core.errors import PivotRLError

    os.environ.setdefault("PREFECT_SERVER_ANALYTICS_ENABLED", "false")
    os.environ.setdefault("PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS", "120")
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    try:
        app()
    except PivotRLError as e:
        typer.echo(f"error ({type(e).__name__}): {e}", err=True)
        raise SystemExit(2)


if __name__ == "__main__":
    main()
