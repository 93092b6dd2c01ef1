"""ORM tables. Every lookup the catalog does is served by a primary key or one of the indexes here,
so lookups stay O(log n) at millions of policies; listings walk the same indexes by keyset.

Tables carry a `catalog_` prefix because a PostgreSQL database may be shared with the rest of the
service. Changing this file means adding a migration under migrations/versions/ (the test suite
compares the migrated schema against these models).
"""

from __future__ import annotations

from datetime import UTC, datetime
from typing import Any

from sqlalchemy import (
    JSON,
    BigInteger,
    DateTime,
    Double,
    ForeignKey,
    Index,
    Integer,
    MetaData,
    String,
    Text,
    UniqueConstraint,
)
from sqlalchemy.dialects.postgresql import JSONB
from sqlalchemy.orm import DeclarativeBase, Mapped, mapped_column
from sqlalchemy.types import TypeDecorator

# SQLite only turns INTEGER PRIMARY KEY into a rowid alias (fast, auto-assigned), so ids are
# BIGINT elsewhere and INTEGER there.
Id = BigInteger().with_variant(Integer(), "sqlite")
Json = JSON().with_variant(JSONB(), "postgresql")


def Key(length: int) -> String:  # noqa: N802 - reads like a type
    """A name/hash column compared bytewise: the C collation on PostgreSQL matches SQLite's BINARY,
    so keyset order and sha-prefix range scans behave the same on both backends."""
    return String(length).with_variant(String(length, collation="C"), "postgresql")


class UTCDateTime(TypeDecorator[datetime]):
    """Timestamps in UTC. SQLite has no time zones, so values are stored naive-UTC there and made
    aware again on the way out; callers always get aware datetimes."""

    impl = DateTime(timezone=True)
    cache_ok = True

    def process_bind_param(self, value: datetime | None, dialect: Any) -> datetime | None:
        if value is None:
            return None
        value = value.astimezone(UTC) if value.tzinfo else value.replace(tzinfo=UTC)
        return value.replace(tzinfo=None) if dialect.name == "sqlite" else value

    def process_result_value(self, value: datetime | None, dialect: Any) -> datetime | None:
        if value is None:
            return None
        return value.replace(tzinfo=UTC) if value.tzinfo is None else value.astimezone(UTC)


NAMING = {
    "ix": "ix_%(table_name)s_%(column_0_N_name)s",
    "uq": "uq_%(table_name)s_%(column_0_N_name)s",
    "fk": "fk_%(table_name)s_%(column_0_name)s_%(referred_table_name)s",
    "pk": "pk_%(table_name)s",
}


class Base(DeclarativeBase):
    metadata = MetaData(naming_convention=NAMING)


class PolicyRow(Base):
    __tablename__ = "catalog_policies"
    # (owner, name) is the lookup key and, walked in order, the listing order.
    __table_args__ = (UniqueConstraint("owner", "name"),)

    id: Mapped[int] = mapped_column(Id, primary_key=True)
    owner: Mapped[str] = mapped_column(Key(256))
    name: Mapped[str] = mapped_column(Key(128))
    base_model: Mapped[str] = mapped_column(String(512))
    lora_config: Mapped[dict[str, Any]] = mapped_column(Json)
    # `metadata` is reserved on declarative classes, hence the attribute name.
    meta: Mapped[dict[str, Any]] = mapped_column("metadata", Json)
    created_at: Mapped[datetime] = mapped_column(UTCDateTime())


class RevisionRow(Base):
    __tablename__ = "catalog_revisions"
    __table_args__ = (
        # Lookup by number, "latest" (max number) and the newest-first listing.
        UniqueConstraint("policy_id", "number"),
        # Sha-prefix references are a range scan within one policy.
        Index(None, "policy_id", "sha256"),
    )

    id: Mapped[int] = mapped_column(Id, primary_key=True)
    policy_id: Mapped[int] = mapped_column(Id, ForeignKey("catalog_policies.id"))
    number: Mapped[int] = mapped_column(Integer)
    sha256: Mapped[str] = mapped_column(Key(64))
    size: Mapped[int] = mapped_column(BigInteger)
    rank: Mapped[int] = mapped_column(Integer)
    parent_id: Mapped[int | None] = mapped_column(Id, ForeignKey("catalog_revisions.id"))
    training_run: Mapped[str | None] = mapped_column(String(256))
    step: Mapped[int | None] = mapped_column(BigInteger)
    note: Mapped[str | None] = mapped_column(Text)
    created_at: Mapped[datetime] = mapped_column(UTCDateTime())
    # The precision of the base the adapter was trained on ("fp32", "bf16", "int8", "fp8-dequantized-bf16"
    # …; model/prequant_spec.base_precision); None where unknown (imported, or published before 0004).
    base_precision: Mapped[str | None] = mapped_column(String(32))


