"""The S3 blob store against a real S3 API server on loopback (moto's standalone server): the same
contract as the local store, every read verified, packs shared between processes, and the catalog
(seed, publish, GC, the CLI's --store) on top of it."""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path

import pytest

from mint_server.catalog import Catalog, IntegrityError, InvalidArgument, gc
from mint_server.catalog import seed as seeding
from mint_server.catalog.stores import open_blob_store
from tests.catalog.helpers import BASE_MODEL, write_peft
from tests.catalog.test_cli import run

obstore = pytest.importorskip("obstore")


def _raw(url: str):  # the bucket as a plain obstore client sees it, to damage objects behind the store's back
    from obstore.store import S3Store

    return S3Store.from_url(url)


def test_s3_store_round_trip_seen_from_another_node(s3_url: str, tmp_path: Path) -> None:
    store = open_blob_store(s3_url, tmp_path / "unused")
    assert type(store).__name__ == "S3BlobStore" and store.url == s3_url
    small = store.put_bytes(b"config")
    big_data = os.urandom(3 << 20)
    (tmp_path / "big").write_bytes(big_data)
    big = store.put_file(tmp_path / "big")
    assert big.sha256 == hashlib.sha256(big_data).hexdigest()
    datas = [os.urandom(2000 + i) for i in range(30)]
    infos = store.put_many([*datas, datas[0]])
    assert len(list(obstore.list(_raw(s3_url), prefix="packs").collect())) == 1  # one PUT for the batch

    node2 = open_blob_store(s3_url, tmp_path / "unused")
    assert node2.read(small.sha256) == b"config" and node2.read(big.sha256) == big_data
    for data, info in zip(datas, infos, strict=False):
        assert node2.read(info.sha256) == data and node2.exists(info.sha256)
    with node2.open(big.sha256) as stream:
        assert stream.read() == big_data
    node2.copy_to(infos[5].sha256, tmp_path / "copy")
    assert (tmp_path / "copy").read_bytes() == datas[5]
    assert node2.stat(big.sha256).size == len(big_data)
    assert {b.sha256 for b in node2.iter()} == {small.sha256, big.sha256, *(i.sha256 for i in infos)}
    assert node2.missing([small.sha256, infos[0].sha256, "1" * 64]) == {"1" * 64}
    node2.put_many(datas)  # already stored: no second pack
    assert len(list(obstore.list(_raw(s3_url), prefix="packs").collect())) == 1
    assert node2.delete(small.sha256) and not store.exists(small.sha256) and not node2.delete(small.sha256)


def test_s3_corrupt_objects_are_detected(s3_url: str, tmp_path: Path) -> None:
    store = open_blob_store(s3_url, tmp_path / "unused")
    loose = os.urandom(1 << 20)
    sha = store.put_bytes(loose).sha256
    raw = _raw(s3_url)
    damaged = bytearray(loose)
    damaged[777] ^= 0x10
    obstore.put(raw, f"sha256/{sha[:2]}/{sha[2:]}", bytes(damaged))
    with pytest.raises(IntegrityError, match=f"blob sha256:{sha} is corrupt"):
        store.read(sha)
    with pytest.raises(IntegrityError, match=sha), store.open(sha) as stream:
        stream.read()
    with pytest.raises(IntegrityError, match=sha):
        store.copy_to(sha, tmp_path / "copy")
    assert not (tmp_path / "copy").exists()
    store.put_bytes(loose)  # a put uploads again: the good copy is back
    assert store.read(sha) == loose

    datas = [os.urandom(3000) for _ in range(3)]
    shas = [i.sha256 for i in store.put_many(datas)]
    (pack,) = [m["path"] for m in obstore.list(raw, prefix="packs").collect()]
    body = bytearray(obstore.get(raw, pack).bytes())
    body[8 + 3000 + 5] ^= 0x01  # inside the second blob
    obstore.put(raw, pack, bytes(body))
    node2 = open_blob_store(s3_url, tmp_path / "unused")
    assert node2.read(shas[0]) == datas[0] and node2.read(shas[2]) == datas[2]
    with pytest.raises(IntegrityError, match=f"blob sha256:{shas[1]} is corrupt"):
        node2.read(shas[1])


def test_bad_store_urls_are_refused(tmp_path: Path) -> None:
    for url in ("ftp://host/x", "s3:///no-bucket"):
        with pytest.raises(InvalidArgument) as e:
            open_blob_store(url, tmp_path)
        assert e.value.field == "store"


def test_catalog_seed_publish_gc_and_cli_on_s3(
    s3_url: str, s3_endpoint: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from tests.s3 import s3_env

    with Catalog.open(f"sqlite:///{tmp_path / 'c.db'}", data_dir=tmp_path / "data", store=s3_url) as catalog:
        payloads = {i: {"adapter_config.json": b'{"peft_type": "LORA", "r": 1}',
                        "adapter_model.safetensors": os.urandom(512)} for i in range(12)}
        result = seeding.seed(catalog, 12, owner="o", prefix="sv-", batch_size=5, payload_for=payloads.__getitem__)
        assert result.policies == 12
        assert len(list(obstore.list(_raw(s3_url), prefix="packs").collect())) == 3  # a pack per batch
        rev = catalog.publish_revision("o", "chat", write_peft(tmp_path / "p", 1), base_model=BASE_MODEL)
        for i in range(12):
            r = catalog.resolve("o", f"sv-{i:09d}@prod")
            assert catalog.read_payload(r) == payloads[i]
        catalog.verify(rev)
        catalog.blobs.put_many([b"orphan-1" * 50, b"orphan-2" * 50])  # a cut-off batch's pack
        report = gc.collect(catalog, grace_seconds=0)
        assert report.removed == 2
        for i in range(12):
            catalog.verify(catalog.resolve("o", f"sv-{i:09d}"))
        catalog.verify(rev)

    # The CLI selects the store by URL; endpoint and credentials come from the AWS_* variables.
    env_args = ["--data-dir", str(tmp_path / "cli"), "--store", s3_url, "--owner", "o", "--json"]
    for key, value in s3_env(s3_endpoint).items():  # the subprocess inherits them (subprocess_env copies os.environ)
        monkeypatch.setenv(key, value)
    seeded = json.loads(run("catalog", "seed", "--policies", "7", *env_args).stdout)
    assert seeded["policies"] == 7
    shown = json.loads(run("revision", "show", "synthetic-000000006@prod", *env_args).stdout)
    with Catalog.open(data_dir=tmp_path / "cli", store=s3_url) as catalog:
        catalog.verify(catalog.resolve("o", "synthetic-000000006"))
        assert catalog.resolve("o", "synthetic-000000006").sha256 == shown["sha256"]
