"""Metering: tokens trained and sampled, checkpoints saved, and the audit trail, per tenant.

Counted in memory on the event loop (a dict add per request) and written to the catalog's ledger
(catalog/ledger.py) by the service's upkeep every few seconds, off the event loop, and before any
read of them. A crash loses at most what the last few seconds counted; nothing is ever half-written
(one transaction per flush). What tinker 0.38's `AdminClient` reads is summed from the ledger.
"""

from __future__ import annotations

import threading
from datetime import UTC, datetime
from typing import Any

from mint_server.catalog.ledger import Ledger
from mint_server.catalog.records import AuditEntry, UsageEntry

TRAINING, PREFILL, SAMPLE, CHECKPOINT = "training", "sampling_prefill", "sampling_sample", "checkpoint"
KINDS = (TRAINING, PREFILL, SAMPLE, CHECKPOINT)


def hour_of(at: datetime) -> datetime:
    return at.astimezone(UTC).replace(minute=0, second=0, microsecond=0)


class Meter:
    def __init__(self, ledger: Ledger, base_model: str) -> None:
        self.ledger = ledger
        self.base_model = base_model
        self._usage: dict[tuple[str, datetime, str, str | None, str | None], float] = {}
        self._audit: list[AuditEntry] = []
        self._lock = threading.Lock()  # flushes run on a worker thread

    def count(self, owner: str, kind: str, quantity: float, *, session_id: str | None = None,
              project_id: str | None = None) -> None:
        if quantity <= 0:
            return
        key = (owner, hour_of(datetime.now(UTC)), kind, session_id, project_id)
        with self._lock:
            self._usage[key] = self._usage.get(key, 0.0) + quantity

    def audit(self, owner: str, event: str, **details: Any) -> None:
        """Note `event` (`<resource>_<action>`) of `owner`, with what it was about."""
        entry = AuditEntry(owner, datetime.now(UTC), event, {k: v for k, v in details.items() if v is not None})
        with self._lock:
            self._audit.append(entry)

    def flush(self) -> None:
        """Write what was counted since the last flush (blocking: call it off the event loop). If
        the write fails, the counts are kept for the next flush."""
        with self._lock:
            usage, audit = self._usage, self._audit
            self._usage, self._audit = {}, []
        entries = [UsageEntry(owner, bucket, kind, quantity, session, project, self.base_model)
                   for (owner, bucket, kind, session, project), quantity in usage.items()]
        try:
            self.ledger.add(entries, audit)
        except BaseException:
            with self._lock:
                for key, quantity in usage.items():
                    self._usage[key] = self._usage.get(key, 0.0) + quantity
                self._audit[:0] = audit
            raise
