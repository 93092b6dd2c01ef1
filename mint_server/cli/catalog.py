"""`mint policy|revision|alias|eval|export|import|catalog|key …`: the policy catalog (and the scoped
API keys kept in its database) from the shell.

Every command works on a local catalog (--data-dir / --db-url) or on a running
server (--server URL --api-key KEY, owner implied by the key; the key defaults to $MINT_API_KEY,
$TINKER_API_KEY, else the api_key file `mint serve` keeps in the data dir). Output is rich tables,
or JSON with --json. Errors are one line on stderr and exit status 2.
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
from rich.progress import (
    BarColumn,
    MofNCompleteColumn,
    Progress,
    ProgressColumn,
    Task,
    TextColumn,
    TimeRemainingColumn,
)
from rich.table import Table
from rich.text import Text

# Only the light catalog modules here: `mint` imports this for every command, and the database
# and HTTP layers (SQLAlchemy, httpx) load in CatalogLocation.open, only when a catalog command runs.
from mint_server.catalog.errors import CatalogError, InvalidArgument
from mint_server.catalog.records import Page, Revision, page_to_dict, to_dict

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
            client: CatalogClient = HttpClient(self.server, self.api_key or _served_key(self.data_dir))
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


def _served_key(data_dir: Path | None) -> str | None:
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
            _fail(str(e))
        except Exception as e:
            # Database unreachable, bad URL, …: still one line, not a traceback.
            if not type(e).__module__.startswith("sqlalchemy"):
                raise
            _fail(f"database error: {getattr(e, 'orig', None) or e}")
        finally:
            for client in target.opened:
                client.close()

    run.__name__, run.__doc__ = fn.__name__, fn.__doc__
    run.__signature__ = inspect.Signature(own + _COMMON)  # type: ignore[attr-defined]
    return run


def _fail(message: str) -> None:
    first_line = message.strip().splitlines()[0] if message.strip() else "failed"
    typer.echo(f"error: {first_line}", err=True)  # plain echo: rich would wrap long lines
    raise typer.Exit(2)


# -- output helpers -----------------------------------------------------------------------------
def _emit(target: CatalogLocation, data: Any, render: Callable[[], None]) -> None:
    if target.json:
        print(json.dumps(data, indent=2))
    else:
        render()


def _when(value: datetime) -> str:
    return value.astimezone().strftime("%Y-%m-%d %H:%M:%S")


def _size(n: float) -> str:
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


def _table(*columns: str) -> Table:
    table = PlainTable(box=None, header_style="bold", pad_edge=False)
    for c in columns:
        table.add_column(c)
    return table


def _kv(rows: list[tuple[str, Any]]) -> None:
    table = PlainTable(box=None, show_header=False, pad_edge=False)
    table.add_column(style="bold")
    table.add_column()
    for key, value in rows:
        table.add_row(key, "" if value is None else str(value))
    out.print(table)


def _next_hint(page: Page[Any]) -> None:
    if page.next_cursor:
        err.print(f"more: --cursor {page.next_cursor}", markup=False, highlight=False)


def _pages(fetch: Callable[..., Page[T]], cursor: str | None, limit: int, all_pages: bool) -> Page[T]:
    page = fetch(cursor=cursor, limit=limit)
    if not all_pages:
        return page
    items = list(page.items)
    while page.next_cursor:
        page = fetch(cursor=page.next_cursor, limit=limit)
        items.extend(page.items)
    return Page(items, None)


def _revision_rows(revisions: list[Revision]) -> Table:
    table = _table("revision", "sha256", "size", "rank", "parent", "step", "created", "note")
    for r in revisions:
        table.add_row(
            r.ref, r.sha256[:12], _size(r.size), str(r.rank), r.parent or "", "" if r.step is None else str(r.step),
            _when(r.created_at), r.note or "",
        )  # fmt: skip
    return table


def _parse_json_object(text: str | None, name: str) -> dict[str, Any] | None:
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


# -- policy -------------------------------------------------------------------------------------
policy_app = typer.Typer(no_args_is_help=True, help="Policies: named LoRA adapters with immutable revisions.")


@policy_app.command("list")
@command
def policy_list(
    target: CatalogLocation,
    limit: Limit = 50,
    cursor: Cursor = None,
    all_pages: AllPages = False,
    all_owners: Annotated[
        bool, typer.Option("--all-owners", help="Local mode: every owner's policies (the data dir admin's view).")
    ] = False,
) -> None:
    """List policies by name."""
    if all_owners and target.server:
        raise InvalidArgument("--all-owners lists a local catalog; it cannot be combined with --server")
    client = target.open()
    if all_owners:
        catalog = client.catalog  # type: ignore[attr-defined]  # local mode: a LocalClient
        page = _pages(catalog.list_all_policies, cursor, limit, all_pages)
    else:
        page = _pages(client.list_policies, cursor, limit, all_pages)

    def render() -> None:
        table = _table(*(("owner",) if all_owners else ()), "name", "base model", "rank", "created")
        for p in page.items:
            owner = (p.owner[:12],) if all_owners else ()
            table.add_row(*owner, p.name, p.base_model, str(p.lora_config.get("rank", "")), _when(p.created_at))
        out.print(table)
        _next_hint(page)

    _emit(target, page_to_dict(page), render)


@policy_app.command("show")
@command
def policy_show(target: CatalogLocation, name: Annotated[str, typer.Argument(help="Policy name.")]) -> None:
    """Show a policy, its aliases and its latest revision."""
    client = target.open()
    policy = client.get_policy(name)
    aliases = client.list_aliases(name, limit=1000).items
    latest = client.list_revisions(name, limit=1).items
    data = {
        **to_dict(policy),
        "aliases": [to_dict(a) for a in aliases],
        "latest": to_dict(latest[0]) if latest else None,
    }

    def render() -> None:
        _kv(
            [
                ("name", policy.name),
                ("owner", policy.owner),
                ("base model", policy.base_model),
                ("lora config", json.dumps(policy.lora_config)),
                ("metadata", json.dumps(policy.metadata)),
                ("created", _when(policy.created_at)),
                ("latest", latest[0].ref if latest else "(no revisions)"),
                ("aliases", ", ".join(f"{a.name}→{a.revision}" for a in aliases) or "(none)"),
            ]
        )

    _emit(target, data, render)


@policy_app.command("create")
@command
def policy_create(
    target: CatalogLocation,
    name: Annotated[str, typer.Argument(help="Policy name.")],
    base_model: Annotated[str, typer.Option("--base-model", help="Base model the adapters are for.")],
    rank: Annotated[
        int | None, typer.Option("--rank", min=1, help="LoRA rank (sets lora_config.rank).")
    ] = None,
    lora_config: Annotated[
        str | None, typer.Option("--lora-config", help="LoRA config as a JSON object.")
    ] = None,
    metadata: Annotated[str | None, typer.Option("--metadata", help="Metadata as a JSON object.")] = None,
    exist_ok: Annotated[bool, typer.Option("--exist-ok", help="Succeed if it already exists.")] = False,
) -> None:
    """Create a policy."""
    config = _parse_json_object(lora_config, "lora_config") or {}
    if rank is not None:
        config["rank"] = rank
    policy = target.open().create_policy(
        name, base_model, config, _parse_json_object(metadata, "metadata"), exist_ok=exist_ok
    )
    _emit(
        target,
        to_dict(policy),
        lambda: out.print(f"policy {policy.name} ({policy.base_model})", markup=False),
    )


# -- revision -----------------------------------------------------------------------------------
revision_app = typer.Typer(no_args_is_help=True, help="Adapter revisions.")


@revision_app.command("list")
@command
def revision_list(
    target: CatalogLocation,
    name: Annotated[str, typer.Argument(help="Policy name.")],
    limit: Limit = 50,
    cursor: Cursor = None,
    all_pages: AllPages = False,
) -> None:
    """List a policy's revisions, newest first."""
    client = target.open()
    page = _pages(lambda **kw: client.list_revisions(name, **kw), cursor, limit, all_pages)

    def render() -> None:
        out.print(_revision_rows(page.items))
        _next_hint(page)

    _emit(target, page_to_dict(page), render)


