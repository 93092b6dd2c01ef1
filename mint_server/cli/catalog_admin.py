"""`mint catalog …`: catalog maintenance (garbage collection) and load generation (seed, import-many)."""

from pathlib import Path
from typing import Annotated, Any

import typer
from rich.progress import (
    BarColumn,
    MofNCompleteColumn,
    Progress,
    ProgressColumn,
    Task,
    TextColumn,
    TimeRemainingColumn,
)
from rich.text import Text

# Only the light catalog modules here: `mint` imports this for every command, and the database
# and HTTP layers (SQLAlchemy, httpx) load in CatalogLocation.open, only when a catalog command runs.
from mint_server.catalog.errors import InvalidArgument
from mint_server.catalog.records import to_dict
from mint_server.cli.catalog_command import (
    CatalogLocation,
    command,
    emit,
    err,
    out,
    size_text,
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
    emit(
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
    emit(target, to_dict(result),
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
    emit(
        target,
        to_dict(report),
        lambda: out.print(
            f"{verb} {report.removed} blobs ({size_text(report.freed_bytes)}), kept {report.kept}", markup=False
        ),
    )
