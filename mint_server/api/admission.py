"""Admission at the service's door: whether new work is taken, per-key pending limits, the server's
bound on sample requests in flight. One object owns these counters; every route that queues work
enters through one call, `Admission.enter`, whose `Ticket` is released exactly once (see Ticket).

The engine's scheduler decides the order of admitted work; this only keeps one key (or the whole
server) from queueing without bound, answering 429 with Retry-After (the SDKs back off and resubmit)."""

from __future__ import annotations

import asyncio
from typing import Any

from mint_server.api.settings import Settings


class ShuttingDown(Exception):
    """The server is draining and takes no new work (HTTP 503, which the SDK retries)."""


class Busy(Exception):
    """Too much work in flight, for the server or for one key (HTTP 429 with Retry-After: the SDK
    backs off and resubmits the same request, seq_id and all)."""

    def __init__(self, message: str, retry_after: float = 1.0) -> None:
        super().__init__(message)
        self.retry_after = retry_after


class Ticket:
    """One admitted request: its place in its key's pending count (and its samples in the server's
    in-flight count) until released. Used as a context manager around the request's checks: a
    request refused after it entered leaves at once; one whose work was queued `hold`s the ticket
    until that work is done, however it ends. Release happens once."""

    def __init__(self, admission: Admission, owner: str, samples: int) -> None:
        self._admission = admission
        self.owner = owner
        self.samples = samples
        self._held = False
        self._released = False

    def hold(self, work: asyncio.Future[Any]) -> None:
        """The request's work is `work`: the ticket is released when it is done, however it ends."""
        self._held = True
        work.add_done_callback(lambda _f: self.release())

    def release(self) -> None:
        if not self._released:
            self._released = True
            self._admission._leave(self)

    def __enter__(self) -> Ticket:
        return self

    def __exit__(self, *_exc: object) -> None:
        if not self._held:  # refused, or its work never started: nothing keeps it
            self.release()


class Admission:
    def __init__(self, settings: Settings) -> None:
        self.max_pending_per_key = settings.max_pending_per_key
        self.max_inflight_samples = settings.max_inflight_samples
        self.accepting = True
        self.pending_by_owner: dict[str, int] = {}  # admitted, unreleased requests per key
        self.samples_inflight = 0  # engine sample requests of admitted, unreleased requests

    def check_accepting(self) -> None:
        """For calls that queue no work (session creation): refused only while shutting down."""
        if not self.accepting:
            raise ShuttingDown("server is shutting down")

    def enter(self, owner: str, samples: int = 0) -> Ticket:
        """Admit one request of `owner` that runs `samples` engine sample requests, or refuse it:
        503 while shutting down; 429 when the key already has `max_pending_per_key` requests pending
        (its futures then report "paused_rate_limit") or the server's `max_inflight_samples` would be
        passed. Admitted, it is counted at once (the checks and the count are one step on the loop)."""
        self.check_accepting()
        limit = self.max_pending_per_key
        if self.pending_by_owner.get(owner, 0) >= limit:
            raise Busy(f"this API key already has {limit} requests pending (the per-key limit); retry when some finish",
                       retry_after=2.0)  # fmt: skip
        if self.samples_inflight + samples > self.max_inflight_samples:
            raise Busy("too many sample requests in flight; retry shortly")
        self.pending_by_owner[owner] = self.pending_by_owner.get(owner, 0) + 1
        self.samples_inflight += samples
        return Ticket(self, owner, samples)

    def _leave(self, ticket: Ticket) -> None:
        left = self.pending_by_owner[ticket.owner] - 1
        if left:
            self.pending_by_owner[ticket.owner] = left
        else:
            del self.pending_by_owner[ticket.owner]
        self.samples_inflight -= ticket.samples

    def queue_state(self, owner: str) -> str:
        """Tinker's queue_state for a pending request of `owner`."""
        if self.pending_by_owner.get(owner, 0) >= self.max_pending_per_key:
            return "paused_rate_limit"
        if self.samples_inflight >= self.max_inflight_samples:
            return "paused_capacity"
        return "active"
