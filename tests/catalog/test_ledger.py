"""The usage and audit ledger on both backends: metered counts add into one row per hour and
attribution however often they are flushed; windows, event filters and owners hold."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta

from sqlalchemy import func, select

from mint_server.catalog import Catalog
from mint_server.catalog.ledger import Ledger
from mint_server.catalog.records import AuditEntry, UsageEntry
from mint_server.catalog.schema import UsageRow

HOUR = datetime(2026, 5, 1, 10, tzinfo=UTC)


def test_usage_adds_into_its_bucket_and_audit_filters(catalog: Catalog) -> None:
    ledger = Ledger(catalog.engine)
    for _ in range(3):  # three flushes of the same bucket
        ledger.add([UsageEntry("a", HOUR, "training", 10, "s1", "p", "base"),
                    UsageEntry("a", HOUR, "training", 1, None, None, "base")], [])
    ledger.add([UsageEntry("a", HOUR + timedelta(hours=1), "checkpoint", 2, "s1", "p", "base"),
                UsageEntry("b", HOUR, "training", 99, "s9", None, "base")], [])
    with catalog.engine.connect() as conn:
        assert conn.execute(select(func.count()).select_from(UsageRow.__table__)).scalar() == 4  # one row per key
    rows = ledger.usage("a", HOUR, HOUR + timedelta(hours=2))
    assert [(r.bucket_start, r.kind, r.quantity, r.session_id, r.project_id) for r in rows] == [
        (HOUR, "training", 30.0, "s1", "p"), (HOUR, "training", 3.0, None, None),
        (HOUR + timedelta(hours=1), "checkpoint", 2.0, "s1", "p")]
    assert [r.kind for r in ledger.usage("a", HOUR + timedelta(hours=1), HOUR + timedelta(hours=2))] == ["checkpoint"]
    assert ledger.usage("nobody", HOUR, HOUR + timedelta(days=1)) == []

    ledger.add([], [AuditEntry("a", HOUR, "checkpoint_created", {"tinker_path": "tinker://r/weights/w"}),
                    AuditEntry("a", HOUR + timedelta(minutes=1), "organization_api_key_created", {"key_id": "k"}),
                    AuditEntry("b", HOUR, "checkpoint_deleted", {})])
    day = (HOUR.replace(hour=0), HOUR.replace(hour=0) + timedelta(days=1))
    assert [e.event for e in ledger.audit("a", *day)] == ["checkpoint_created", "organization_api_key_created"]
    assert [e.details for e in ledger.audit("a", *day, ["checkpoint_"])] == [{"tinker_path": "tinker://r/weights/w"}]
    assert ledger.audit("a", *day, ["team_"]) == []
    assert ledger.audit("a", day[1], day[1] + timedelta(days=1)) == []
