"""The rest of tinker 0.38's REST surface — the `AdminClient` routes (audit log, usage events,
checkpoint storage), session search, moving a session into a project, trace export (refused), the
key check `tinker auth login` makes — and MinT's run metrics and evals. Handlers only decode, call the service, and encode."""

from __future__ import annotations

import asyncio
from typing import Any

from fastapi import APIRouter, Query, Request, Response
from tinker import types

from mint_server.api.auth.keys import ADMIN, SERVE, TRAIN, Principal
from mint_server.api.http.openapi import ProjectBody, body_doc
from mint_server.api.http.plumbing import json_body, needs, parse, service
from mint_server.api.tinker.mint_types import EvalRequest, RunMetricsReport
from mint_server.api.tinker.validate import InvalidInput

router = APIRouter(prefix="/api/v1")
CONFIGURED_KEY_NAME = "configured key"  # keys given to `mint serve` have no name of their own
TRACE_EXPORT_UNSUPPORTED = (
    "trace export is not supported by this server: MinT keeps no per-request timeline of a session "
    "(its Prometheus metrics at /metrics and the dashboard's run curves are what it records)"
)


@router.get("/auth/apikey/me")
async def my_api_key(request: Request, p: Principal = needs(SERVE)) -> dict[str, Any]:
    """The presented key's public record, as `tinker auth login` checks a pasted key: its id (the
    key id read as a number; a configured key's owner-id prefix), name, and who it is (its URN, in
    the `email` the CLI prints, and its tenant)."""
    name = CONFIGURED_KEY_NAME
    if p.key_id is not None and (found := await asyncio.to_thread(request.app.state.authenticator.keys.get, p.key_id)):
        name = found[0].name
    return {"key_id": int(p.key_id or p.owner[:16], 16), "name": name, "note": "",
            "details": {"org_details": {"name": f"tenant {p.owner[:12]}"}, "user_details": {"email": p.urn}}}


@router.delete("/auth/apikey/me", status_code=204)
async def revoke_my_api_key(request: Request, p: Principal = needs(SERVE)) -> Response:
    """Revoke the presented scoped key itself (`tinker auth logout` of a key minted for the CLI)."""
    if p.key_id is None:
        raise InvalidInput("this key is configured on the server (--api-key, MINT_API_KEYS); it cannot revoke itself")
    await asyncio.to_thread(request.app.state.authenticator.keys.revoke, p.owner, p.key_id)
    service(request).core.stores.meter.audit(p.owner, "organization_api_key_revoked", key_id=p.key_id, actor=p.urn)
    return Response(status_code=204)


@router.get("/audit")
async def audit_log(request: Request, event_type: str = "all", day: str | None = None,
                    p: Principal = needs(ADMIN)) -> Any:
    """The tenant's audit events of one UTC day (default today): `checkpoint_*`, `project_*`,
    `organization_*` (API keys)."""
    return (await service(request).admin.audit_log(p, event_type, day)).model_dump(mode="json")


@router.get("/billing/usage/events")
async def usage_events(request: Request, starting_on: str = Query(...), ending_before: str = Query(...),
                       p: Principal = needs(ADMIN)) -> Any:
    """Hourly usage (tokens trained, prefilled and sampled; checkpoints saved; storage), no prices."""
    query = {"starting_on": starting_on, "ending_before": ending_before}
    return (await service(request).admin.usage_events(p, query)).model_dump(mode="json")


@router.get("/billing/usage/checkpoints/current")
async def checkpoint_storage(request: Request, project_id: str | None = None, p: Principal = needs(ADMIN)) -> Any:
    return service(request).admin.storage(p, project_id).model_dump(mode="json")


@router.post("/sessions/search", openapi_extra=body_doc(types.SessionSearchRequest))
async def search_sessions(request: Request, p: Principal = needs(TRAIN)) -> Any:
    req = await parse(request, types.SessionSearchRequest)
    return service(request).admin.search_sessions(p, req).model_dump(mode="json")


@router.put("/sessions/{session_id}/project", status_code=204, openapi_extra=body_doc(ProjectBody))
async def assign_session_project(session_id: str, request: Request, p: Principal = needs(TRAIN)) -> Response:
    service(request).admin.assign_project(p, session_id, await json_body(request))
    return Response(status_code=204)


@router.get("/sessions/{session_id}/trace_export")
async def trace_export(session_id: str, request: Request, p: Principal = needs(TRAIN)) -> dict[str, Any]:
    """Answered as a failed export (the SDK raises it at once, naming the reason)."""
    service(request).core.stores.sessions.get(session_id, p.owner)  # another key's session: 404
    return {"status": "failed", "error": TRACE_EXPORT_UNSUPPORTED}


@router.get("/mint/runs/{run_id}/metrics")
async def run_metrics(run_id: str, request: Request, after: int = Query(0, ge=0, le=1 << 40),
                      p: Principal = needs(TRAIN)) -> dict[str, Any]:
    """The run's per-step records from line `after` on, and `next` to pass as `after` next time."""
    return service(request).admin.run_metrics(p.owner, run_id, after)


@router.post("/mint/runs/{run_id}/metrics", openapi_extra=body_doc(RunMetricsReport))
async def report_run_metrics(run_id: str, request: Request, p: Principal = needs(TRAIN)) -> dict[str, Any]:
    return service(request).admin.report_metrics(p, run_id, await parse(request, RunMetricsReport))


@router.post("/mint/evals", openapi_extra=body_doc(EvalRequest))
async def start_eval(request: Request, p: Principal = needs(TRAIN)) -> dict[str, Any]:
    """An eval comparing revisions: a future whose result (retrieve_future) is an `EvalResponse`."""
    future = service(request).evals.start(p, await parse(request, EvalRequest))
    return future.model_dump(mode="json", exclude_none=True)
