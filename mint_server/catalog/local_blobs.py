"""The blob store on a local filesystem (a path or file://…, the default <data dir>/blobs).

    <root>/sha256/ab/cdef…       loose blobs
    <root>/packs/<sha256>.pack   packs
    <root>/tmp/…                 writes in progress

Writes go to a temp file in <root>/tmp (same filesystem), are fsynced, renamed into place with
os.replace (atomic) and the directory is fsynced, so a blob or pack path either does not exist or
holds complete content; a bulk write costs one fsync per pack instead of one per blob.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import io
import os
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import BinaryIO

from mint_server.catalog import packs
from mint_server.catalog.blobs import (
    CHUNK,
    SHA256_RE,
    BlobInfo,
    check_sha256,
    fsync_dir,
    verified_file,
)
from mint_server.catalog.errors import IntegrityError
from mint_server.catalog.packed_store import PackedStore
from mint_server.fsutil import full_disk_named


class LocalBlobStore(PackedStore):
    def __init__(self, root: str | os.PathLike[str]) -> None:
        super().__init__()
        self.root = Path(root)
        self.url = str(self.root.absolute())
        self._blobs = self.root / "sha256"
        self._packs = self.root / "packs"
        self._tmp = self.root / "tmp"
        for directory in (self._blobs, self._packs, self._tmp):
            directory.mkdir(parents=True, exist_ok=True)
        # The start's sweep: partial writes a killed process left (no lock holds them any more) go
        # now, not at the next `mint catalog gc`. Writes in progress elsewhere hold their lock and stay.
        with contextlib.suppress(OSError):  # a read-only store keeps them until it is writable
            self.remove_stale_temp(time.time() + 1)

    def __repr__(self) -> str:
        return f"LocalBlobStore({str(self.root)!r})"

    def path(self, sha256: str) -> Path:
        check_sha256(sha256)
        return self._blobs / sha256[:2] / sha256[2:]

    # -- loose blobs --------------------------------------------------------------------------
    def put_bytes(self, data: bytes) -> BlobInfo:
        sha256 = hashlib.sha256(data).hexdigest()
        if self._loose_keep(sha256) or self._keep_packed(sha256, refresh=True):
            return BlobInfo(sha256, len(data), time.time())
        return self._put_stream(io.BytesIO(data))

    def put_file(self, path: str | os.PathLike[str]) -> BlobInfo:
        with open(path, "rb") as source:
            return self._put_stream(source)

    def _loose_put(self, sha256: str, data: bytes) -> None:
        self._put_stream(io.BytesIO(data))

    def _put_stream(self, source: BinaryIO) -> BlobInfo:
        digest = hashlib.sha256()
        with full_disk_named("a blob"):  # a read-only store fails at the temp file already
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
                if not (self._loose_keep(sha256) or self._keep_packed(sha256, refresh=True)):
                    self._install(tmp_name, sha256)
        finally:
            with contextlib.suppress(FileNotFoundError):  # already renamed into place
                os.unlink(tmp_name)
        # Not a fresh stat: GC with a tiny grace period may already have taken the blob again,
        # which the publisher detects under its lock (see Catalog.gc).
        return BlobInfo(sha256, size, time.time())

    def _locked_temp(self, prefix: str = "put-") -> tuple[int, str]:
        """A new temp file, flock'ed: the lock marks it as being written until it is renamed into
        place, so remove_stale_temp never deletes it however long the write takes (a crashed
        writer's lock dies with its process)."""
        while True:
            fd, name = tempfile.mkstemp(dir=self._tmp, prefix=prefix)
            fcntl.flock(fd, fcntl.LOCK_EX)
            try:
                # Between mkstemp and flock the file was unlocked; make sure GC did not take it.
                if os.stat(name).st_ino == os.fstat(fd).st_ino:
                    return fd, name
            except FileNotFoundError:
                pass
            os.close(fd)

    def _loose_keep(self, sha256: str) -> bool:
        """True if a good loose copy is already stored (its mtime is refreshed so GC's grace period
        restarts). A corrupt existing copy returns False and is then replaced by the fresh write."""
        target = self.path(sha256)
        try:
            verified_file(target, sha256)
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

    def _loose_info(self, sha256: str) -> BlobInfo | None:
        try:
            st = self.path(sha256).stat()
        except FileNotFoundError:
            return None
        return BlobInfo(sha256, st.st_size, st.st_mtime)

    def _loose_read(self, sha256: str) -> bytes | None:
        try:
            with open(self.path(sha256), "rb") as f:
                return f.read()
        except FileNotFoundError:
            return None

    def _loose_open(self, sha256: str) -> BinaryIO | None:
        try:
            return open(self.path(sha256), "rb")
        except FileNotFoundError:
            return None

    def delete(self, sha256: str) -> bool:
        try:
            self.path(sha256).unlink()
        except FileNotFoundError:
            return False
        return True

    def iter_loose(self) -> Iterator[BlobInfo]:
        for shard in sorted(self._blobs.iterdir()):
            if not shard.is_dir() or len(shard.name) != 2:
                continue
            for entry in os.scandir(shard):
                sha256 = shard.name + entry.name
                if SHA256_RE.fullmatch(sha256) and entry.is_file():
                    st = entry.stat()
                    yield BlobInfo(sha256, st.st_size, st.st_mtime)

    # -- packs ------------------------------------------------------------------------------------
    def _pack_path(self, name: str) -> Path:
        return self._packs / f"{name}{packs.SUFFIX}"

    def _pack_names(self) -> dict[str, float]:
        out = {}
        for entry in os.scandir(self._packs):
            name = entry.name.removesuffix(packs.SUFFIX)
            if entry.name.endswith(packs.SUFFIX) and SHA256_RE.fullmatch(name):
                with contextlib.suppress(FileNotFoundError):
                    out[name] = entry.stat().st_mtime
        return out

    def _pack_read(self, name: str, offset: int, size: int) -> bytes:
        with open(self._pack_path(name), "rb") as f:
            data = os.pread(f.fileno(), size, offset)
        if len(data) != size:
            raise IntegrityError(f"pack {name} is truncated", field="sha256")
        return data

    def _pack_tail(self, name: str, size: int) -> bytes:
        with open(self._pack_path(name), "rb") as f:
            end = os.fstat(f.fileno()).st_size
            return os.pread(f.fileno(), size, max(0, end - size))

    def pack_mtime(self, name: str) -> float | None:
        try:
            return self._pack_path(name).stat().st_mtime
        except FileNotFoundError:
            return None

    def _pack_touch(self, name: str) -> None:
        os.utime(self._pack_path(name))

    def _pack_delete(self, name: str) -> None:
        with contextlib.suppress(FileNotFoundError):
            self._pack_path(name).unlink()

    def _pack_begin(self) -> tuple[BinaryIO, object]:
        fd, tmp_name = self._locked_temp("pack-")
        return os.fdopen(fd, "wb"), tmp_name

    def _pack_commit(self, file: BinaryIO, token: object, name: str) -> None:
        try:
            with full_disk_named("a pack of blobs"), file:
                file.flush()
                os.fsync(file.fileno())
                os.replace(str(token), self._pack_path(name))  # while the lock is held (remove_stale_temp)
            fsync_dir(self._packs)
        finally:
            with contextlib.suppress(FileNotFoundError):  # already renamed into place
                os.unlink(str(token))

    def _pack_abort(self, file: BinaryIO, token: object) -> None:
        file.close()
        with contextlib.suppress(FileNotFoundError):
            os.unlink(str(token))

    # -- housekeeping -------------------------------------------------------------------------
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
