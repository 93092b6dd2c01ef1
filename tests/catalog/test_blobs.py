"""The content-addressed blob store and blob GC."""

from __future__ import annotations

import hashlib
import os
import time
from pathlib import Path

import pytest

from mint_server.catalog import Catalog, IntegrityError, InvalidArgument, LocalBlobStore, gc
from tests.catalog.helpers import BASE_MODEL, write_peft


def test_put_read_dedupe(tmp_path: Path) -> None:
    store = LocalBlobStore(tmp_path / "blobs")
    data = os.urandom(3 << 20)
    sha = hashlib.sha256(data).hexdigest()
    info = store.put_bytes(data)
    assert (info.sha256, info.size) == (sha, len(data))
    assert store.path(sha) == tmp_path / "blobs" / "sha256" / sha[:2] / sha[2:]
    source = tmp_path / "f"
    source.write_bytes(data)
    assert store.put_file(source).sha256 == sha
    assert [b.sha256 for b in store.iter()] == [sha]  # stored once
    assert list((tmp_path / "blobs" / "tmp").iterdir()) == []  # no temp files left behind
    assert store.read(sha) == data
    with store.open(sha) as stream:
        assert stream.read() == data
    store.copy_to(sha, tmp_path / "copy")
    assert (tmp_path / "copy").read_bytes() == data
    assert store.exists(sha) and store.delete(sha) and not store.exists(sha) and not store.delete(sha)


def test_corruption_is_detected_on_every_read_path(tmp_path: Path) -> None:
    store = LocalBlobStore(tmp_path / "blobs")
    data = os.urandom(1 << 20)
    sha = store.put_bytes(data).sha256
    path = store.path(sha)
    corrupt = bytearray(data)
    corrupt[12345] ^= 0x80
    path.write_bytes(bytes(corrupt))

    with pytest.raises(IntegrityError, match=f"blob sha256:{sha} is corrupt"):
        store.read(sha)
    with pytest.raises(IntegrityError, match=sha), store.open(sha) as stream:
        stream.read()
    with pytest.raises(IntegrityError, match=sha):
        store.copy_to(sha, tmp_path / "copy")
    assert not (tmp_path / "copy").exists() and list(tmp_path.glob(".copy*")) == []
    # A put of the right content repairs the stored copy.
    store.put_bytes(data)
    assert store.read(sha) == data


def test_bad_sha_is_rejected(tmp_path: Path) -> None:
    store = LocalBlobStore(tmp_path / "blobs")
    for bad in ("abc", "../" + "0" * 61, "A" * 64):
        with pytest.raises(InvalidArgument):
            store.exists(bad)
    with pytest.raises(IntegrityError, match="missing"):
        store.read("0" * 64)


def _age(path: Path, seconds: float) -> None:
    old = time.time() - seconds
    os.utime(path, (old, old))


def test_gc_removes_only_unreferenced_blobs(catalog: Catalog, tmp_path: Path) -> None:
    store = catalog.blobs
    r1 = catalog.publish_revision("o", "p", write_peft(tmp_path / "a", 1), base_model=BASE_MODEL)
    r2 = catalog.publish_revision("o", "p", write_peft(tmp_path / "b", 2), base_model=BASE_MODEL)
    orphan = store.put_bytes(b"left behind by a crashed publish").sha256
    for blob in store.iter():
        _age(store.path(blob.sha256), 7200)
    in_flight = store.put_bytes(b"just written, publish not committed yet").sha256
    stale_tmp, young_tmp = store.root / "tmp" / "put-stale", store.root / "tmp" / "put-young"
    stale_tmp.write_bytes(b"x")
    young_tmp.write_bytes(b"y")
    _age(stale_tmp, 7200)

    dry = gc.collect(catalog, grace_seconds=3600, dry_run=True)
    assert (dry.removed, dry.temp_removed) == (1, 0) and store.exists(orphan)

    report = gc.collect(catalog, grace_seconds=3600)
    assert (report.removed, report.temp_removed) == (1, 1)
    assert report.freed_bytes == len(b"left behind by a crashed publish")
    assert not store.exists(orphan) and store.exists(in_flight)
    assert not stale_tmp.exists() and young_tmp.exists()
    for revision in (r1, r2):
        catalog.verify(revision)
    # Re-putting an old blob restarts its grace period.
    store.put_bytes(b"left behind by a crashed publish")
    assert gc.collect(catalog, grace_seconds=3600).removed == 0
