"""HTTP routes of the Anthropic Messages face, under the base URL /anthropic/api (an Anthropic SDK
given `base_url="http://HOST/anthropic/api"` posts to /anthropic/api/v1/messages).

Auth is the Tinker API's keys and owners, sent as `x-api-key: KEY` (Anthropic's header) or
`Authorization: Bearer KEY` (what the SDK sends for `api_key` since 2.x). Errors, whatever raised
them, answer in Anthropic's shape `{"type": "error", "error": {"type", "message"}}` with the
status the OpenAI face gives the same failure. Streams are Server-Sent Events with Anthropic's
event names (`event: message_start` …); a client that disconnects cancels its request.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Coroutine
from typing import Any

from fastapi import APIRouter, Request, Response, Security
from fastapi.responses import JSONResponse
from fastapi.routing import APIRoute
from fastapi.security import SecurityScopes
from pydantic import BaseModel, ValidationError

from mint_server.api.anthropic.schemas import CountTokensRequest, MessagesRequest
from mint_server.api.anthropic.service import AnthropicService
from mint_server.api.auth.keys import SERVE, AuthError, Principal
from mint_server.api.http.openapi import body_doc
from mint_server.api.http.plumbing import (
    API_KEY_HEADER,
    API_KEY_SCHEME,
    authorized,
    json_body,
    openai_exception_response,
    service,
)
from mint_server.api.http.statuses import status_for
from mint_server.api.openai.errors import OpenAIError
from mint_server.api.openai.routes import EventStream, unless_disconnected
from mint_server.api.state.runs import NotFound
from mint_server.api.tinker.codec import describe_validation_error
from mint_server.engine.interface import EngineError

PREFIX = "/anthropic/api"

_TYPES = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
          404: "not_found_error", 413: "request_too_large", 429: "rate_limit_error",
          503: "overloaded_error"}  # fmt: skip


def error_body(status: int, message: str) -> dict[str, Any]:
    kind = _TYPES.get(status, "api_error" if status >= 500 else "invalid_request_error")
    return {"type": "error", "error": {"type": kind, "message": message}}


def error_response(exc: BaseException) -> JSONResponse:
    """Any failure in Anthropic's shape, with the status (and Retry-After) the OpenAI face gives it."""
    openai_shaped = openai_exception_response(exc)
    message = json.loads(bytes(openai_shaped.body))["error"]["message"]
    headers = {"Retry-After": openai_shaped.headers["retry-after"]} if "retry-after" in openai_shaped.headers else None
    return JSONResponse(error_body(openai_shaped.status_code, message), status_code=openai_shaped.status_code,
                        headers=headers)  # fmt: skip


class AnthropicRoute(APIRoute):
    """A route whose errors (auth, parsing, admission, the engine) all answer in Anthropic's shape."""

    def get_route_handler(self) -> Callable[[Request], Coroutine[Any, Any, Response]]:
        handler = super().get_route_handler()

        async def answer(request: Request) -> Response:
            try:
                return await handler(request)
            except Exception as e:  # noqa: BLE001  # every failure becomes an Anthropic error body
                return error_response(e)

        return answer


def _caller(request: Request, needed: SecurityScopes, _key: str | None = Security(API_KEY_SCHEME)) -> Principal:
    """The caller, from `Authorization: Bearer KEY` or `x-api-key` (declared as the ApiKey scheme
    so the served spec documents the route's 401 and 403)."""
    auth = request.headers.get("authorization", "")
    scheme, _, token = auth.partition(" ")
    key = token.strip() if scheme.lower() == "bearer" else request.headers.get(API_KEY_HEADER)
    try:  # a refused key's AuthError or ScopeError goes to the one mapping (api/http) as it is
        return authorized(request, key or None, needed)
    except AuthError:
        if key:
            raise
        raise OpenAIError(401, "missing API key: send x-api-key: KEY") from None


def principal() -> Any:
    return Security(_caller, scopes=[SERVE])


async def _parse(request: Request, model: type[BaseModel]) -> Any:
    body = await json_body(request)
    try:
        return model.model_validate(body)
    except ValidationError as e:
        raise OpenAIError(400, describe_validation_error(e)) from None


class AnthropicEventStream(EventStream):
    """Anthropic's SSE framing: `event: TYPE` and `data: {…}` per event, no `[DONE]`; an error after
    the 200 went out is an `error` event."""

    async def _write(self, send: Any) -> None:
        try:
            async for event in self.events:
                await send({"type": "http.response.body", "body": _frame(event), "more_body": True})
        except (OpenAIError, EngineError, NotFound) as e:
            status = e.status if isinstance(e, OpenAIError) else status_for(e)
            await send({"type": "http.response.body", "body": _frame(error_body(status, str(e))), "more_body": True})
        except OSError:
            return  # the client is gone
        await send({"type": "http.response.body", "body": b"", "more_body": False})


def _frame(event: dict[str, Any]) -> bytes:
    data = json.dumps(event, separators=(",", ":"), ensure_ascii=False)
    return f"event: {event['type']}\ndata: {data}\n\n".encode()


def face(request: Request) -> AnthropicService:
    return AnthropicService(service(request).openai)


router = APIRouter(prefix=PREFIX, route_class=AnthropicRoute)


@router.post("/v1/messages", openapi_extra=body_doc(MessagesRequest))
async def messages(request: Request, p: Principal = principal()) -> Any:
    req: MessagesRequest = await _parse(request, MessagesRequest)
    anthropic = face(request)
    reply, _chat = await anthropic.admit(p.owner, req)
    if req.stream:
        return AnthropicEventStream(anthropic.stream(reply, req), reply.ticket)
    with reply.ticket:
        return await unless_disconnected(request, anthropic.message(reply, req))


@router.post("/v1/messages/count_tokens", openapi_extra=body_doc(CountTokensRequest))
async def count_tokens(request: Request, p: Principal = principal()) -> Any:
    req: CountTokensRequest = await _parse(request, CountTokensRequest)
    return await face(request).count_tokens(p.owner, req)
