"""`S3BlobStore`: the content-addressed store on the S3 API, which every node of a fleet can share.

Selected by URL, `s3://bucket/prefix` (`mint … --store`, `Catalog.open(store=…)`); the endpoint,
region and credentials come from the usual environment variables (AWS_ENDPOINT_URL,
AWS_DEFAULT_REGION, AWS_ACCESS_KEY_ID, AWS_SECRET_ACCESS_KEY, AWS_ALLOW_HTTP for a plain-http
endpoint such as a local test server). The client is obstore (Rust object_store): against a local S3
server it moved 1.3-2.4x the bytes per second of s3fs on every operation we use (benchmarks/scale_out.py
--compare-s3-clients measures it).

Same layout and rules as the local store (blobs.py): loose blobs under sha256/ab/…, packs under packs/,
every read verified against the sha256. A PUT is atomic on S3, so there are no temp files; an
abandoned multipart upload is S3's to expire (a bucket lifecycle rule). Differences, because a
request costs far more than a stat: a put of a loose blob always uploads (the same key, so still
stored once; this also refreshes its LastModified for GC's grace period and repairs a corrupt copy),
a bulk put does not look for loose copies (a packed duplicate is harmless), and a packed copy found by
a bulk put is trusted by its pack's checked index rather than re-read (reads still verify every byte).
GC stays safe without refreshed pack times: publishers check their blobs exist under the lock GC
takes (catalog/gc.py).
"""

from __future__ import annotations

import contextlib
import hashlib
import io
import os
import tempfile
import time
from collections.abc import Iterator
from typing import Any, BinaryIO

import obstore
from obstore.exceptions import NotFoundError

from mint_server.catalog import packs
from mint_server.catalog.blobs import CHUNK, SHA256_RE, BlobInfo, check_sha256
from mint_server.catalog.errors import InvalidArgument
from mint_server.catalog.packed_store import PackedStore

# obstore reports a missing object as its NotFoundError or, from some calls, as FileNotFoundError
NOT_FOUND = (NotFoundError, FileNotFoundError)
PACK_BYTES = 64 << 20  # smaller than local packs: a ranged GET is cheap on S3, a huge PUT retried is not


