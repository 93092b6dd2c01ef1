"""The policy catalog: policies, immutable adapter revisions, aliases with history, evals.

Every public method takes the caller's `owner`; rows of other owners are invisible (NotFound,
never the row). Methods return plain dataclasses from records.py and raise the errors in
errors.py. A Catalog is thread-safe (one engine, one session per call) and several processes may
share one database.
"""

from __future__ import annotations

import json
import math
import os
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from sqlalchemy import Engine, Select, func, select, text, tuple_
from sqlalchemy import exc as sa_exc
from sqlalchemy.orm import Session, aliased

from mint_server import paths
from mint_server.catalog import cursor as cursors
from mint_server.catalog import db, payload, queries
from mint_server.catalog.blobs import BlobStore
from mint_server.catalog.errors import (
    AlreadyExists,
    IntegrityError,
    InvalidArgument,
    InvalidReference,
    NotFound,
)
from mint_server.catalog.records import (
    Alias,
    AliasEvent,
    EvalRecord,
    ImportResult,
    Page,
    Policy,
    Revision,
)
from mint_server.catalog.refs import Ref, check_alias_name, check_owner, check_policy_name, parse_ref
from mint_server.catalog.schema import (
    AliasEventRow,
    AliasRow,
    EvalRow,
    ManifestEntryRow,
    PolicyRow,
    RevisionRow,
)
from mint_server.catalog.stores import open_blob_store

_FromRev = aliased(RevisionRow, name="from_rev")
_ToRev = aliased(RevisionRow, name="to_rev")


def _now() -> datetime:
    return datetime.now(UTC)


