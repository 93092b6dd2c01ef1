"""REST views: training runs, checkpoints (list/delete/publish/TTL/archive), weights_info, sessions."""

from __future__ import annotations

import asyncio
import os
import tarfile
import tempfile
import time
from datetime import UTC, datetime
from email.utils import formatdate
from pathlib import Path
from typing import Any

from fastapi import APIRouter, Query, Request, Response
from fastapi.responses import FileResponse
from starlette.background import BackgroundTask
from tinker import types

from mint_server.api.auth.keys import SERVE, TRAIN, Principal
from mint_server.api.http.openapi import TtlBody, WeightsInfoBody, body_doc
from mint_server.api.http.plumbing import json_body, needs, parse, service
from mint_server.api.state.runs import NotFound
from mint_server.api.tinker.codec import DecodeError
from mint_server.api.tinker.paths import CheckpointRef
from mint_server.model.peft_archive import write_archive_dir

router = APIRouter(prefix="/api/v1")
Limit = Query(20, ge=1, le=1000)
Offset = Query(0, ge=0, le=(1 << 63) - 1)


@router.get("/training_runs")
async def list_runs(
    request: Request, limit: int = Limit, offset: int = Offset, project_id: str | None = None,
    p: Principal = needs(TRAIN),
) -> Any:
    return service(request).checkpoints.list_runs(p, limit, offset, project_id).model_dump(mode="json")


@router.get("/training_runs/{run_id}")
async def get_run(run_id: str, request: Request, p: Principal = needs(TRAIN)) -> Any:
    return service(request).checkpoints.get_run(p, run_id).model_dump(mode="json")


@router.get("/training_runs/{run_id}/checkpoints")
async def list_checkpoints(run_id: str, request: Request, p: Principal = needs(TRAIN)) -> Any:
    return service(request).checkpoints.list_checkpoints(p, run_id).model_dump(mode="json")


@router.get("/checkpoints")
async def list_owner_checkpoints(
    request: Request, limit: int = Query(100, ge=1, le=1000), offset: int = Offset, project_id: str | None = None,
    p: Principal = needs(TRAIN),
) -> Any:
    return service(request).checkpoints.list_owner_checkpoints(p, limit, offset, project_id).model_dump(mode="json")


@router.post("/copy_weights", openapi_extra=body_doc(types.CopyWeightsRequest))
async def copy_weights(request: Request, p: Principal = needs(TRAIN)) -> Any:
    req = await parse(request, types.CopyWeightsRequest)
    out = service(request).checkpoints.copy_weights(p, req, request.headers.get("x-idempotency-key"))
    return out.model_dump(mode="json")


@router.delete("/training_runs/{run_id}/checkpoints/{kind}/{name}", status_code=204)
async def delete_checkpoint(run_id: str, kind: str, name: str, request: Request, p: Principal = needs(TRAIN)) -> Response:
    svc = service(request).checkpoints
    svc.delete(p, svc.ref(run_id, kind, name))
    return Response(status_code=204)


@router.post("/training_runs/{run_id}/checkpoints/{kind}/{name}/publish", status_code=204)
async def publish(run_id: str, kind: str, name: str, request: Request, p: Principal = needs(TRAIN)) -> Response:
    svc = service(request).checkpoints
    svc.set_public(p, svc.ref(run_id, kind, name), True)
    return Response(status_code=204)


@router.delete("/training_runs/{run_id}/checkpoints/{kind}/{name}/publish", status_code=204)
async def unpublish(run_id: str, kind: str, name: str, request: Request, p: Principal = needs(TRAIN)) -> Response:
    svc = service(request).checkpoints
    svc.set_public(p, svc.ref(run_id, kind, name), False)
    return Response(status_code=204)


@router.put("/training_runs/{run_id}/checkpoints/{kind}/{name}/ttl", status_code=204, openapi_extra=body_doc(TtlBody))
async def set_ttl(run_id: str, kind: str, name: str, request: Request, p: Principal = needs(TRAIN)) -> Response:
    body = await json_body(request)
    ttl = body.get("ttl_seconds")
    if ttl is not None and (not isinstance(ttl, int) or isinstance(ttl, bool)):
        raise DecodeError("invalid field 'ttl_seconds': expected an integer or null")
    svc = service(request).checkpoints
    svc.set_ttl(p, svc.ref(run_id, kind, name), ttl)
    return Response(status_code=204)


