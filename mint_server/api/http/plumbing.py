"""HTTP plumbing shared by the routes: auth, body parsing and limits, error responses.

Every error leaves as JSON `{"detail": "..."}` with a message naming the field or thing at fault,
plus `field` and `code` where the error carries them (attributes set where it was raised: never read
back from its text); under the OpenAI face's prefixes in OpenAI's shape (`param`, `code`), under
/anthropic/api in Anthropic's. The status is `statuses.status_for`'s, the one mapping.
The SDK treats a 400 with an *empty* body as a proxy glitch and retries it, so bodies are never
empty.
"""

from __future__ import annotations

import asyncio
import logging
import uuid
from collections.abc import Callable, Coroutine
from typing import Any, TypeVar

import zstandard
from fastapi import FastAPI, Request, Response, Security
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from fastapi.routing import APIRoute
from fastapi.security import APIKeyHeader, SecurityScopes
from pydantic import BaseModel, ValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.routing import BaseRoute, Match
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from mint_server.api.auth.keys import Principal
from mint_server.api.http import jsonsafe
from mint_server.api.http.jsonsafe import JSONInputError, SafeJSONResponse
from mint_server.api.http.statuses import STATUS_OF, BodyTooLarge, RequestTimeout, status_for
from mint_server.api.openai.errors import OpenAIError, is_openai_path, openai_error_response
from mint_server.api.service import Service
from mint_server.api.tinker.codec import DecodeError, describe_validation_error
from mint_server.catalog.errors import IntegrityError

log = logging.getLogger(__name__)
M = TypeVar("M", bound=BaseModel)
API_KEY_HEADER = "x-api-key"


def error_response(
    status: int, detail: str, *, error: str | None = None, field: str | None = None, code: str | None = None,
    retry_after: float = 1,
) -> JSONResponse:
    headers = {"Retry-After": str(max(1, round(retry_after)))} if status in (429, 503) else {}
    if status == 408:
        headers["Connection"] = "close"  # the rest of a stalled body may still come: do not read it as a request
    body: dict[str, object] = {"detail": detail}
    if error is not None:
        body["error"] = error  # the exception class: the catalog's HTTP client raises the same one
    if field is not None:
        body["field"] = field  # the request field at fault, as the error carries it (never read from its text)
    if code is not None:
        body["code"] = code
    return SafeJSONResponse(body, status_code=status, headers=headers)


def _validation_message(exc: RequestValidationError) -> str:
    parts = []
    for err in exc.errors()[:5]:
        loc = ".".join(str(p) for p in err.get("loc", ()) if p not in ("body", "query", "path"))
        parts.append(f"invalid field {loc or 'request'!r}: {err.get('msg')}")
    return "; ".join(parts) or "invalid request"


def unhandled(exc: BaseException) -> tuple[str, str]:
    """The last resort for an exception no rule names: logged with a fresh error id, answered as a
    503 (the server's fault, maybe passing: the client may retry) carrying that id — never a bare
    500. Returns (message, error id)."""
    error_id = uuid.uuid4().hex[:16]
    log.error("unhandled error (error id %s)", error_id, exc_info=exc)
    return f"internal error: {type(exc).__name__} (error id {error_id}; the server log has the details)", error_id


def exception_response(exc: BaseException) -> JSONResponse:
    status = status_for(exc)
    if status == 499:
        log.debug("client disconnected before its request was read")
    if status == 500 and not isinstance(exc, IntegrityError):
        detail, error_id = unhandled(exc)
        response = error_response(503, detail, error="InternalError")
        response.headers["X-Error-Id"] = error_id
        return response
    detail = _validation_message(exc) if isinstance(exc, RequestValidationError) else str(exc)
    return error_response(
        status, detail, error=type(exc).__name__, field=getattr(exc, "field", None), code=getattr(exc, "code", None),
        retry_after=getattr(exc, "retry_after", 1),
    )


def openai_exception_response(exc: BaseException) -> JSONResponse:
    """The same statuses, in OpenAI's body shape, for the OpenAI face's paths (see api/openai)."""
    if isinstance(exc, OpenAIError):
        return openai_error_response(exc.status, str(exc), exc.param, exc.code)
    if isinstance(exc, StarletteHTTPException):
        return openai_error_response(exc.status_code, str(exc.detail))
    status = status_for(exc)
    if status == 500 and not isinstance(exc, IntegrityError):
        detail, error_id = unhandled(exc)
        response = openai_error_response(503, detail)
        response.headers["X-Error-Id"] = error_id
        return response
    detail = _validation_message(exc) if isinstance(exc, RequestValidationError) else str(exc)
    return openai_error_response(status, detail, getattr(exc, "field", None), getattr(exc, "code", None))