@revision_app.command("show")
@command
def revision_show(
    target: CatalogLocation, ref: Annotated[str, typer.Argument(help="NAME, NAME@N, NAME@ALIAS or NAME@SHA.")]
) -> None:
    """Show one revision."""
    r = target.open().resolve(ref)
    rows = [
        ("revision", r.ref), ("sha256", r.sha256), ("size", f"{_size(r.size)} ({r.size} bytes)"), ("rank", r.rank),
        ("parent", r.parent), ("training run", r.training_run), ("step", r.step), ("note", r.note),
        ("base precision", r.base_precision), ("created", _when(r.created_at)),
    ]  # fmt: skip
    _emit(target, to_dict(r), lambda: _kv(rows))


@revision_app.command("log")
@command
def revision_log(
    target: CatalogLocation,
    ref: Annotated[str, typer.Argument(help="Where to start.")],
    limit: Limit = 50,
    cursor: Cursor = None,
    all_pages: AllPages = False,
) -> None:
    """Lineage: the revision, its parent, grandparent, …"""
    client = target.open()
    page = _pages(lambda **kw: client.lineage(ref, **kw), cursor, limit, all_pages)

    def render() -> None:
        out.print(_revision_rows(page.items))
        _next_hint(page)

    _emit(target, page_to_dict(page), render)