@router.get("/training_runs/{run_id}/checkpoints/{kind}/{name}/archive")
async def archive_url(run_id: str, kind: str, name: str, request: Request, p: Principal = needs(TRAIN)) -> Response:
    """302 to a short-lived signed URL: the SDK hands the URL out, and whoever fetches it has no key."""
    svc = service(request).checkpoints
    ref = svc.ref(run_id, kind, name)
    svc.readable(p, ref, "archive")
    token, expires = request.app.state.authenticator.issue_download(
        p, {"run": ref.run_id, "kind": ref.kind, "name": ref.name}
    )
    url = str(request.url_for("download_archive", token=token))
    return Response(status_code=302, headers={"Location": url, "Expires": formatdate(expires, usegmt=True)})


@router.get("/training_runs/{run_id}/checkpoints/{kind}/{name}/external_weights_urls")
async def external_weights_urls(run_id: str, kind: str, name: str, request: Request,
                                p: Principal = needs(TRAIN)) -> Any:
    """One signed URL per file of an external weights checkpoint (what `weights.download` and
    `tinker checkpoint download` fetch, with no key): served here, valid until `expires`."""
    svc = service(request).checkpoints
    ref = svc.ref(run_id, kind, name)
    rec, files = svc.external_files(p, ref)
    lifetime = service(request).core.settings.download_url_ttl_s
    urls, expires = {}, 0
    for f in files:
        token, expires = request.app.state.authenticator.issue_download(
            p, {"run": ref.run_id, "kind": ref.kind, "name": ref.name, "file": f,
             "created": rec.created_at}, lifetime_s=lifetime,
        )
        urls[f] = str(request.url_for("download_external_file", token=token, file=f))
    expires_at = datetime.fromtimestamp(expires or time.time() + lifetime, UTC)
    return types.ExternalWeightsUrlsResponse(urls=urls, expires=expires_at).model_dump(mode="json")


@router.get("/external_weights/{token}/{file:path}", name="download_external_file")
async def download_external_file(token: str, file: str, request: Request) -> Response:
    claims = request.app.state.authenticator.verify_download(token)
    if claims is None or claims.get("file") != file:
        raise NotFound("download link is invalid or has expired")
    ref = CheckpointRef(claims["run"], claims["kind"], claims["name"])
    path = service(request).checkpoints.external_file(claims["sub"], ref, claims["created"], file)
    return FileResponse(path, media_type="application/octet-stream", filename=path.name)


@router.get("/archives/{token}", name="download_archive")
async def download_archive(token: str, request: Request) -> Response:
    claims = request.app.state.authenticator.verify_download(token)
    if claims is None or "file" in claims:  # a file URL of external weights is not an archive link
        raise NotFound("download link is invalid or has expired")
    svc = service(request).checkpoints
    ref = CheckpointRef(claims["run"], claims["kind"], claims["name"])
    peft_dir, cleanup = await svc.peft_dir(claims["sub"], ref)
    try:
        archive = await asyncio.to_thread(_archive, peft_dir, svc.tied_embeddings(), svc.stores.ephemeral_root)
    finally:
        cleanup()
    return FileResponse(
        archive,
        media_type="application/gzip",
        filename=f"{ref.name}.tar.gz",
        background=BackgroundTask(os.unlink, archive),
    )


def _archive(peft_dir: Path, tied_embeddings: bool, scratch: Path) -> str:
    """The checkpoint's adapter as a .tar.gz, with the names archives use (see model/peft_archive.py),
    in `scratch` (emptied at startup: a kill mid-download leaves nothing behind for good)."""
    with tempfile.TemporaryDirectory(prefix="archive-", dir=scratch) as tmp:
        write_archive_dir(peft_dir, Path(tmp), tied_embeddings)
        return _tar_gz(Path(tmp), scratch)


def _tar_gz(src: Path, scratch: Path) -> str:
    """The files of `src` at the archive root, as PEFT's from_pretrained expects after extraction."""
    fd, path = tempfile.mkstemp(suffix=".tar.gz", dir=scratch)
    os.close(fd)
    with tarfile.open(path, "w:gz") as tar:
        for f in sorted(src.rglob("*")):
            if f.is_file():
                tar.add(f, arcname=str(f.relative_to(src)))
    return path


@router.post("/weights_info", openapi_extra=body_doc(WeightsInfoBody))
async def weights_info(request: Request, p: Principal = needs(SERVE)) -> Any:
    body = await json_body(request)
    path = body.get("tinker_path")
    if not isinstance(path, str):
        raise DecodeError("missing field 'tinker_path'")
    return service(request).checkpoints.weights_info(p, path).model_dump(mode="json")


@router.get("/sessions")
async def list_sessions(request: Request, limit: int = Limit, offset: int = Offset, p: Principal = needs(TRAIN)) -> Any:
    return service(request).checkpoints.list_sessions(p, limit, offset).model_dump(mode="json")


@router.get("/sessions/{session_id}")
async def get_session(session_id: str, request: Request, p: Principal = needs(TRAIN)) -> Any:
    return service(request).checkpoints.session_view(p, session_id).model_dump(mode="json")
