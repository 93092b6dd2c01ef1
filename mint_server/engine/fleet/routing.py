"""Where work goes: the hash ring that breaks placement ties, and the router's records of each
replica, each tracked request and each training adapter's placement."""

from __future__ import annotations

import bisect
import hashlib
import threading
from collections import Counter
from dataclasses import dataclass, field
from typing import Any

from mint_server.engine.interface import TokenCallback

VNODES = 64  # points per replica on the hash ring: keys spread evenly, and few move when N changes
HOMES_KEPT = 200_000  # read-only adapter keys whose home the router remembers (least recently used go)


class HashRing:
    """Consistent hashing of keys onto replica indices."""

    def __init__(self, replicas: int, vnodes: int = VNODES) -> None:
        points = sorted((ring_hash(f"replica-{i}#{v}"), i) for i in range(replicas) for v in range(vnodes))
        self._hashes = [h for h, _ in points]
        self._owners = [i for _, i in points]

    def home(self, key: str) -> int:
        at = bisect.bisect(self._hashes, ring_hash(key)) % len(self._hashes)
        return self._owners[at]


def ring_hash(text: str) -> int:
    return int.from_bytes(hashlib.blake2b(text.encode(), digest_size=8).digest(), "big")


@dataclass
class ReplicaView:
    index: int
    handle: Any
    incarnation: str = ""
    pid: int = 0
    up: bool = True
    inflight: int = 0  # requests routed to it and not finished (the router's own count: no RPC)
    capacity: int = 1  # adapter slots on its device: its share of a wave of cold adapters
    restarts: int = 0
    report: dict[str, Any] = field(default_factory=dict)
    step_count: int = 0
    step_sum: float = 0.0
    retired: dict[str, Any] = field(default_factory=dict)  # cumulative counts of its dead incarnations


@dataclass(eq=False)
class TrackedRequest:
    """A sample request in flight: where it runs now (so a cancel can reach it) and, when streamed,
    the caller's callback, its cancel event and how many tokens of each sample it has seen."""

    request_id: str
    on_token: TokenCallback | None
    cancel: threading.Event | None
    delivered: Counter[int] = field(default_factory=Counter)
    replica: ReplicaView | None = None
    cancel_requested: bool = False  # FleetEngine.cancel

    @property
    def streamed(self) -> bool:
        return self.on_token is not None or self.cancel is not None

    @property
    def cancelled(self) -> bool:
        return self.cancel_requested or (self.cancel is not None and self.cancel.is_set())


@dataclass
class Placement:
    """Where a training adapter lives: its replica, its id there, and that replica's incarnation."""

    replica: int
    local_id: str
    incarnation: str


