"""CLI commands over rollout records and pivot exports, registered on the main app by
:func:`register`:

    pivotrl rollouts URI [--step N] [--state ID] [--json]   every sampled action under URI
    pivotrl pivots export PIVOTS --out rows.jsonl [--config ...] [--agent NAME] [--tokenizer DIR]
"""

from __future__ import annotations

from typing import Optional

import typer


def rollouts(uri: str = typer.Argument(..., help="Run root, or any artifact folder under it (e.g. train/<key>)."),
             step: Optional[int] = typer.Option(None, "--step", metavar="N", help="Only this step (0 = probing)."),
             state: Optional[str] = typer.Option(None, "--state", metavar="ID", help="Only this state id (e.g. 'multi_turn_base_3#2')."),
             as_json: bool = typer.Option(False, "--json", help="Print JSON Lines instead of a table.")) -> None:
    """Print rollout records: every sampled action of probing, training and evaluation.

    Each with its reward, verifier reason, advantage, ratio and the policy step that sampled it."""
    import os

    from pivotrl.core.errors import StorageError
    from pivotrl.provenance.rollouts import read_rollouts, render_rollouts
    from pivotrl.storage import ArtifactStore

    try:
        df = read_rollouts(ArtifactStore(os.path.expanduser(uri)), step=step, state=state)
    except StorageError as e:
        typer.echo(f"rollouts: {e}", err=True)
        raise typer.Exit(2)
    if as_json:
        typer.echo(df.to_json(orient="records", lines=True, force_ascii=False))
    elif not len(df):
        typer.echo("no records match")
    else:
        typer.echo("\n".join(render_rollouts(df)))


def export(pivots: str = typer.Argument(..., help="URI of a pivots.parquet (its manifest sits beside it)."),
           out: str = typer.Option(..., "--out", "-o", metavar="PATH", help="Where to write the JSONL rows (path or fsspec URL)."),
           config: str = typer.Option("configs/default.yaml", "--config", "-c", metavar="PATH",
                                      help="Run config whose verifier, prompt and model the rows are checked against."),
           overrides: Optional[list[str]] = typer.Option(None, "--set", "-s", metavar="KEY=VALUE", help="Override a config key (repeatable)."),
           agent: str = typer.Option("single_step_tool_use_with_argument_comparison_agent", "--agent", metavar="NAME",
                                     help="agent_ref.name of every row."),
           tokenizer: Optional[str] = typer.Option(None, "--tokenizer", metavar="PATH",
                                                   help="Tokenizer of the model to be trained (default: model.source)."),
           allow_stop_decisions: bool = typer.Option(
               False, "--allow-stop-decisions",
               help="Export stop-decision pivots too (their expected action is a closing text, not a call).")) -> None:
    """Write a pivot set as NeMo Gym / NeMo RL PivotRL rows, after checking it (inputs as their
    manifests record them, more than one reward per pivot, same verifier and chat template as at
    probing, expert actions only, no stop decisions unless --allow-stop-decisions)."""
    from pivotrl.config import load_config
    from pivotrl.core.errors import ConfigError, DataError, ModelError, StorageError
    from pivotrl.interop.export import export_pivots
    from pivotrl.provenance.lineage import open_artifact
    from pivotrl.runtime.models import load_tokenizer, resolve_model
    from pivotrl.pipeline.demos import cache_dir

    try:
        cfg = load_config(config, overrides or [])
        store, key = open_artifact(pivots)
        tok = load_tokenizer(tokenizer or resolve_model(cfg.model.source, cache_dir(cfg)))
        res = export_pivots(store, key, cfg, tok, out, agent=agent, allow_stop_decisions=allow_stop_decisions)
    except (ConfigError, DataError, ModelError, StorageError) as e:
        typer.echo(f"pivots export: {e}", err=True)
        raise typer.Exit(2)
    typer.echo(f"{res['rows']} rows → {res['uri']}")


def register(app: typer.Typer, pivots_app: typer.Typer) -> None:
    """Add ``rollouts`` to ``app`` and ``export`` to its ``pivots`` group."""
    app.command("rollouts")(rollouts)
    pivots_app.command("export")(export)