class Catalog:
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
    ) -> Catalog:
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

    def __enter__(self) -> Catalog:
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

    # -- policies -------------------------------------------------------------------------
    def create_policy(
        self,
        owner: str,
        name: str,
        base_model: str,
        lora_config: dict[str, Any] | None = None,
        metadata: dict[str, Any] | None = None,
    ) -> Policy:
        """Create a policy; AlreadyExists if this owner already has one called `name`."""
        row = self._new_policy_row(owner, name, base_model, lora_config, metadata)
        with self._write() as s:
            s.add(row)
            try:
                s.flush()
            except sa_exc.IntegrityError:
                raise AlreadyExists(f"policy {name!r} already exists", field="name") from None
            return _policy(row)

    def get_or_create_policy(
        self,
        owner: str,
        name: str,
        base_model: str,
        lora_config: dict[str, Any] | None = None,
        metadata: dict[str, Any] | None = None,
    ) -> Policy:
        """The existing policy `name` (which must be for `base_model`), or a new one."""
        row = self._new_policy_row(owner, name, base_model, lora_config, metadata)
        with self._write() as s:
            return _policy(self._ensure_policy(s, row))

    def get_policy(self, owner: str, name: str) -> Policy:
        with self._read() as s:
            return _policy(self._policy_row(s, owner, name))

    def list_policies(
        self, owner: str, *, cursor: str | None = None, limit: int | None = None
    ) -> Page[Policy]:
        """This owner's policies by name."""
        check_owner(owner)
        limit = cursors.check_limit(limit)
        after = cursors.decode("policies", cursor, str)
        q = select(PolicyRow).where(PolicyRow.owner == owner)
        if after is not None:
            q = q.where(PolicyRow.name > after)
        q = q.order_by(PolicyRow.name).limit(limit + 1)
        with self._read() as s:
            rows = list(s.scalars(q))
        return _page([_policy(r) for r in rows], limit, "policies", lambda p: p.name)

    def list_all_policies(self, *, cursor: str | None = None, limit: int | None = None) -> Page[Policy]:
        """Every owner's policies, by owner then name: the data dir admin's view (local CLI only)."""
        limit = cursors.check_limit(limit)
        after = cursors.decode("all-policies", cursor, list)
        q = select(PolicyRow)
        if after is not None:
            if len(after) != 2 or not all(isinstance(k, str) for k in after):
                raise InvalidArgument(f"cursor {cursor!r} is malformed", field="cursor")
            q = q.where(tuple_(PolicyRow.owner, PolicyRow.name) > tuple_(after[0], after[1]))
        q = q.order_by(PolicyRow.owner, PolicyRow.name).limit(limit + 1)
        with self._read() as s:
            rows = list(s.scalars(q))
        return _page([_policy(r) for r in rows], limit, "all-policies", lambda p: [p.owner, p.name])

    def _new_policy_row(
        self,
        owner: str,
        name: str,
        base_model: str,
        lora_config: dict[str, Any] | None,
        metadata: dict[str, Any] | None,
    ) -> PolicyRow:
        return PolicyRow(
            owner=check_owner(owner),
            name=check_policy_name(name),
            base_model=_text(base_model, "base_model", 512, required=True),
            lora_config=_lora_config(lora_config),
            meta=_json_object(metadata, "metadata"),
            created_at=_now(),
        )

    def _policy_row(self, s: Session, owner: str, name: str, *, lock: bool = False) -> PolicyRow:
        check_owner(owner)
        check_policy_name(name)
        query = queries.POLICY_FOR_UPDATE if lock else queries.POLICY
        row = s.scalars(query, {"owner": owner, "name": name}).first()
        if row is None:
            raise NotFound(f"policy {name!r} not found", field="name")
        return row

    def _ensure_policy(self, s: Session, new: PolicyRow) -> PolicyRow:
        try:
            row = self._policy_row(s, new.owner, new.name, lock=True)
        except NotFound:
            try:
                with s.begin_nested():
                    s.add(new)
                return new
            except sa_exc.IntegrityError:
                # Another transaction created it since we looked (PostgreSQL); use theirs.
                row = self._policy_row(s, new.owner, new.name, lock=True)
        if row.base_model != new.base_model:
            raise InvalidArgument(
                f"base_model {new.base_model!r} does not match policy {row.name!r}, which is for {row.base_model!r}",
                field="base_model",
            )
        return row

    # -- revisions ------------------------------------------------------------------------
    def publish_revision(
        self,
        owner: str,
        policy_name: str,
        peft_dir: str | os.PathLike[str],
        *,
        base_model: str,
        lora_config: dict[str, Any] | None = None,
        parent: Revision | str | None = None,
        training_run: str | None = None,
        step: int | None = None,
        note: str | None = None,
        base_precision: str | None = None,
    ) -> Revision:
        """Store a PEFT LoRA directory as the next revision of `policy_name` (created if missing).

        Blobs are written (durably) first, then one transaction inserts the revision, so a revision
        row exists only once all its files do. `parent` is a Revision or a reference of this owner.
        `lora_config` is used when the policy is created; the revision records the adapter's rank,
        and `base_precision` the precision of the base it was trained on (serving warns on another).
        """
        scanned = payload.scan_peft_dir(peft_dir)
        new_policy = self._new_policy_row(owner, policy_name, base_model, lora_config, None)
        training_run = _text(training_run, "training_run", 256)
        note = _text(note, "note", 10_000)
        base_precision = _text(base_precision, "base_precision", 32)
        if step is not None and (isinstance(step, bool) or not isinstance(step, int) or step < 0):
            raise InvalidArgument(f"step must be a non-negative integer, got {step!r}", field="step")

        entries = self._put_all(scanned.files)
        for attempt in (1, 2):
            with self._write() as s:
                self._hold_blobs(s, shared=True)
                if attempt == 2:
                    # GC took a blob between our put and the transaction (the publish was slower than
                    # GC's grace period). Put again while holding the lock GC needs: cannot recur.
                    entries = self._put_all(scanned.files)
                elif not all(self.blobs.exists(e.sha256) for e in entries):
                    continue
                sha256 = payload.manifest_sha256(entries)
                policy = self._ensure_policy(s, new_policy)
                parent_rev = self._parent(s, owner, parent)
                last = s.scalar(
                    select(func.max(RevisionRow.number)).where(RevisionRow.policy_id == policy.id)
                )
                self._insert_manifest(s, sha256, entries)
                row = RevisionRow(
                    policy_id=policy.id,
                    number=(last or 0) + 1,
                    sha256=sha256,
                    size=sum(e.size for e in entries),
                    rank=scanned.rank,
                    parent_id=parent_rev.id if parent_rev else None,
                    training_run=training_run,
                    step=step,
                    note=note,
                    created_at=_now(),
                    base_precision=base_precision,
                )
                s.add(row)
                s.flush()
                return _revision_from_row(row, policy.name, parent_rev.ref if parent_rev else None)
        raise AssertionError("unreachable: the second attempt always returns")

    def import_peft(
        self,
        owner: str,
        peft_dir: str | os.PathLike[str],
        policy: str,
        *,
        base_model: str | None = None,
        lora_config: dict[str, Any] | None = None,
        parent: Revision | str | None = None,
        training_run: str | None = None,
        step: int | None = None,
        note: str | None = None,
    ) -> Revision:
        """Publish an existing PEFT LoRA directory. The base model defaults to the policy's if it
        exists, else to adapter_config.json's base_model_name_or_path; the LoRA config defaults to
        what adapter_config.json says."""
        scanned = payload.scan_peft_dir(peft_dir)
        if base_model is None:
            try:
                base_model = self.get_policy(owner, policy).base_model
            except NotFound:
                base_model = scanned.adapter_config.get("base_model_name_or_path")
        if not base_model:
            raise InvalidArgument(
                "base_model not given and adapter_config.json has no base_model_name_or_path",
                field="base_model",
            )
        return self.publish_revision(
            owner,
            policy,
            peft_dir,
            base_model=base_model,
            lora_config=lora_config or payload.lora_config_from_adapter(scanned.adapter_config),
            parent=parent,
            training_run=training_run,
            step=step,
            note=note,
        )

    def import_many(
        self,
        owner: str,
        items: list[tuple[str, str | os.PathLike[str]]],
        *,
        base_model: str | None = None,
        batch_size: int = 500,
        progress: Callable[[int], None] | None = None,
    ) -> ImportResult:
        """Import many PEFT dirs, (policy name, dir) each, as the next revision of their policy, in
        batches: a batch's files go into one pack (one fsync), then one transaction adds its
        revisions, so each batch is all or nothing. Rerunnable: an item whose policy's latest revision
        already has the same content is skipped, so an import cut off (kill -9) is finished by running
        it again. Base model and LoRA config default as in import_peft."""
        check_owner(owner)
        if isinstance(batch_size, bool) or not isinstance(batch_size, int) or batch_size < 1:
            raise InvalidArgument(f"batch_size must be an integer >= 1, got {batch_size!r}", field="batch_size")
        imported = skipped = 0
        for first in range(0, len(items), batch_size):
            batch = [(name, payload.scan_peft_dir(d, f"peft_dir {str(d)!r}")) for name, d in items[first : first + batch_size]]
            rows = []
            for name, scanned in batch:
                model = base_model or scanned.adapter_config.get("base_model_name_or_path")
                if not model:
                    raise InvalidArgument(f"{name}: base_model not given and adapter_config.json has no "
                                          "base_model_name_or_path", field="base_model")
                rows.append((self._new_policy_row(owner, name, model, payload.lora_config_from_adapter(
                    scanned.adapter_config), None), scanned))
            entries = self._put_batch([scanned for _, scanned in batch])
            with self._write() as s:
                self._hold_blobs(s, shared=True)
                if self.blobs.missing(e.sha256 for es in entries for e in es):
                    entries = self._put_batch([scanned for _, scanned in batch])  # GC took some; we hold its lock
                for (new_policy, scanned), files in zip(rows, entries, strict=True):
                    sha256 = payload.manifest_sha256(files)
                    policy = self._ensure_policy(s, new_policy)
                    last = s.execute(
                        select(RevisionRow.number, RevisionRow.sha256)
                        .where(RevisionRow.policy_id == policy.id)
                        .order_by(RevisionRow.number.desc())
                        .limit(1)
                    ).first()
                    if last is not None and last.sha256 == sha256:
                        skipped += 1
                        continue
                    self._insert_manifest(s, sha256, files)
                    s.add(RevisionRow(policy_id=policy.id, number=(last.number if last else 0) + 1, sha256=sha256,
                                      size=sum(e.size for e in files), rank=scanned.rank, created_at=_now()))
                    imported += 1
                    s.flush()
            if progress:
                progress(first + len(batch))
        return ImportResult(imported=imported, skipped=skipped)

    def _put_batch(self, dirs: list[payload.PeftDir]) -> list[list[payload.ManifestEntry]]:
        """Every file of `dirs` in one bulk put; each dir's manifest entries."""
        infos = iter(self.blobs.put_many(path.read_bytes() for d in dirs for path in d.files))
        return [[payload.ManifestEntry(path.name, *next(infos)[:2]) for path in d.files] for d in dirs]

    def _put_all(self, files: list[Path]) -> list[payload.ManifestEntry]:
        entries = []
        for path in files:
            info = self.blobs.put_file(path)
            entries.append(payload.ManifestEntry(path.name, info.sha256, info.size))
        return entries

    def _hold_blobs(self, s: Session, *, shared: bool) -> None:
        """Order blob-referencing transactions against GC (see gc). SQLite's write lock already does."""
        if s.get_bind().dialect.name == "postgresql":
            fn = "pg_advisory_xact_lock_shared" if shared else "pg_advisory_xact_lock"
            s.execute(text(f"SELECT {fn}(:key)"), {"key": db.BLOB_LOCK})

    def _insert_manifest(self, s: Session, sha256: str, entries: list[payload.ManifestEntry]) -> None:
        if s.scalar(select(ManifestEntryRow.name).where(ManifestEntryRow.manifest_sha256 == sha256).limit(1)):
            return  # identical payload published before
        try:
            with s.begin_nested():
                s.add_all(
                    ManifestEntryRow(manifest_sha256=sha256, name=e.name, blob_sha256=e.sha256, size=e.size)
                    for e in entries
                )
        except sa_exc.IntegrityError:
            pass  # a concurrent publish of the same payload inserted the same (content-addressed) rows

    def _parent(self, s: Session, owner: str, parent: Revision | str | None) -> Revision | None:
        if parent is None:
            return None
        if isinstance(parent, Revision):
            row = s.execute(queries.REVISION_BY_ID, {"id": parent.id, "owner": owner}).first()
            if row is None:
                raise NotFound(f"parent revision {parent.ref!r} not found", field="parent")
            return _revision(row)
        return self._resolve(s, owner, parse_ref(parent, "parent"), parent, "parent")

    def get_revision(self, owner: str, policy_name: str, number: int) -> Revision:
        """Revision `number` of a policy (same as resolve(owner, f"{policy_name}@{number}"))."""
        check_owner(owner)
        check_policy_name(policy_name)
        if isinstance(number, bool) or not isinstance(number, int) or number < 1:
            raise InvalidArgument(f"number must be an integer >= 1, got {number!r}", field="number")
        with self._read() as s:
            return self._resolve(
                s, owner, Ref(policy_name, "number", number=number), f"{policy_name}@{number}"
            )

    def resolve(self, owner: str, ref: str) -> Revision:
        """The revision `ref` names: NAME (latest), NAME@N, NAME@ALIAS or NAME@<sha prefix>."""
        parsed = parse_ref(ref)
        check_owner(owner)
        with self._read() as s:
            return self._resolve(s, owner, parsed, ref)

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
        return _revision(row)

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

    def list_revisions(
        self, owner: str, policy_name: str, *, cursor: str | None = None, limit: int | None = None
    ) -> Page[Revision]:
        """Revisions of a policy, newest first."""
        limit = cursors.check_limit(limit)
        before = cursors.decode("revisions", cursor, int)
        with self._read() as s:
            policy = self._policy_row(s, owner, policy_name)
            q = queries.revisions().where(RevisionRow.policy_id == policy.id)
            if before is not None:
                q = q.where(RevisionRow.number < before)
            rows = s.execute(q.order_by(RevisionRow.number.desc()).limit(limit + 1)).all()
        return _page([_revision(r) for r in rows], limit, "revisions", lambda r: r.number)

    def lineage(
        self, owner: str, ref: str, *, cursor: str | None = None, limit: int | None = None
    ) -> Page[Revision]:
        """`ref`'s revision, then its parent, grandparent, … (parents may be in other policies of
        the same owner). Each step is a primary-key lookup; pages continue where the last ended."""
        parsed = parse_ref(ref)
        check_owner(owner)
        limit = cursors.check_limit(limit)
        next_id = cursors.decode("lineage", cursor, int)
        chain: list[Revision] = []
        with self._read() as s:
            if next_id is None:
                chain.append(self._resolve(s, owner, parsed, ref))
                next_id = chain[-1].parent_id
            while next_id is not None and len(chain) <= limit:
                row = s.execute(queries.REVISION_BY_ID, {"id": next_id, "owner": owner}).first()
                if row is None:
                    break
                chain.append(_revision(row))
                next_id = chain[-1].parent_id
        return _page(chain, limit, "lineage", lambda r: r.parent_id)

    # -- aliases --------------------------------------------------------------------------
    def set_alias(
        self, owner: str, name: str, alias: str, revision: int | str, *, actor: str, reason: str | None = None
    ) -> Alias:
        """Point `alias` at `revision` (a number, or anything after '@' in a reference, e.g. another
        alias) and record the move. Concurrent moves are serialized; each is in the history."""
        check_alias_name(alias)
        actor = _text(actor, "actor", 256, required=True)
        reason = _text(reason, "reason", 10_000)
        with self._write() as s:
            policy = self._policy_row(s, owner, name, lock=True)
            target_ref = f"{name}@{revision}"
            target = self._resolve(s, owner, parse_ref(target_ref, "revision"), target_ref, "revision")
            return self._move_alias(s, policy, alias, target.id, target.number, "set", actor, reason)

    def rollback_alias(
        self, owner: str, name: str, alias: str, *, actor: str, reason: str | None = None
    ) -> Alias:
        """Move `alias` back to where it pointed before its latest move. The rollback is itself
        recorded as a move, so rolling back twice returns to where you started.

        An alias whose latest move created it has no "before"; it then goes to the policy's
        newest revision older than its current one (so set prod=2 then rollback gives prod=1).
        """
        check_alias_name(alias)
        actor = _text(actor, "actor", 256, required=True)
        reason = _text(reason, "reason", 10_000)
        with self._write() as s:
            policy = self._policy_row(s, owner, name, lock=True)
            last = s.scalars(
                select(AliasEventRow)
                .where(AliasEventRow.policy_id == policy.id, AliasEventRow.alias == alias)
                .order_by(AliasEventRow.id.desc())
                .limit(1)
            ).first()
            if last is None:
                raise NotFound(f"policy {name!r} has no alias {alias!r}", field="alias")
            if last.from_revision_id is not None:
                target = s.execute(
                    select(RevisionRow.id, RevisionRow.number).where(RevisionRow.id == last.from_revision_id)
                ).one()
            else:
                current = (
                    select(RevisionRow.number).where(RevisionRow.id == last.to_revision_id).scalar_subquery()
                )
                target = s.execute(
                    select(RevisionRow.id, RevisionRow.number)
                    .where(RevisionRow.policy_id == policy.id, RevisionRow.number < current)
                    .order_by(RevisionRow.number.desc())
                    .limit(1)
                ).first()
                if target is None:
                    raise InvalidArgument(
                        f"alias {alias!r} of policy {name!r} has no earlier revision to roll back to",
                        field="alias",
                    )
            return self._move_alias(s, policy, alias, target.id, target.number, "rollback", actor, reason)

    def _move_alias(
        self,
        s: Session,
        policy: PolicyRow,
        alias: str,
        to_id: int,
        to_number: int,
        action: str,
        actor: str,
        reason: str | None,
    ) -> Alias:
        at = _now()
        current = s.get(AliasRow, (policy.id, alias))
        from_id = current.revision_id if current else None
        if current is None:
            s.add(AliasRow(policy_id=policy.id, name=alias, revision_id=to_id, updated_at=at))
        else:
            current.revision_id = to_id
            current.updated_at = at
        s.add(
            AliasEventRow(
                policy_id=policy.id,
                alias=alias,
                action=action,
                from_revision_id=from_id,
                to_revision_id=to_id,
                actor=actor,
                reason=reason,
                at=at,
            )
        )
        s.flush()
        return Alias(policy.name, alias, to_number, to_id, at)

    def get_alias(self, owner: str, name: str, alias: str) -> Alias:
        check_alias_name(alias)
        with self._read() as s:
            policy = self._policy_row(s, owner, name)
            row = s.execute(_aliases(policy).where(AliasRow.name == alias)).first()
        if row is None:
            raise NotFound(f"policy {name!r} has no alias {alias!r}", field="alias")
        return Alias(**row._mapping)

    def list_aliases(
        self, owner: str, name: str, *, cursor: str | None = None, limit: int | None = None
    ) -> Page[Alias]:
        """A policy's aliases by name."""
        limit = cursors.check_limit(limit)
        after = cursors.decode("aliases", cursor, str)
        with self._read() as s:
            policy = self._policy_row(s, owner, name)
            q = _aliases(policy)
            if after is not None:
                q = q.where(AliasRow.name > after)
            rows = s.execute(q.order_by(AliasRow.name).limit(limit + 1)).all()
        return _page([Alias(**r._mapping) for r in rows], limit, "aliases", lambda a: a.name)

    def alias_history(
        self, owner: str, name: str, alias: str, *, cursor: str | None = None, limit: int | None = None
    ) -> Page[AliasEvent]:
        """Every move of `alias`, newest first."""
        check_alias_name(alias)
        limit = cursors.check_limit(limit)
        before = cursors.decode("alias_history", cursor, int)
        with self._read() as s:
            policy = self._policy_row(s, owner, name)
            q = (
                select(
                    AliasEventRow.id,
                    AliasEventRow.alias,
                    AliasEventRow.action,
                    _FromRev.number.label("from_revision"),
                    _ToRev.number.label("to_revision"),
                    AliasEventRow.actor,
                    AliasEventRow.reason,
                    AliasEventRow.at,
                )
                .outerjoin(_FromRev, _FromRev.id == AliasEventRow.from_revision_id)
                .join(_ToRev, _ToRev.id == AliasEventRow.to_revision_id)
                .where(AliasEventRow.policy_id == policy.id, AliasEventRow.alias == alias)
            )
            if before is not None:
                q = q.where(AliasEventRow.id < before)
            rows = s.execute(q.order_by(AliasEventRow.id.desc()).limit(limit + 1)).all()
        if not rows and before is None:
            raise NotFound(f"policy {name!r} has no alias {alias!r}", field="alias")
        events = [AliasEvent(policy=name, **r._mapping) for r in rows]
        return _page(events, limit, "alias_history", lambda e: e.id)

    # -- evals ----------------------------------------------------------------------------
    def record_eval(
        self, owner: str, ref: str, metric: str, value: float, *, dataset: str | None = None
    ) -> EvalRecord:
        """Attach a metric value to the revision `ref` names."""
        (record,) = self.record_evals(owner, [(ref, value)], metric, dataset=dataset)
        return record

    def record_evals(
        self, owner: str, values: list[tuple[str, float]], metric: str, *, dataset: str | None = None
    ) -> list[EvalRecord]:
        """Attach one metric to many revisions ((ref, value) pairs) in one transaction: all or none."""
        check_owner(owner)
        metric = _text(metric, "metric", 128, required=True)
        dataset = _text(dataset, "dataset", 256)
        parsed = [(parse_ref(ref), ref, value) for ref, value in values]
        for _, _, value in parsed:
            if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value):
                raise InvalidArgument(f"value must be a finite number, got {value!r}", field="value")
        out = []
        with self._write() as s:
            for ref, text_ref, value in parsed:
                revision = self._resolve(s, owner, ref, text_ref)
                row = EvalRow(
                    revision_id=revision.id, metric=metric, value=float(value), dataset=dataset, created_at=_now()
                )
                s.add(row)
                s.flush()
                out.append(EvalRecord(row.id, revision.id, revision.ref, metric, row.value, dataset, row.created_at))
        return out

    def list_evals(
        self,
        owner: str,
        ref: str,
        *,
        metric: str | None = None,
        cursor: str | None = None,
        limit: int | None = None,
    ) -> Page[EvalRecord]:
        """Evals of the revision `ref` names, newest first, optionally only one metric."""
        parsed = parse_ref(ref)
        check_owner(owner)
        limit = cursors.check_limit(limit)
        before = cursors.decode("evals", cursor, int)
        with self._read() as s:
            revision = self._resolve(s, owner, parsed, ref)
            q = select(EvalRow).where(EvalRow.revision_id == revision.id)
            if metric is not None:
                q = q.where(EvalRow.metric == metric)
            if before is not None:
                q = q.where(EvalRow.id < before)
            rows = list(s.scalars(q.order_by(EvalRow.id.desc()).limit(limit + 1)))
        records = [
            EvalRecord(r.id, revision.id, revision.ref, r.metric, r.value, r.dataset, r.created_at)
            for r in rows
        ]
        return _page(records, limit, "evals", lambda e: e.id)

    # -- payloads -------------------------------------------------------------------------
    def manifest(self, revision: Revision) -> list[payload.ManifestEntry]:
        """The files of a revision's payload (name, blob sha256, size), sorted by name."""
        with self._read() as s:
            rows = s.scalars(
                select(ManifestEntryRow)
                .where(ManifestEntryRow.manifest_sha256 == revision.sha256)
                .order_by(ManifestEntryRow.name)
            ).all()
        if not rows:
            raise IntegrityError(
                f"revision {revision.ref!r} has no recorded files (sha256:{revision.sha256})", field="sha256"
            )
        return [payload.ManifestEntry(r.name, r.blob_sha256, r.size) for r in rows]

    def materialize(self, revision: Revision, dest_dir: str | os.PathLike[str]) -> Path:
        """Write the revision's PEFT directory to `dest_dir` (absent or empty). Every file is
        verified before `dest_dir` appears; on IntegrityError nothing is left behind."""
        return payload.write_peft_dir(self.blobs, self.manifest(revision), revision.sha256, dest_dir)

    def read_payload(self, revision: Revision) -> dict[str, bytes]:
        """The revision's files, read straight from the blob store and verified (no copy on disk):
        what the engine's residency manager loads a revision from."""
        entries = self.manifest(revision)
        if payload.manifest_sha256(entries) != revision.sha256:
            raise IntegrityError(f"revision {revision.ref!r}: its file list does not hash to its sha256",
                                 field="sha256")
        return {e.name: self.blobs.read(e.sha256) for e in entries}

    def checkout(self, revision: Revision) -> Path:
        """A materialized copy of the revision under <data_dir>/checkouts/<sha256>, made once and
        reused (content-addressed, so it never goes stale); what the engine loads adapters from."""
        dest = self.data_dir / "checkouts" / revision.sha256
        if dest.is_dir():
            return dest
        try:
            return self.materialize(revision, dest)
        except AlreadyExists:
            return dest  # a concurrent checkout of the same content won the rename

    def verify(self, revision: Revision) -> None:
        """Read and hash every file of the revision; IntegrityError names the first bad blob."""
        entries = self.manifest(revision)
        if payload.manifest_sha256(entries) != revision.sha256:
            raise IntegrityError(
                f"revision {revision.ref!r}: file list does not hash to its sha256", field="sha256"
            )
        for entry in entries:
            with self.blobs.open(entry.sha256) as stream:
                while stream.read(1 << 20):
                    pass


