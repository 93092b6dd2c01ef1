"""HTTP routes of the OpenAI face, mounted at /oai/api/v1 and at /v1 (what OpenAI clients assume).

Auth is the Tinker API's: the same keys and owners, sent as `Authorization: Bearer KEY` (the
`X-API-Key` header works too). Streams are Server-Sent Events: `data: {chunk}` per event, then
`data: [DONE]`. A client that disconnects, streamed or not, has its response closed at once, which
cancels its sequences.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator, Coroutine
from typing import Any

from fastapi import APIRouter, Query, Request, Response, Security
from fastapi.security import HTTPAuthorizationCredentials, HTTPBearer, SecurityScopes
from pydantic import BaseModel, ValidationError
from starlette.types import Receive, Scope, Send

from mint_server.api.admission import Ticket
from mint_server.api.auth.keys import SERVE, AuthError, Principal
from mint_server.api.http.openapi import body_doc
from mint_server.api.http.plumbing import API_KEY_HEADER, authorized, json_body, service
from mint_server.api.http.statuses import status_for
from mint_server.api.openai.errors import PREFIXES, OpenAIError, error_body
from mint_server.api.openai.schemas import ChatRequest, CompletionRequest
from mint_server.api.openai.service import OpenAIService
from mint_server.api.state.runs import NotFound
from mint_server.api.tinker.codec import describe_validation_error
from mint_server.engine.interface import EngineError

SSE_HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}


def openai(request: Request) -> OpenAIService:
    return service(request).openai


BEARER = HTTPBearer(scheme_name="Bearer", auto_error=False, description="Authorization: Bearer KEY (or X-API-Key)")


def _caller(request: Request, needed: SecurityScopes,
            bearer: HTTPAuthorizationCredentials | None = Security(BEARER)) -> Principal:
    """The caller, from `Authorization: Bearer KEY` (or X-API-Key); 401 / 403 in OpenAI's shape otherwise."""
    key = bearer.credentials.strip() if bearer else request.headers.get(API_KEY_HEADER)
    try:  # a refused key's AuthError or ScopeError goes to the one mapping (api/http) as it is
        return authorized(request, key or None, needed)
    except AuthError:
        if key:
            raise
        raise OpenAIError(401, "missing API key: send Authorization: Bearer KEY", code=AuthError.code) from None


def principal() -> Any:
    return Security(_caller, scopes=[SERVE])


async def _parse(request: Request, model: type[BaseModel]) -> Any:
    body = await json_body(request)
    try:
        return model.model_validate(body)
    except ValidationError as e:
        first = e.errors()[0]
        param = ".".join(str(p) for p in first.get("loc", ())) or None
        raise OpenAIError(400, describe_validation_error(e), param) from None


class EventStream(Response):
    """An SSE response that notices a disconnect while it waits for the next event (not only when a
    write fails), so a client that leaves releases its sequences at once."""

    def __init__(self, events: AsyncIterator[dict[str, Any]], ticket: Ticket) -> None:
        super().__init__(status_code=200, media_type="text/event-stream")
        self.events = events
        self.ticket = ticket  # the reply's admission: closed here if its run never started

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        headers = [(b"content-type", b"text/event-stream; charset=utf-8")]
        headers += [(k.lower().encode(), v.encode()) for k, v in SSE_HEADERS.items()]
        with self.ticket:
            await send({"type": "http.response.start", "status": 200, "headers": headers})
            writer = asyncio.ensure_future(self._write(send))
            watcher = asyncio.ensure_future(_disconnected(receive))
            try:
                await asyncio.wait({writer, watcher}, return_when=asyncio.FIRST_COMPLETED)
            finally:
                for task in (writer, watcher):
                    task.cancel()
                await asyncio.gather(writer, watcher, return_exceptions=True)
                await self.events.aclose()  # runs the generator's cleanup: cancels what still runs

    async def _write(self, send: Send) -> None:
        try:
            async for event in self.events:
                await send({"type": "http.response.body", "body": _frame(event), "more_body": True})
        except (OpenAIError, EngineError, NotFound) as e:  # after the 200 went out: the error is an event
            status = e.status if isinstance(e, OpenAIError) else status_for(e)
            await send({"type": "http.response.body", "body": _frame(error_body(status, str(e))), "more_body": True})
        except OSError:
            return  # the client is gone
        await send({"type": "http.response.body", "body": b"data: [DONE]\n\n", "more_body": False})


async def unless_disconnected(request: Request, work: Coroutine[Any, Any, Any]) -> Any:
    """Run a non-streamed response's work while watching the connection: a client that goes away
    cancels it (its engine work stops and frees its KV) instead of leaving it to run unread."""
    task = asyncio.ensure_future(work)
    watcher = asyncio.ensure_future(_disconnected(request.receive))
    try:
        await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        watcher.cancel()
        if not task.done():
            task.cancel()
        await asyncio.gather(task, watcher, return_exceptions=True)
    if task.cancelled():
        return Response(status_code=499)  # nobody reads it (nginx's "client closed request")
    return task.result()


async def _disconnected(receive: Receive) -> None:
    while (await receive())["type"] != "http.disconnect":
        pass


def _frame(event: dict[str, Any]) -> bytes:
    return b"data: " + json.dumps(event, separators=(",", ":"), ensure_ascii=False).encode() + b"\n\n"


def make_router(prefix: str) -> APIRouter:
    router = APIRouter(prefix=prefix)

    @router.get("/models")
    async def list_models(request: Request, limit: int = Query(100, ge=1, le=1000), after: str | None = None,
                          p: Principal = principal()) -> Any:  # fmt: skip
        return await asyncio.to_thread(openai(request).list_models, p.owner, limit, after)

    @router.get("/models/{model_id:path}")
    async def get_model(model_id: str, request: Request, p: Principal = principal()) -> Any:
        return openai(request).get_model(p.owner, model_id)

    @router.post("/chat/completions", openapi_extra=body_doc(ChatRequest))
    async def chat(request: Request, p: Principal = principal()) -> Any:
        req: ChatRequest = await _parse(request, ChatRequest)
        face = openai(request)
        reply = await face.admit_chat(p.owner, req)
        if req.stream:
            return EventStream(face.chat_stream(reply, req), reply.ticket)
        with reply.ticket:
            return await unless_disconnected(request, face.chat(reply, req))

    @router.post("/completions", openapi_extra=body_doc(CompletionRequest))
    async def completions(request: Request, p: Principal = principal()) -> Any:
        req: CompletionRequest = await _parse(request, CompletionRequest)
        face = openai(request)
        reply = await face.admit_completion(p.owner, req)
        if req.stream:
            return EventStream(face.complete_stream(reply, req), reply.ticket)
        with reply.ticket:
            return await unless_disconnected(request, face.complete(reply, req))

    return router


routers = [make_router(prefix) for prefix in PREFIXES]
