"""Bulk synthetic load: many policies, each with a chain of revisions and a `prod` alias.

Used by benchmarks, load tests and `mint catalog seed`. Without `payload_for` every revision shares
one tiny (but valid) PEFT payload, so the blob store holds two small files however large the catalog
grows; with it (`--servable`) each policy gets its own real adapter.

Bulk writes, a batch at a time: a batch's blobs go into one pack (packed_store.py: one write and one fsync
for the batch, not one per blob), then one transaction inserts the batch's rows with the driver's
executemany (COPY on PostgreSQL), ids assigned here: tens of thousands of policies per second, versus
one ORM flush per row. Each batch is atomic (its rows commit together, after its blobs are durable),
so a seed killed at any point leaves whole batches; `resume=True` continues to a target count, and
the blobs of the batch that was cut off are found again (the payloads are deterministic by index)
rather than written twice. Identical content is shared: payload manifests are content-addressed and
inserted only if absent.
"""

from __future__ import annotations

import json
import time
from collections import deque
from collections.abc import Callable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from datetime import UTC, datetime
from typing import TYPE_CHECKING, Any

import numpy as np
from safetensors.numpy import save as save_safetensors
from sqlalchemy import func, select, text

from mint_server.catalog import payload
from mint_server.catalog.errors import InvalidArgument
from mint_server.catalog.records import SeedResult
from mint_server.catalog.refs import check_owner, check_policy_name
from mint_server.catalog.schema import AliasEventRow, AliasRow, ManifestEntryRow, PolicyRow, RevisionRow

if TYPE_CHECKING:
    from mint_server.catalog.catalog import Catalog

SYNTHETIC_BASE_MODEL = "synthetic/base-model"
SYNTHETIC_LORA = {"rank": 1, "train_attn": True, "train_mlp": True, "train_unembed": False}
SEED_ALIAS = "prod"
DIGITS = 9  # zero-padded so name order is numeric order and the next index is one index probe
Payload = dict[str, bytes]


def synthetic_payload() -> Payload:
    """A minimal rank-1 LoRA adapter: valid adapter_config.json and safetensors, a few hundred bytes."""
    config = {
        "peft_type": "LORA",
        "r": 1,
        "lora_alpha": 1,
        "target_modules": ["q_proj"],
        "base_model_name_or_path": SYNTHETIC_BASE_MODEL,
    }
    prefix = "base_model.model.model.layers.0.self_attn.q_proj"
    weights = save_safetensors(
        {
            f"{prefix}.lora_A.weight": np.zeros((1, 8), np.float32),
            f"{prefix}.lora_B.weight": np.zeros((8, 1), np.float32),
        }
    )
    return {
        payload.ADAPTER_CONFIG: json.dumps(config, sort_keys=True).encode(),
        payload.ADAPTER_WEIGHTS: weights,
    }