# -- alias --------------------------------------------------------------------------------------
alias_app = typer.Typer(no_args_is_help=True, help="Aliases (e.g. prod, staging) pointing at revisions.")
Reason = Annotated[str | None, typer.Option("--reason", help="Why; kept in the alias history.")]
Actor = Annotated[str | None, typer.Option("--actor", help="Who, in local mode (default: your user name).")]


@alias_app.command("set")
@command
def alias_set(
    target: CatalogLocation,
    name: Annotated[str, typer.Argument(help="Policy name.")],
    alias: Annotated[str, typer.Argument(help="Alias name.")],
    revision: Annotated[str, typer.Argument(help="Revision number (or another alias / sha prefix).")],
    reason: Reason = None,
    actor: Actor = None,
) -> None:
    """Point an alias at a revision."""
    a = target.open(actor).set_alias(name, alias, revision, reason=reason)
    _emit(
        target, to_dict(a), lambda: out.print(f"{a.policy}@{a.name} → {a.policy}@{a.revision}", markup=False)
    )


@alias_app.command("rollback")
@command
def alias_rollback(
    target: CatalogLocation,
    name: Annotated[str, typer.Argument(help="Policy name.")],
    alias: Annotated[str, typer.Argument(help="Alias name.")],
    reason: Reason = None,
    actor: Actor = None,
) -> None:
    """Move an alias back to where it pointed before its latest move."""
    a = target.open(actor).rollback_alias(name, alias, reason=reason)
    _emit(
        target, to_dict(a), lambda: out.print(f"{a.policy}@{a.name} → {a.policy}@{a.revision}", markup=False)
    )


@alias_app.command("history")
@command
def alias_history(
    target: CatalogLocation,
    name: Annotated[str, typer.Argument(help="Policy name.")],
    alias: Annotated[str, typer.Argument(help="Alias name.")],
    limit: Limit = 50,
    cursor: Cursor = None,
    all_pages: AllPages = False,
) -> None:
    """Every move of an alias, newest first."""
    client = target.open()
    page = _pages(lambda **kw: client.alias_history(name, alias, **kw), cursor, limit, all_pages)

    def render() -> None:
        table = _table("at", "action", "from", "to", "actor", "reason")
        for e in page.items:
            table.add_row(
                _when(e.at), e.action, "" if e.from_revision is None else str(e.from_revision),
                str(e.to_revision), e.actor, e.reason or "",
            )  # fmt: skip
        out.print(table)
        _next_hint(page)

    _emit(target, page_to_dict(page), render)


@alias_app.command("list")
@command
def alias_list(
    target: CatalogLocation,
    name: Annotated[str, typer.Argument(help="Policy name.")],
    limit: Limit = 50,
    cursor: Cursor = None,
    all_pages: AllPages = False,
) -> None:
    """A policy's aliases."""
    client = target.open()
    page = _pages(lambda **kw: client.list_aliases(name, **kw), cursor, limit, all_pages)

    def render() -> None:
        table = _table("alias", "revision", "updated")
        for a in page.items:
            table.add_row(a.name, f"{a.policy}@{a.revision}", _when(a.updated_at))
        out.print(table)
        _next_hint(page)

    _emit(target, page_to_dict(page), render)


