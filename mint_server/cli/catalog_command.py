"""How a catalog command (`mint policy|revision|alias|eval|export|import|catalog|key …`, cli/catalog.py)
is declared and prints: where its catalog is, from the location options every command shares — a
local catalog (--data-dir / --db-url) or a running server (--server URL --api-key KEY, owner implied
by the key; the key defaults to $MINT_API_KEY, $TINKER_API_KEY, else the api_key file `mint serve`
keeps in the data dir) —, its output as rich tables or, with --json, JSON, and its errors as one line
on stderr with exit status 2.
"""

import getpass
import inspect
import json
import os
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any, TypeVar

import typer
from rich.console import Console
from rich.table import Table
from rich.text import Text

# Only the light catalog modules here: `mint` imports this for every command, and the database
# and HTTP layers (SQLAlchemy, httpx) load in CatalogLocation.open, only when a catalog command runs.
from mint_server.catalog.errors import CatalogError, InvalidArgument
from mint_server.catalog.records import Page, Revision

if TYPE_CHECKING:
    from mint_server.cli.catalog_client import CatalogClient

T = TypeVar("T")
PANEL = "Catalog location"
out = Console(soft_wrap=True)
err = Console(stderr=True)


@dataclass
class CatalogLocation:
    """Where a command's catalog is, from the options every command shares."""

    data_dir: Path | None
    db_url: str | None
    store: str | None
    server: str | None
    api_key: str | None
    owner: str | None
    json: bool
    opened: list["CatalogClient"] = field(default_factory=list)

    def open(self, actor: str | None = None) -> "CatalogClient":
        from mint_server.catalog.catalog import Catalog
        from mint_server.cli.catalog_client import HttpClient, LocalClient

        if self.server:
            if self.db_url or self.store:
                raise InvalidArgument("--server cannot be combined with --db-url or --store")
            client: CatalogClient = HttpClient(self.server, self.api_key or served_key(self.data_dir))
        else:
            catalog = Catalog.open(self.db_url, data_dir=self.data_dir, store=self.store)
            owner = self.local_owner()
            client = LocalClient(catalog, owner, actor or _default_actor(owner))
        self.opened.append(client)
        return client

    def local_owner(self) -> str:
        """Who local mode acts as: --owner, else the data dir's owner (api/auth/keys.py's data_dir_owner:
        the owner of the key `mint serve` keeps there, made now if no command made it yet)."""
        from mint_server.api.auth.keys import data_dir_owner  # stdlib only
        from mint_server.paths import data_dir

        return self.owner or data_dir_owner(data_dir(self.data_dir))


def served_key(data_dir: Path | None) -> str | None:
    """The key `mint serve` created when started without one, if that data dir is on this machine."""
    root = data_dir or Path(os.environ.get("MINT_HOME") or Path.home() / ".mint")
    try:
        return (root.expanduser() / "api_key").read_text().strip() or None
    except OSError:
        return None  # none there: the server answers 401 unless it runs with --no-auth


def _default_actor(owner: str) -> str:
    try:
        return getpass.getuser()
    except (KeyError, OSError):
        return owner


def _option(name: str, annotation: Any, default: Any, *decls: str, help: str, **kw: Any) -> inspect.Parameter:
    return inspect.Parameter(
        name,
        inspect.Parameter.KEYWORD_ONLY,
        default=default,
        annotation=Annotated[annotation, typer.Option(*decls, help=help, rich_help_panel=PANEL, **kw)],
    )


# The options shared by every command, appended to each command's own parameters by `command`.
_COMMON = [
    _option(
        "data_dir",
        Path | None,
        None,
        "--data-dir",
        help="Local data dir (default $MINT_HOME or ~/.mint); with --server, where to find its api_key file.",
    ),
    _option(
        "db_url",
        str | None,
        None,
        "--db-url",
        help="Database URL instead of <data-dir>/catalog.db.",
        envvar="MINT_CATALOG_URL",
    ),
    _option(
        "store",
        str | None,
        None,
        "--store",
        help="Blob store instead of <data-dir>/blobs: a path, or s3://BUCKET/PREFIX (a store several nodes "
        "share; endpoint and credentials from the AWS_* env vars).",
        envvar="MINT_STORE",
    ),
    _option(
        "server",
        str | None,
        None,
        "--server",
        help="Use a running MinT server at this URL.",
        envvar="MINT_SERVER",
    ),
    _option(
        "api_key",
        str | None,
        None,
        "--api-key",
        help="API key for --server (default $MINT_API_KEY, $TINKER_API_KEY, else <data dir>/api_key).",
        envvar=["MINT_API_KEY", "TINKER_API_KEY"],
    ),
    _option(
        "owner",
        str | None,
        None,
        "--owner",
        help="Owner in local mode (default: the owner of <data dir>/api_key, the key `mint serve` uses "
        "when given none; created by whichever command runs first).",
        envvar="MINT_OWNER",
    ),
    _option("json", bool, False, "--json", help="Print JSON instead of tables."),
]


