"""The one mapping from exception type to HTTP status, for every route (Tinker, MinT extensions,
catalog, the OpenAI face). A leaf module, so that the service can ask which errors the HTTP layer
names (and which would be an internal error) without importing the routes.
"""

from __future__ import annotations

from fastapi.exceptions import RequestValidationError
from starlette.requests import ClientDisconnect

from mint_server.api.admission import Busy, ShuttingDown
from mint_server.api.auth.keys import AuthError, ScopeError
from mint_server.api.http.jsonsafe import JSONInputError
from mint_server.api.state.runs import NotFound
from mint_server.api.state.sessions import SessionGone
from mint_server.api.tinker.codec import DecodeError
from mint_server.api.tinker.ordering import SeqError
from mint_server.api.tinker.paths import PathError
from mint_server.catalog.errors import AlreadyExists, IntegrityError, InvalidArgument
from mint_server.catalog.errors import NotFound as CatalogNotFound
from mint_server.engine.interface import EngineError, EngineFailed
from mint_server.fsutil import DiskFull


class BodyTooLarge(Exception):
    pass


class HeadersTooLarge(Exception):
    pass


class RequestTimeout(Exception):
    pass


# The one mapping from exception type to HTTP status, for every route (Tinker, MinT extensions,
# catalog). The first match wins, so subclasses come before their bases.
STATUS_OF: list[tuple[type[BaseException], int]] = [
    (AuthError, 401),
    (ScopeError, 403),
    (NotFound, 404),
    (CatalogNotFound, 404),
    (RequestTimeout, 408),
    (AlreadyExists, 409),
    (SessionGone, 410),
    (ClientDisconnect, 499),  # the client left mid-body: nobody reads the answer, and it is no server fault
    (BodyTooLarge, 413),
    (HeadersTooLarge, 431),
    (Busy, 429),
    (ShuttingDown, 503),
    (EngineFailed, 503),
    (EngineError, 400),
    (PathError, 400),
    (DecodeError, 400),
    (JSONInputError, 400),
    (SeqError, 400),
    (InvalidArgument, 400),
    (RequestValidationError, 400),
    (DiskFull, 507),  # out of room: the server's condition, not the request's; nothing partial was kept
    (IntegrityError, 500),  # stored data is corrupt: the server is at fault, and says which blob
]


def status_for(error: BaseException) -> int:
    for exc_type, status in STATUS_OF:
        if isinstance(error, exc_type):
            return status
    return 500