# -- eval ---------------------------------------------------------------------------------------
eval_app = typer.Typer(no_args_is_help=True, help="Evals of revisions: `mint eval REF… --dataset F --metric M` runs one (see `run`); record and list results.")


@eval_app.command("record")
@command
def eval_record(
    target: CatalogLocation,
    ref: Annotated[str, typer.Argument(help="Revision reference.")],
    metric: Annotated[str, typer.Argument(help="Metric name.")],
    value: Annotated[float, typer.Argument(help="Metric value.")],
    dataset: Annotated[str | None, typer.Option("--dataset", help="What it was measured on.")] = None,
) -> None:
    """Record a metric value for a revision."""
    e = target.open().record_eval(ref, metric, value, dataset=dataset)
    _emit(target, to_dict(e), lambda: out.print(f"{e.revision} {e.metric}={e.value:g}", markup=False))


@eval_app.command("list")
@command
def eval_list(
    target: CatalogLocation,
    ref: Annotated[str, typer.Argument(help="Revision reference.")],
    metric: Annotated[str | None, typer.Option("--metric", help="Only this metric.")] = None,
    limit: Limit = 50,
    cursor: Cursor = None,
    all_pages: AllPages = False,
) -> None:
    """A revision's evals, newest first."""
    client = target.open()
    page = _pages(lambda **kw: client.list_evals(ref, metric=metric, **kw), cursor, limit, all_pages)

    def render() -> None:
        table = _table("revision", "metric", "value", "dataset", "recorded")
        for e in page.items:
            table.add_row(e.revision, e.metric, f"{e.value:g}", e.dataset or "", _when(e.created_at))
        out.print(table)
        _next_hint(page)

    _emit(target, page_to_dict(page), render)


# -- export / import ----------------------------------------------------------------------------
@command
def export(
    target: CatalogLocation,
    ref: Annotated[str, typer.Argument(help="Revision reference, e.g. NAME@prod.")],
    dest: Annotated[Path, typer.Argument(help="Directory to create (must be absent or empty).")],
    moe_layout: Annotated[
        str | None,
        typer.Option("--moe-layout", help="Expert LoRA of MoE adapters as 'packed' (as stored) or 'per-expert' "
                     "(PEFT's per-module tensors). No effect on adapters without expert LoRA."),
    ] = None,
    merged: Annotated[
        bool,
        typer.Option("--merged", help="Write a full HF checkpoint (config, safetensors, tokenizer) with the "
                     "adapter folded into the base weights, for tools that serve plain models."),
    ] = False,
    base_model_dir: Annotated[
        Path | None,
        typer.Option("--base-model", help="With --merged: the base model's HF checkpoint dir on this machine "
                     "(default: the revision's base model when it names a local dir or the prepared default)."),
    ] = None,
) -> None:
    """Write a revision as a PEFT directory (verified before it appears), or with --merged as a full
    checkpoint with the adapter folded into the base."""
    from mint_server.model.moe_layout import MOE_LAYOUTS

    if moe_layout is not None and moe_layout not in MOE_LAYOUTS:
        raise InvalidArgument(f"--moe-layout must be one of {', '.join(MOE_LAYOUTS)}, got {moe_layout!r}")
    if merged:
        if moe_layout is not None:
            raise InvalidArgument("--moe-layout applies to adapter exports; a --merged checkpoint has no LoRA tensors")
        _export_merged(target, ref, dest, base_model_dir)
        return
    if base_model_dir is not None:
        raise InvalidArgument("--base-model is for --merged exports")
    if moe_layout is None:
        r = target.open().export(ref, dest)
    else:  # export (verified) into a staging dir, then re-lay the experts from there into dest
        import tempfile

        if dest.exists() and (not dest.is_dir() or any(dest.iterdir())):
            raise InvalidArgument(f"dest: {dest} exists and is not an empty directory")
        with tempfile.TemporaryDirectory(prefix="mint-export-") as tmp:
            r = target.open().export(ref, Path(tmp) / "peft")
            _relayout(Path(tmp) / "peft", dest, moe_layout)
    data = {**to_dict(r), "path": str(dest.absolute())}
    _emit(target, data, lambda: out.print(f"{r.ref} ({r.sha256[:12]}) → {dest}", markup=False))


