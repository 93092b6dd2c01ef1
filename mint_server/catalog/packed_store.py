"""Packs (bulk writes, packs.py) and every read of a blob whichever kind it is, over a backend's
storage primitives (`_loose_*`, `_pack_*`: local_blobs.LocalBlobStore, s3.S3BlobStore)."""

from __future__ import annotations

import contextlib
import hashlib
import io
import os
import tempfile
import time
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import BinaryIO

from mint_server.catalog import packs
from mint_server.catalog.blobs import (
    CHUNK,
    PACK_BYTES,
    BlobInfo,
    PackInfo,
    VerifyingReader,
    check_sha256,
    missing_error,
    verified,
)
from mint_server.catalog.errors import IntegrityError
from mint_server.fsutil import full_disk_named


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
