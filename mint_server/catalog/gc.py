"""Blob garbage collection: delete blobs that no revision references.

Safety argument, in two parts:

* A blob is only a candidate once untouched for the grace period (a put refreshes its mtime, or
  its pack's), and temp files are skipped while their writer holds its lock (local_blobs.py), so
  in-progress writes and blobs a publish has put but not yet committed are left alone.
* The reference check and the delete run under the database write lock (SQLite) or an exclusive
  advisory lock that publishers take shared (PostgreSQL), and publishers check that their blobs
  still exist under that same lock before inserting the revision. So either GC sees the new
  reference, or the publisher sees the blob gone and writes it again: never a committed revision
  with a missing blob, whatever the grace period.
"""

from __future__ import annotations

from datetime import UTC, datetime
from typing import TYPE_CHECKING

from sqlalchemy import select
from sqlalchemy.orm import Session

from mint_server.catalog.records import GcReport
from mint_server.catalog.schema import ManifestEntryRow

if TYPE_CHECKING:
    from mint_server.catalog.catalog import Catalog

DEFAULT_GRACE_S = 3600.0
BATCH = 500  # candidates checked per transaction, so the write lock is held only briefly
REPACK_BELOW = 0.5  # a pack whose referenced bytes fall under this fraction is rewritten with only those


def collect(catalog: Catalog, grace_seconds: float = DEFAULT_GRACE_S, dry_run: bool = False) -> GcReport:
    """Delete blobs no revision references and untouched for `grace_seconds` (see the module doc
    for why this never races a publish). Loose blobs go one by one; a pack goes whole when none of
    its blobs is referenced, and is rewritten with only its referenced blobs when they are under
    REPACK_BELOW of its bytes."""
    blobs = catalog.blobs
    cutoff = datetime.now(UTC).timestamp() - grace_seconds
    temp_removed = 0 if dry_run else blobs.remove_stale_temp(cutoff)
    candidates = [b for b in blobs.iter_loose() if b.mtime < cutoff]
    removed = freed = 0
    for start in range(0, len(candidates), BATCH):
        batch = {b.sha256: b for b in candidates[start : start + BATCH]}
        with catalog._write() as s:
            catalog._hold_blobs(s, shared=False)
            used = _referenced(s, list(batch))
            for sha256, info in batch.items():
                if sha256 in used:
                    continue
                current = blobs.stat(sha256)
                if current is None or current.mtime >= cutoff:
                    continue  # put again since we listed it: a publish is about to reference it
                if dry_run or blobs.delete(sha256):
                    removed += 1
                    freed += info.size
    kept = len(candidates) - removed
    for pack in blobs.iter_packs():
        if pack.mtime >= cutoff:
            continue
        with catalog._write() as s:
            catalog._hold_blobs(s, shared=False)
            shas = [e.sha256 for e in pack.blobs]
            used = set().union(*(_referenced(s, shas[i : i + BATCH]) for i in range(0, len(shas), BATCH)))
            mtime = blobs.pack_mtime(pack.name)
            if mtime is None or mtime >= cutoff:
                continue  # gone, or a put found content in it since we listed it
            total = sum(e.size for e in pack.blobs)
            live = sum(e.size for e in pack.blobs if e.sha256 in used)
            if live >= REPACK_BELOW * total:
                kept += len(pack.blobs)
                continue
            if not dry_run:
                blobs.drop_pack(pack.name, keep=used)
            dead = [e for e in pack.blobs if e.sha256 not in used]
            removed += len(dead)
            freed += sum(e.size for e in dead)
            kept += len(pack.blobs) - len(dead)
    return GcReport(removed=removed, freed_bytes=freed, kept=kept, temp_removed=temp_removed)


def _referenced(s: Session, shas: list[str]) -> set[str]:
    return set(
        s.scalars(select(ManifestEntryRow.blob_sha256).where(ManifestEntryRow.blob_sha256.in_(shas)).distinct())
    )
