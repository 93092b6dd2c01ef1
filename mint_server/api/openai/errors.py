"""Errors in OpenAI's shape: `{"error": {"message", "type", "param", "code"}}`.

The service's own exceptions keep their meaning (NotFound → 404, Busy → 429, bad input → 400, …);
only the body differs from the Tinker face's `{"detail": …}`. Which shape a response gets is
decided by its path (see `is_openai_path`), so one set of exception handlers serves both faces.
"""

from __future__ import annotations

from fastapi.responses import JSONResponse

PREFIXES = ("/oai/api/v1", "/v1")

_TYPES = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
          404: "not_found_error", 413: "invalid_request_error", 429: "rate_limit_error",
          503: "service_unavailable"}  # fmt: skip


class OpenAIError(Exception):
    """An error answered in OpenAI's shape; `param` names the request field at fault."""

    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None) -> None:
        super().__init__(message)
        self.status, self.param, self.code = status, param, code

    @classmethod
    def from_error(cls, error: BaseException, status: int, param: str | None) -> OpenAIError:
        """`error` (an engine or catalog refusal) answered in this shape: its message and code kept,
        `param` the request field this face names (its field, `error.field`, in the face's terms)."""
        return cls(status, str(error), param, getattr(error, "code", None))


def is_openai_path(path: str) -> bool:
    return any(path == p or path.startswith(p + "/") for p in PREFIXES)


def error_body(status: int, message: str, param: str | None = None, code: str | None = None) -> dict:
    kind = _TYPES.get(status, "server_error" if status >= 500 else "invalid_request_error")
    return {"error": {"message": message, "type": kind, "param": param, "code": code}}


def openai_error_response(status: int, message: str, param: str | None = None, code: str | None = None) -> JSONResponse:
    headers = {"Retry-After": "1"} if status in (429, 503) else None
    return JSONResponse(error_body(status, message, param, code), status_code=status, headers=headers)