def seed(
    catalog: Catalog,
    n_policies: int,
    revisions_per_policy: int = 1,
    owner: str = "synthetic",
    *,
    prefix: str = "synthetic-",
    batch_size: int = 10_000,
    progress: Callable[[int], None] | None = None,
    payload_for: Callable[[int], Payload] | None = None,
    base_model: str = SYNTHETIC_BASE_MODEL,
    lora_config: dict[str, Any] | None = None,
    resume: bool = False,
) -> SeedResult:
    """Add `n_policies` policies named PREFIX000000000… after the prefix's last one; with `resume`,
    add only what it takes for the prefix to have `n_policies` (so rerunning a cut-off seed finishes
    it). `payload_for(index)`, when given, makes each policy's own payload (servable policies: real,
    distinct adapters for the served base); otherwise every revision shares one tiny payload."""
    check_owner(owner)
    check_policy_name(f"{prefix}{0:0{DIGITS}d}", "prefix")
    for field, value, low in (
        ("n_policies", n_policies, 0),
        ("revisions_per_policy", revisions_per_policy, 1),
        ("batch_size", batch_size, 1),
    ):
        if isinstance(value, bool) or not isinstance(value, int) or value < low:
            raise InvalidArgument(f"{field} must be an integer >= {low}, got {value!r}", field=field)
    if resume:
        n_policies = max(0, n_policies - next_index(catalog, owner, prefix))

    shared_files = synthetic_payload()
    shared_entries = []
    if payload_for is None:
        infos = catalog.blobs.put_many(shared_files.values())
        shared_entries = [payload.ManifestEntry(name, *info[:2]) for name, info in zip(shared_files, infos, strict=True)]

    started = time.perf_counter()
    first = last = None
    done = 0
    while done < n_policies:
        count = min(batch_size, n_policies - done)
        start = next_index(catalog, owner, prefix)
        if start + count > 10**DIGITS:
            raise InvalidArgument(f"prefix {prefix!r} has no room for {count} more policies", field="prefix")
        # Blobs first, durably, outside the write transaction (which then holds the lock only briefly).
        manifests = _store_payloads(catalog, payload_for, start, count) if payload_for else None
        with catalog._write() as s:
            catalog._hold_blobs(s, shared=True)
            conn = s.connection()
            if conn.dialect.name == "postgresql":
                # We assign ids ourselves (max+1), so keep other inserts out until the batch commits.
                conn.execute(
                    text(
                        "LOCK TABLE catalog_policies, catalog_revisions, catalog_alias_events IN EXCLUSIVE MODE"
                    )
                )
            if _next_index(s, owner, prefix) != start:
                continue  # a concurrent seed of this prefix took these names: this batch again, after it
            if manifests is None:
                if catalog.blobs.missing(e.sha256 for e in shared_entries):  # GC took them; we hold its lock
                    catalog.blobs.put_many(shared_files.values())
                manifests = [shared_entries] * count
            elif catalog.blobs.missing(e.sha256 for m in manifests for e in m):
                # GC took some since we wrote them (a grace period shorter than this batch); we hold its
                # lock now, so writing them again cannot race it.
                manifests = _store_payloads(catalog, payload_for, start, count)  # type: ignore[arg-type]
            payloads = _insert_manifests(conn, manifests)
            _insert_batch(
                conn,
                start,
                count,
                revisions_per_policy,
                owner,
                prefix,
                payloads,
                base_model,
                lora_config or SYNTHETIC_LORA,
                policy_id=_max_id(s, PolicyRow) + 1,
                revision_id=_max_id(s, RevisionRow) + 1,
                event_id=_max_id(s, AliasEventRow) + 1,
            )
            if conn.dialect.name == "postgresql":
                for table in ("catalog_policies", "catalog_revisions", "catalog_alias_events"):
                    conn.execute(
                        text(
                            f"SELECT setval(pg_get_serial_sequence('{table}', 'id'), (SELECT max(id) FROM {table}))"
                        )
                    )
        first = start if first is None else first
        last = start + count - 1
        done += count
        if progress:
            progress(done)
    return SeedResult(
        policies=n_policies,
        revisions=n_policies * revisions_per_policy,
        first_name=None if first is None else f"{prefix}{first:0{DIGITS}d}",
        last_name=None if last is None else f"{prefix}{last:0{DIGITS}d}",
        seconds=time.perf_counter() - started,
    )


def _store_payloads(
    catalog: Catalog, payload_for: Callable[[int], Payload], start: int, count: int
) -> list[list[payload.ManifestEntry]]:
    """Generate and store the payloads of indices start…start+count-1 (one bulk put: a pack);
    each one's manifest entries."""
    layouts: list[list[str]] = []  # each payload's file names, filled as put_many consumes the blobs

    def blobs() -> Iterator[bytes]:
        for generated in _prefetched(payload_for, range(start, start + count)):
            files = sorted(generated.items())
            layouts.append([name for name, _ in files])
            yield from (data for _, data in files)

    infos = iter(catalog.blobs.put_many(blobs()))
    return [[payload.ManifestEntry(name, *next(infos)[:2]) for name in names] for names in layouts]


def _prefetched(payload_for: Callable[[int], Payload], indices: range, window: int = 16) -> Iterator[Payload]:
    """payload_for over `indices`, in order, made on a helper thread a few ahead of the consumer: the
    generation (numpy, GIL released) overlaps the hashing and writing of the previous ones, so a
    2-core box uses both cores."""
    with ThreadPoolExecutor(1, thread_name_prefix="mint-seed") as pool:
        ahead: deque[Future[Payload]] = deque()
        for i in indices:
            ahead.append(pool.submit(payload_for, i))
            if len(ahead) >= window:
                yield ahead.popleft().result()
        while ahead:
            yield ahead.popleft().result()


def _insert_manifests(conn: Any, manifests: list[list[payload.ManifestEntry]]) -> list[tuple[str, int]]:
    """Record the payloads' file lists, each once (content-addressed: a payload seeded or published
    before, or twice in this batch, shares its rows); each one's (sha256, size)."""
    out, rows = [], {}
    for entries in manifests:
        sha = payload.manifest_sha256(entries)
        out.append((sha, sum(e.size for e in entries)))
        for e in entries:
            rows[(sha, e.name)] = (sha, e.name, e.sha256, e.size)
    _insert(conn, ManifestEntryRow.__table__, ["manifest_sha256", "name", "blob_sha256", "size"],
            list(rows.values()), skip_existing=True)
    return out


def _max_id(s: Any, row: type) -> int:
    return s.scalar(select(func.max(row.id))) or 0


def next_index(catalog: Catalog, owner: str, prefix: str) -> int:
    """How many synthetic policies the prefix has (one past its last index)."""
    with catalog._read() as s:
        return _next_index(s, owner, prefix)