def _export_merged(target: CatalogLocation, ref: str, dest: Path, base_model_dir: Path | None) -> None:
    """Export the revision's adapter (verified) into a staging dir, then merge it into the base read
    from this machine's disk (the same with --server: only the adapter comes over the wire)."""
    import tempfile

    from mint_server.model.config import ModelError
    from mint_server.model.merge import merge_peft_dir

    if dest.exists() and (not dest.is_dir() or any(dest.iterdir())):
        raise InvalidArgument(f"dest: {dest} exists and is not an empty directory")
    client = target.open()
    revision = client.resolve(ref)
    base_dir = _merge_base_dir(target, client.get_policy(revision.policy).base_model, base_model_dir)
    with tempfile.TemporaryDirectory(prefix="mint-export-") as tmp:
        r = client.export(revision.ref, Path(tmp) / "peft")
        try:
            summary = merge_peft_dir(Path(tmp) / "peft", base_dir, dest)
        except ModelError as e:
            raise InvalidArgument(f"cannot export {r.ref} merged: {e}") from None
    data = {**to_dict(r), "path": str(dest.absolute()), "merged": True, "base_model_dir": str(base_dir), **summary}
    _emit(target, data, lambda: out.print(
        f"{r.ref} ({r.sha256[:12]}) merged into {base_dir} → {dest}", markup=False))


def _merge_base_dir(target: CatalogLocation, base_model: str, given: Path | None) -> Path:
    """The base checkpoint dir a merged export reads: --base-model, else the revision's base model
    when it is a dir here, else the prepared default model (never prepared or downloaded here)."""
    from mint_server.model.prepare import DEFAULT_BASE_MODEL, default_model_dir, is_prepared

    if given is not None:
        if not (given / "config.json").is_file():
            raise InvalidArgument(f"--base-model: {given} is not an HF checkpoint dir (no config.json)")
        return given
    if base_model.startswith(("/", ".", "~")) and (Path(base_model).expanduser() / "config.json").is_file():
        return Path(base_model).expanduser()
    if base_model == DEFAULT_BASE_MODEL and is_prepared(default_model_dir(target.data_dir)):
        return default_model_dir(target.data_dir)
    raise InvalidArgument(f"the revision's base model {base_model!r} is not a checkpoint dir on this machine; "
                          "pass --base-model DIR (the base's HF checkpoint dir) to merge into it")


@command
def import_(
    target: CatalogLocation,
    peft_dir: Annotated[
        Path, typer.Argument(help="PEFT LoRA directory (adapter_config.json + adapter_model.safetensors), "
                             "or a tar / zip archive of one.")
    ],
    policy: Annotated[
        str, typer.Option("--policy", help="Policy to add the revision to (created if missing).")
    ],
    base_model: Annotated[
        str | None, typer.Option("--base-model", help="Default: the policy's, else the adapter's.")
    ] = None,
    parent: Annotated[str | None, typer.Option("--parent", help="Parent revision reference.")] = None,
    training_run: Annotated[str | None, typer.Option("--training-run")] = None,
    step: Annotated[int | None, typer.Option("--step", min=0)] = None,
    note: Annotated[str | None, typer.Option("--note")] = None,
) -> None:
    """Publish a PEFT LoRA directory as a new revision (expert LoRA is stored packed); prints its
    tinker:// path, which sampling clients and create_training_client_from_state take."""
    import tempfile

    from mint_server.model.moe_layout import moe_layout_of

    with tempfile.TemporaryDirectory(prefix="mint-import-") as tmp:
        if peft_dir.is_file():  # an archive (tar or zip: what `tinker checkpoint download` fetches)
            from mint_server.catalog.archive import unpack

            peft_dir = unpack(peft_dir, Path(tmp) / "unpacked")
        if (peft_dir / "adapter_model.safetensors").is_file() and moe_layout_of(peft_dir) == "per-expert":
            _relayout(peft_dir, Path(tmp) / "peft", "packed")
            peft_dir = Path(tmp) / "peft"
        r = _import(target, peft_dir, policy, base_model, parent, training_run, step, note)
    # The revision's path: sample it, or continue training it (create_training_client_from_state;
    # weights only, the optimizer starts fresh). A number, not an alias: it never moves.
    path = f"tinker://{r.ref}"
    _emit(target, {**to_dict(r), "path": path},
          lambda: out.print(f"{r.ref} ({r.sha256[:12]}, {_size(r.size)})\n{path}", markup=False))


