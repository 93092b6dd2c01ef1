"""A catalog's database and blob store: how it opens, its read and write sessions, and the lookups
every part of the catalog makes (a policy's row, the revision a reference names), with the helpers
they share (`now`, `page_of`, `revision_record`)."""

from __future__ import annotations

import os
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from datetime import UTC, datetime
from pathlib import Path
from typing import Any, Self

from sqlalchemy import Engine, select
from sqlalchemy.orm import Session

from mint_server import paths
from mint_server.catalog import cursor as cursors
from mint_server.catalog import db, queries
from mint_server.catalog.blobs import BlobStore
from mint_server.catalog.errors import InvalidReference, NotFound
from mint_server.catalog.records import Page, Revision
from mint_server.catalog.refs import Ref, check_owner, check_policy_name
from mint_server.catalog.schema import PolicyRow
from mint_server.catalog.stores import open_blob_store


def now() -> datetime:
    return datetime.now(UTC)


def revision_record(row: Any) -> Revision:
    m = dict(row._mapping)
    parent_policy, parent_number = m.pop("parent_policy"), m.pop("parent_number")
    m["parent"] = f"{parent_policy}@{parent_number}" if m["parent_id"] is not None else None
    return Revision(**m)


def page_of(items: list[Any], limit: int, tag: str, key: Callable[[Any], Any]) -> Page[Any]:
    # We fetched limit+1 rows: an extra row means there is a next page.
    if len(items) > limit:
        items = items[:limit]
        return Page(items, cursors.encode(tag, key(items[-1])))
    return Page(items, None)


class CatalogCore:
    def __init__(self, engine: Engine, blobs: BlobStore, data_dir: Path) -> None:
        self.engine = engine
        self.blobs = blobs
        self.data_dir = data_dir
        self._writer = db.writer(engine)

    @classmethod
    def open(
        cls,
        url: str | None = None,
        *,
        data_dir: str | os.PathLike[str] | None = None,
        blob_store: BlobStore | None = None,
        store: str | None = None,
        migrate: bool = True,
    ) -> Self:
        """Open (and migrate to the latest schema) the catalog at `url`; default SQLite in the data dir.

        Blobs live in `blob_store`, else at the `store` URL (blobs.open_blob_store: a path, file://…
        or s3://bucket/prefix), else in <data_dir>/blobs; data_dir defaults as in mint_server.paths
        (explicit override, $MINT_HOME, ~/.mint).
        """
        root = paths.data_dir(data_dir)
        blobs = blob_store or open_blob_store(store, root / "blobs")
        engine = db.make_engine(url or db.default_url(root))
        try:
            if migrate:
                db.migrate(engine)
        except BaseException:
            engine.dispose()
            raise
        return cls(engine, blobs, root)

    def close(self) -> None:
        self.engine.dispose()

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    @contextmanager
    def _read(self) -> Iterator[Session]:
        # expire_on_commit=False: rows stay readable after the transaction, to build records.
        with Session(self.engine, expire_on_commit=False) as s, s.begin():
            yield s

    @contextmanager
    def _write(self) -> Iterator[Session]:
        with db.full_database_named(), Session(self._writer, expire_on_commit=False) as s, s.begin():
            # Sessions begin lazily; take the write lock (SQLite BEGIN IMMEDIATE) now, so that
            # non-SQL checks made inside the block (blob existence) are covered by it too.
            s.connection()
            yield s

    def _policy_row(self, s: Session, owner: str, name: str, *, lock: bool = False) -> PolicyRow:
        check_owner(owner)
        check_policy_name(name)
        query = queries.POLICY_FOR_UPDATE if lock else queries.POLICY
        row = s.scalars(query, {"owner": owner, "name": name}).first()
        if row is None:
            raise NotFound(f"policy {name!r} not found", field="name")
        return row

    def _resolve(self, s: Session, owner: str, ref: Ref, text_ref: str, field: str = "ref") -> Revision:
        params: dict[str, Any] = {"owner": owner, "name": ref.policy}
        if ref.kind == "number":
            params["number"] = ref.number
        elif ref.kind == "alias":
            params["alias"] = ref.alias
        elif ref.kind == "sha":
            params.update(queries.sha_bounds(ref.sha_prefix or ""))
            if len(s.scalars(queries.SHAS_WITH_PREFIX, params).all()) > 1:
                raise InvalidReference(
                    f"{field} {text_ref!r} is ambiguous: sha256 prefix {ref.sha_prefix!r} matches several "
                    "revisions; use more digits",
                    field=field,
                )
        row = s.execute(queries.RESOLVE[ref.kind], params).first()
        if row is None:
            raise self._why_missing(s, owner, ref, text_ref, field)
        return revision_record(row)

    def _why_missing(self, s: Session, owner: str, ref: Ref, text_ref: str, field: str) -> NotFound:
        exists = s.scalar(select(PolicyRow.id).where(PolicyRow.owner == owner, PolicyRow.name == ref.policy))
        if exists is None:
            what = f"policy {ref.policy!r} not found"
        elif ref.kind == "latest":
            what = f"policy {ref.policy!r} has no revisions"
        elif ref.kind == "number":
            what = f"policy {ref.policy!r} has no revision {ref.number}"
        elif ref.kind == "alias":
            what = f"policy {ref.policy!r} has no alias {ref.alias!r}"
        else:
            what = f"policy {ref.policy!r} has no revision whose sha256 starts with {ref.sha_prefix!r}"
        return NotFound(f"{field} {text_ref!r}: {what}", field=field)
