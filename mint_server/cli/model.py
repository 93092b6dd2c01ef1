"""`mint model …` commands."""

import typer


def register(app: typer.Typer) -> None:
    model_app = typer.Typer(no_args_is_help=True, help="Prepare and inspect base models.")
    app.add_typer(model_app, name="model")
