"""Admission at the service's door: whether new work is taken, per-key pending limits, the server's
bound on sample requests in flight. One object owns these counters; every route asks it.

The engine's scheduler decides the order of admitted work; this only keeps one key (or the whole
server) from queueing without bound, answering 429 with Retry-After (the SDKs back off and resubmit)."""

from __future__ import annotations

from mint_server.api.settings import Settings


class ShuttingDown(Exception):
    """The server is draining and takes no new work (HTTP 503, which the SDK retries)."""


class Busy(Exception):
    """Too much work in flight, for the server or for one key (HTTP 429 with Retry-After: the SDK
    backs off and resubmits the same request, seq_id and all)."""

    def __init__(self, message: str, retry_after: float = 1.0) -> None:
        super().__init__(message)
        self.retry_after = retry_after


class Admission:
    def __init__(self, settings: Settings) -> None:
        self.max_pending_per_key = settings.max_pending_per_key
        self.max_inflight_samples = settings.max_inflight_samples
        self.accepting = True
        self.pending_by_owner: dict[str, int] = {}  # unfinished requests per key
        self.samples_inflight = 0  # sample requests submitted to the engine and unfinished

    def check_accepting(self) -> None:
        if not self.accepting:
            raise ShuttingDown("server is shutting down")

    def admit(self, owner: str) -> None:
        """Take new work from `owner`? One key may hold at most `max_pending_per_key` unfinished
        requests: beyond that it gets 429 (and its pending futures report "paused_rate_limit")."""
        self.check_accepting()
        limit = self.max_pending_per_key
        if self.pending_by_owner.get(owner, 0) >= limit:
            raise Busy(f"this API key already has {limit} requests pending (the per-key limit); retry when some finish",
                       retry_after=2.0)  # fmt: skip

    def pending(self, owner: str) -> None:
        self.pending_by_owner[owner] = self.pending_by_owner.get(owner, 0) + 1

    def finished(self, owner: str) -> None:
        left = self.pending_by_owner[owner] - 1
        if left:
            self.pending_by_owner[owner] = left
        else:
            del self.pending_by_owner[owner]

    def check_samples(self, count: int = 1) -> None:
        """Room for `count` more sample requests in flight? Else 429."""
        if self.samples_inflight + count > self.max_inflight_samples:
            raise Busy("too many sample requests in flight; retry shortly")

    def samples_started(self, count: int = 1) -> None:
        self.samples_inflight += count

    def samples_done(self, count: int = 1) -> None:
        self.samples_inflight -= count

    def queue_state(self, owner: str) -> str:
        """Tinker's queue_state for a pending request of `owner`."""
        if self.pending_by_owner.get(owner, 0) >= self.max_pending_per_key:
            return "paused_rate_limit"
        if self.samples_inflight >= self.max_inflight_samples:
            return "paused_capacity"
        return "active"