class S3BlobStore(PackedStore):
    pack_bytes = PACK_BYTES
    bulk_checks_loose = False
    verify_dedupe = False

    def __init__(self, store: Any, url: str) -> None:
        super().__init__()
        self._store = store
        self.url = url

    @classmethod
    def from_url(cls, url: str) -> S3BlobStore:
        from obstore.store import S3Store

        bucket = url[len("s3://") :].split("/", 1)[0]
        if not bucket:
            raise InvalidArgument(f"store {url!r}: no bucket (s3://BUCKET/PREFIX)", field="store")
        try:
            store = S3Store.from_url(url.rstrip("/"))
        except Exception as e:  # obstore's config errors: a bad URL or environment variable
            raise InvalidArgument(f"store {url!r}: {e}", field="store") from None
        return cls(store, url.rstrip("/"))

    def __repr__(self) -> str:
        return f"S3BlobStore({self.url!r})"

    @staticmethod
    def _loose_key(sha256: str) -> str:
        return f"sha256/{sha256[:2]}/{sha256[2:]}"

    @staticmethod
    def _pack_key(name: str) -> str:
        return f"packs/{name}{packs.SUFFIX}"

    def _head(self, key: str) -> dict[str, Any] | None:
        try:
            return obstore.head(self._store, key)  # type: ignore[return-value]
        except NOT_FOUND:
            return None

    # -- loose blobs --------------------------------------------------------------------------
    def put_bytes(self, data: bytes) -> BlobInfo:
        sha256 = hashlib.sha256(data).hexdigest()
        self._loose_put(sha256, data)
        return BlobInfo(sha256, len(data), time.time())

    def put_file(self, path: str | os.PathLike[str]) -> BlobInfo:
        digest, size = hashlib.sha256(), 0
        with open(path, "rb") as f:
            while chunk := f.read(CHUNK):
                digest.update(chunk)
                size += len(chunk)
            sha256 = digest.hexdigest()
            f.seek(0)
            # Upload the file just hashed (callers hand over files they own and do not change meanwhile;
            # a read of the blob verifies it in any case).
            obstore.put(self._store, self._loose_key(sha256), f, chunk_size=16 << 20)
        return BlobInfo(sha256, size, time.time())

    def _loose_put(self, sha256: str, data: bytes) -> None:
        obstore.put(self._store, self._loose_key(sha256), data, use_multipart=len(data) > (64 << 20))

    def _loose_keep(self, sha256: str) -> bool:
        return False  # see the module doc: a loose put always uploads

    def _loose_info(self, sha256: str) -> BlobInfo | None:
        meta = self._head(self._loose_key(check_sha256(sha256)))
        return None if meta is None else BlobInfo(sha256, meta["size"], meta["last_modified"].timestamp())

    def _loose_read(self, sha256: str) -> bytes | None:
        try:
            return bytes(obstore.get(self._store, self._loose_key(sha256)).bytes())
        except NOT_FOUND:
            return None

    def _loose_open(self, sha256: str) -> BinaryIO | None:
        try:
            result = obstore.get(self._store, self._loose_key(sha256))
        except NOT_FOUND:
            return None
        return _StreamReader(iter(result.stream(min_chunk_size=CHUNK)))  # type: ignore[return-value]

    def delete(self, sha256: str) -> bool:
        key = self._loose_key(check_sha256(sha256))
        if self._head(key) is None:
            return False
        obstore.delete(self._store, key)
        return True

    def iter_loose(self) -> Iterator[BlobInfo]:
        for batch in obstore.list(self._store, prefix="sha256", chunk_size=1000):
            for meta in batch:
                parts = meta["path"].split("/")
                sha256 = "".join(parts[-2:])
                if len(parts) >= 3 and len(parts[-2]) == 2 and SHA256_RE.fullmatch(sha256):
                    yield BlobInfo(sha256, meta["size"], meta["last_modified"].timestamp())

    # -- packs ------------------------------------------------------------------------------------
    def _pack_names(self) -> dict[str, float]:
        out = {}
        for batch in obstore.list(self._store, prefix="packs", chunk_size=1000):
            for meta in batch:
                file = meta["path"].rsplit("/", 1)[-1]
                name = file.removesuffix(packs.SUFFIX)
                if file.endswith(packs.SUFFIX) and SHA256_RE.fullmatch(name):
                    out[name] = meta["last_modified"].timestamp()
        return out

    def _pack_read(self, name: str, offset: int, size: int) -> bytes:
        if size == 0:
            return b""
        try:
            return bytes(obstore.get_range(self._store, self._pack_key(name), start=offset, length=size))
        except NOT_FOUND:
            raise FileNotFoundError(self._pack_key(name)) from None

    def _pack_tail(self, name: str, size: int) -> bytes:
        try:
            result = obstore.get(self._store, self._pack_key(name), options={"range": {"suffix": size}})
        except NOT_FOUND:
            raise FileNotFoundError(self._pack_key(name)) from None
        return bytes(result.bytes())

    def pack_mtime(self, name: str) -> float | None:
        meta = self._head(self._pack_key(name))
        return None if meta is None else meta["last_modified"].timestamp()

    def _pack_touch(self, name: str) -> None:
        pass  # see the module doc

    def _pack_delete(self, name: str) -> None:
        with contextlib.suppress(*NOT_FOUND):
            obstore.delete(self._store, self._pack_key(name))

    def _pack_begin(self) -> tuple[BinaryIO, object]:
        return tempfile.TemporaryFile(prefix="mint-pack-"), None

    def _pack_commit(self, file: BinaryIO, token: object, name: str) -> None:
        with file:
            size = file.tell()
            file.seek(0)
            obstore.put(self._store, self._pack_key(name), file, use_multipart=size > (32 << 20),
                        chunk_size=16 << 20)

    def _pack_abort(self, file: BinaryIO, token: object) -> None:
        file.close()

    def remove_stale_temp(self, older_than: float) -> int:
        return 0  # no temp objects: a PUT is atomic


class _StreamReader(io.RawIOBase):
    """A raw file over an iterator of byte chunks (an obstore GET stream)."""

    def __init__(self, chunks: Iterator[Any]) -> None:
        self._chunks = chunks
        self._buffer = memoryview(b"")

    def readable(self) -> bool:
        return True

    def readinto(self, buffer) -> int:  # type: ignore[no-untyped-def]
        while not self._buffer:
            try:
                self._buffer = memoryview(bytes(next(self._chunks)))
            except StopIteration:
                return 0
        n = min(len(buffer), len(self._buffer))
        buffer[:n] = self._buffer[:n]
        self._buffer = self._buffer[n:]
        return n