class ManifestEntryRow(Base):
    """One file of a revision payload. Keyed by the manifest sha (= the revision sha), so identical
    payloads share rows, and indexed by blob so GC can ask "is this blob referenced?" cheaply."""

    __tablename__ = "catalog_manifest_entries"
    __table_args__ = (Index(None, "blob_sha256"),)

    manifest_sha256: Mapped[str] = mapped_column(Key(64), primary_key=True)
    name: Mapped[str] = mapped_column(Key(255), primary_key=True)
    blob_sha256: Mapped[str] = mapped_column(Key(64))
    size: Mapped[int] = mapped_column(BigInteger)


class AliasRow(Base):
    __tablename__ = "catalog_aliases"

    policy_id: Mapped[int] = mapped_column(Id, ForeignKey("catalog_policies.id"), primary_key=True)
    name: Mapped[str] = mapped_column(Key(64), primary_key=True)
    revision_id: Mapped[int] = mapped_column(Id, ForeignKey("catalog_revisions.id"))
    updated_at: Mapped[datetime] = mapped_column(UTCDateTime())


class AliasEventRow(Base):
    __tablename__ = "catalog_alias_events"
    # History of one alias, newest first, by keyset on id.
    __table_args__ = (Index(None, "policy_id", "alias", "id"),)

    id: Mapped[int] = mapped_column(Id, primary_key=True)
    policy_id: Mapped[int] = mapped_column(Id, ForeignKey("catalog_policies.id"))
    alias: Mapped[str] = mapped_column(Key(64))
    action: Mapped[str] = mapped_column(String(16))
    from_revision_id: Mapped[int | None] = mapped_column(Id, ForeignKey("catalog_revisions.id"))
    to_revision_id: Mapped[int] = mapped_column(Id, ForeignKey("catalog_revisions.id"))
    actor: Mapped[str] = mapped_column(String(256))
    reason: Mapped[str | None] = mapped_column(Text)
    at: Mapped[datetime] = mapped_column(UTCDateTime())


class EvalRow(Base):
    __tablename__ = "catalog_evals"
    __table_args__ = (Index(None, "revision_id", "id"),)

    id: Mapped[int] = mapped_column(Id, primary_key=True)
    revision_id: Mapped[int] = mapped_column(Id, ForeignKey("catalog_revisions.id"))
    metric: Mapped[str] = mapped_column(String(128))
    value: Mapped[float] = mapped_column(Double())
    dataset: Mapped[str | None] = mapped_column(String(256))
    created_at: Mapped[datetime] = mapped_column(UTCDateTime())


class ApiKeyRow(Base):
    """A scoped API key. Only the sha256 of the key is kept; `key_id` is its public, non-secret part
    (shown in listings, used to revoke), and a key is looked up by it."""

    __tablename__ = "catalog_api_keys"
    # A tenant's listing, oldest first.
    __table_args__ = (Index(None, "owner", "id"),)

    id: Mapped[int] = mapped_column(Id, primary_key=True)
    key_id: Mapped[str] = mapped_column(Key(32), unique=True)
    digest: Mapped[str] = mapped_column(String(64))
    owner: Mapped[str] = mapped_column(Key(256))
    name: Mapped[str] = mapped_column(String(128))
    scopes: Mapped[list[str]] = mapped_column(Json)
    created_at: Mapped[datetime] = mapped_column(UTCDateTime())
    revoked_at: Mapped[datetime | None] = mapped_column(UTCDateTime())


class UsageRow(Base):
    """Usage of one tenant in one UTC hour, by kind (training / sampling_prefill / sampling_sample /
    checkpoint) and attribution ("" where there is none: the key must be unique, and NULLs never
    collide). The service adds its metered counts to the bucket's row (catalog/ledger.py)."""

    __tablename__ = "catalog_usage"
    # One row per bucket and attribution; its leading columns serve a tenant's window in bucket order.
    __table_args__ = (UniqueConstraint("owner", "bucket_start", "kind", "session_id", "project_id", "base_model",
                                       name="uq_catalog_usage_bucket"),)  # the generated name passes PG's 63

    id: Mapped[int] = mapped_column(Id, primary_key=True)
    owner: Mapped[str] = mapped_column(Key(256))
    bucket_start: Mapped[datetime] = mapped_column(UTCDateTime())
    kind: Mapped[str] = mapped_column(Key(32))
    session_id: Mapped[str] = mapped_column(Key(64))
    project_id: Mapped[str] = mapped_column(Key(128))
    base_model: Mapped[str] = mapped_column(Key(512))
    quantity: Mapped[float] = mapped_column(Double())


class AuditEventRow(Base):
    """One audited action of a tenant: `<resource>_<action>` with what it was about."""

    __tablename__ = "catalog_audit_events"
    # A tenant's day, in time order.
    __table_args__ = (Index(None, "owner", "at"),)

    id: Mapped[int] = mapped_column(Id, primary_key=True)
    owner: Mapped[str] = mapped_column(Key(256))
    at: Mapped[datetime] = mapped_column(UTCDateTime())
    event: Mapped[str] = mapped_column(String(64))
    details: Mapped[dict[str, Any]] = mapped_column(Json)
