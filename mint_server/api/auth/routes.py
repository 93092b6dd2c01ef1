"""Scoped API keys over HTTP, for callers holding the `admin` scope: create (the key is shown once,
in the answer), list (never the key), revoke (effective on the key's next request).

Keys made here act as the admin's own owner: an admin hands out narrower keys to its own data, and
another owner's keys look absent.
"""

from __future__ import annotations

import asyncio
from typing import Any

from fastapi import APIRouter, Query, Request, Response
from pydantic import BaseModel, ConfigDict

from mint_server.api import KEYS_PREFIX
from mint_server.api.auth.keys import ADMIN, SCOPES, Principal, issue_key
from mint_server.api.http.openapi import body_doc
from mint_server.api.http.plumbing import needs, parse, service
from mint_server.catalog.keys import KeyStore
from mint_server.catalog.records import to_dict

router = APIRouter(prefix=KEYS_PREFIX)


class CreateKeyBody(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)

    name: str
    scopes: list[str]  # of SCOPES; each includes the ones before it


def _store(request: Request) -> KeyStore:
    return request.app.state.authenticator.keys


@router.post("", status_code=201, openapi_extra=body_doc(CreateKeyBody))
async def create_key(request: Request, p: Principal = needs(ADMIN)) -> dict[str, Any]:
    """A new key for the caller's owner; `key` is in this answer only. Scopes: one or more of
    `serve`, `train`, `admin`."""
    body = await parse(request, CreateKeyBody)
    record, key = await asyncio.to_thread(issue_key, _store(request), p.owner, body.name, body.scopes)
    service(request).core.stores.meter.audit(p.owner, "organization_api_key_created", key_id=record.key_id,
                                             name=record.name, scopes=record.scopes, actor=p.urn)
    return {"key": key, **to_dict(record)}


@router.get("")
async def list_keys(request: Request, include_revoked: bool = Query(False),
                    p: Principal = needs(ADMIN)) -> dict[str, Any]:  # fmt: skip
    keys = await asyncio.to_thread(_store(request).list, p.owner, include_revoked=include_revoked)
    return {"keys": [to_dict(k) for k in keys], "scopes": list(SCOPES)}


@router.delete("/{key_id}", status_code=204)
async def revoke_key(key_id: str, request: Request, p: Principal = needs(ADMIN)) -> Response:
    await asyncio.to_thread(_store(request).revoke, p.owner, key_id)
    service(request).core.stores.meter.audit(p.owner, "organization_api_key_revoked", key_id=key_id, actor=p.urn)
    return Response(status_code=204)