def _relayout(src: Path, dest: Path, layout: str) -> None:
    from mint_server.model.config import ModelError
    from mint_server.model.peft_io import convert_peft_dir

    try:
        convert_peft_dir(src, dest, layout)
    except ModelError as e:
        raise InvalidArgument(f"peft_dir: {e}") from None


def _import(
    target: CatalogLocation, peft_dir: Path, policy: str, base_model: str | None, parent: str | None,
    training_run: str | None, step: int | None, note: str | None,
) -> Revision:
    return target.open().import_peft(
        peft_dir,
        policy,
        base_model=base_model,
        parent=parent,
        training_run=training_run,
        step=step,
        note=note,
    )


# -- catalog maintenance ------------------------------------------------------------------------
catalog_app = typer.Typer(no_args_is_help=True, help="Catalog maintenance and load generation.")


class RateColumn(ProgressColumn):
    """Items per second, over rich's recent-speed window."""

    def render(self, task: Task) -> Text:
        speed = task.finished_speed or task.speed
        return Text(f"{speed:,.0f}/s" if speed else "–/s", style="progress.data.speed")


def progress_bar(label: str, disable: bool) -> Progress:
    """A bar with count, rate and ETA on stderr (stdout keeps the result)."""
    return Progress(TextColumn(label), BarColumn(), MofNCompleteColumn(), RateColumn(), TextColumn("ETA"),
                    TimeRemainingColumn(), console=err, transient=True, disable=disable)


@catalog_app.command("seed")
@command
def catalog_seed(
    target: CatalogLocation,
    policies: Annotated[int, typer.Option("--policies", min=0, help="How many synthetic policies.")],
    revisions_per_policy: Annotated[int, typer.Option("--revisions-per-policy", min=1)] = 1,
    prefix: Annotated[
        str, typer.Option("--prefix", help="Name prefix of the synthetic policies.")
    ] = "synthetic-",
    servable: Annotated[
        bool, typer.Option("--servable", help="Real, distinct adapters for --base-model (local catalogs only).")
    ] = False,
    base_model: Annotated[
        Path | None, typer.Option("--base-model", help="The served base model's dir (with --servable).")
    ] = None,
    rank: Annotated[int, typer.Option("--rank", min=1, help="LoRA rank of servable adapters.")] = 1,
    batch_size: Annotated[
        int | None,
        typer.Option("--batch-size", min=1, help="Policies per transaction (and per pack of blobs with --servable); "
                     "default 1000 servable, 10000 otherwise."),
    ] = None,
    resume: Annotated[
        bool, typer.Option("--resume", help="Seed until the prefix has --policies policies (finish a cut-off seed).")
    ] = False,
) -> None:
    """Bulk-load synthetic policies (each with a revision chain and a `prod` alias), in batches that
    are each atomic."""
    from mint_server.cli.catalog_client import LocalClient

    client = target.open()
    extra: dict[str, Any] = {}
    if servable:
        from mint_server.cli.sweep import servable_payloads
        from mint_server.model.prepare import resolve_base_model

        if not isinstance(client, LocalClient):
            raise InvalidArgument("--servable seeds a local catalog (--data-dir / --db-url), not --server")
        name, lora, payload_for = servable_payloads(resolve_base_model(str(base_model) if base_model else None,
                                                                       target.data_dir), rank)
        extra = {"payload_for": payload_for, "base_model": name, "lora_config": lora}
    if not isinstance(client, LocalClient) and (resume or batch_size):
        raise InvalidArgument("--resume and --batch-size seed a local catalog, not --server")
    with progress_bar("seeding", target.json) as progress:
        task = progress.add_task("seed", total=None if resume else policies)
        update = lambda done: progress.update(task, completed=done)  # noqa: E731
        if isinstance(client, LocalClient):
            from mint_server.catalog.seed import next_index, seed

            if resume:
                progress.update(task, total=max(0, policies - next_index(client.catalog, client.owner, prefix)))
            result = seed(client.catalog, policies, revisions_per_policy, client.owner, prefix=prefix,
                          batch_size=batch_size or (1000 if servable else 10_000), progress=update, resume=resume,
                          **extra)
        else:
            result = client.seed(policies, revisions_per_policy, prefix=prefix, progress=update)
    rate = result.policies / result.seconds if result.seconds else 0.0
    data = {**to_dict(result), "policies_per_second": rate}
    _emit(
        target,
        data,
        lambda: out.print(
            f"seeded {result.policies} policies / {result.revisions} revisions in {result.seconds:.2f}s "
            f"({rate:,.0f} policies/s): {result.first_name} … {result.last_name}",
            markup=False,
        ),
    )


