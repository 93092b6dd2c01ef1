"""`mint export` and `mint import`: a catalog revision to and from a PEFT directory (or a merged
checkpoint, or an archive)."""

from pathlib import Path
from typing import Annotated

import typer

# Only the light catalog modules here: `mint` imports this for every command, and the database
# and HTTP layers (SQLAlchemy, httpx) load in CatalogLocation.open, only when a catalog command runs.
from mint_server.catalog.errors import InvalidArgument
from mint_server.catalog.records import Revision, to_dict
from mint_server.cli.catalog_command import (
    CatalogLocation,
    command,
    emit,
    out,
    size_text,
)


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
    emit(target, data, lambda: out.print(f"{r.ref} ({r.sha256[:12]}) → {dest}", markup=False))


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
    emit(target, data, lambda: out.print(
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
    emit(target, {**to_dict(r), "path": path},
          lambda: out.print(f"{r.ref} ({r.sha256[:12]}, {size_text(r.size)})\n{path}", markup=False))


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
