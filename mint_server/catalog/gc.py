"""Blob garbage collection: delete blobs that no revision references.

Safety argument, in two parts:

* A blob is only a candidate once untouched for the grace period (a put refreshes its mtime),
  and temp files are skipped while their writer holds its lock (blobs.py), so in-progress writes
  and blobs a publish has put but not yet committed are left alone.
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

from mint_server.catalog.records import GcReport
from mint_server.catalog.schema import ManifestEntryRow

if TYPE_CHECKING:
    from mint_server.catalog.catalog import Catalog

DEFAULT_GRACE_S = 3600.0
BATCH = 500  # candidates checked per transaction, so the write lock is held only briefly


def collect(catalog: Catalog, grace_seconds: float = DEFAULT_GRACE_S, dry_run: bool = False) -> GcReport:
    """Delete blobs no revision references and untouched for `grace_seconds` (see the module doc
    for why this never races a publish)."""
    blobs = catalog.blobs
    cutoff = datetime.now(UTC).timestamp() - grace_seconds
    temp_removed = 0 if dry_run else blobs.remove_stale_temp(cutoff)
    candidates = [b for b in blobs.iter() if b.mtime < cutoff]
    removed = freed = 0
    for start in range(0, len(candidates), BATCH):
        batch = {b.sha256: b for b in candidates[start : start + BATCH]}
        with catalog._write() as s:
            catalog._hold_blobs(s, shared=False)
            used = set(
                s.scalars(
                    select(ManifestEntryRow.blob_sha256)
                    .where(ManifestEntryRow.blob_sha256.in_(list(batch)))
                    .distinct()
                )
            )
            for sha256, info in batch.items():
                if sha256 in used:
                    continue
                current = blobs.stat(sha256)
                if current is None or current.mtime >= cutoff:
                    continue  # put again since we listed it: a publish is about to reference it
                if dry_run or blobs.delete(sha256):
                    removed += 1
                    freed += info.size
    return GcReport(
        removed=removed, freed_bytes=freed, kept=len(candidates) - removed, temp_removed=temp_removed
    )
