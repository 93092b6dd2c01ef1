"""Client bootstrap, sessions, futures, telemetry, health and metrics."""

from __future__ import annotations

import asyncio
from typing import Any

from fastapi import APIRouter, Request, Response
from fastapi.responses import PlainTextResponse
from pydantic import BaseModel
from tinker import types
from tinker.types.try_again_response import TryAgainResponse

from mint_server.api.auth.keys import SERVE, Principal
from mint_server.api.http.jsonsafe import SafeJSONResponse as JSONResponse
from mint_server.api.http.openapi import CancelFutureBody, body_doc
from mint_server.api.http.plumbing import json_body, needs, parse, service
from mint_server.api.tinker import codec
from mint_server.engine.interface import EngineError, SampleCancelled, advertised_settings

router = APIRouter(prefix="/api/v1")
FINISH_REASONS = ("success", "errored", "interrupted")  # what a client may say when it finishes a session
PROTO = "application/x-protobuf"


@router.get("/healthz")
async def healthz() -> dict[str, str]:
    return {"status": "ok"}


@router.post("/client/config", openapi_extra=body_doc(types.ClientConfigRequest))
async def client_config(request: Request, p: Principal = needs(SERVE)) -> dict[str, Any]:
    req = await parse(request, types.ClientConfigRequest)
    # Advertise only what this server implements; every other flag keeps the SDK default.
    return types.ClientConfigResponse(
        # `sk-` keys only work through JWT exchange on tinker 0.22; tinker 0.38 reads `whoami` from
        # the exchanged token's claims, so its clients exchange too.
        pjwt_auth_enabled=p.wants_jwt or reads_identity_claims(req.sdk_version),
        use_pyqwest_transport=False,
        parallel_fwdbwd_chunks=True,
        proto_compress_fwdbwd=True,
        sample_use_retrieve_futures=True,
        custom_loss_server_side=True,
        sample_join_sampling_session=False,
    ).model_dump(mode="json")


def reads_identity_claims(sdk_version: str | None) -> bool:
    """Whether an SDK of this version reads `whoami` from its JWT (tinker 0.38 on)."""
    parts = (sdk_version or "").split(".")
    try:
        return (int(parts[0]), int(parts[1])) >= (0, 38)
    except (ValueError, IndexError):
        return False


@router.post("/client/dynamic_config", openapi_extra=body_doc(types.ClientConfigRequest))
async def client_dynamic_config(request: Request, _p: Principal = needs(SERVE)) -> dict[str, Any]:
    await parse(request, types.ClientConfigRequest)
    return types.ClientDynamicConfigResponse(sample_cancel_enabled=True).model_dump(mode="json")


@router.post("/auth/token")
async def auth_token(request: Request, p: Principal = needs(SERVE)) -> dict[str, str]:
    return {"jwt": request.app.state.authenticator.issue_jwt(p)}


@router.get("/get_server_capabilities")
async def capabilities(request: Request, _p: Principal = needs(SERVE)) -> dict[str, Any]:
    engine = service(request).engine
    model = types.SupportedModel(
        model_name=engine.base_model, max_context_length=engine.max_context, trainable=True, sampleable=True
    )
    body = types.GetServerCapabilitiesResponse(supported_models=[model]).model_dump(mode="json")
    # MinT's addition (the SDK's model ignores it): the settings EngineSettings marks `advertise`,
    # bounded by the loaded model where it bounds them (engine/settings.py, docs/engine.md).
    body["engine_settings"] = advertised_settings(engine.settings, engine.limits)
    return body


@router.post("/create_session", openapi_extra=body_doc(types.CreateSessionRequest))
async def create_session(request: Request, p: Principal = needs(SERVE)) -> dict[str, Any]:
    req = await parse(request, types.CreateSessionRequest)
    session_id = service(request).create_session(p, req.user_metadata, req.display_name, req.project_id)
    return types.CreateSessionResponse(session_id=session_id).model_dump(mode="json")


@router.post("/session_heartbeat", openapi_extra=body_doc(types.SessionHeartbeatRequest))
async def session_heartbeat(request: Request, p: Principal = needs(SERVE)) -> dict[str, Any]:
    req = await parse(request, types.SessionHeartbeatRequest)
    service(request).core.stores.sessions.heartbeat(req.session_id, p.owner)
    return types.SessionHeartbeatResponse().model_dump(mode="json")


@router.post("/sessions/{session_id}/finish", status_code=204)
async def finish_session(session_id: str, request: Request, p: Principal = needs(SERVE)) -> Response:
    reason = (await json_body(request)).get("reason")
    kind = reason.get("type") if isinstance(reason, dict) else None
    service(request).finish_session(p, session_id, kind if kind in FINISH_REASONS else None)
    return Response(status_code=204)


