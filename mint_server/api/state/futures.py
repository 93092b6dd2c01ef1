"""Request ids → the asyncio futures that will hold their results.

Every submit endpoint registers exactly one future here and answers with its request id; the
client then polls `retrieve_future`. A future is completed once, by the operation that owns it;
this store only observes it. Finished entries stay for `result_ttl_s` so that a client re-polling
after a dropped connection still finds its result; pending entries are never dropped.
"""

from __future__ import annotations

import asyncio
import time
import uuid
from dataclasses import dataclass, field
from typing import Any

from tinker import types

from mint_server.api.state.runs import NotFound
from mint_server.api.tinker.validate import InvalidInput


@dataclass
class Entry:
    request_id: str
    owner: str
    request_type: str
    future: asyncio.Future[Any]
    created: float = field(default_factory=time.monotonic)
    done_at: float | None = None


class FutureStore:
    def __init__(self, result_ttl_s: float) -> None:
        self._entries: dict[str, Entry] = {}
        self._result_ttl_s = result_ttl_s
        self._closing = asyncio.Event()

    def add(self, owner: str, request_type: str, future: asyncio.Future[Any]) -> str:
        request_id = uuid.uuid4().hex
        entry = Entry(request_id, owner, request_type, future)
        self._entries[request_id] = entry

        def on_done(_: asyncio.Future[Any]) -> None:
            entry.done_at = time.monotonic()
            if not future.cancelled():
                future.exception()  # mark retrieved, so asyncio does not log "never retrieved"

        future.add_done_callback(on_done)
        return request_id

    def get(self, request_id: str, owner: str) -> Entry:
        entry = self._entries.get(request_id)
        if entry is None or entry.owner != owner:
            raise NotFound(f"request {request_id!r} not found (unknown, expired, or not yours)")
        return entry

    async def wait(self, request_id: str, owner: str, timeout: float) -> Entry:
        """The entry once finished, or still pending after `timeout` (or when shutdown starts)."""
        entry = self.get(request_id, owner)
        if not entry.future.done() and timeout > 0:
            closing = asyncio.ensure_future(self._closing.wait())
            try:
                await asyncio.wait({entry.future, closing}, timeout=timeout, return_when=asyncio.FIRST_COMPLETED)
            finally:
                closing.cancel()
        return entry

    def cancel(self, request_id: str, owner: str) -> None:
        """Stop a pending sample (its engine work ends, its KV is freed); a finished one is left as is."""
        entry = self.get(request_id, owner)
        if entry.request_type != "sample":
            raise InvalidInput(f"request {request_id!r} is a {entry.request_type}; only samples can be cancelled")
        entry.future.cancel()

    @property
    def closing(self) -> asyncio.Event:
        return self._closing

    def request_ids(self) -> set[str]:
        return set(self._entries)

    def pending(self) -> list[Entry]:
        return [e for e in self._entries.values() if not e.future.done()]

    def sweep(self) -> None:
        cutoff = time.monotonic() - self._result_ttl_s
        stale = [rid for rid, e in self._entries.items() if e.done_at is not None and e.done_at < cutoff]
        for rid in stale:
            del self._entries[rid]

    def release_pollers(self) -> None:
        """Shutdown: answer every held long-poll now (try_again) instead of at its timeout."""
        self._closing.set()

    async def drain(self, timeout: float) -> int:
        """Wait for in-flight work; returns how many were still pending at the deadline."""
        pending = [e.future for e in self.pending()]
        if pending:
            await asyncio.wait(pending, timeout=timeout)
        return len(self.pending())


class CompletionLog:
    """The completion queue of one sampling session (one per clone id) behind `retrieve_futures`.

    Each finished or failed request appends an event with the next cursor; a poll names the last
    cursor it saw, so older events are dropped then, and gets everything newer (waiting up to its
    timeout when there is nothing yet).
    """

    def __init__(self) -> None:
        self.cursor = 0
        self._events: list[tuple[int, types.FutureFinished | types.FutureFailed]] = []
        self._changed = asyncio.Event()

    def add(self, request_id: str, future: asyncio.Future[Any]) -> None:
        failed = future.cancelled() or future.exception() is not None
        self.cursor += 1
        event = types.FutureFailed(request_id=request_id) if failed else types.FutureFinished(request_id=request_id)
        self._events.append((self.cursor, event))
        self._changed.set()

    async def poll(self, prev_cursor: int, timeout: float, closing: asyncio.Event) -> types.FuturesRetrieveResponse:
        self._events = [(c, e) for c, e in self._events if c > prev_cursor]
        if not self._events and timeout > 0 and not closing.is_set():
            self._changed.clear()
            waits = {asyncio.ensure_future(self._changed.wait()), asyncio.ensure_future(closing.wait())}
            try:
                await asyncio.wait(waits, timeout=timeout, return_when=asyncio.FIRST_COMPLETED)
            finally:
                for w in waits:
                    w.cancel()
        return types.FuturesRetrieveResponse(completions=[e for _, e in self._events], cursor=self.cursor)
