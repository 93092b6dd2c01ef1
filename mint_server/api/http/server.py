"""How `mint serve` runs the app under uvicorn, with the connection limits a public server needs.

uvicorn (h11) on its own answers oversized headers with a plain-text 400 and never times out a
client that sends its request head slowly. The protocol subclass here answers both in JSON, as
every other error: 431 for a request head over `max_header_bytes`, 408 for one not complete within
`header_timeout_s` (a slowloris holds no connection for long). Slow bodies are timed out by
`BodyLimit` (http.py), idle keep-alive connections by uvicorn's own `timeout_keep_alive` (re-armed
here where uvicorn leaves a connection idle without it).

`Server` tells the app when shutdown starts: uvicorn waits for open requests before it runs the
app's lifespan shutdown, so a held long poll would otherwise hold the whole shutdown for its
timeout (or the graceful-shutdown limit).
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import h11
import uvicorn
from uvicorn.protocols.http.h11_impl import H11Protocol


@dataclass(frozen=True)
class ConnectionLimits:
    max_header_bytes: int = 32 * 1024  # request line + headers
    header_timeout_s: float = 30.0  # to receive a complete request head
    body_timeout_s: float = 60.0  # longest wait for the next piece of a request body
    keep_alive_s: int = 75  # idle connection kept open (above the SDK's connection pool expiry)


def _raw_response(status: int, reason: str, detail: str) -> bytes:
    body = json.dumps({"detail": detail}).encode()
    head = (
        f"HTTP/1.1 {status} {reason}\r\ncontent-type: application/json\r\n"
        f"content-length: {len(body)}\r\nconnection: close\r\n\r\n"
    )
    return head.encode() + body


class BoundedH11Protocol(H11Protocol):
    limits = ConnectionLimits()

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._head_timer: asyncio.TimerHandle | None = None

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        self._arm_head_timer()

    def connection_lost(self, exc: Exception | None) -> None:
        self._cancel_head_timer()
        super().connection_lost(exc)

    def data_received(self, data: bytes) -> None:
        if self.conn.their_state is h11.IDLE:  # between requests: these bytes start a request head
            pending = self.conn.trailing_data[0] + data
            end = pending.find(b"\r\n\r\n")
            if (end if end >= 0 else len(pending)) > self.limits.max_header_bytes:
                self._refuse(431, "Request Header Fields Too Large",
                             f"request headers exceed the {self.limits.max_header_bytes}-byte limit")  # fmt: skip
                return
            self._arm_head_timer()
        super().data_received(data)
        if self.conn.their_state is not h11.IDLE:
            self._cancel_head_timer()
        elif (self.conn.our_state is h11.IDLE and self.timeout_keep_alive_task is None and self._head_timer is None
              and not self.transport.is_closing()):
            # uvicorn cancels the keep-alive timer on every read and re-arms it only when a response
            # completes. The rest of a body the route never read (telemetry, session finish) arriving
            # after its response ends the cycle here, idle with no timer: the connection stayed open
            # for good, one per SDK client. Arm the keep-alive timer for it.
            self.timeout_keep_alive_task = self.loop.call_later(self.timeout_keep_alive,
                                                                self.timeout_keep_alive_handler)

    def _arm_head_timer(self) -> None:
        if self._head_timer is None:
            self._head_timer = self.loop.call_later(self.limits.header_timeout_s, self._head_timed_out)

    def _cancel_head_timer(self) -> None:
        if self._head_timer is not None:
            self._head_timer.cancel()
            self._head_timer = None

    def _head_timed_out(self) -> None:
        self._head_timer = None
        if self.conn.their_state is not h11.IDLE or self.transport.is_closing():
            return
        if self.conn.trailing_data[0]:
            self._refuse(408, "Request Timeout",
                         f"request headers not received within {self.limits.header_timeout_s:g}s")  # fmt: skip
        else:
            self.transport.close()  # connected and silent: nothing to answer

    def _refuse(self, status: int, reason: str, detail: str) -> None:
        self._cancel_head_timer()
        if self.cycle is not None and not self.cycle.response_complete:
            self.transport.close()  # a response is under way: never interleave a second one
            return
        self.transport.write(_raw_response(status, reason, detail))
        self.transport.close()


def protocol_with(limits: ConnectionLimits) -> type[H11Protocol]:
    return type("BoundedH11Protocol", (BoundedH11Protocol,), {"limits": limits})


def uvicorn_config(app: Any, limits: ConnectionLimits, **kwargs: Any) -> uvicorn.Config:
    """A uvicorn config for `app` that enforces `limits` (see module doc)."""
    return uvicorn.Config(
        app,
        http=protocol_with(limits),
        timeout_keep_alive=limits.keep_alive_s,
        # h11's own cap is only a backstop: ours answers first, in JSON.
        h11_max_incomplete_event_size=2 * limits.max_header_bytes,
        **kwargs,
    )


class Server(uvicorn.Server):
    """uvicorn's server that calls `on_shutdown_start` (on the server's loop) before it waits for
    open requests: the app answers its held long polls then, not at their timeout."""

    def __init__(self, config: uvicorn.Config, on_shutdown_start: Callable[[], None]) -> None:
        super().__init__(config)
        self._on_shutdown_start = on_shutdown_start

    async def shutdown(self, sockets: Any = None) -> None:
        self._on_shutdown_start()
        await super().shutdown(sockets=sockets)
