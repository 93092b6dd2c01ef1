"""Bulk writes: `mint catalog seed --servable` and `mint catalog import-many` write a batch at a time
(one pack of blobs, one transaction), share identical content, and finish after a kill -9 when run
again: real subprocesses, killed with SIGKILL mid-run, then resumed through the real CLI."""

from __future__ import annotations

import json
import random
import subprocess
import time
from pathlib import Path

import pytest

from mint_server.catalog import Catalog, gc, payload
from mint_server.cli.sweep import servable_payloads
from tests.catalog.helpers import WORKER, python, subprocess_env, write_peft
from tests.catalog.test_cli import run
from tests.catalog.test_durability import _read_line
from tests.catalog.worker import OWNER
from tests.tiny import make_tiny_checkpoint


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_checkpoint(tmp_path_factory.mktemp("tiny") / "llama", "llama", tie=True)


def _expected_sha(payload_for, index: int) -> str:  # type: ignore[no-untyped-def]
    files = payload_for(index)
    entries = [payload.ManifestEntry(n, payload.hashlib.sha256(d).hexdigest(), len(d)) for n, d in files.items()]
    return payload.manifest_sha256(entries)


def _packed(catalog: Catalog) -> list[str]:
    return [e.sha256 for p in catalog.blobs.iter_packs() for e in p.blobs]


def test_second_servable_seed_with_another_prefix_shares_blobs(tiny: Path, tmp_path: Path) -> None:
    data = tmp_path / "data"
    common = ["--servable", "--base-model", str(tiny), "--data-dir", str(data), "--owner", "bench", "--json"]
    first = json.loads(run("catalog", "seed", "--policies", "6", "--prefix", "a-", *common).stdout)
    with Catalog.open(data_dir=data) as catalog:
        blobs_after_first = sorted(b.sha256 for b in catalog.blobs.iter())
    # The same indices under another prefix: the same content, which used to fail with
    # UNIQUE constraint failed: catalog_manifest_entries.manifest_sha256, …name.
    second = json.loads(run("catalog", "seed", "--policies", "6", "--prefix", "b-", *common).stdout)
    assert (first["policies"], second["policies"]) == (6, 6)
    with Catalog.open(data_dir=data) as catalog:
        assert sorted(b.sha256 for b in catalog.blobs.iter()) == blobs_after_first  # nothing written twice
        for i in range(6):
            a, b = (catalog.resolve("bench", f"{p}{i:09d}@prod") for p in ("a-", "b-"))
            assert a.sha256 == b.sha256 and a.id != b.id
            catalog.verify(b)
        assert len({catalog.resolve("bench", f"a-{i:09d}").sha256 for i in range(6)}) == 6  # distinct adapters
    # The prefix continues with new content; --resume tops it up to a total.
    more = json.loads(run("catalog", "seed", "--policies", "10", "--prefix", "a-", "--resume", *common).stdout)
    assert (more["policies"], more["first_name"], more["last_name"]) == (4, "a-000000006", "a-000000009")
    assert json.loads(run("catalog", "seed", "--policies", "10", "--prefix", "a-", "--resume", *common).stdout)[
        "policies"] == 0


@pytest.mark.parametrize("mode", ["seed", "import"])
def test_bulk_write_killed_mid_run_finishes_when_run_again(
    mode: str, db_url: str, data_dir: Path, tmp_path: Path, tiny: Path
) -> None:
    total, batch = 60, 4
    name, _, payload_for = servable_payloads(tiny, 1)
    root = tmp_path / "adapters"
    if mode == "seed":
        args = ["seed", db_url, str(data_dir), str(tiny), "k-", str(total), str(batch)]
        names = [f"k-{i:09d}" for i in range(total)]
        expected = {n: _expected_sha(payload_for, i) for i, n in enumerate(names)}
    else:
        for i in range(total):
            write_peft(root / f"{i:03d}", seed=i, extra_bytes=20_000)
        args = ["import", db_url, str(data_dir), str(root), str(batch)]
        names = [f"imp-{i:03d}" for i in range(total)]
        expected = {n: payload.manifest_sha256(payload.hash_dir(sorted((root / n[4:]).iterdir())))
                    for n in names}
    proc = subprocess.Popen([python(), str(WORKER), *args], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, env=subprocess_env())
    try:
        _read_line(proc)  # a batch committed
        time.sleep(random.Random(11).uniform(0, 0.03))  # land anywhere in a later one
    finally:
        proc.kill()  # SIGKILL: no cleanup handlers run
        proc.wait(timeout=30)

    with Catalog.open(db_url, data_dir=data_dir) as catalog:  # what the kill left: whole batches only
        policies = [p.name for p in catalog.list_policies(OWNER, limit=1000).items]
        assert len(policies) % batch == 0 and policies == names[: len(policies)]
    # Run again through the real CLI: it finishes the job.
    common = ["--db-url", db_url, "--data-dir", str(data_dir), "--owner", OWNER, "--json",
              "--batch-size", str(batch)]
    if mode == "seed":
        out = json.loads(run("catalog", "seed", "--servable", "--base-model", str(tiny), "--prefix", "k-",
                             "--policies", str(total), "--resume", *common).stdout)
        assert out["policies"] == total - len(policies)
    else:
        out = json.loads(run("catalog", "import-many", str(root), "--prefix", "imp-", *common).stdout)
        assert (out["imported"], out["skipped"]) == (total - len(policies), len(policies))

    with Catalog.open(db_url, data_dir=data_dir) as catalog:
        assert [p.name for p in catalog.list_policies(OWNER, limit=1000).items] == names
        referenced = set()
        for n in names:
            (rev,) = catalog.list_revisions(OWNER, n).items  # exactly one revision each: nothing done twice
            assert rev.sha256 == expected[n]
            catalog.verify(rev)
            referenced |= {e.sha256 for e in catalog.manifest(rev)}
        packed = _packed(catalog)
        assert len(packed) == len(set(packed))  # a cut-off batch's pack was reused, not written again
        report = gc.collect(catalog, grace_seconds=0)  # what a kill left (a partial pack, an unused one) goes
        assert {b.sha256 for b in catalog.blobs.iter()} == referenced
        assert list((data_dir / "blobs" / "tmp").iterdir()) == [] and report.kept == len(referenced)
        for n in names:
            catalog.verify(catalog.resolve(OWNER, n))
