"""The policy catalog: policies, immutable adapter revisions, aliases with history, evals.

Every public method takes the caller's `owner`; rows of other owners are invisible (NotFound,
never the row). Methods return plain dataclasses from records.py and raise the errors in
errors.py. A Catalog is thread-safe (one engine, one session per call) and several processes may
share one database.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

from sqlalchemy import exc as sa_exc
from sqlalchemy import func, select, text, tuple_
from sqlalchemy.orm import Session

from mint_server.catalog import cursor as cursors
from mint_server.catalog import db, payload, queries
from mint_server.catalog.aliases import Aliases
from mint_server.catalog.core import now, page_of, revision_record
from mint_server.catalog.errors import AlreadyExists, InvalidArgument, NotFound
from mint_server.catalog.evals import Evals
from mint_server.catalog.fields import check_json_object, check_lora_config, check_text
from mint_server.catalog.records import ImportResult, Page, Policy, Revision
from mint_server.catalog.refs import Ref, check_owner, check_policy_name, parse_ref
from mint_server.catalog.revision_files import RevisionFiles
from mint_server.catalog.schema import ManifestEntryRow, PolicyRow, RevisionRow


class Catalog(Aliases, Evals, RevisionFiles):
    """Every part of the catalog: policies and revisions here; aliases (aliases.py), evals (evals.py),
    revisions' files (revision_files.py); sessions and lookups (core.py)."""

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
        return page_of([_policy(r) for r in rows], limit, "policies", lambda p: p.name)

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
        return page_of([_policy(r) for r in rows], limit, "all-policies", lambda p: [p.owner, p.name])

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
            base_model=check_text(base_model, "base_model", 512, required=True),
            lora_config=check_lora_config(lora_config),
            meta=check_json_object(metadata, "metadata"),
            created_at=now(),
        )

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
        training_run = check_text(training_run, "training_run", 256)
        note = check_text(note, "note", 10_000)
        base_precision = check_text(base_precision, "base_precision", 32)
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
                    created_at=now(),
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
                                      size=sum(e.size for e in files), rank=scanned.rank, created_at=now()))
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
            return revision_record(row)
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
        return page_of([revision_record(r) for r in rows], limit, "revisions", lambda r: r.number)

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
                chain.append(revision_record(row))
                next_id = chain[-1].parent_id
        return page_of(chain, limit, "lineage", lambda r: r.parent_id)

# -- row → record helpers -------------------------------------------------------------------
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
