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


def _pack_paths(store: LocalBlobStore) -> list[Path]:
    return sorted((store.root / "packs").glob("*.pack"))


def test_put_many_writes_one_pack_read_by_any_process(tmp_path: Path) -> None:
    store = LocalBlobStore(tmp_path / "blobs")
    datas = [os.urandom(1000 + i) for i in range(40)] + [b"twice", b"twice"]
    infos = store.put_many(datas)
    assert [i.sha256 for i in infos] == [hashlib.sha256(d).hexdigest() for d in datas]
    assert len(_pack_paths(store)) == 1 and list((store.root / "sha256").iterdir()) == []  # one file, no loose blobs
    assert list((store.root / "tmp").iterdir()) == []
    other = LocalBlobStore(tmp_path / "blobs")  # another process's view: finds the pack by listing
    for data, info in zip(datas, infos, strict=True):
        assert other.read(info.sha256) == data and other.exists(info.sha256)
        assert other.stat(info.sha256).size == len(data)
        with other.open(info.sha256) as stream:
            assert stream.read() == data
    other.copy_to(infos[3].sha256, tmp_path / "copy")
    assert (tmp_path / "copy").read_bytes() == datas[3]
    assert len(list(other.iter())) == 41  # each content once
    assert other.missing([infos[0].sha256, "0" * 64]) == {"0" * 64}
    # Content already stored, loose or packed, is not written again.
    loose = store.put_bytes(b"loose one").sha256
    store.put_many([*datas, b"loose one"])
    assert len(_pack_paths(store)) == 1 and store.path(loose).is_file()
    # A big blob goes loose rather than into a pack.
    store.pack_bytes = 4096
    big = store.put_many([os.urandom(2048)])[0].sha256
    assert store.path(big).is_file() and len(_pack_paths(store)) == 1


def test_corrupt_packed_blob_and_pack_index_are_detected(tmp_path: Path) -> None:
    store = LocalBlobStore(tmp_path / "blobs")
    datas = [os.urandom(5000) for _ in range(3)]
    shas = [i.sha256 for i in store.put_many(datas)]
    (pack,) = _pack_paths(store)
    raw = bytearray(pack.read_bytes())
    raw[8 + 5000 + 17] ^= 0x01  # a byte of the second blob
    pack.chmod(0o600)
    pack.write_bytes(bytes(raw))
    fresh = LocalBlobStore(tmp_path / "blobs")
    assert fresh.read(shas[0]) == datas[0]
    with pytest.raises(IntegrityError, match=f"blob sha256:{shas[1]} is corrupt"):
        fresh.read(shas[1])
    with pytest.raises(IntegrityError, match=shas[1]):
        fresh.copy_to(shas[1], tmp_path / "copy")
    assert not (tmp_path / "copy").exists()
    # A bulk put of the right content does not rely on the corrupt copy: it writes a good one.
    fresh.put_many([datas[1]])
    assert fresh.read(shas[1]) == datas[1]
    # A damaged index (the pack's name is its index's sha256) is refused when the pack is loaded.
    raw[-60] ^= 0x01
    pack.write_bytes(bytes(raw))
    with pytest.raises(IntegrityError, match="corrupt index"):
        LocalBlobStore(tmp_path / "blobs").read(shas[0])


def test_gc_drops_dead_packs_and_repacks_mostly_dead_ones(catalog: Catalog) -> None:
    from mint_server.catalog import seed as seeding

    store = catalog.blobs
    config = b'{"peft_type": "LORA", "r": 1}'
    weights = [b"w" * 4096 + i.to_bytes(4, "little") for i in range(10)]
    store.put_many([*weights, config])  # one pack; two of its adapters get referenced below
    dead = store.put_many([b"orphan-a" * 100, b"orphan-b" * 100])
    seeding.seed(catalog, 2, owner="o", prefix="kept-",
                 payload_for=lambda i: {"adapter_config.json": config, "adapter_model.safetensors": weights[i]})
    for path in _pack_paths(store):
        _age(path, 7200)
    young = store.put_many([b"young-a" * 100, b"young-b" * 100])
    referenced = {hashlib.sha256(b).hexdigest() for b in (config, weights[0], weights[1])}

    dry = gc.collect(catalog, grace_seconds=3600, dry_run=True)
    assert dry.removed == 8 + 2 and len(_pack_paths(store)) == 3
    report = gc.collect(catalog, grace_seconds=3600)
    assert report.removed == 8 + 2 and report.freed_bytes == 8 * 4100 + 1600
    assert {b.sha256 for b in store.iter()} == referenced | {i.sha256 for i in young}
    for info in dead:
        assert not store.exists(info.sha256)
    for name in ("kept-000000000", "kept-000000001"):
        catalog.verify(catalog.resolve("o", name))  # the referenced blobs were rewritten before the pack went
    assert gc.collect(catalog, grace_seconds=3600).removed == 0


def test_pack_index_finds_live_copies_across_merges() -> None:
    from mint_server.catalog import packs

    index = packs.PackIndex()
    shas = [hashlib.sha256(str(i).encode()).hexdigest() for i in range(70_000)]
    index.add("a" * 64, [packs.PackEntry(s, 8 + i, 1) for i, s in enumerate(shas[:40_000])])
    index.add("b" * 64, [packs.PackEntry(s, 8 + i, 2) for i, s in enumerate(shas[30_000:])])  # 10K in both
    assert index.find(shas[5]) == packs.Located("a" * 64, 13, 1)
    assert index.find(shas[60_000]) == packs.Located("b" * 64, 8 + 30_000, 2)
    assert index.find(shas[35_000]).pack in {"a" * 64, "b" * 64}  # in both packs
    index.drop("b" * 64)
    assert index.find(shas[35_000]) == packs.Located("a" * 64, 8 + 35_000, 1)  # the live copy
    assert index.find(shas[60_000]) is None and index.find("0" * 64) is None
    index.compact()  # all in the sorted arrays, the dropped pack's entries left out
    assert index.nbytes() == 40_000 * 48
    assert index.find(shas[39_999]).pack == "a" * 64 and index.packs() == {"a" * 64}