def _next_index(s: Any, owner: str, prefix: str) -> int:
    """One past the highest synthetic index already used with this prefix (an index probe)."""
    low, high = f"{prefix}{0:0{DIGITS}d}", f"{prefix}{10**DIGITS - 1}"
    last = s.scalar(
        select(PolicyRow.name)
        .where(PolicyRow.owner == owner, PolicyRow.name >= low, PolicyRow.name <= high)
        .order_by(PolicyRow.name.desc())
        .limit(1)
    )
    if last is None:
        return 0
    suffix = last[len(prefix) :]
    if not (suffix.isdigit() and len(suffix) == DIGITS):
        raise InvalidArgument(f"prefix {prefix!r} is used by non-synthetic policy {last!r}", field="prefix")
    return int(suffix) + 1


def _db_value(conn: Any, table: Any, column: str, value: Any) -> Any:
    """`value` as the driver wants it for `column` (JSON text, SQLite datetime string, …)."""
    impl = table.c[column].type.dialect_impl(conn.dialect)
    process = impl.bind_processor(conn.dialect)
    return process(value) if process else value


def _insert(conn: Any, table: Any, columns: list[str], rows: list[tuple[Any, ...]], *,
            skip_existing: bool = False) -> None:
    """Straight to the driver: the values are already driver-ready, and skipping SQLAlchemy's
    per-row parameter processing is most of the seeding speed. PostgreSQL gets COPY, its bulk path;
    `skip_existing` rows (a key already there) are left out instead (INSERT … ON CONFLICT DO NOTHING)."""
    if not rows:
        return
    quote = conn.dialect.identifier_preparer.quote
    names = ", ".join(quote(c) for c in columns)
    postgres = conn.dialect.name == "postgresql"
    if conn.dialect.driver == "psycopg" and not skip_existing:
        with (conn.connection.driver_connection.cursor() as cursor,
              cursor.copy(f"COPY {quote(table.name)} ({names}) FROM STDIN") as copy):
            for row in rows:
                copy.write_row(row)
        return
    mark = "?" if conn.dialect.paramstyle == "qmark" else "%s"
    verb = "INSERT OR IGNORE" if skip_existing and not postgres else "INSERT"
    tail = " ON CONFLICT DO NOTHING" if skip_existing and postgres else ""
    conn.exec_driver_sql(
        f"{verb} INTO {quote(table.name)} ({names}) VALUES ({', '.join([mark] * len(columns))}){tail}", rows
    )


def _insert_batch(
    conn: Any,
    first: int,
    count: int,
    k: int,
    owner: str,
    prefix: str,
    payloads: list[tuple[str, int]],
    base_model: str,
    lora_config: dict[str, Any],
    *,
    policy_id: int,
    revision_id: int,
    event_id: int,
) -> None:
    policies_t, revisions_t = PolicyRow.__table__, RevisionRow.__table__
    aliases_t, events_t = AliasRow.__table__, AliasEventRow.__table__
    now = datetime.now(UTC)
    # Every row shares these, so convert them for the driver once, not per row.
    policy_now = _db_value(conn, policies_t, "created_at", now)
    lora = _db_value(conn, policies_t, "lora_config", lora_config)
    meta = _db_value(conn, policies_t, "metadata", {})
    revision_now = _db_value(conn, revisions_t, "created_at", now)
    alias_now = _db_value(conn, aliases_t, "updated_at", now)
    event_now = _db_value(conn, events_t, "at", now)

    policies, revisions, aliases, events = [], [], [], []
    for i in range(count):
        pid = policy_id + i
        policies.append(
            (pid, owner, f"{prefix}{first + i:0{DIGITS}d}", base_model, lora, meta, policy_now)
        )
        base = revision_id + i * k
        for n in range(k):
            # Each revision's parent is the previous one, so lineage has depth.
            revisions.append(
                (base + n, pid, n + 1, payloads[i][0], payloads[i][1], lora_config["rank"],
                 base + n - 1 if n else None, n, revision_now)
            )
        last = base + k - 1
        aliases.append((pid, SEED_ALIAS, last, alias_now))
        events.append((event_id + i, pid, SEED_ALIAS, "set", None, last, "seed", "synthetic", event_now))

    _insert(
        conn,
        policies_t,
        ["id", "owner", "name", "base_model", "lora_config", "metadata", "created_at"],
        policies,
    )
    _insert(
        conn,
        revisions_t,
        ["id", "policy_id", "number", "sha256", "size", "rank", "parent_id", "step", "created_at"],
        revisions,
    )
    _insert(conn, aliases_t, ["policy_id", "name", "revision_id", "updated_at"], aliases)
    _insert(
        conn,
        events_t,
        ["id", "policy_id", "alias", "action", "from_revision_id", "to_revision_id", "actor", "reason", "at"],
        events,
    )
