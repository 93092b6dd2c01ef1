"""HTTP routes for the catalog: `make_catalog_router(...)` returns an APIRouter that the service
mounts under CATALOG_PREFIX. The service supplies the owner (from the API key) through a FastAPI
dependency; every route is scoped to that owner.

Errors are answered by the app's handlers (http.py) as JSON `{"detail", "error", "field"}`; the
CLI's HTTP client (cli/catalog_client.py) raises the same exception class from "error".
"""

# No `from __future__ import annotations` here: FastAPI must see the real Annotated types of the
# route parameters, which are built inside make_catalog_router.
import shutil
import tempfile
from collections.abc import Callable, Collection
from pathlib import Path
from typing import Annotated, Any

from fastapi import APIRouter, Depends, Query, Request
from fastapi.responses import FileResponse
from pydantic import BaseModel, Field
from starlette.background import BackgroundTask
from starlette.concurrency import run_in_threadpool

from mint_server.api.http.jsonsafe import INT64_MAX
from mint_server.api.http.plumbing import BodyTooLarge, CheckedRoute
from mint_server.catalog import archive
from mint_server.catalog import seed as seeding
from mint_server.catalog.catalog import Catalog
from mint_server.catalog.cursor import DEFAULT_LIMIT, MAX_LIMIT
from mint_server.catalog.errors import InvalidArgument
from mint_server.catalog.records import page_to_dict, to_dict

DEFAULT_MAX_UPLOAD_BYTES = 8 << 30


class CreatePolicyBody(BaseModel):
    name: str = Field(max_length=128)
    base_model: str = Field(max_length=512)
    # Checked by the catalog (rank, alpha, dropout, target_modules, train_*: typed and in range).
    lora_config: dict[str, Any] = Field(default_factory=dict)
    metadata: dict[str, Any] = Field(default_factory=dict)
    exist_ok: bool = False  # return the existing policy instead of 409


class SetAliasBody(BaseModel):
    revision: int | str  # a number, or anything after '@' in a reference (alias, sha prefix)
    reason: str | None = None


class RollbackBody(BaseModel):
    reason: str | None = None


class EvalBody(BaseModel):
    metric: str
    value: float = Field(allow_inf_nan=False)
    dataset: str | None = None


class SeedBody(BaseModel):
    policies: int = Field(ge=0, le=10_000_000)
    revisions_per_policy: int = Field(default=1, ge=1, le=1000)
    prefix: str = "synthetic-"


