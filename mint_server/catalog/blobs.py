"""Content-addressed blob storage.

`BlobStore` is the interface the catalog uses; `stores.open_blob_store(url)` picks the backend:
`LocalBlobStore` (a path or file://…, the default <data dir>/blobs) or `S3BlobStore` (s3://bucket/prefix,
catalog/s3.py: a store several nodes share). Both keep the same two kinds of objects:

    <root>/sha256/ab/cdef…       a loose blob: the blob whose sha256 is "abcdef…" (put_bytes, put_file)
    <root>/packs/<sha256>.pack   a pack: many blobs written at once (put_many; format in packs.py)
    <root>/tmp/…                 local writes in progress

Local writes go to a temp file in <root>/tmp (same filesystem), are fsynced, renamed into place with
os.replace (atomic) and the directory is fsynced, so a blob or pack path either does not exist or
holds complete content; a bulk write costs one fsync per pack instead of one per blob. Reads hash
what they return and raise IntegrityError on a mismatch, so a corrupt blob is reported, never served.
Identical content is stored once: putting a blob that already exists (and verifies) only refreshes the
mtime of its file or pack, which is what GC's grace period keys on. GC removes loose blobs one by one
and packs whole (a pack whose blobs are partly referenced is rewritten with only those: drop_pack).
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
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import BinaryIO, NamedTuple, Protocol

from mint_server.catalog import packs
from mint_server.catalog.errors import IntegrityError, InvalidArgument
from mint_server.fsutil import full_disk_named

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


class PackedStore:
    """Packs (bulk writes, packs.py) and everything that reads blobs whichever kind they are; a backend
    supplies the storage primitives below (`_loose_*`, `_pack_*`)."""

    url: str
    pack_bytes = PACK_BYTES
    # Whether a bulk put checks for a loose copy (a stat locally; on S3 a request per blob, so there a
    # loose duplicate is left to be: harmless) and re-hashes a packed copy before relying on it.
    bulk_checks_loose = True
    verify_dedupe = True

    def __init__(self) -> None:
        self._index = packs.PackIndex()

    # -- backend primitives -----------------------------------------------------------------
    def _loose_info(self, sha256: str) -> BlobInfo | None: raise NotImplementedError
    def _loose_read(self, sha256: str) -> bytes | None: raise NotImplementedError
    def _loose_open(self, sha256: str) -> BinaryIO | None: raise NotImplementedError
    def _loose_keep(self, sha256: str) -> bool: raise NotImplementedError
    def _loose_put(self, sha256: str, data: bytes) -> None: raise NotImplementedError
    def iter_loose(self) -> Iterator[BlobInfo]: raise NotImplementedError
    def _pack_names(self) -> dict[str, float]: raise NotImplementedError  # name → mtime
    def _pack_read(self, name: str, offset: int, size: int) -> bytes: raise NotImplementedError  # FileNotFoundError if gone
    def _pack_tail(self, name: str, size: int) -> bytes: raise NotImplementedError
    def pack_mtime(self, name: str) -> float | None: raise NotImplementedError
    def _pack_touch(self, name: str) -> None: raise NotImplementedError
    def _pack_delete(self, name: str) -> None: raise NotImplementedError
    # a pack is written to the file `_pack_begin` gives, then made durable and visible (or dropped)
    def _pack_begin(self) -> tuple[BinaryIO, object]: raise NotImplementedError
    def _pack_commit(self, file: BinaryIO, token: object, name: str) -> None: raise NotImplementedError
    def _pack_abort(self, file: BinaryIO, token: object) -> None: raise NotImplementedError

    # -- packs --------------------------------------------------------------------------------
    def _load_pack(self, name: str) -> list[packs.PackEntry]:
        entries = self._entries(name)
        self._index.add(name, entries)
        return entries

    def refresh(self) -> None:
        """Pick up packs other writers (processes, nodes) added and forget those GC removed."""
        listed = self._pack_names()
        known = self._index.packs()
        for name in known - listed.keys():
            self._index.drop(name)
        for name in listed.keys() - known:
            with contextlib.suppress(FileNotFoundError):  # removed since listed
                self._load_pack(name)

    def _locate(self, sha256: str, *, refresh: bool = True) -> packs.Located | None:
        found = self._index.find(sha256)
        if found is None and refresh:
            self.refresh()
            found = self._index.find(sha256)
        return found

    def _packed_read(self, sha256: str) -> bytes | None:
        for attempt in (1, 2):
            found = self._locate(sha256)
            if found is None:
                return None
            try:
                return self._pack_read(found.pack, found.offset, found.size)
            except FileNotFoundError:  # GC rewrote or removed the pack since we indexed it
                self._index.drop(found.pack)
                if attempt == 2:
                    raise
        return None

    def _keep_packed(self, sha256: str, *, refresh: bool, exclude: str | None = None) -> bool:
        """True if a good packed copy exists outside pack `exclude` (its pack's mtime is refreshed
        for GC's grace period)."""
        found = self._locate(sha256, refresh=refresh)
        if found is None or found.pack == exclude:
            return False
        try:
            if self.verify_dedupe:
                verified(sha256, self._pack_read(found.pack, found.offset, found.size))
            self._pack_touch(found.pack)
        except (FileNotFoundError, IntegrityError):
            if self.pack_mtime(found.pack) is None:
                self._index.drop(found.pack)
            return False
        return True

    def put_many(self, datas: Iterable[bytes]) -> list[BlobInfo]:
        return self._put_many(datas)

    def _put_many(self, datas: Iterable[bytes], exclude: str | None = None) -> list[BlobInfo]:
        self.refresh()
        now = time.time()
        out: list[BlobInfo] = []
        seen: set[str] = set()
        pack: _OpenPack | None = None
        try:
            for data in datas:
                sha256 = hashlib.sha256(data).hexdigest()
                out.append(BlobInfo(sha256, len(data), now))
                if sha256 in seen:
                    continue
                seen.add(sha256)
                if (self.bulk_checks_loose and self._loose_keep(sha256)) or self._keep_packed(
                    sha256, refresh=False, exclude=exclude
                ):
                    continue
                if len(data) > min(self.pack_bytes // 4, packs.MAX_PACKED):
                    self._loose_put(sha256, data)
                    continue
                if pack is None:
                    pack = _OpenPack(*self._pack_begin())
                pack.writer.add(sha256, data)
                if pack.writer.size >= self.pack_bytes:
                    self._finish_pack(pack)
                    pack = None
            if pack is not None:
                self._finish_pack(pack)
                pack = None
        finally:
            if pack is not None:
                self._pack_abort(pack.file, pack.token)
        return out

    def _finish_pack(self, pack: _OpenPack) -> None:
        name = pack.writer.finish()
        self._pack_commit(pack.file, pack.token, name)
        self._index.drop(name)  # the same pack written again: index it afresh
        self._index.add(name, pack.writer.entries)

    def missing(self, shas: Iterable[str]) -> set[str]:
        """Which of `shas` are not stored: one listing and one check per pack, not one per blob."""
        self.refresh()
        out, packs_there = set(), {}
        for sha256 in set(shas):
            found = self._locate(check_sha256(sha256), refresh=False)
            if found is not None:
                there = packs_there.get(found.pack)
                if there is None:
                    there = packs_there[found.pack] = self.pack_mtime(found.pack) is not None
                if there:
                    continue
            if self._loose_info(sha256) is None:
                out.add(sha256)
        return out

    def iter_packs(self) -> Iterator[PackInfo]:
        for name, mtime in sorted(self._pack_names().items()):
            try:
                entries = self._load_pack(name)
            except FileNotFoundError:
                continue
            yield PackInfo(name, mtime, entries)

    def _entries(self, name: str) -> list[packs.PackEntry]:
        index_offset, index_len = packs.parse_trailer(name, self._pack_tail(name, packs.trailer_size()))
        return packs.parse_index(name, self._pack_read(name, index_offset, index_len), index_offset)

    def drop_pack(self, name: str, keep: Iterable[str]) -> None:
        keep = set(keep)
        entries = self._entries(name) if keep else []
        if entries and keep.issuperset(e.sha256 for e in entries):
            return  # nothing to drop
        survivors = [verified(e.sha256, self._pack_read(name, e.offset, e.size)) for e in entries if e.sha256 in keep]
        if survivors:  # written (durably) elsewhere before the pack goes; never found in the pack itself
            self._put_many(survivors, exclude=name)
        self._pack_delete(name)
        self._index.drop(name)

    # -- reading --------------------------------------------------------------------------------
    def read(self, sha256: str) -> bytes:
        check_sha256(sha256)
        data = self._loose_read(sha256)
        if data is None:
            data = self._packed_read(sha256)
        if data is None:
            raise missing_error(sha256, self)
        return verified(sha256, data)

    def open(self, sha256: str) -> BinaryIO:
        check_sha256(sha256)
        raw = self._loose_open(sha256)
        if raw is not None:
            return io.BufferedReader(VerifyingReader(raw, sha256), CHUNK)  # type: ignore[return-value]
        return io.BytesIO(self.read(sha256))  # packed blobs are small (at most a quarter of a pack)

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
        return self.stat(sha256) is not None

    def stat(self, sha256: str) -> BlobInfo | None:
        check_sha256(sha256)
        info = self._loose_info(sha256)
        if info is not None:
            return info
        for _ in (1, 2):
            found = self._locate(sha256)
            if found is None:
                return None
            mtime = self.pack_mtime(found.pack)  # the index may be stale: the pack must still be there
            if mtime is not None:
                return BlobInfo(sha256, found.size, mtime)
            self._index.drop(found.pack)
        return None

    def iter(self) -> Iterator[BlobInfo]:
        seen: set[str] = set()
        for info in self.iter_loose():
            seen.add(info.sha256)
            yield info
        for pack in self.iter_packs():
            for e in pack.blobs:
                if e.sha256 not in seen:
                    seen.add(e.sha256)
                    yield BlobInfo(e.sha256, e.size, pack.mtime)

    def index_bytes(self, compact: bool = False) -> int:
        """Host memory of this process's pack index (after merging recent additions, if `compact`)."""
        if compact:
            self._index.compact()
        return self._index.nbytes()


@dataclass
class _OpenPack:
    file: BinaryIO
    token: object
    writer: packs.PackWriter = None  # type: ignore[assignment]

    def __post_init__(self) -> None:
        self.writer = packs.PackWriter(self.file)


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


def verified_file(path: Path, sha256: str) -> None:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(CHUNK):
            digest.update(chunk)
    if digest.hexdigest() != sha256:
        raise corrupt_error(sha256, digest.hexdigest())