# -- row → record helpers -------------------------------------------------------------------
def _revision(row: Any) -> Revision:
    m = dict(row._mapping)
    parent_policy, parent_number = m.pop("parent_policy"), m.pop("parent_number")
    m["parent"] = f"{parent_policy}@{parent_number}" if m["parent_id"] is not None else None
    return Revision(**m)


def _revision_from_row(row: RevisionRow, policy: str, parent: str | None) -> Revision:
    return Revision(
        id=row.id,
        policy_id=row.policy_id,
        policy=policy,
        number=row.number,
        sha256=row.sha256,
        size=row.size,
        rank=row.rank,
        parent_id=row.parent_id,
        parent=parent,
        training_run=row.training_run,
        step=row.step,
        note=row.note,
        created_at=row.created_at,
        base_precision=row.base_precision,
    )


def _aliases(policy: PolicyRow) -> Select:
    return (
        select(
            PolicyRow.name.label("policy"),
            AliasRow.name,
            RevisionRow.number.label("revision"),
            AliasRow.revision_id,
            AliasRow.updated_at,
        )
        .join(PolicyRow, PolicyRow.id == AliasRow.policy_id)
        .join(RevisionRow, RevisionRow.id == AliasRow.revision_id)
        .where(AliasRow.policy_id == policy.id)
    )


