"""`mint key …`: the scoped API keys kept in the catalog's database."""

from typing import Annotated

import typer

# Only the light catalog modules here: `mint` imports this for every command, and the database
# and HTTP layers (SQLAlchemy, httpx) load in CatalogLocation.open, only when a catalog command runs.
from mint_server.catalog.records import to_dict
from mint_server.cli.catalog_command import (
    CatalogLocation,
    command,
    emit,
    new_table,
    out,
    when,
)

# -- API keys -------------------------------------------------------------------------------------
key_app = typer.Typer(no_args_is_help=True, help="Scoped API keys: serve (sampling only) ⊂ train ⊂ admin.")


@key_app.command("create")
@command
def key_create(
    target: CatalogLocation,
    name: Annotated[str, typer.Argument(help="What the key is for (shown in listings).")],
    scopes: Annotated[
        list[str], typer.Option("--scope", help="serve (OpenAI face and sampling), train, or admin; repeatable.")
    ],
) -> None:
    """Make a key for the owner (local: --owner's rule; --server: the admin key's own owner). The key is
    printed once and never stored: keep it."""
    record, key = target.open().create_key(name, scopes)
    emit(target, {"key": key, **to_dict(record)},
          lambda: out.print(f"{key}\n(key id {record.key_id}, scopes {', '.join(record.scopes)}; "
                            "shown once: store it now)", markup=False))


@key_app.command("list")
@command
def key_list(
    target: CatalogLocation,
    include_revoked: Annotated[bool, typer.Option("--include-revoked", help="Show revoked keys too.")] = False,
) -> None:
    """The owner's scoped keys (never the keys themselves)."""
    keys = target.open().list_keys(include_revoked=include_revoked)

    def render() -> None:
        table = new_table("key id", "name", "scopes", "created", "revoked")
        for k in keys:
            table.add_row(k.key_id, k.name, ",".join(k.scopes), when(k.created_at),
                          when(k.revoked_at) if k.revoked_at else "")
        out.print(table)

    emit(target, [to_dict(k) for k in keys], render)


@key_app.command("revoke")
@command
def key_revoke(target: CatalogLocation, key_id: Annotated[str, typer.Argument(help="The key id `mint key list` shows.")]) -> None:
    """Revoke a key: its next request, and every token it was traded for, is refused (401)."""
    target.open().revoke_key(key_id)
    emit(target, {"revoked": key_id}, lambda: out.print(f"revoked {key_id}", markup=False))
