"""Prebuilt statements for the hot lookups, parameterized with bind parameters.

Building a SQLAlchemy select and computing its cache key costs more than running the query on
an indexed table, so the statements every resolve/lookup uses are built once here (SQLAlchemy
memoizes the cache key per statement object) and executed with parameters.
"""

from __future__ import annotations

from sqlalchemy import Select, bindparam, select
from sqlalchemy.orm import aliased

from mint_server.catalog.schema import AliasRow, PolicyRow, RevisionRow

_ParentRev = aliased(RevisionRow, name="parent_rev")
_ParentPolicy = aliased(PolicyRow, name="parent_policy")


def revisions() -> Select:
    """Revision columns plus the policy name and the parent's reference (parents may live in
    another policy of the same owner)."""
    return (
        select(
            RevisionRow.id,
            RevisionRow.policy_id,
            PolicyRow.name.label("policy"),
            RevisionRow.number,
            RevisionRow.sha256,
            RevisionRow.size,
            RevisionRow.rank,
            RevisionRow.parent_id,
            _ParentPolicy.name.label("parent_policy"),
            _ParentRev.number.label("parent_number"),
            RevisionRow.training_run,
            RevisionRow.step,
            RevisionRow.note,
            RevisionRow.created_at,
            RevisionRow.base_precision,
        )
        .join(PolicyRow, PolicyRow.id == RevisionRow.policy_id)
        .outerjoin(_ParentRev, _ParentRev.id == RevisionRow.parent_id)
        .outerjoin(_ParentPolicy, _ParentPolicy.id == _ParentRev.policy_id)
    )


# Parameters: owner, name (+ number | alias | low, high).
_OF_POLICY = revisions().where(PolicyRow.owner == bindparam("owner"), PolicyRow.name == bindparam("name"))
# All stored hashes are lowercase hex and 'g' sorts after every hex digit, so the hashes starting
# with a prefix are exactly [prefix, prefix + "g"): an index range scan (see sha_bounds).
_SHA_RANGE = (RevisionRow.sha256 >= bindparam("low")) & (RevisionRow.sha256 < bindparam("high"))

RESOLVE: dict[str, Select] = {
    "latest": _OF_POLICY.order_by(RevisionRow.number.desc()).limit(1),
    "number": _OF_POLICY.where(RevisionRow.number == bindparam("number")),
    "alias": _OF_POLICY.join(
        AliasRow, (AliasRow.policy_id == PolicyRow.id) & (AliasRow.revision_id == RevisionRow.id)
    ).where(AliasRow.name == bindparam("alias")),
    # Equal hashes mean equal content (a re-published payload): the newest such revision.
    "sha": _OF_POLICY.where(_SHA_RANGE).order_by(RevisionRow.number.desc()).limit(1),
}

# Up to two distinct hashes matching a prefix: two means the prefix is ambiguous.
SHAS_WITH_PREFIX = (
    select(RevisionRow.sha256)
    .join(PolicyRow, PolicyRow.id == RevisionRow.policy_id)
    .where(PolicyRow.owner == bindparam("owner"), PolicyRow.name == bindparam("name"), _SHA_RANGE)
    .distinct()
    .limit(2)
)

# Parameters: id, owner.
REVISION_BY_ID = revisions().where(RevisionRow.id == bindparam("id"), PolicyRow.owner == bindparam("owner"))

# Parameters: owner, name.
POLICY = select(PolicyRow).where(PolicyRow.owner == bindparam("owner"), PolicyRow.name == bindparam("name"))
# Serializes every change to one policy on PostgreSQL; SQLite's BEGIN IMMEDIATE already has.
POLICY_FOR_UPDATE = POLICY.with_for_update()


def sha_bounds(prefix: str) -> dict[str, str]:
    return {"low": prefix, "high": prefix + "g"}
