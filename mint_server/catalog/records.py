"""Plain dataclasses the catalog hands to callers (never ORM objects), plus JSON round-tripping.

The same classes travel over REST: `to_dict` is what the routes return, `from_dict` is what the
HTTP client rebuilds, so local and remote callers see identical objects.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from datetime import datetime
from typing import Any, Generic, NamedTuple, TypeVar

T = TypeVar("T")

# Fields holding datetimes; they travel as ISO-8601 strings.
_TIME_FIELDS = frozenset({"created_at", "updated_at", "at", "revoked_at"})


@dataclass(frozen=True)
class Policy:
    id: int
    owner: str
    name: str
    base_model: str
    lora_config: dict[str, Any]
    metadata: dict[str, Any]
    created_at: datetime


@dataclass(frozen=True)
class Revision:
    id: int
    policy_id: int
    policy: str
    number: int
    sha256: str  # sha256 of the canonical manifest of the PEFT files (see payload.py)
    size: int  # total bytes of the PEFT files
    rank: int
    parent_id: int | None
    parent: str | None  # the parent as a reference, "name@N"
    training_run: str | None
    step: int | None
    note: str | None
    created_at: datetime
    # The precision of the base it was trained on (model/prequant_spec.base_precision); None: unknown.
    base_precision: str | None = None

    @property
    def ref(self) -> str:
        return f"{self.policy}@{self.number}"


@dataclass(frozen=True)
class Alias:
    policy: str
    name: str
    revision: int  # revision number within the policy
    revision_id: int
    updated_at: datetime


@dataclass(frozen=True)
class AliasEvent:
    id: int
    policy: str
    alias: str
    action: str  # "set" or "rollback"
    from_revision: int | None  # None when this move created the alias
    to_revision: int
    actor: str
    reason: str | None
    at: datetime


@dataclass(frozen=True)
class EvalRecord:
    id: int
    revision_id: int
    revision: str  # "name@N"
    metric: str
    value: float
    dataset: str | None
    created_at: datetime


@dataclass(frozen=True)
class ApiKey:
    """A scoped API key as listed: never the key itself, which is shown once, when it is created."""

    key_id: str
    owner: str
    name: str
    scopes: list[str]
    created_at: datetime
    revoked_at: datetime | None


@dataclass(frozen=True)
class UsageEntry:
    """A quantity of one kind of usage in one UTC hour, attributed to a session and project where known."""

    owner: str
    bucket_start: datetime
    kind: str  # training | sampling_prefill | sampling_sample | checkpoint (tokens; checkpoints counted)
    quantity: float
    session_id: str | None = None
    project_id: str | None = None
    base_model: str | None = None


@dataclass(frozen=True)
class AuditEntry:
    owner: str
    at: datetime
    event: str  # <resource>_<action>, e.g. checkpoint_deleted
    details: dict[str, Any]


@dataclass(frozen=True)
class SeedResult:
    policies: int
    revisions: int
    first_name: str | None
    last_name: str | None
    seconds: float


@dataclass(frozen=True)
class ImportResult:
    imported: int  # new revisions
    skipped: int  # already the latest revision of their policy (an import run again)


@dataclass(frozen=True)
class GcReport:
    removed: int
    freed_bytes: int
    kept: int
    temp_removed: int


class Page(NamedTuple, Generic[T]):
    """One page of a keyset-paginated listing; pass `next_cursor` back to get the next page."""

    items: list[T]
    next_cursor: str | None


def to_dict(record: Any) -> dict[str, Any]:
    """A JSON-ready dict of a record dataclass (datetimes as ISO strings)."""
    out = dataclasses.asdict(record)
    for key in _TIME_FIELDS.intersection(out):
        if out[key] is not None:
            out[key] = out[key].isoformat()
    return out


def from_dict(cls: type[T], data: dict[str, Any]) -> T:
    """Rebuild a record dataclass from `to_dict` output; unknown keys are ignored for forward compatibility."""
    names = {f.name for f in dataclasses.fields(cls)}  # type: ignore[arg-type]
    kwargs = {k: v for k, v in data.items() if k in names}
    for key in _TIME_FIELDS.intersection(kwargs):
        if kwargs[key] is not None:
            kwargs[key] = datetime.fromisoformat(kwargs[key])
    return cls(**kwargs)


def page_to_dict(page: Page[Any]) -> dict[str, Any]:
    return {"items": [to_dict(item) for item in page.items], "next_cursor": page.next_cursor}