ANTHROPIC_PREFIX = "/anthropic/api"  # api/anthropic/routes.py's PREFIX (that module imports this one)
# Anthropic's error types by status (api/anthropic/routes.py's table; kept here, where the shape is
# needed outside that face's routes, since importing it from there would make an import circle).
ANTHROPIC_ERROR_TYPES = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
                         404: "not_found_error", 413: "request_too_large", 429: "rate_limit_error",
                         503: "overloaded_error"}  # fmt: skip


def is_anthropic_path(path: str) -> bool:
    return path == ANTHROPIC_PREFIX or path.startswith(ANTHROPIC_PREFIX + "/")


def anthropic_error_response(status: int, message: str, headers: dict[str, str] | None = None) -> JSONResponse:
    """Anthropic's shape, `{"type": "error", "error": {"type", "message"}}`."""
    kind = ANTHROPIC_ERROR_TYPES.get(status, "api_error" if status >= 500 else "invalid_request_error")
    return SafeJSONResponse({"type": "error", "error": {"type": kind, "message": message}}, status_code=status,
                            headers=headers)


def anthropic_exception_response(exc: BaseException) -> JSONResponse:
    """What fails under /anthropic/api outside that face's routes (an unknown path or method), with
    the status and Retry-After the OpenAI face gives it (as api/anthropic/routes.error_response)."""
    openai_shaped = openai_exception_response(exc)
    message = jsonsafe.loads(bytes(openai_shaped.body))["error"]["message"]
    retry = openai_shaped.headers.get("retry-after")
    return anthropic_error_response(openai_shaped.status_code, message, {"Retry-After": retry} if retry else None)


HTTP_METHODS = ("GET", "HEAD", "POST", "PUT", "PATCH", "DELETE", "OPTIONS")


def allowed_methods(request: Request) -> list[str]:
    """Every method some route serves at this request's path: a 405's complete `Allow`, on both
    faces alike. (Starlette names only the first matching route's, so a path served by two routes —
    GET and POST of /api/v1/mint/keys — listed one.) Each method is tried against the app's routes
    as the router itself would match it."""
    routes = [r for r in request.app.router.routes if isinstance(r, BaseRoute)]
    return [m for m in HTTP_METHODS
            if any(r.matches({**request.scope, "method": m})[0] == Match.FULL for r in routes)]


