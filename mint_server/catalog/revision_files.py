"""A revision's files: its manifest, and its payload read, verified, materialized or checked out
from the blob store."""

from __future__ import annotations

import os
from pathlib import Path

from sqlalchemy import select

from mint_server.catalog import payload
from mint_server.catalog.core import CatalogCore
from mint_server.catalog.errors import AlreadyExists, IntegrityError
from mint_server.catalog.records import Revision
from mint_server.catalog.schema import ManifestEntryRow


class RevisionFiles(CatalogCore):
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