def command(fn: Callable[..., None]) -> Callable[..., None]:
    """Give `fn(target, ...)` the shared location options, and turn catalog errors into one line
    on stderr with exit status 2. Typer reads the combined __signature__."""
    own = [p for p in inspect.signature(fn).parameters.values() if p.name != "target"]

    def run(**kwargs: Any) -> None:
        target = CatalogLocation(**{p.name: kwargs.pop(p.name) for p in _COMMON})
        try:
            fn(target, **kwargs)
        except (CatalogError, OSError) as e:
            fail(str(e))
        except Exception as e:
            # Database unreachable, bad URL, …: still one line, not a traceback.
            if not type(e).__module__.startswith("sqlalchemy"):
                raise
            fail(f"database error: {getattr(e, 'orig', None) or e}")
        finally:
            for client in target.opened:
                client.close()

    run.__name__, run.__doc__ = fn.__name__, fn.__doc__
    run.__signature__ = inspect.Signature(own + _COMMON)  # type: ignore[attr-defined]
    return run


def fail(message: str) -> None:
    first_line = message.strip().splitlines()[0] if message.strip() else "failed"
    typer.echo(f"error: {first_line}", err=True)  # plain echo: rich would wrap long lines
    raise typer.Exit(2)


# -- output helpers -----------------------------------------------------------------------------
def emit(target: CatalogLocation, data: Any, render: Callable[[], None]) -> None:
    if target.json:
        print(json.dumps(data, indent=2))
    else:
        render()


def when(value: datetime) -> str:
    return value.astimezone().strftime("%Y-%m-%d %H:%M:%S")


def size_text(n: float) -> str:
    if n < 1024:
        return f"{n:.0f} B"
    for unit in ("KiB", "MiB", "GiB"):
        n /= 1024
        if n < 1024 or unit == "GiB":
            break
    return f"{n:.1f} {unit}"


class PlainTable(Table):
    """A table whose string cells are shown as they are: stored names, metrics and metadata may hold
    console markup (a key named "[/]" crashed `mint key list`), which must print, not parse."""

    def add_row(self, *renderables: Any, **kw: Any) -> None:
        super().add_row(*(Text(r) if isinstance(r, str) else r for r in renderables), **kw)


def new_table(*columns: str) -> Table:
    table = PlainTable(box=None, header_style="bold", pad_edge=False)
    for c in columns:
        table.add_column(c)
    return table


def print_kv(rows: list[tuple[str, Any]]) -> None:
    table = PlainTable(box=None, show_header=False, pad_edge=False)
    table.add_column(style="bold")
    table.add_column()
    for key, value in rows:
        table.add_row(key, "" if value is None else str(value))
    out.print(table)


def next_hint(page: Page[Any]) -> None:
    if page.next_cursor:
        err.print(f"more: --cursor {page.next_cursor}", markup=False, highlight=False)


def fetch_pages(fetch: Callable[..., Page[T]], cursor: str | None, limit: int, all_pages: bool) -> Page[T]:
    page = fetch(cursor=cursor, limit=limit)
    if not all_pages:
        return page
    items = list(page.items)
    while page.next_cursor:
        page = fetch(cursor=page.next_cursor, limit=limit)
        items.extend(page.items)
    return Page(items, None)


def revision_table(revisions: list[Revision]) -> Table:
    table = new_table("revision", "sha256", "size", "rank", "parent", "step", "created", "note")
    for r in revisions:
        table.add_row(
            r.ref, r.sha256[:12], size_text(r.size), str(r.rank), r.parent or "", "" if r.step is None else str(r.step),
            when(r.created_at), r.note or "",
        )  # fmt: skip
    return table


def parse_json_object(text: str | None, name: str) -> dict[str, Any] | None:
    if text is None:
        return None
    try:
        value = json.loads(text)
    except ValueError as e:
        raise InvalidArgument(f"{name} is not valid JSON: {e}", field=name) from None
    if not isinstance(value, dict):
        raise InvalidArgument(f"{name} must be a JSON object", field=name)
    return value


Limit = Annotated[int, typer.Option("--limit", min=1, max=1000, help="Items per page.")]
Cursor = Annotated[str | None, typer.Option("--cursor", help="Continue from a previous page's cursor.")]
AllPages = Annotated[bool, typer.Option("--all", help="Fetch every page.")]