def install_error_handlers(app: FastAPI) -> None:
    async def handler(request: Request, exc: Exception) -> JSONResponse:
        if is_openai_path(request.url.path):
            return openai_exception_response(exc)
        if is_anthropic_path(request.url.path):
            return anthropic_exception_response(exc)
        return exception_response(exc)

    async def http_error(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        if is_openai_path(request.url.path):
            response = openai_exception_response(exc)
        elif is_anthropic_path(request.url.path):
            response = anthropic_exception_response(exc)
        else:
            response = error_response(exc.status_code, str(exc.detail))
        response.headers.update(exc.headers or {})
        if exc.status_code == 405:
            response.headers["Allow"] = ", ".join(allowed_methods(request))
        return response

    for exc_type, _status in STATUS_OF:
        app.add_exception_handler(exc_type, handler)
    app.add_exception_handler(OpenAIError, handler)
    app.add_exception_handler(StarletteHTTPException, http_error)
    app.add_exception_handler(Exception, handler)


class BodyLimit:
    """Refuse request bodies over `max_bytes` (413) without reading them into memory first, and
    bodies that stall: each piece must arrive within `timeout_s` of the last (408), so a client
    trickling its body cannot hold a request open for ever."""

    def __init__(self, app: ASGIApp, max_bytes: int, timeout_s: float = 60.0) -> None:
        self.app = app
        self.max_bytes = max_bytes
        self.timeout_s = timeout_s

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        for name, value in scope.get("headers", []):
            if name == b"content-length" and value.isdigit() and int(value) > self.max_bytes:
                message = f"request body exceeds the {self.max_bytes}-byte limit"
                response = (anthropic_error_response(413, message) if is_anthropic_path(scope.get("path", ""))
                            else error_response(413, message))
                return await response(scope, receive, send)
        seen = 0
        body_done = False

        async def limited() -> Message:
            nonlocal seen, body_done
            if body_done:  # after the body only a disconnect can come: wait for it as long as it takes
                return await receive()
            try:
                message = await asyncio.wait_for(receive(), self.timeout_s)
            except TimeoutError:
                raise RequestTimeout(f"request body stalled: nothing received for {self.timeout_s:g}s") from None
            seen += len(message.get("body", b""))
            if seen > self.max_bytes:
                raise BodyTooLarge(f"request body exceeds the {self.max_bytes}-byte limit")
            body_done = message["type"] != "http.request" or not message.get("more_body", False)
            return message

        await self.app(scope, limited, send)


def service(request: Request) -> Service:
    return request.app.state.service


# Declared as a security scheme so that the served spec says, per operation, which scope it needs.
API_KEY_SCHEME = APIKeyHeader(name="X-API-Key", scheme_name="ApiKey", auto_error=False,
                              description="A configured key or a scoped key; see docs/security.md")


def authorized(request: Request, credential: str | None, needed: SecurityScopes) -> Principal:
    """The caller presenting `credential`, holding every scope in `needed` (401 / 403 otherwise)."""
    p: Principal = request.app.state.authenticator.authenticate(credential)
    for scope in needed.scopes:
        p.require(scope)
    return p


def _caller(request: Request, needed: SecurityScopes, credential: str | None = Security(API_KEY_SCHEME)) -> Principal:
    return authorized(request, credential, needed)


def needs(scope: str) -> Any:
    """`p: Principal = needs(TRAIN)` in a route's signature: the authenticated caller, holding `scope`."""
    return Security(_caller, scopes=[scope])


async def json_body(request: Request) -> dict[str, Any]:
    """The body as a checked JSON object (see jsonsafe); an empty body is `{}`."""
    cached = getattr(request.state, "json_body", None)
    if cached is not None:
        return cached
    body = decompress(await request.body(), request.headers.get("content-encoding"),
                      service(request).core.settings.max_body_bytes)
    try:
        # Big bodies (0.22's JSON forward_backward) are parsed off the event loop.
        obj = (await asyncio.to_thread(jsonsafe.loads, body) if len(body) > 1 << 20 else jsonsafe.loads(body)) if body else {}
    except JSONInputError as e:
        if isinstance(e.document, dict):  # parsed, then refused: an ordered request still gives up its seq_id
            model_id, seq_id = ordered_ids(e.document)
            raise DecodeError(str(e), model_id=model_id, seq_id=seq_id) from None
        raise
    if not isinstance(obj, dict):
        raise DecodeError("request body must be a JSON object")
    request.state.json_body = obj
    return obj


def ordered_ids(obj: dict[str, Any]) -> tuple[str | None, int | None]:
    """The model_id and seq_id a (maybe invalid) body names, where it names them plainly."""
    model_id, seq_id = obj.get("model_id"), obj.get("seq_id")
    return (
        model_id if isinstance(model_id, str) else None,
        seq_id if isinstance(seq_id, int) and not isinstance(seq_id, bool) else None,
    )


async def parse(request: Request, model: type[M]) -> M:
    obj = await json_body(request)
    try:
        return model.model_validate(obj)
    except ValidationError as e:
        model_id, seq_id = ordered_ids(obj)
        raise DecodeError(describe_validation_error(e), model_id=model_id, seq_id=seq_id) from None


ZSTD_FEED_BYTES = 1024  # input fed per step: one step can expand to at most ~32 MiB (zstd's 128 KiB blocks)


def decompress(body: bytes, encoding: str | None, limit: int) -> bytes:
    """The body under its Content-Encoding (zstd or none): 400 for a corrupt or truncated frame,
    413 once the output passes `limit` (a zip bomb stops there, it is never expanded whole)."""
    if not encoding or encoding == "identity":
        return body
    if encoding != "zstd":
        raise DecodeError(f"unsupported Content-Encoding {encoding!r}; use zstd or none")
    inflater = zstandard.ZstdDecompressor().decompressobj()
    chunks, total = [], 0
    try:
        for start in range(0, len(body), ZSTD_FEED_BYTES):
            chunk = inflater.decompress(body[start:start + ZSTD_FEED_BYTES])
            total += len(chunk)
            if total > limit:
                raise BodyTooLarge(f"decompressed request body exceeds the {limit}-byte limit")
            chunks.append(chunk)
            if inflater.eof:
                break
    except zstandard.ZstdError as e:
        raise DecodeError(f"body is not valid zstd: {e}") from None
    if not inflater.eof:
        raise DecodeError("body is not valid zstd: the frame is truncated")
    if inflater.unused_data or start + ZSTD_FEED_BYTES < len(body):
        raise DecodeError("body is not valid zstd: data after the end of the frame")
    return b"".join(chunks)


class CheckedRoute(APIRoute):
    """A route whose JSON body FastAPI parses itself (a declared body model) gets the same input
    checks as the routes that call `json_body` (see jsonsafe): no NaN, no integer beyond int64,
    no lone surrogate, bounded nesting — a 400 naming the field before the model sees it."""

    def get_route_handler(self) -> Callable[[Request], Coroutine[Any, Any, Response]]:
        handler = super().get_route_handler()
        if self.body_field is None:
            return handler

        async def route(request: Request) -> Response:
            body = await request.body()
            if body and "json" in request.headers.get("content-type", "application/json"):
                jsonsafe.loads(body)
            return await handler(request)

        return route
