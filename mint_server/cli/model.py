"""`mint model …` commands."""

from pathlib import Path

import typer
from rich.console import Console

from mint_server.model.config import ModelError


def register(app: typer.Typer) -> None:
    model_app = typer.Typer(no_args_is_help=True, help="Prepare and inspect base models.")
    model_app.command("prepare")(prepare)
    app.add_typer(model_app, name="model")


def prepare(
    source: str | None = typer.Argument(
        None, help="An HF checkpoint dir to validate; omit for HuggingFaceTB/SmolLM2-135M-Instruct."
    ),
    data_dir: Path | None = typer.Option(
        None, "--data-dir", help="Data dir (default $MINT_HOME or ~/.mint)."
    ),
) -> None:
    """Prepare a base model and print its checkpoint directory (last line of stdout)."""
    from mint_server.model.prepare import prepare as prepare_model  # keeps `mint --help` fast

    err = Console(stderr=True)
    try:
        result = prepare_model(source, data_dir, log=lambda msg: err.print(f"[dim]{msg}…[/dim]"))
    except (ModelError, OSError) as e:
        # Bad input is the user's to fix, so one line instead of a traceback.
        typer.echo(f"error: {e}", err=True)
        raise typer.Exit(2) from None
    # Plain echo, not rich: scripts read this line, and rich would wrap long paths.
    typer.echo(str(result.path))
