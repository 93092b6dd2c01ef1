"""Usage and audit records in the catalog's database, so every server on one database reports the
same figures (tinker 0.38's `AdminClient`: billing usage events and the audit log).

Usage arrives already summed by hour (the service meters in memory and flushes every few
seconds, see api/state/usage.py) and is added to its bucket's row (one per hour, kind and attribution);
a read sums a window's rows by bucket and attribution. Nothing
here knows prices: this is self-hosted usage, not billing.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from datetime import UTC, datetime
from typing import Any

from sqlalchemy import Engine, false, func, insert, or_, select

from mint_server.catalog import db
from mint_server.catalog.records import AuditEntry, UsageEntry
from mint_server.catalog.schema import AuditEventRow, UsageRow

MAX_AUDIT_ROWS = 10_000  # one day of one tenant's audit log, at most, per read


class Ledger:
    def __init__(self, engine: Engine) -> None:
        self._engine = engine
        self._writer = db.writer(engine)

    def add(self, usage: Sequence[UsageEntry], audit: Sequence[AuditEntry]) -> None:
        """Write metered usage and audit events in one transaction."""
        if not usage and not audit:
            return
        with db.full_database_named(), self._writer.begin() as conn:
            if usage:
                conn.execute(_add_to_bucket(conn.dialect.name), [
                    {"owner": u.owner, "bucket_start": u.bucket_start, "kind": u.kind, "quantity": u.quantity,
                     "session_id": u.session_id or "", "project_id": u.project_id or "",
                     "base_model": u.base_model or ""}
                    for u in usage
                ])
            if audit:
                conn.execute(insert(AuditEventRow), [
                    {"owner": a.owner, "at": a.at, "event": a.event, "details": a.details} for a in audit
                ])

    def usage(self, owner: str, start: datetime, end: datetime) -> list[UsageEntry]:
        """`owner`'s usage with bucket_start in [start, end), summed per bucket, kind and attribution,
        in bucket order, biggest first within a bucket."""
        t = UsageRow.__table__
        keys = (t.c.bucket_start, t.c.kind, t.c.session_id, t.c.project_id, t.c.base_model)
        total = func.sum(t.c.quantity).label("quantity")
        q = (select(*keys, total).where(t.c.owner == owner, t.c.bucket_start >= start, t.c.bucket_start < end)
             .group_by(*keys).order_by(t.c.bucket_start, total.desc(), t.c.kind))
        with self._engine.connect() as conn:
            rows = conn.execute(q).all()
        return [UsageEntry(owner=owner, bucket_start=_aware(r.bucket_start), kind=r.kind, quantity=float(r.quantity),
                           session_id=r.session_id or None, project_id=r.project_id or None,
                           base_model=r.base_model or None)
                for r in rows]

    def audit(self, owner: str, start: datetime, end: datetime,
              prefixes: Iterable[str] | None = None) -> list[AuditEntry]:
        """`owner`'s audit events in [start, end) in time order; with `prefixes`, only events whose
        name starts with one of them."""
        t = AuditEventRow.__table__
        q = select(t).where(t.c.owner == owner, t.c.at >= start, t.c.at < end)
        if prefixes is not None:
            q = q.where(or_(false(), *(t.c.event.startswith(p) for p in prefixes)))
        q = q.order_by(t.c.at, t.c.id).limit(MAX_AUDIT_ROWS)
        with self._engine.connect() as conn:
            rows = conn.execute(q).all()
        return [AuditEntry(owner=owner, at=_aware(r.at), event=r.event, details=dict(r.details)) for r in rows]


def _add_to_bucket(dialect: str) -> Any:
    """INSERT … ON CONFLICT (the bucket's key) DO UPDATE SET quantity = quantity + the new count:
    one row per bucket and attribution however often the meter flushes (both backends speak it)."""
    if dialect == "postgresql":
        from sqlalchemy.dialects.postgresql import insert as dialect_insert
    else:
        from sqlalchemy.dialects.sqlite import insert as dialect_insert
    t = UsageRow.__table__
    stmt = dialect_insert(t)
    keys = ["owner", "bucket_start", "kind", "session_id", "project_id", "base_model"]
    return stmt.on_conflict_do_update(index_elements=keys, set_={"quantity": t.c.quantity + stmt.excluded.quantity})


def _aware(value: datetime) -> datetime:
    # Core selects of a UTCDateTime column come back aware; a plain one (SQLite) may not.
    return value.replace(tzinfo=UTC) if value.tzinfo is None else value.astimezone(UTC)
