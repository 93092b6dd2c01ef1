"""Opaque keyset-pagination cursors.

A cursor carries the sort key of the last item returned plus a tag naming the listing, so a
cursor from one listing cannot be replayed against another. Listings never use OFFSET: the next
page is `WHERE key > last ORDER BY key LIMIT n`, an index range scan at any depth.
"""

from __future__ import annotations

import base64
import binascii
import json
from typing import Any

from mint_server.catalog.errors import InvalidArgument

DEFAULT_LIMIT = 50
MAX_LIMIT = 1000


def encode(tag: str, key: Any) -> str:
    raw = json.dumps([tag, key], separators=(",", ":")).encode()
    return base64.urlsafe_b64encode(raw).decode().rstrip("=")


def decode(tag: str, cursor: str | None, key_type: type) -> Any:
    """The key inside `cursor` (None for the first page); InvalidArgument if it is not ours."""
    if cursor is None or cursor == "":
        return None
    try:
        padded = cursor + "=" * (-len(cursor) % 4)
        got_tag, key = json.loads(base64.urlsafe_b64decode(padded.encode()))
    except (ValueError, TypeError, binascii.Error):
        raise InvalidArgument(f"cursor {cursor!r} is malformed", field="cursor") from None
    if got_tag != tag or not isinstance(key, key_type) or isinstance(key, bool):
        raise InvalidArgument(f"cursor {cursor!r} does not belong to this listing", field="cursor")
    # A forged cursor must not carry a key the database cannot compare (SQL integers are 64-bit;
    # text must be valid Unicode).
    if isinstance(key, int) and not -(1 << 63) <= key < (1 << 63):
        raise InvalidArgument(f"cursor {cursor!r} is malformed", field="cursor")
    if isinstance(key, str):
        try:
            key.encode("utf-8")
        except UnicodeEncodeError:
            raise InvalidArgument(f"cursor {cursor!r} is malformed", field="cursor") from None
    return key


def check_limit(limit: int | None) -> int:
    if limit is None:
        return DEFAULT_LIMIT
    if isinstance(limit, bool) or not isinstance(limit, int) or not 1 <= limit <= MAX_LIMIT:
        raise InvalidArgument(
            f"limit must be an integer between 1 and {MAX_LIMIT}, got {limit!r}", field="limit"
        )
    return limit
