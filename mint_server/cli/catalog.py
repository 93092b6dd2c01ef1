"""`mint policy|revision|alias|eval …`: the policy catalog from the shell (and `register`, which adds
those, `export|import` (cli/transfer.py), `catalog …` (cli/catalog_admin.py) and `key …`
(cli/keys.py) to `mint`).

Every command works on a local catalog (--data-dir / --db-url) or on a running
server (--server URL --api-key KEY, owner implied by the key; the key defaults to $MINT_API_KEY,
$TINKER_API_KEY, else the api_key file `mint serve` keeps in the data dir). Output is rich tables,
or JSON with --json. Errors are one line on stderr and exit status 2.
"""

import json
from typing import Annotated

import typer

# Only the light catalog modules here: `mint` imports this for every command, and the database
# and HTTP layers (SQLAlchemy, httpx) load in CatalogLocation.open, only when a catalog command runs.
from mint_server.catalog.errors import InvalidArgument
from mint_server.catalog.records import page_to_dict, to_dict
from mint_server.cli.catalog_admin import catalog_app
from mint_server.cli.catalog_command import (
    AllPages,
    CatalogLocation,
    Cursor,
    Limit,
    command,
    emit,
    fetch_pages,
    new_table,
    next_hint,
    out,
    parse_json_object,
    print_kv,
    revision_table,
    size_text,
    when,
)
from mint_server.cli.keys import key_app
from mint_server.cli.transfer import export, import_

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
        page = fetch_pages(catalog.list_all_policies, cursor, limit, all_pages)
    else:
        page = fetch_pages(client.list_policies, cursor, limit, all_pages)

    def render() -> None:
        table = new_table(*(("owner",) if all_owners else ()), "name", "base model", "rank", "created")
        for p in page.items:
            owner = (p.owner[:12],) if all_owners else ()
            table.add_row(*owner, p.name, p.base_model, str(p.lora_config.get("rank", "")), when(p.created_at))
        out.print(table)
        next_hint(page)

    emit(target, page_to_dict(page), render)


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
        print_kv(
            [
                ("name", policy.name),
                ("owner", policy.owner),
                ("base model", policy.base_model),
                ("lora config", json.dumps(policy.lora_config)),
                ("metadata", json.dumps(policy.metadata)),
                ("created", when(policy.created_at)),
                ("latest", latest[0].ref if latest else "(no revisions)"),
                ("aliases", ", ".join(f"{a.name}→{a.revision}" for a in aliases) or "(none)"),
            ]
        )

    emit(target, data, render)


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
    config = parse_json_object(lora_config, "lora_config") or {}
    if rank is not None:
        config["rank"] = rank
    policy = target.open().create_policy(
        name, base_model, config, parse_json_object(metadata, "metadata"), exist_ok=exist_ok
    )
    emit(
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
    page = fetch_pages(lambda **kw: client.list_revisions(name, **kw), cursor, limit, all_pages)

    def render() -> None:
        out.print(revision_table(page.items))
        next_hint(page)

    emit(target, page_to_dict(page), render)


@revision_app.command("show")
@command
def revision_show(
    target: CatalogLocation, ref: Annotated[str, typer.Argument(help="NAME, NAME@N, NAME@ALIAS or NAME@SHA.")]
) -> None:
    """Show one revision."""
    r = target.open().resolve(ref)
    rows = [
        ("revision", r.ref), ("sha256", r.sha256), ("size", f"{size_text(r.size)} ({r.size} bytes)"), ("rank", r.rank),
        ("parent", r.parent), ("training run", r.training_run), ("step", r.step), ("note", r.note),
        ("base precision", r.base_precision), ("created", when(r.created_at)),
    ]  # fmt: skip
    emit(target, to_dict(r), lambda: print_kv(rows))


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
    page = fetch_pages(lambda **kw: client.lineage(ref, **kw), cursor, limit, all_pages)

    def render() -> None:
        out.print(revision_table(page.items))
        next_hint(page)

    emit(target, page_to_dict(page), render)


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
    emit(
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
    emit(
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
    page = fetch_pages(lambda **kw: client.alias_history(name, alias, **kw), cursor, limit, all_pages)

    def render() -> None:
        table = new_table("at", "action", "from", "to", "actor", "reason")
        for e in page.items:
            table.add_row(
                when(e.at), e.action, "" if e.from_revision is None else str(e.from_revision),
                str(e.to_revision), e.actor, e.reason or "",
            )  # fmt: skip
        out.print(table)
        next_hint(page)

    emit(target, page_to_dict(page), render)


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
    page = fetch_pages(lambda **kw: client.list_aliases(name, **kw), cursor, limit, all_pages)

    def render() -> None:
        table = new_table("alias", "revision", "updated")
        for a in page.items:
            table.add_row(a.name, f"{a.policy}@{a.revision}", when(a.updated_at))
        out.print(table)
        next_hint(page)

    emit(target, page_to_dict(page), render)


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
    emit(target, to_dict(e), lambda: out.print(f"{e.revision} {e.metric}={e.value:g}", markup=False))


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
    page = fetch_pages(lambda **kw: client.list_evals(ref, metric=metric, **kw), cursor, limit, all_pages)

    def render() -> None:
        table = new_table("revision", "metric", "value", "dataset", "recorded")
        for e in page.items:
            table.add_row(e.revision, e.metric, f"{e.value:g}", e.dataset or "", when(e.created_at))
        out.print(table)
        next_hint(page)

    emit(target, page_to_dict(page), render)


def register(app: typer.Typer) -> None:
    app.add_typer(policy_app, name="policy")
    app.add_typer(revision_app, name="revision")
    app.add_typer(alias_app, name="alias")
    app.add_typer(eval_app, name="eval")
    app.add_typer(catalog_app, name="catalog")
    app.add_typer(key_app, name="key")
    app.command("export")(export)
    app.command("import")(import_)
