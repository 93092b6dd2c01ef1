"""HTTP plumbing shared by the routes: auth, body parsing and limits, error responses.

Every error leaves as JSON `{"detail": "..."}` with a message naming the field or thing at fault.
The SDK treats a 400 with an *empty* body as a proxy glitch and retries it, so bodies are never
empty.
"""

from __future__ import annotations

import asyncio
import io
import json
import logging
from typing import Any, TypeVar

import zstandard
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from pydantic import BaseModel, ValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from mint_server.api.auth import AuthError, Principal
from mint_server.api.codec import DecodeError, describe_validation_error
from mint_server.api.core import Busy, ShuttingDown
from mint_server.api.ordering import SeqError
from mint_server.api.paths import PathError
from mint_server.api.runs import NotFound
from mint_server.api.service import Service
from mint_server.api.sessions import SessionGone
from mint_server.catalog.errors import CatalogError
from mint_server.catalog.rest import status_for
from mint_server.engine.interface import EngineError

log = logging.getLogger(__name__)
M = TypeVar("M", bound=BaseModel)
API_KEY_HEADER = "x-api-key"


class BodyTooLarge(Exception):
    pass


# Exception type → HTTP status. Order matters only for subclasses (none overlap here).
_STATUS: list[tuple[type[Exception], int]] = [
    (AuthError, 401),
    (NotFound, 404),
    (SessionGone, 410),
    (BodyTooLarge, 413),
    (Busy, 429),
    (ShuttingDown, 503),
    (EngineError, 400),
    (PathError, 400),
    (DecodeError, 400),
    (SeqError, 400),
]


def error_response(status: int, detail: str) -> JSONResponse:
    headers = {"Retry-After": "1"} if status in (429, 503) else None
    return JSONResponse({"detail": detail}, status_code=status, headers=headers)


def install_error_handlers(app: FastAPI) -> None:
    for exc_type, status in _STATUS:

        async def handler(_request: Request, exc: Exception, status: int = status) -> JSONResponse:
            return error_response(status, str(exc))

        app.add_exception_handler(exc_type, handler)

    async def validation(_request: Request, exc: RequestValidationError) -> JSONResponse:
        parts = []
        for err in exc.errors()[:5]:
            loc = ".".join(str(p) for p in err.get("loc", ()))
            parts.append(f"invalid {loc}: {err.get('msg')}")
        return error_response(400, "; ".join(parts) or "invalid request")

    async def http_error(_request: Request, exc: StarletteHTTPException) -> JSONResponse:
        return error_response(exc.status_code, str(exc.detail))

    async def unexpected(_request: Request, exc: Exception) -> JSONResponse:
        log.exception("unhandled error", exc_info=exc)
        return error_response(500, f"internal error: {type(exc).__name__}")

    async def catalog_error(_request: Request, exc: CatalogError) -> JSONResponse:
        # The catalog routes answer their own errors; this catches any that reach the service's.
        return error_response(status_for(exc), str(exc))

    app.add_exception_handler(CatalogError, catalog_error)
    app.add_exception_handler(RequestValidationError, validation)
    app.add_exception_handler(StarletteHTTPException, http_error)
    app.add_exception_handler(Exception, unexpected)


class BodyLimit:
    """Refuse request bodies over `max_bytes` (413) without reading them into memory first."""

    def __init__(self, app: ASGIApp, max_bytes: int) -> None:
        self.app = app
        self.max_bytes = max_bytes

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        for name, value in scope.get("headers", []):
            if name == b"content-length" and value.isdigit() and int(value) > self.max_bytes:
                response = error_response(413, f"request body exceeds the {self.max_bytes}-byte limit")
                return await response(scope, receive, send)
        seen = 0

        async def limited() -> Message:
            nonlocal seen
            message = await receive()
            seen += len(message.get("body", b""))
            if seen > self.max_bytes:
                raise BodyTooLarge(f"request body exceeds the {self.max_bytes}-byte limit")
            return message

        await self.app(scope, limited, send)


def service(request: Request) -> Service:
    return request.app.state.service


def principal(request: Request) -> Principal:
    """FastAPI dependency: the authenticated caller (401 otherwise)."""
    return request.app.state.authenticator.authenticate(request.headers.get(API_KEY_HEADER))


async def json_body(request: Request) -> dict[str, Any]:
    body = await request.body()
    try:
        # Big bodies (0.22's JSON forward_backward) are parsed off the event loop.
        obj = (await asyncio.to_thread(json.loads, body) if len(body) > 1 << 20 else json.loads(body)) if body else {}
    except ValueError:
        raise DecodeError("request body is not valid JSON") from None
    if not isinstance(obj, dict):
        raise DecodeError("request body must be a JSON object")
    return obj


async def parse(request: Request, model: type[M]) -> M:
    obj = await json_body(request)
    try:
        return model.model_validate(obj)
    except ValidationError as e:
        raise DecodeError(describe_validation_error(e)) from None


def decompress(body: bytes, encoding: str | None, limit: int) -> bytes:
    if not encoding or encoding == "identity":
        return body
    if encoding != "zstd":
        raise DecodeError(f"unsupported Content-Encoding {encoding!r}; use zstd or none")
    # Read through a stream so a small body cannot expand past the limit (zip bomb).
    reader = zstandard.ZstdDecompressor().stream_reader(io.BytesIO(body))
    chunks, total = [], 0
    try:
        while chunk := reader.read(1 << 20):
            total += len(chunk)
            if total > limit:
                raise BodyTooLarge(f"decompressed request body exceeds the {limit}-byte limit")
            chunks.append(chunk)
    except zstandard.ZstdError as e:
        raise DecodeError(f"body is not valid zstd: {e}") from None
    return b"".join(chunks)