def make_catalog_router(
    get_catalog: Callable[[], Catalog],
    owner_dependency: Callable[..., Any],
    *,
    actor_dependency: Callable[..., Any] | None = None,
    enable_seed: bool = False,
    max_upload_bytes: int = DEFAULT_MAX_UPLOAD_BYTES,
    served_base_models: Collection[str] | None = None,
    scratch_dir: Path | None = None,
) -> APIRouter:
    """Routes for every catalog operation.

    get_catalog: returns the service's Catalog (called per request; cheap).
    owner_dependency: FastAPI dependency returning the owner id (raises 401 itself).
    actor_dependency: who is recorded on alias moves; defaults to the owner.
    enable_seed: expose POST /seed (bulk synthetic load) — for test and benchmark deployments only.
    served_base_models: the base models a policy may be created for (None: any); a policy for a
    model this server does not serve could never be sampled.
    scratch_dir: where uploads and exports are unpacked and packed (None: the system temp dir); the
    service gives a dir it empties at startup, so what a killed server left there is not kept.
    """
    router = APIRouter(route_class=CheckedRoute)

    def check_base_model(base_model: str | None) -> None:
        if served_base_models is not None and base_model is not None and base_model not in served_base_models:
            served = ", ".join(repr(m) for m in served_base_models)
            raise InvalidArgument(
                f"base_model {base_model!r} is not served here (this server serves {served})", field="base_model"
            )
    Owner = Annotated[str, Depends(owner_dependency)]

    def _default_actor(owner: Owner) -> str:
        return owner

    Actor = Annotated[str, Depends(actor_dependency or _default_actor)]
    Cursor = Annotated[str | None, Query(description="next_cursor from the previous page")]
    Limit = Annotated[int, Query(ge=1, le=MAX_LIMIT)]

    # -- policies ---------------------------------------------------------------------------
    @router.get("/policies")
    def list_policies(owner: Owner, cursor: Cursor = None, limit: Limit = DEFAULT_LIMIT) -> dict[str, Any]:
        return page_to_dict(get_catalog().list_policies(owner, cursor=cursor, limit=limit))

    @router.post("/policies", status_code=201)
    def create_policy(owner: Owner, body: CreatePolicyBody) -> dict[str, Any]:
        check_base_model(body.base_model)
        create = get_catalog().get_or_create_policy if body.exist_ok else get_catalog().create_policy
        return to_dict(create(owner, body.name, body.base_model, body.lora_config, body.metadata))

    @router.get("/policies/{name}")
    def get_policy(owner: Owner, name: str) -> dict[str, Any]:
        return to_dict(get_catalog().get_policy(owner, name))

    @router.get("/policies/{name}/revisions")
    def list_revisions(
        owner: Owner, name: str, cursor: Cursor = None, limit: Limit = DEFAULT_LIMIT
    ) -> dict[str, Any]:
        return page_to_dict(get_catalog().list_revisions(owner, name, cursor=cursor, limit=limit))

    archive_body = {"type": "string", "format": "binary", "description": "a tar or zip of a PEFT directory"}

    @router.post(
        "/policies/{name}/revisions", status_code=201,
        openapi_extra={"requestBody": {"required": True, "content": {
            media: {"schema": archive_body} for media in ("application/octet-stream", "application/x-tar")}}},
    )
    async def import_revision(
        owner: Owner,
        name: str,
        request: Request,
        base_model: str | None = None,
        parent: str | None = None,
        training_run: str | None = None,
        step: Annotated[int | None, Query(ge=0, le=INT64_MAX)] = None,
        note: str | None = None,
    ) -> dict[str, Any]:
        """Publish a PEFT directory uploaded as the request body: a tar or zip archive."""
        check_base_model(base_model)
        workdir = Path(tempfile.mkdtemp(prefix="mint-import-", dir=scratch_dir))
        try:
            upload = workdir / "upload"
            size = 0
            with open(upload, "wb") as out:
                async for chunk in request.stream():
                    size += len(chunk)
                    if size > max_upload_bytes:
                        raise BodyTooLarge(f"upload exceeds the {max_upload_bytes}-byte limit")
                    out.write(chunk)
            if size == 0:
                raise InvalidArgument(
                    "request body must be a tar or zip archive of a PEFT directory", field="archive"
                )

            def publish() -> dict[str, Any]:
                root = archive.unpack(upload, workdir / "peft", max_bytes=max_upload_bytes * 4)
                revision = get_catalog().import_peft(
                    owner,
                    root,
                    name,
                    base_model=base_model,
                    parent=parent,
                    training_run=training_run,
                    step=step,
                    note=note,
                )
                return to_dict(revision)

            return await run_in_threadpool(publish)
        finally:
            shutil.rmtree(workdir, ignore_errors=True)

    # -- aliases ----------------------------------------------------------------------------
    @router.get("/policies/{name}/aliases")
    def list_aliases(
        owner: Owner, name: str, cursor: Cursor = None, limit: Limit = DEFAULT_LIMIT
    ) -> dict[str, Any]:
        return page_to_dict(get_catalog().list_aliases(owner, name, cursor=cursor, limit=limit))

    @router.get("/policies/{name}/aliases/{alias}")
    def get_alias(owner: Owner, name: str, alias: str) -> dict[str, Any]:
        return to_dict(get_catalog().get_alias(owner, name, alias))

    @router.put("/policies/{name}/aliases/{alias}")
    def set_alias(owner: Owner, actor: Actor, name: str, alias: str, body: SetAliasBody) -> dict[str, Any]:
        return to_dict(
            get_catalog().set_alias(owner, name, alias, body.revision, actor=actor, reason=body.reason)
        )

    @router.post("/policies/{name}/aliases/{alias}/rollback")
    def rollback_alias(
        owner: Owner, actor: Actor, name: str, alias: str, body: RollbackBody | None = None
    ) -> dict[str, Any]:
        reason = body.reason if body else None
        return to_dict(get_catalog().rollback_alias(owner, name, alias, actor=actor, reason=reason))

    @router.get("/policies/{name}/aliases/{alias}/history")
    def alias_history(
        owner: Owner, name: str, alias: str, cursor: Cursor = None, limit: Limit = DEFAULT_LIMIT
    ) -> dict[str, Any]:
        return page_to_dict(get_catalog().alias_history(owner, name, alias, cursor=cursor, limit=limit))

    # -- revisions by reference ---------------------------------------------------------------
    @router.get("/revisions/{ref}")
    def resolve(owner: Owner, ref: str) -> dict[str, Any]:
        """NAME (latest), NAME@N, NAME@ALIAS or NAME@<sha prefix>."""
        return to_dict(get_catalog().resolve(owner, ref))

    @router.get("/revisions/{ref}/lineage")
    def lineage(
        owner: Owner, ref: str, cursor: Cursor = None, limit: Limit = DEFAULT_LIMIT
    ) -> dict[str, Any]:
        return page_to_dict(get_catalog().lineage(owner, ref, cursor=cursor, limit=limit))

    @router.get("/revisions/{ref}/archive")
    def export(
        owner: Owner, ref: str, fmt: Annotated[archive.Format, Query(alias="format")] = "tar"
    ) -> FileResponse:
        """The revision's PEFT directory as a tar or zip (files at the top level)."""
        catalog = get_catalog()
        revision = catalog.resolve(owner, ref)
        workdir = Path(tempfile.mkdtemp(prefix="mint-export-", dir=scratch_dir))
        try:
            catalog.materialize(revision, workdir / "peft")  # verified before anything is sent
            packed = archive.pack(workdir / "peft", workdir / f"export.{fmt}", fmt)
        except BaseException:
            shutil.rmtree(workdir, ignore_errors=True)
            raise
        return FileResponse(
            packed,
            media_type=archive.MEDIA_TYPES[fmt],
            filename=f"{revision.policy}-{revision.number}.{fmt}",
            headers={"X-Mint-Revision": revision.ref, "X-Mint-Sha256": revision.sha256},
            background=BackgroundTask(shutil.rmtree, workdir, ignore_errors=True),
        )

    @router.get("/revisions/{ref}/evals")
    def list_evals(
        owner: Owner, ref: str, metric: str | None = None, cursor: Cursor = None, limit: Limit = DEFAULT_LIMIT
    ) -> dict[str, Any]:
        return page_to_dict(get_catalog().list_evals(owner, ref, metric=metric, cursor=cursor, limit=limit))

    @router.post("/revisions/{ref}/evals", status_code=201)
    def record_eval(owner: Owner, ref: str, body: EvalBody) -> dict[str, Any]:
        return to_dict(get_catalog().record_eval(owner, ref, body.metric, body.value, dataset=body.dataset))

    if enable_seed:

        @router.post("/seed", status_code=201)
        def seed(owner: Owner, body: SeedBody) -> dict[str, Any]:
            result = seeding.seed(get_catalog(), body.policies, body.revisions_per_policy, owner, prefix=body.prefix)
            return to_dict(result)

    return router
