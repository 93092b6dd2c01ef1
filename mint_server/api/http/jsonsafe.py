"""JSON in and out of the service, safe against what a hostile client can put in a body.

In: one parse for every JSON body (`loads`) that refuses, naming the field, what Python's json
module would accept but nothing downstream can hold: non-finite numbers (NaN, 1e400), integers
beyond int64 (they overflow numpy, SQLite and the engine), strings that are not encodable as
UTF-8 (lone UTF-16 surrogates: accepted once, they break every later response that carries
them), and nesting deeper than any request needs.

Out: `SafeJSONResponse` renders as Starlette does; should a body hold NaN or an unencodable
string anyway (a record stored before these checks existed), it falls back to a rendering that
JSON can hold (non-finite numbers as null, strings \\u-escaped) instead of answering 500.
"""

from __future__ import annotations

import json
import math
from typing import Any

from starlette.responses import JSONResponse

INT64_MIN, INT64_MAX = -(1 << 63), (1 << 63) - 1
MAX_DEPTH = 32  # the deepest Tinker body (a datum's tensor inside forward_backward_input) is ~8
# Free-form fields a body may carry, by top-level name → most bytes of their JSON. They are stored
# and listed back (sessions, runs, checkpoints, catalog rows), so they are kept small.
MAX_FIELD_BYTES = {"user_metadata": 64 << 10, "metadata": 64 << 10, "tags": 16 << 10, "display_name": 1 << 10,
                   "reason": 4 << 10, "detail": 16 << 10}


class JSONInputError(ValueError):
    """A JSON body or parameter that cannot be accepted; `field` is the path to the value at fault."""

    def __init__(self, message: str, field: str | None = None) -> None:
        super().__init__(message)
        self.field = field
        self.document: Any = None  # the parsed document, when the refusal came after parsing


class _NonFinite:
    """Stands in for a NaN / Infinity literal until the walk can name the field that holds it."""

    def __init__(self, literal: str) -> None:
        self.literal = literal


def loads(body: bytes | str) -> Any:
    """Parse and check a JSON document (see module doc); JSONInputError names what is wrong."""
    try:
        obj = json.loads(body, parse_constant=_NonFinite)
    except JSONInputError:
        raise
    except RecursionError:
        raise JSONInputError(f"request body is nested deeper than {MAX_DEPTH} levels") from None
    except (ValueError, UnicodeDecodeError):
        raise JSONInputError("request body is not valid JSON") from None
    try:
        check_value(obj)
        if isinstance(obj, dict):
            check_field_sizes(obj)
    except JSONInputError as e:
        e.document = obj
        raise
    return obj


def check_field_sizes(obj: dict[str, Any]) -> None:
    for name, most in MAX_FIELD_BYTES.items():
        value = obj.get(name)
        if value is not None and len(json.dumps(value, ensure_ascii=False).encode()) > most:
            raise JSONInputError(f"invalid field {name!r}: at most {most} bytes of JSON", name)


def _where(path: str) -> str:
    return path or "request body"


def check_text(value: str, field: str) -> str:
    """`value` unchanged if it is encodable as UTF-8 (no lone surrogates), else JSONInputError."""
    try:
        value.encode("utf-8")
    except UnicodeEncodeError as e:
        raise JSONInputError(
            f"invalid field {field!r}: not valid Unicode text (lone surrogate {value[e.start]!r} at position {e.start})",
            field,
        ) from None
    return value


def check_int(value: int, field: str) -> int:
    if not INT64_MIN <= value <= INT64_MAX:
        raise JSONInputError(f"invalid field {field!r}: integer is outside the 64-bit range", field)
    return value


def check_value(obj: Any, path: str = "") -> None:
    """Walk a parsed JSON value; iterative, so a deep document cannot exhaust the stack."""
    stack: list[tuple[Any, str, int]] = [(obj, path, 0)]
    while stack:
        value, where, depth = stack.pop()
        if isinstance(value, str):
            check_text(value, _where(where))
        elif isinstance(value, bool) or value is None:
            continue
        elif isinstance(value, int):
            check_int(value, _where(where))
        elif isinstance(value, _NonFinite):
            raise JSONInputError(
                f"invalid field {_where(where)!r}: non-finite number {value.literal} is not allowed", _where(where)
            )
        elif isinstance(value, float):
            if not math.isfinite(value):
                raise JSONInputError(f"invalid field {_where(where)!r}: number must be finite", _where(where))
        elif isinstance(value, list | dict):
            if depth >= MAX_DEPTH:
                raise JSONInputError(f"invalid field {_where(where)!r}: nested deeper than {MAX_DEPTH} levels", where)
            if isinstance(value, list):
                if value and all(type(v) is int for v in value):  # token lists: the common bulk case
                    if min(value) < INT64_MIN or max(value) > INT64_MAX:
                        bad = next(i for i, v in enumerate(value) if not INT64_MIN <= v <= INT64_MAX)
                        check_int(value[bad], f"{where}[{bad}]")
                    continue
                stack.extend((v, f"{where}[{i}]", depth + 1) for i, v in enumerate(value))
            else:
                for k, v in value.items():
                    key_path = f"{where}.{k}" if where else str(k)
                    check_text(k, _where(where) + " key")
                    stack.append((v, key_path, depth + 1))


def _sanitize(value: Any) -> Any:
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if isinstance(value, dict):
        return {k: _sanitize(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [_sanitize(v) for v in value]
    return value


def dumps(content: Any) -> bytes:
    """Compact UTF-8 JSON; never raises for NaN or lone surrogates (see module doc)."""
    try:
        return json.dumps(content, ensure_ascii=False, allow_nan=False, separators=(",", ":")).encode("utf-8")
    except (ValueError, UnicodeEncodeError):
        return json.dumps(_sanitize(content), ensure_ascii=True, allow_nan=False, separators=(",", ":")).encode()


class SafeJSONResponse(JSONResponse):
    def render(self, content: Any) -> bytes:
        return dumps(content)