def _policy(row: PolicyRow) -> Policy:
    return Policy(
        id=row.id,
        owner=row.owner,
        name=row.name,
        base_model=row.base_model,
        lora_config=dict(row.lora_config),
        metadata=dict(row.meta),
        created_at=row.created_at,
    )


def _page(items: list[Any], limit: int, tag: str, key: Callable[[Any], Any]) -> Page[Any]:
    # We fetched limit+1 rows: an extra row means there is a next page.
    if len(items) > limit:
        items = items[:limit]
        return Page(items, cursors.encode(tag, key(items[-1])))
    return Page(items, None)


def _text(value: str | None, field: str, max_len: int, *, required: bool = False) -> str | None:
    if value is None or value == "":
        if required:
            raise InvalidArgument(f"{field} is required", field=field)
        return None
    if not isinstance(value, str) or len(value) > max_len:
        raise InvalidArgument(f"{field} must be a string of at most {max_len} characters", field=field)
    try:
        value.encode("utf-8")  # a lone surrogate would be stored, then break every read of it
    except UnicodeEncodeError:
        raise InvalidArgument(f"{field} is not valid Unicode text", field=field) from None
    return value


def _json_object(value: dict[str, Any] | None, field: str) -> dict[str, Any]:
    if value is None:
        return {}
    if not isinstance(value, dict):
        raise InvalidArgument(f"{field} must be a JSON object", field=field)
    try:
        # ensure_ascii=False + encode: a lone surrogate fails here, not in every later read.
        json.dumps(value, allow_nan=False, ensure_ascii=False).encode("utf-8")
    except (TypeError, ValueError) as e:
        raise InvalidArgument(f"{field} is not JSON-serializable: {e}", field=field) from None
    return value


