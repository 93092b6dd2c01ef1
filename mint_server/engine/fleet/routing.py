"""Where work goes: the router's policy (a read-only adapter's home replica, spilling when it is
saturated), the hash ring that breaks placement ties, and the router's records of each replica, each
tracked request and each training adapter's placement. No Ray here: the facade (engine.py) acts on
the decisions."""

from __future__ import annotations

import bisect
import hashlib
import threading
from collections import Counter, OrderedDict
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




class Router:
    """Which replica takes work on a read-only adapter (`route`) or on the base (`least_loaded`).

    An adapter key has a home, where its requests go so it stays hot on one replica. A key seen for
    the first time is placed where free capacity is largest (ties: its consistent-hashing home) and
    stays there; past `spill_inflight` requests in flight at home, new ones spill to the least-loaded
    replica unless the others are nearly as busy."""

    def __init__(self, replicas: list[ReplicaView], spill_inflight: int) -> None:
        self.replicas = replicas
        self.spill_inflight = spill_inflight
        self._ring = HashRing(len(replicas))
        self._homes: OrderedDict[str, int] = OrderedDict()  # read-only adapter key → home replica (LRU)
        self._lock = threading.Lock()

    def home_of(self, key: str) -> int:
        with self._lock:
            home = self._homes.get(key)
            if home is not None:
                self._homes.move_to_end(key)
                return home
            home = self._homes[key] = self._place_cold(key)
            if len(self._homes) > HOMES_KEPT:
                self._homes.popitem(last=False)  # a long-unused key: placed afresh if it comes back
            return home

    def _place_cold(self, key: str) -> int:
        """The up replica with the fewest requests in flight per adapter slot; on a tie (an idle
        fleet), the key's ring home. A wave of cold adapters submitted at once is so spread in
        proportion to the replicas' free capacity."""
        ring = self._ring.home(key)
        return min(self.up(), key=lambda r: ((r.inflight + 1) / r.capacity, r.index != ring, r.index)).index

    def up(self) -> list[ReplicaView]:
        up = [r for r in self.replicas if r.up]
        return up or self.replicas  # all down: Ray queues calls until a restart answers

    def least_loaded(self, exclude: int | None = None) -> ReplicaView:
        candidates = [r for r in self.up() if r.index != exclude] or self.up()
        return min(candidates, key=lambda r: (r.inflight, r.index))

    def route(self, key: str, exclude: int | None = None) -> tuple[ReplicaView, str]:
        """The replica for work on a read-only adapter, and why: "home", "spill" (home saturated) or
        "retry" (`exclude` failed it)."""
        home = self.replicas[self.home_of(key)]
        if exclude is None and home.up and home.inflight < self.spill_inflight:
            return home, "home"
        other = self.least_loaded(exclude)
        if other.index == home.index:
            return home, "home"
        if exclude is None and home.up and 2 * other.inflight > home.inflight:
            return home, "home"  # the others are nearly as busy: stay where the adapter is hot
        return other, "spill" if exclude is None else "retry"
