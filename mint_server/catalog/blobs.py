"""Content-addressed blob storage: what every store is and shares.

`BlobStore` is the interface the catalog uses; `stores.open_blob_store(url)` picks the backend:
`LocalBlobStore` (local_blobs.py: a path or file://…, the default <data dir>/blobs) or `S3BlobStore`
(s3.py: s3://bucket/prefix, a store several nodes share). Both are `PackedStore`s (packed_store.py)
and keep the same two kinds of objects:

    <root>/sha256/ab/cdef…       a loose blob: the blob whose sha256 is "abcdef…" (put_bytes, put_file)
    <root>/packs/<sha256>.pack   a pack: many blobs written at once (put_many; format in packs.py)

Reads hash what they return and raise IntegrityError on a mismatch (`verified`, `VerifyingReader`,
`verified_file`), so a corrupt blob is reported, never served. Identical content is stored once:
putting a blob that already exists (and verifies) only refreshes the mtime of its file or pack, which
is what GC's grace period keys on. GC removes loose blobs one by one and packs whole (a pack whose
blobs are partly referenced is rewritten with only those: drop_pack).
"""

from __future__ import annotations

import hashlib
import io
import os
import re
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import BinaryIO, NamedTuple, Protocol

from mint_server.catalog import packs
from mint_server.catalog.errors import IntegrityError, InvalidArgument

CHUNK = 1 << 20
SHA256_RE = re.compile(r"[0-9a-f]{64}")
PACK_BYTES = 256 << 20  # a pack is closed once it holds this much; a blob over a quarter of it goes loose


class BlobInfo(NamedTuple):
    sha256: str
    size: int
    mtime: float  # last write or put of this content (seconds since the epoch)


@dataclass(frozen=True)
class PackInfo:
    name: str
    mtime: float
    blobs: list[packs.PackEntry]


class BlobStore(Protocol):
    """What the catalog needs from blob storage."""

    url: str  # where it is, as open_blob_store takes it (another process or node can open the same store)

    def put_bytes(self, data: bytes) -> BlobInfo: ...
    def put_file(self, path: str | os.PathLike[str]) -> BlobInfo: ...
    def put_many(self, datas: Iterable[bytes]) -> list[BlobInfo]:
        """Store many blobs durably with one sync per pack (bulk writes); infos in input order.
        Content already stored is not written again."""
        ...

    def read(self, sha256: str) -> bytes:
        """The whole blob, verified."""
        ...

    def open(self, sha256: str) -> BinaryIO:
        """A stream that raises IntegrityError at EOF if the content does not match; data read before
        EOF is unverified, so consumers must read to the end before trusting it."""
        ...

    def copy_to(self, sha256: str, dest: str | os.PathLike[str]) -> None:
        """Write the blob to `dest` atomically; `dest` appears only if the content verified."""
        ...

    def exists(self, sha256: str) -> bool: ...
    def missing(self, shas: Iterable[str]) -> set[str]:
        """Which of `shas` are not stored (a bulk exists: one check per pack)."""
        ...

    def stat(self, sha256: str) -> BlobInfo | None: ...
    def delete(self, sha256: str) -> bool:
        """Delete a loose blob (packed blobs go with their pack: drop_pack)."""
        ...

    def iter(self) -> Iterator[BlobInfo]:
        """Every stored blob once, loose or packed."""
        ...

    def iter_loose(self) -> Iterator[BlobInfo]: ...
    def iter_packs(self) -> Iterator[PackInfo]: ...
    def pack_mtime(self, name: str) -> float | None: ...
    def drop_pack(self, name: str, keep: Iterable[str]) -> None:
        """Delete a pack; the blobs in `keep` are first written again elsewhere (GC's repack)."""
        ...

    def remove_stale_temp(self, older_than: float) -> int:
        """Delete abandoned partial writes last touched before `older_than` (epoch seconds)."""
        ...


def check_sha256(sha256: str) -> str:
    if not isinstance(sha256, str) or not SHA256_RE.fullmatch(sha256):
        raise InvalidArgument(f"sha256 {sha256!r} is not 64 lowercase hex digits", field="sha256")
    return sha256


def fsync_dir(path: str | os.PathLike[str]) -> None:
    """Make a directory's entries (a rename, a new file) durable."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def corrupt_error(sha256: str, actual: str) -> IntegrityError:
    return IntegrityError(f"blob sha256:{sha256} is corrupt: its content hashes to {actual}", field="sha256")


def missing_error(sha256: str, where: object) -> IntegrityError:
    return IntegrityError(f"blob sha256:{sha256} is missing from {where}", field="sha256")


def verified(sha256: str, data: bytes) -> bytes:
    actual = hashlib.sha256(data).hexdigest()
    if actual != sha256:
        raise corrupt_error(sha256, actual)
    return data


class VerifyingReader(io.RawIOBase):
    def __init__(self, file: BinaryIO, sha256: str) -> None:
        self._file = file
        self._sha256 = sha256
        self._hash = hashlib.sha256()
        self._checked = False

    def readable(self) -> bool:
        return True

    def readinto(self, buffer) -> int:  # type: ignore[no-untyped-def]
        n = self._file.readinto(buffer)  # type: ignore[attr-defined]
        if n:
            self._hash.update(memoryview(buffer)[:n])
        elif not self._checked:
            self._checked = True
            if self._hash.hexdigest() != self._sha256:
                raise corrupt_error(self._sha256, self._hash.hexdigest())
        return n

    def close(self) -> None:
        self._file.close()
        super().close()


def verified_file(path: Path, sha256: str) -> None:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(CHUNK):
            digest.update(chunk)
    if digest.hexdigest() != sha256:
        raise corrupt_error(sha256, digest.hexdigest())
