"""Where the fleet's adapters are: each training adapter's replica and that replica's incarnation
(under a fleet-wide id), and adapter sources written out where every replica can read them."""

from __future__ import annotations

import hashlib
import itertools
import threading
from collections import Counter
from pathlib import Path

from mint_server.engine.fleet.routing import Placement, ReplicaView
from mint_server.engine.interface import AdapterLost, EngineError
from mint_server.engine.jobs import AdapterRef
from mint_server.engine.values import AdapterSource
from mint_server.fsutil import write_content_dir


class Placements:
    def __init__(self, replicas: list[ReplicaView], tag: str, shared: Path) -> None:
        """tag: this fleet's part of its adapter ids; shared: the dir every node mounts, where
        catalog revisions are written out for the replicas."""
        self._replicas, self._tag, self.shared = replicas, tag, shared
        self._lock = threading.Lock()
        self._adapters: dict[str, Placement] = {}
        self._ids = itertools.count(1)
        self._materialized: dict[str, Path] = {}  # source key → its PEFT dir under the shared dir

    # --- training adapters ----------------------------------------------------------------------
    def of(self, fleet_id: str) -> Placement:
        """Where a training adapter lives; AdapterLost when its replica was replaced meanwhile."""
        with self._lock:
            p = self._adapters.get(fleet_id)
        if p is None:
            raise EngineError(f"unknown adapter {fleet_id!r}")
        r = self._replicas[p.replica]
        if p.incarnation != r.incarnation:
            raise AdapterLost(f"adapter {fleet_id!r}: replica {p.replica} died and was replaced; "
                              "its live state is gone (retry: the model resumes from its last saved state)")
        return p

    def place(self, replica: int, local_id: str) -> str:
        """A fleet id for the replica's adapter `local_id`."""
        fleet_id = f"fa-{self._tag}-{next(self._ids)}"
        with self._lock:
            self._adapters[fleet_id] = Placement(replica, local_id, self._replicas[replica].incarnation)
        return fleet_id

    def pop(self, fleet_id: str) -> Placement | None:
        with self._lock:
            return self._adapters.pop(fleet_id, None)

    def held(self) -> Counter[int]:
        """Training adapters per replica index."""
        with self._lock:
            return Counter(p.replica for p in self._adapters.values())

    # --- portable sources -----------------------------------------------------------------------
    def portable(self, ref: AdapterRef) -> AdapterRef:
        """A source every replica can read. A catalog revision's `read` (verified blob reads; the
        closure holds this process's catalog and cannot travel) runs here, once per key, into a PEFT
        dir under the shared dir that every node mounts."""
        if not isinstance(ref, AdapterSource) or ref.read is None:
            return ref
        with self._lock:
            path = self._materialized.get(ref.key)
        if path is None:
            path = self.shared / hashlib.sha256(ref.key.encode()).hexdigest()[:32]
            if not (path / "adapter_config.json").exists():
                files = ref.read()

                def fill(d: Path) -> None:
                    for name, data in files.items():
                        (d / name).write_bytes(data)

                write_content_dir(path, fill)  # another thread or node may write the same content first
            with self._lock:
                self._materialized[ref.key] = path
        return AdapterSource(ref.key, peft_dir=path)

    def needs_materialize(self, ref: AdapterRef) -> bool:
        """Whether `portable(ref)` would write it out first (blocking: run it off the caller's thread)."""
        return isinstance(ref, AdapterSource) and ref.read is not None and ref.key not in self._materialized

    def forget(self, key_prefix: str) -> None:
        """Sources under this key prefix are gone: a later use writes them out again."""
        with self._lock:
            for key in [k for k in self._materialized if k.startswith(key_prefix)]:
                del self._materialized[key]
