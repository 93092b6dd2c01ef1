"""Pack files: many blobs in one file, so a bulk write costs one write and one fsync (or one PUT on
an object store) instead of one per blob.

    "MINTPK01"                                   8-byte magic
    blob bytes, back to back
    index: one 48-byte entry per blob            sha256 digest (32), offset (u64), size (u64)
    trailer: index offset (u64), count (u64), sha256 of the index (32), "MINTPEND"

A pack is named by the sha256 of its index, so its name checks its index, and every blob in it is
checked on read against its own sha256 (the store's rule: corrupt content is reported, never served).
Packs are written whole and renamed (or PUT) into place: a pack either exists complete or not at all.

`PackIndex` is a process's in-memory map from blob to (pack, offset, size): sorted numpy arrays
(48 bytes a blob) plus a small dict of recent additions merged in from time to time, so it stays
compact at millions of blobs where a dict of tuples would take ~200 bytes each.
"""

from __future__ import annotations

import hashlib
import struct
import threading
from collections.abc import Iterable
from typing import BinaryIO, NamedTuple

import numpy as np

from mint_server.catalog.errors import IntegrityError

MAGIC = b"MINTPK01"
END = b"MINTPEND"
ENTRY = struct.Struct("<32sQQ")
TRAILER = struct.Struct("<QQ32s8s")
SUFFIX = ".pack"
MAX_PACKED = (1 << 32) - 1  # the in-memory index keeps a packed blob's size in 32 bits


class PackEntry(NamedTuple):
    sha256: str
    offset: int
    size: int


class PackWriter:
    """Writes one pack to a binary file: `add` each blob, then `finish` (returns the pack's name)."""

    def __init__(self, file: BinaryIO) -> None:
        self._file = file
        self._file.write(MAGIC)
        self._offset = len(MAGIC)
        self._index: list[bytes] = []
        self.entries: list[PackEntry] = []

    @property
    def size(self) -> int:
        return self._offset

    def add(self, sha256: str, data: bytes | memoryview) -> None:
        self._file.write(data)
        self._index.append(ENTRY.pack(bytes.fromhex(sha256), self._offset, len(data)))
        self.entries.append(PackEntry(sha256, self._offset, len(data)))
        self._offset += len(data)

    def finish(self) -> str:
        index = b"".join(self._index)
        digest = hashlib.sha256(index).digest()
        self._file.write(index)
        self._file.write(TRAILER.pack(self._offset, len(self._index), digest, END))
        return digest.hex()


def trailer_size() -> int:
    return TRAILER.size


def parse_trailer(name: str, tail: bytes) -> tuple[int, int]:
    """(index offset, index length) from a pack's last TRAILER.size bytes."""
    if len(tail) != TRAILER.size:
        raise _bad(name, "is truncated")
    index_offset, count, digest, end = TRAILER.unpack(tail)
    if end != END or digest.hex() != name:
        raise _bad(name, "has a bad trailer")
    return index_offset, count * ENTRY.size


def parse_index(name: str, index: bytes, index_offset: int) -> list[PackEntry]:
    if hashlib.sha256(index).hexdigest() != name:
        raise _bad(name, "has a corrupt index")
    entries = []
    for digest, offset, size in ENTRY.iter_unpack(index):
        if offset < len(MAGIC) or offset + size > index_offset:
            raise _bad(name, "has an index entry outside its data")
        entries.append(PackEntry(digest.hex(), offset, size))
    return entries


def _bad(name: str, what: str) -> IntegrityError:
    return IntegrityError(f"pack {name} {what}", field="sha256")


class Located(NamedTuple):
    pack: str
    offset: int
    size: int


_MERGE_AT = 1 << 16  # recent entries kept in a dict before they are merged into the sorted arrays


class PackIndex:
    """blob sha256 → where it is, over the packs this process has loaded. Thread-safe."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._names: list[str] = []  # pack number → name
        self._numbers: dict[str, int] = {}  # live packs only
        self._keys = np.empty(0, "S32")  # sorted digests
        self._packs = np.empty(0, np.uint32)
        self._offsets = np.empty(0, np.uint64)
        self._sizes = np.empty(0, np.uint32)  # a packed blob is at most a quarter of a pack
        self._recent: dict[bytes, tuple[int, int, int]] = {}

    def packs(self) -> set[str]:
        with self._lock:
            return set(self._numbers)

    def add(self, name: str, entries: Iterable[PackEntry]) -> None:
        with self._lock:
            if name in self._numbers:
                return
            number = len(self._names)
            self._names.append(name)
            self._numbers[name] = number
            new = {bytes.fromhex(e.sha256): (number, e.offset, e.size) for e in entries}
            if not self._recent.keys().isdisjoint(new):
                self._merge()  # a blob in two packs: keep both copies (the arrays hold duplicates)
            self._recent.update(new)
            if len(self._recent) >= _MERGE_AT:
                self._merge()

    def drop(self, name: str) -> None:
        """Forget a pack that is gone (its entries are filtered out at the next merge)."""
        with self._lock:
            self._numbers.pop(name, None)

    def find(self, sha256: str) -> Located | None:
        key = bytes.fromhex(sha256)
        with self._lock:
            hit = self._recent.get(key)
            if hit is not None and self._names[hit[0]] in self._numbers:
                return Located(self._names[hit[0]], hit[1], hit[2])
            lo = int(np.searchsorted(self._keys, key, "left"))
            hi = int(np.searchsorted(self._keys, key, "right"))
            for i in range(lo, hi):  # the same blob may be in several packs; any live one will do
                name = self._names[int(self._packs[i])]
                if name in self._numbers:
                    return Located(name, int(self._offsets[i]), int(self._sizes[i]))
        return None

    def _merge(self) -> None:
        live = np.array([n in self._numbers for n in self._names], bool)
        keep = live[self._packs] if len(self._packs) else np.empty(0, bool)
        recent = {k: v for k, v in self._recent.items() if live[v[0]]}
        count = len(recent)
        keys = np.fromiter(recent.keys(), "S32", count)
        values = np.array(list(recent.values()), np.uint64).reshape(count, 3)
        all_keys = np.concatenate([self._keys[keep], keys])
        order = np.argsort(all_keys, kind="stable")
        self._keys = all_keys[order]
        self._packs = np.concatenate([self._packs[keep], values[:, 0].astype(np.uint32)])[order]
        self._offsets = np.concatenate([self._offsets[keep], values[:, 1]])[order]
        self._sizes = np.concatenate([self._sizes[keep], values[:, 2].astype(np.uint32)])[order]
        self._recent = {}

    def compact(self) -> None:
        """Merge recent additions into the sorted arrays now (48 bytes a blob from then on)."""
        with self._lock:
            if self._recent:
                self._merge()

    def nbytes(self) -> int:
        """Memory the index holds (arrays, plus ~150 bytes per entry not yet merged)."""
        arrays = self._keys.nbytes + self._packs.nbytes + self._offsets.nbytes + self._sizes.nbytes
        return arrays + 150 * len(self._recent)
