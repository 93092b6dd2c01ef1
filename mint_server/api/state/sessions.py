"""Client sessions: one per ServiceClient, kept alive by heartbeats.

A session that stops heartbeating (the client process died) or is finished by the client is
closed; the service then releases what it holds in the engine. Sessions live in memory only: after
a restart old clients get 410 on heartbeat and stop, and new clients open new sessions.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

from mint_server.api.auth.keys import random_id
from mint_server.api.state.runs import NotFound


class SessionGone(Exception):
    """The session finished or expired (HTTP 410: the SDK stops heartbeating)."""


@dataclass
class Session:
    session_id: str
    owner: str
    created_at: float
    last_seen: float
    user_metadata: dict[str, Any] | None = None
    display_name: str | None = None
    project_id: str | None = None  # scopes the runs (and so the checkpoints) it creates
    model_ids: list[str] = field(default_factory=list)
    sampler_ids: list[str] = field(default_factory=list)
    closed: bool = False
    finish_reason: str | None = None  # what its client said when it finished it: success | errored | interrupted


class SessionRegistry:
    def __init__(self, ttl_s: float) -> None:
        self._ttl_s = ttl_s
        self._sessions: dict[str, Session] = {}

    def create(self, owner: str, user_metadata: dict[str, Any] | None, display_name: str | None,
               project_id: str | None = None) -> Session:
        now = time.monotonic()
        session = Session(random_id(), owner, time.time(), now, user_metadata, display_name, project_id)
        self._sessions[session.session_id] = session
        return session

    def get(self, session_id: str, owner: str) -> Session:
        session = self._sessions.get(session_id)
        if session is None or session.owner != owner:
            raise NotFound(f"session {session_id!r} not found")
        return session

    def find(self, session_id: str) -> Session | None:
        """Any owner's session (for attributing work already checked to be the caller's)."""
        return self._sessions.get(session_id)

    def live(self, session_id: str, owner: str) -> Session:
        """A session that may still create things."""
        session = self.get(session_id, owner)
        if session.closed:
            raise SessionGone(f"session {session_id!r} has ended")
        session.last_seen = time.monotonic()
        return session

    def heartbeat(self, session_id: str, owner: str) -> None:
        session = self._sessions.get(session_id)
        if session is None or session.owner != owner or session.closed:
            # Unknown includes "from before a restart": either way this client should stop.
            raise SessionGone(f"session {session_id!r} is not active")
        session.last_seen = time.monotonic()

    def owned(self, owner: str) -> list[Session]:
        return sorted((s for s in self._sessions.values() if s.owner == owner), key=lambda s: s.created_at)

    def active_count(self) -> int:
        return sum(not s.closed for s in self._sessions.values())

    def take_expired(self) -> list[Session]:
        """Close sessions whose heartbeat lapsed and return them for cleanup."""
        cutoff = time.monotonic() - self._ttl_s
        expired = [s for s in self._sessions.values() if not s.closed and s.last_seen < cutoff]
        for s in expired:
            s.closed = True
        return expired

    def close(self, session: Session) -> bool:
        was_open = not session.closed
        session.closed = True
        return was_open
