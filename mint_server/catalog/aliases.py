"""Aliases (e.g. prod, staging): names pointing at a policy's revisions, moved (set, rolled back)
with every move kept in their history."""

from __future__ import annotations

from sqlalchemy import Select, select
from sqlalchemy.orm import Session, aliased

from mint_server.catalog import cursor as cursors
from mint_server.catalog.core import CatalogCore, now, page_of
from mint_server.catalog.errors import InvalidArgument, NotFound
from mint_server.catalog.fields import check_text
from mint_server.catalog.records import Alias, AliasEvent, Page
from mint_server.catalog.refs import check_alias_name, parse_ref
from mint_server.catalog.schema import AliasEventRow, AliasRow, PolicyRow, RevisionRow

_FromRev = aliased(RevisionRow, name="from_rev")
_ToRev = aliased(RevisionRow, name="to_rev")


def alias_rows(policy: PolicyRow) -> Select:
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


class Aliases(CatalogCore):
    # -- aliases --------------------------------------------------------------------------
    def set_alias(
        self, owner: str, name: str, alias: str, revision: int | str, *, actor: str, reason: str | None = None
    ) -> Alias:
        """Point `alias` at `revision` (a number, or anything after '@' in a reference, e.g. another
        alias) and record the move. Concurrent moves are serialized; each is in the history."""
        check_alias_name(alias)
        actor = check_text(actor, "actor", 256, required=True)
        reason = check_text(reason, "reason", 10_000)
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
        actor = check_text(actor, "actor", 256, required=True)
        reason = check_text(reason, "reason", 10_000)
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
        at = now()
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
            row = s.execute(alias_rows(policy).where(AliasRow.name == alias)).first()
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
            q = alias_rows(policy)
            if after is not None:
                q = q.where(AliasRow.name > after)
            rows = s.execute(q.order_by(AliasRow.name).limit(limit + 1)).all()
        return page_of([Alias(**r._mapping) for r in rows], limit, "aliases", lambda a: a.name)

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
        return page_of(events, limit, "alias_history", lambda e: e.id)