# What a policy's LoRA config may hold: the fields training records (rank, train_*) and those a PEFT
# import implies (rank, alpha, target_modules, dropout), each typed and in range.
MAX_LORA_RANK = 65536


def _lora_config(value: dict[str, Any] | None) -> dict[str, Any]:
    config = _json_object(value, "lora_config")
    for key, v in config.items():
        field = f"lora_config.{key}"
        number = isinstance(v, int | float) and not isinstance(v, bool)
        if key == "rank":
            ok = isinstance(v, int) and not isinstance(v, bool) and 1 <= v <= MAX_LORA_RANK
            expected = f"an integer between 1 and {MAX_LORA_RANK}"
        elif key == "alpha":
            ok, expected = number and 0 < v <= 1e6, "a number in (0, 1e6]"
        elif key == "dropout":
            ok, expected = number and 0 <= v < 1, "a number in [0, 1)"
        elif key == "target_modules":
            ok = (isinstance(v, str) and 0 < len(v) <= 1024) or (
                isinstance(v, list) and len(v) <= 256 and all(isinstance(m, str) and 0 < len(m) <= 128 for m in v)
            )
            expected = "a list of module names (or a PEFT regex string)"
        elif key in ("train_mlp", "train_attn", "train_unembed"):
            ok, expected = isinstance(v, bool), "true or false"
        else:
            raise InvalidArgument(
                f"{field}: unknown field (known: rank, alpha, dropout, target_modules, train_mlp, train_attn, "
                "train_unembed)",
                field=field,
            )
        if not ok:
            raise InvalidArgument(f"{field} must be {expected}, got {v!r}", field=field)
    return config
