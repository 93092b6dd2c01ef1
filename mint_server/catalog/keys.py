"""Scoped API keys, kept in the catalog's database so that `mint key` on the data dir and a running
server see the same keys: a key created or revoked by either holds for the other on its next request.

The store keeps what identifies and limits a key, never the key: its public id, the sha256 of the
key, the owner it acts as, a name and its scopes. Making keys and checking them is api/auth/keys.py's job.
"""

from __future__ import annotations

from datetime import UTC, datetime

from sqlalchemy import Engine, select
from sqlalchemy.orm import Session

from mint_server.catalog import db
from mint_server.catalog.errors import InvalidArgument, NotFound
from mint_server.catalog.records import ApiKey
from mint_server.catalog.schema import ApiKeyRow

MAX_KEY_NAME = 128
MAX_KEYS_PER_OWNER = 1000  # live keys; a bound so a leaked admin key cannot fill the table


class KeyStore:
    def __init__(self, engine: Engine) -> None:
        self._engine = engine
        self._writer = db.writer(engine)

    def create(self, owner: str, key_id: str, digest: str, name: str, scopes: list[str]) -> ApiKey:
        if not isinstance(name, str) or not name or len(name) > MAX_KEY_NAME or not name.isprintable():
            raise InvalidArgument(f"name must be 1-{MAX_KEY_NAME} printable characters", field="name")
        with db.full_database_named(), Session(self._writer, expire_on_commit=False) as s, s.begin():
            s.connection()  # the write lock first (SQLite BEGIN IMMEDIATE): the count below stays true
            live = s.scalar(
                select(ApiKeyRow.id).where(ApiKeyRow.owner == owner, ApiKeyRow.revoked_at.is_(None))
                .offset(MAX_KEYS_PER_OWNER - 1).limit(1)
            )
            if live is not None:
                raise InvalidArgument(f"at most {MAX_KEYS_PER_OWNER} live keys per owner: revoke one first",
                                      field="name")
            row = ApiKeyRow(key_id=key_id, digest=digest, owner=owner, name=name, scopes=list(scopes),
                            created_at=datetime.now(UTC), revoked_at=None)
            s.add(row)
        return _record(row)

    def get(self, key_id: str) -> tuple[ApiKey, str] | None:
        """The key with this id and its stored digest, revoked or not; None if there is none.
        Read on every request a scoped key makes: one indexed select on a pooled connection."""
        t = ApiKeyRow.__table__
        with self._engine.connect() as conn:
            row = conn.execute(select(t).where(t.c.key_id == key_id)).first()
        if row is None:
            return None
        return ApiKey(key_id=row.key_id, owner=row.owner, name=row.name, scopes=list(row.scopes),
                      created_at=row.created_at, revoked_at=row.revoked_at), row.digest

    def list(self, owner: str, *, include_revoked: bool = False) -> list[ApiKey]:
        query = select(ApiKeyRow).where(ApiKeyRow.owner == owner).order_by(ApiKeyRow.id)
        if not include_revoked:
            query = query.where(ApiKeyRow.revoked_at.is_(None))
        with Session(self._engine, expire_on_commit=False) as s, s.begin():
            return [_record(row) for row in s.scalars(query)]

    def revoke(self, owner: str, key_id: str) -> ApiKey:
        """Revoke one of `owner`'s keys (revoking a revoked key changes nothing); another owner's key
        looks absent."""
        with Session(self._writer, expire_on_commit=False) as s, s.begin():
            row = s.scalar(select(ApiKeyRow).where(ApiKeyRow.key_id == key_id, ApiKeyRow.owner == owner))
            if row is None:
                raise NotFound(f"no API key {key_id!r}", field="key_id")
            if row.revoked_at is None:
                row.revoked_at = datetime.now(UTC)
        return _record(row)


def _record(row: ApiKeyRow) -> ApiKey:
    return ApiKey(key_id=row.key_id, owner=row.owner, name=row.name, scopes=list(row.scopes),
                  created_at=row.created_at, revoked_at=row.revoked_at)
