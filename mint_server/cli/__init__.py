"""The `mint` command. Each command group lives in its own module; this file only assembles them."""

import typer

from mint_server.cli import catalog as catalog_cli
from mint_server.cli import chat as chat_cli
from mint_server.cli import evals as evals_cli
from mint_server.cli import generate as generate_cli
from mint_server.cli import model as model_cli
from mint_server.cli import plan as plan_cli
from mint_server.cli import serve as serve_cli
from mint_server.cli import sweep as sweep_cli

app = typer.Typer(no_args_is_help=True, add_completion=False, help="MinT: LoRA post-training and serving.")
model_cli.register(app)
generate_cli.register(app)
catalog_cli.register(app)
evals_cli.register(catalog_cli.eval_app)
serve_cli.register(app)
sweep_cli.register(app)
plan_cli.register(app)
chat_cli.register(app)


def main() -> None:
    app()