@router.post("/telemetry")
async def telemetry(_p: Principal = needs(SERVE)) -> dict[str, str]:
    # Accepted and dropped: the body is never read, so it cannot cost us anything but the upload.
    return {"status": "accepted"}


@router.post("/retrieve_future", openapi_extra=body_doc(types.FutureRetrieveRequest))
async def retrieve_future(request: Request, p: Principal = needs(SERVE)) -> Response:
    req = await parse(request, types.FutureRetrieveRequest)
    svc = service(request)
    entry = await svc.core.stores.futures.wait(req.request_id, p.owner, svc.core.settings.long_poll_s)
    if not entry.future.done():
        state = svc.core.admission.queue_state(p.owner)
        # A key-wide pause names the cause; otherwise a request behind others' work gets MinT's queue fields.
        if state == "active" and (queued := svc.core.work.queue_position(req.request_id)) is not None:
            return _queued_response(req.request_id, *queued)
        body = TryAgainResponse(request_id=req.request_id, queue_state=state).model_dump(mode="json")  # type: ignore[arg-type]
        if state != "active":
            body["queue_state_reason"] = (
                "this API key has reached its limit of pending requests" if state == "paused_rate_limit"
                else "the server is at its sampling capacity"
            )
        return JSONResponse(body)
    if entry.future.cancelled():
        return JSONResponse({"error": str(SampleCancelled()), "category": "server"})
    if (error := entry.future.exception()) is not None:
        category = "user" if isinstance(error, EngineError) else "server"
        return JSONResponse({"error": str(error) or type(error).__name__, "category": category})
    return await _result_response(entry.future.result(), request.headers.get("accept", ""))


def _queued_response(request_id: str, position: int, depth: int) -> Response:
    """A request waiting behind others: tinker's try_again with a paused queue state (its clients
    call their queue-state observers), carried on a 408 with MinT's queue fields and headers."""
    body = TryAgainResponse(request_id=request_id, queue_state="paused_capacity").model_dump(mode="json")
    body.update(queue_state_reason=f"waiting behind {position} other requests in the engine queue",
                status="queued", queue_depth=depth, queue_position=position, retry_after_s=1)
    headers = {"Retry-After": "1", "X-Queue-Depth": str(depth), "X-Queue-Position": str(position),
               "X-Queue-Status": "queued"}
    return JSONResponse(body, status_code=408, headers=headers)


@router.post("/retrieve_futures", openapi_extra=body_doc(types.FuturesRetrieveRequest))
async def retrieve_futures(request: Request, p: Principal = needs(SERVE)) -> dict[str, Any]:
    req = await parse(request, types.FuturesRetrieveRequest)
    response = await service(request).sampling.retrieve_futures(p, req)
    return response.model_dump(mode="json")


@router.post("/cancel_future", status_code=204, openapi_extra=body_doc(CancelFutureBody))
async def cancel_future(request: Request, p: Principal = needs(SERVE)) -> Response:
    body = await json_body(request)
    request_id = body.get("request_id")
    if not isinstance(request_id, str) or set(body) - {"request_id"}:
        raise codec.DecodeError("expected {'request_id': <id of a sample request>}")
    service(request).core.work.cancel_sample(request_id, p.owner)
    return Response(status_code=204)


async def _result_response(result: Any, accept: str) -> Response:
    proto = PROTO in accept
    if isinstance(result, types.ForwardBackwardOutput):
        if proto:
            return Response(await asyncio.to_thread(codec.encode_fwdbwd_output, result), media_type=PROTO)
        return JSONResponse(await asyncio.to_thread(codec.fwdbwd_output_json, result))
    if isinstance(result, types.SampleResponse):
        if proto:
            return Response(await asyncio.to_thread(codec.encode_sample_response, result), media_type=PROTO)
        return JSONResponse(await asyncio.to_thread(codec.sample_response_json, result))
    if isinstance(result, BaseModel):
        return JSONResponse(result.model_dump(mode="json", exclude_none=True))
    raise TypeError(f"cannot encode a {type(result).__name__} result")


metrics_router = APIRouter()


@metrics_router.get("/metrics", response_class=PlainTextResponse,
                    responses={200: {"content": {"text/plain": {"schema": {"type": "string"}}},
                                     "description": "Prometheus text exposition format 0.0.4"}})
async def metrics(request: Request) -> Response:
    """Prometheus scrape target; unauthenticated, like /api/v1/healthz, and holds no secrets."""
    return Response(service(request).core.metrics.render(), media_type="text/plain; version=0.0.4")
