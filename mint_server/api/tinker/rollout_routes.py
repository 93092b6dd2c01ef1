"""Rollout control over HTTP (MinT routes; tinker has no call for them): pause, resume and abort a
policy's or a sampling session's sampling, and list what is paused. Rules in rollouts.py."""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter, Request

from mint_server.api.auth.keys import SERVE, Principal
from mint_server.api.http.openapi import body_doc
from mint_server.api.http.plumbing import needs, parse, service
from mint_server.api.tinker.rollouts import AbortRequest, PauseRequest, RolloutTarget

router = APIRouter(prefix="/api/v1/mint/sampling", tags=["rollout control"])


@router.post("/pause", openapi_extra=body_doc(PauseRequest))
async def pause(request: Request, p: Principal = needs(SERVE)) -> dict[str, Any]:
    """Hold the target's new sample requests (accepted, queued) until resumed or `timeout_s`."""
    req = await parse(request, PauseRequest)
    return service(request).rollouts.pause(p, req).model_dump()


@router.post("/resume", openapi_extra=body_doc(RolloutTarget))
async def resume(request: Request, p: Principal = needs(SERVE)) -> dict[str, Any]:
    """Release the target's held requests (a target not paused: `paused` false all the same)."""
    req = await parse(request, RolloutTarget)
    return service(request).rollouts.resume(p, req).model_dump()


@router.post("/abort", openapi_extra=body_doc(AbortRequest))
async def abort(request: Request, p: Principal = needs(SERVE)) -> dict[str, Any]:
    """Cancel every pending request of the target now: queued ones dropped, running ones end at the
    engine's next step and free their KV blocks."""
    req = await parse(request, AbortRequest)
    return service(request).rollouts.abort(p, req).model_dump()


@router.get("/pauses")
async def pauses(request: Request, p: Principal = needs(SERVE)) -> dict[str, Any]:
    return {"paused": service(request).rollouts.paused(p)}