@catalog_app.command("import-many")
@command
def catalog_import_many(
    target: CatalogLocation,
    root: Annotated[Path, typer.Argument(help="A directory whose subdirectories are PEFT LoRA dirs.")],
    prefix: Annotated[str, typer.Option("--prefix", help="Policy name = PREFIX + the subdirectory's name.")] = "",
    base_model: Annotated[
        str | None, typer.Option("--base-model", help="Default: each adapter's base_model_name_or_path.")
    ] = None,
    batch_size: Annotated[int, typer.Option("--batch-size", min=1, help="Adapters per pack and transaction.")] = 500,
) -> None:
    """Import every PEFT dir under ROOT as the next revision of its policy, in atomic batches. Run it
    again to finish a cut-off import: adapters already imported are skipped."""
    from mint_server.cli.catalog_client import LocalClient

    if not root.is_dir():
        raise InvalidArgument(f"{root} is not a directory", field="root")
    items = [(prefix + d.name, d) for d in sorted(root.iterdir()) if d.is_dir() and not d.name.startswith(".")]
    client = target.open()
    if not isinstance(client, LocalClient):
        raise InvalidArgument("import-many imports into a local catalog (--data-dir / --db-url / --store)")
    with progress_bar("importing", target.json) as progress:
        task = progress.add_task("import", total=len(items))
        result = client.catalog.import_many(client.owner, items, base_model=base_model, batch_size=batch_size,
                                            progress=lambda n: progress.update(task, completed=n))
    _emit(target, to_dict(result),
          lambda: out.print(f"imported {result.imported} adapters ({result.skipped} already there)", markup=False))


@catalog_app.command("gc")
@command
def catalog_gc(
    target: CatalogLocation,
    grace_seconds: Annotated[
        float, typer.Option("--grace-seconds", min=0, help="Keep blobs touched this recently.")
    ] = 3600.0,
    dry_run: Annotated[bool, typer.Option("--dry-run", help="Only report what would go.")] = False,
) -> None:
    """Delete blobs no revision references."""
    report = target.open().gc(grace_seconds=grace_seconds, dry_run=dry_run)
    verb = "would remove" if dry_run else "removed"
    _emit(
        target,
        to_dict(report),
        lambda: out.print(
            f"{verb} {report.removed} blobs ({_size(report.freed_bytes)}), kept {report.kept}", markup=False
        ),
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
    _emit(target, {"key": key, **to_dict(record)},
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
        table = _table("key id", "name", "scopes", "created", "revoked")
        for k in keys:
            table.add_row(k.key_id, k.name, ",".join(k.scopes), _when(k.created_at),
                          _when(k.revoked_at) if k.revoked_at else "")
        out.print(table)

    _emit(target, [to_dict(k) for k in keys], render)


@key_app.command("revoke")
@command
def key_revoke(target: CatalogLocation, key_id: Annotated[str, typer.Argument(help="The key id `mint key list` shows.")]) -> None:
    """Revoke a key: its next request, and every token it was traded for, is refused (401)."""
    target.open().revoke_key(key_id)
    _emit(target, {"revoked": key_id}, lambda: out.print(f"revoked {key_id}", markup=False))


def register(app: typer.Typer) -> None:
    app.add_typer(policy_app, name="policy")
    app.add_typer(revision_app, name="revision")
    app.add_typer(alias_app, name="alias")
    app.add_typer(eval_app, name="eval")
    app.add_typer(catalog_app, name="catalog")
    app.add_typer(key_app, name="key")
    app.command("export")(export)
    app.command("import")(import_)
