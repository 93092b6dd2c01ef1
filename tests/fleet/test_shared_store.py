"""Two Ray replicas on one machine share one S3 blob store (moto's S3 server on loopback) and one
catalog database: what one writes, the other reads (verified), and both writing the same content at
once stores it once. Each replica has its own data dir, so nothing reaches it but through the store."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import pytest

ray = pytest.importorskip("ray", reason="the fleet needs Ray: pip install 'mint-server[fleet]'")
pytest.importorskip("obstore")


def payload(index: int) -> dict[str, bytes]:
    rng = __import__("random").Random(index)
    return {"adapter_config.json": b'{"peft_type": "LORA", "r": 1}',
            "adapter_model.safetensors": bytes(rng.getrandbits(8) for _ in range(4096))}


class Replica:
    """A replica's view: its own process, its own Catalog and S3 client, its own data dir."""

    def __init__(self, env: dict[str, str], db_url: str, data_dir: str, store: str) -> None:
        os.environ.update(env)
        from mint_server.catalog import Catalog

        self.catalog = Catalog.open(db_url, data_dir=data_dir, store=store)

    def pid(self) -> int:
        return os.getpid()

    def seed(self, prefix: str, n: int) -> list[str]:
        from mint_server.catalog import seed as seeding

        result = seeding.seed(self.catalog, n, owner="fleet", prefix=prefix, batch_size=4, payload_for=payload)
        return [f"{prefix}{i:09d}" for i in range(n)] if result.policies == n else []

    def read(self, names: list[str]) -> dict[str, dict[str, bytes]]:
        return {n: self.catalog.read_payload(self.catalog.resolve("fleet", f"{n}@prod")) for n in names}

    def put_many(self, datas: list[bytes]) -> list[str]:
        return [info.sha256 for info in self.catalog.blobs.put_many(datas)]


@pytest.fixture(scope="module")
def local_ray() -> Any:
    ray.init(num_cpus=2, include_dashboard=False, object_store_memory=96 * 1024 * 1024, log_to_driver=False)
    yield ray
    ray.shutdown()


def test_two_replicas_share_one_s3_store(local_ray: Any, tmp_path: Path) -> None:
    from mint_server.catalog.stores import open_blob_store
    from tests.s3 import new_bucket, s3_env, s3_environ, s3_server

    with s3_server() as endpoint:
        store = f"s3://{new_bucket(endpoint)}/fleet"
        db_url = f"sqlite:///{tmp_path / 'catalog.db'}"  # one machine; a fleet on many nodes uses PostgreSQL
        actor = ray.remote(num_cpus=0)(Replica)
        a, b = (actor.remote(s3_env(endpoint), db_url, str(tmp_path / f"node-{i}"), store) for i in range(2))
        assert len(set(ray.get([a.pid.remote(), b.pid.remote()]))) == 2

        names = ray.get(a.seed.remote("wave-", 10))
        assert len(names) == 10
        seen_by_b = ray.get(b.read.remote(names))
        assert seen_by_b == {n: payload(i) for i, n in enumerate(names)}  # verified reads of A's packs

        shared = [os.urandom(3000) for _ in range(6)]
        from_a, from_b = ray.get([a.put_many.remote(shared), b.put_many.remote(shared)])
        assert from_a == from_b
        with s3_environ(endpoint):
            view = open_blob_store(store, tmp_path / "unused")
            assert [view.read(sha) for sha in from_a] == shared
            assert set(from_a) <= {b.sha256 for b in view.iter()}
        assert not (tmp_path / "node-0" / "blobs").exists() and not (tmp_path / "node-1" / "blobs").exists()
