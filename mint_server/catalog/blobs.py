"""Content-addressed blob storage.

`BlobStore` is the interface the catalog uses; `LocalBlobStore` keeps blobs on a local filesystem:

    <root>/sha256/ab/cdef…   the blob whose sha256 is "abcdef…"
    <root>/tmp/…             writes in progress

Writes go to a temp file in <root>/tmp (same filesystem), are fsynced, renamed into place with
os.replace (atomic) and the directory is fsynced, so a blob path either does not exist or holds the
complete content. Reads hash what they return and raise IntegrityError on a mismatch, so a corrupt
blob is reported, never served. Identical content is stored once: putting a blob that already
exists (and verifies) only refreshes its mtime, which is what GC's grace period keys on.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import io
import os
import re
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import BinaryIO, NamedTuple, Protocol

from mint_server.catalog.errors import IntegrityError, InvalidArgument
from mint_server.fsutil import full_disk_named

CHUNK = 1 << 20
SHA256_RE = re.compile(r"[0-9a-f]{64}")


class BlobInfo(NamedTuple):
    sha256: str
    size: int
    mtime: float  # last write or put of this content (seconds since the epoch)


class BlobStore(Protocol):
    """What the catalog needs from blob storage; an object store can implement it later."""

    def put_bytes(self, data: bytes) -> BlobInfo: ...
    def put_file(self, path: str | os.PathLike[str]) -> BlobInfo: ...
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
    def stat(self, sha256: str) -> BlobInfo | None: ...
    def delete(self, sha256: str) -> bool: ...
    def iter(self) -> Iterator[BlobInfo]: ...
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


def _corrupt(sha256: str, actual: str) -> IntegrityError:
    return IntegrityError(f"blob sha256:{sha256} is corrupt: its content hashes to {actual}", field="sha256")


class _VerifyingReader(io.RawIOBase):
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
                raise _corrupt(self._sha256, self._hash.hexdigest())
        return n

    def close(self) -> None:
        self._file.close()
        super().close()


class LocalBlobStore:
    def __init__(self, root: str | os.PathLike[str]) -> None:
        self.root = Path(root)
        self._blobs = self.root / "sha256"
        self._tmp = self.root / "tmp"
        for directory in (self._blobs, self._tmp):
            directory.mkdir(parents=True, exist_ok=True)

    def __repr__(self) -> str:
        return f"LocalBlobStore({str(self.root)!r})"

    def path(self, sha256: str) -> Path:
        check_sha256(sha256)
        return self._blobs / sha256[:2] / sha256[2:]

    # -- writing ----------------------------------------------------------------------------
    def put_bytes(self, data: bytes) -> BlobInfo:
        sha256 = hashlib.sha256(data).hexdigest()
        if self._keep_existing(sha256):
            return BlobInfo(sha256, len(data), time.time())
        return self._put_stream(io.BytesIO(data))

    def put_file(self, path: str | os.PathLike[str]) -> BlobInfo:
        with open(path, "rb") as source:
            return self._put_stream(source)

    def _put_stream(self, source: BinaryIO) -> BlobInfo:
        digest = hashlib.sha256()
        fd, tmp_name = self._locked_temp()
        size = 0
        try:
            with full_disk_named("a blob"), os.fdopen(fd, "wb") as tmp:
                while chunk := source.read(CHUNK):
                    digest.update(chunk)
                    tmp.write(chunk)
                    size += len(chunk)
                tmp.flush()
                os.fsync(tmp.fileno())
                sha256 = digest.hexdigest()
                if not self._keep_existing(sha256):
                    self._install(tmp_name, sha256)
        finally:
            with contextlib.suppress(FileNotFoundError):  # already renamed into place
                os.unlink(tmp_name)
        # Not a fresh stat: GC with a tiny grace period may already have taken the blob again,
        # which the publisher detects under its lock (see Catalog.gc).
        return BlobInfo(sha256, size, time.time())

    def _locked_temp(self) -> tuple[int, str]:
        """A new temp file, flock'ed: the lock marks it as being written until it is renamed into
        place, so remove_stale_temp never deletes it however long the write takes (a crashed
        writer's lock dies with its process)."""
        while True:
            fd, name = tempfile.mkstemp(dir=self._tmp, prefix="put-")
            fcntl.flock(fd, fcntl.LOCK_EX)
            try:
                # Between mkstemp and flock the file was unlocked; make sure GC did not take it.
                if os.stat(name).st_ino == os.fstat(fd).st_ino:
                    return fd, name
            except FileNotFoundError:
                pass
            os.close(fd)

    def _keep_existing(self, sha256: str) -> bool:
        """True if a good copy is already stored (its mtime is refreshed so GC's grace period restarts).
        A corrupt existing copy returns False and is then replaced by the fresh write."""
        target = self.path(sha256)
        try:
            self._check_file(target, sha256)
            os.utime(target)
        except (IntegrityError, FileNotFoundError):
            return False
        return True

    def _install(self, tmp_name: str, sha256: str) -> None:
        target = self.path(sha256)
        shard = target.parent
        if not shard.is_dir():
            shard.mkdir(exist_ok=True)
            fsync_dir(self._blobs)
        os.replace(tmp_name, target)
        fsync_dir(shard)

    # -- reading ----------------------------------------------------------------------------
    def _check_file(self, path: Path, sha256: str) -> None:
        digest = hashlib.sha256()
        with open(path, "rb") as f:
            while chunk := f.read(CHUNK):
                digest.update(chunk)
        if digest.hexdigest() != sha256:
            raise _corrupt(sha256, digest.hexdigest())

    def _open_raw(self, sha256: str) -> BinaryIO:
        try:
            return open(self.path(sha256), "rb")
        except FileNotFoundError:
            raise IntegrityError(
                f"blob sha256:{sha256} is missing from {self.root}", field="sha256"
            ) from None

    def read(self, sha256: str) -> bytes:
        with self._open_raw(sha256) as f:
            data = f.read()
        actual = hashlib.sha256(data).hexdigest()
        if actual != sha256:
            raise _corrupt(sha256, actual)
        return data

    def open(self, sha256: str) -> BinaryIO:
        return io.BufferedReader(_VerifyingReader(self._open_raw(sha256), sha256), CHUNK)  # type: ignore[return-value]

    def copy_to(self, sha256: str, dest: str | os.PathLike[str]) -> None:
        dest = Path(dest)
        fd, tmp_name = tempfile.mkstemp(dir=dest.parent, prefix=f".{dest.name}.")
        try:
            with full_disk_named(dest.name), os.fdopen(fd, "wb") as out, self.open(sha256) as source:
                while chunk := source.read(CHUNK):
                    out.write(chunk)
                out.flush()
                os.fsync(out.fileno())
            os.replace(tmp_name, dest)
        finally:
            with contextlib.suppress(FileNotFoundError):  # already renamed into place
                os.unlink(tmp_name)

    def exists(self, sha256: str) -> bool:
        return self.path(sha256).is_file()

    def stat(self, sha256: str) -> BlobInfo | None:
        try:
            return self._info(sha256)
        except FileNotFoundError:
            return None

    def _info(self, sha256: str) -> BlobInfo:
        st = self.path(sha256).stat()
        return BlobInfo(sha256, st.st_size, st.st_mtime)

    # -- housekeeping -----------------------------------------------------------------------
    def delete(self, sha256: str) -> bool:
        try:
            self.path(sha256).unlink()
        except FileNotFoundError:
            return False
        return True

    def iter(self) -> Iterator[BlobInfo]:
        for shard in sorted(self._blobs.iterdir()):
            if not shard.is_dir() or len(shard.name) != 2:
                continue
            for entry in os.scandir(shard):
                sha256 = shard.name + entry.name
                if SHA256_RE.fullmatch(sha256) and entry.is_file():
                    st = entry.stat()
                    yield BlobInfo(sha256, st.st_size, st.st_mtime)

    def remove_stale_temp(self, older_than: float) -> int:
        removed = 0
        for entry in os.scandir(self._tmp):
            try:
                if entry.stat().st_mtime >= older_than:
                    continue
                fd = os.open(entry.path, os.O_RDONLY)
            except FileNotFoundError:
                continue  # its writer renamed it into place while we looked
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                os.unlink(entry.path)
                removed += 1
            except (BlockingIOError, FileNotFoundError):
                pass  # still being written, or finished meanwhile
            finally:
                os.close(fd)
        return removed
