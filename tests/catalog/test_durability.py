"""Crash safety and cross-process concurrency, with real processes and real databases."""

from __future__ import annotations

import random
import subprocess
import threading
import time
from itertools import pairwise
from pathlib import Path

import pytest

from mint_server.catalog import Catalog, gc
from tests.catalog.helpers import BASE_MODEL, LORA, WORKER, python, subprocess_env, write_peft
from tests.catalog.test_catalog import walk
from tests.catalog.worker import OWNER


def _read_line(proc: subprocess.Popen) -> str:
    line = proc.stdout.readline()
    if not line:
        proc.wait(timeout=30)
        raise AssertionError(f"worker exited ({proc.returncode}): {proc.stderr.read()}")
    return line.strip()


def test_kill_during_publish_leaves_no_half_visible_revision(
    db_url: str, data_dir: Path, tmp_path: Path
) -> None:
    rng = random.Random(7)
    for cycle in range(3):
        work = tmp_path / f"work{cycle}"
        work.mkdir()
        proc = subprocess.Popen(
            [python(), str(WORKER), "publish", db_url, str(data_dir), "victim", str(work)],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            env=subprocess_env(),
        )
        try:
            for _ in range(2):
                _read_line(proc)
            time.sleep(rng.uniform(0, 0.03))  # land anywhere in the next publish
        finally:
            proc.kill()  # SIGKILL: no cleanup handlers run
            proc.wait(timeout=30)

    with Catalog.open(db_url, data_dir=data_dir) as catalog:
        revisions = walk(lambda **kw: catalog.list_revisions(OWNER, "victim", **kw), 100)
        numbers = sorted(r.number for r in revisions)
        assert numbers == list(range(1, len(numbers) + 1)) and len(numbers) >= 6
        for revision in revisions:
            catalog.verify(revision)  # every file of every visible revision is present and intact
        chain = walk(lambda **kw: catalog.lineage(OWNER, "victim", **kw), 100)
        assert [r.number for r in chain] == numbers[::-1]  # one unbroken parent chain across the crashes
        # Blobs of killed publishes are unreferenced: GC takes them and nothing that is referenced.
        gc.collect(catalog, grace_seconds=0)
        for revision in revisions:
            catalog.verify(revision)
        referenced = {e.sha256 for r in revisions for e in catalog.manifest(r)}
        assert {b.sha256 for b in catalog.blobs.iter()} == referenced
        latest = catalog.materialize(revisions[0], tmp_path / "latest")
        assert (latest / "adapter_model.safetensors").stat().st_size > 1 << 20


def test_concurrent_alias_moves_from_two_processes(db_url: str, data_dir: Path, tmp_path: Path) -> None:
    with Catalog.open(db_url, data_dir=data_dir) as catalog:
        for seed in range(3):
            peft = write_peft(tmp_path / f"p{seed}", seed)
            catalog.publish_revision(OWNER, "shared", peft, base_model=BASE_MODEL, lora_config=LORA)
        catalog.set_alias(OWNER, "shared", "prod", 1, actor="setup")

    go, moves = tmp_path / "go", 25
    procs = [
        subprocess.Popen(
            [
                python(),
                str(WORKER),
                "move",
                db_url,
                str(data_dir),
                "shared",
                "prod",
                str(moves),
                f"actor{i}",
                str(go),
            ],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            env=subprocess_env(),
        )
        for i in range(2)
    ]
    try:
        for proc in procs:
            assert _read_line(proc) == "ready"
        go.touch()
        for proc in procs:
            assert _read_line(proc) == "done"
            assert proc.wait(timeout=60) == 0, proc.stderr.read()
    finally:
        for proc in procs:
            proc.kill()

    with Catalog.open(db_url, data_dir=data_dir) as catalog:
        events = walk(lambda **kw: catalog.alias_history(OWNER, "shared", "prod", **kw), 20)[::-1]
        assert len(events) == 1 + 2 * moves
        assert sum(e.actor == "actor0" for e in events) == sum(e.actor == "actor1" for e in events) == moves
        # Serialized: every move starts where the previous one left the alias.
        for before, after in pairwise(events):
            assert after.from_revision == before.to_revision
        assert catalog.get_alias(OWNER, "shared", "prod").revision == events[-1].to_revision


def test_gc_racing_publishes_never_loses_a_referenced_blob(catalog: Catalog, tmp_path: Path) -> None:
    """GC with no grace period deletes freshly put blobs before their publish commits; the
    publisher must notice (under the shared lock) and put them again."""
    published = []
    done = threading.Event()

    def publisher() -> None:
        try:
            for i in range(12):
                peft = write_peft(tmp_path / f"race{i}", 100 + i)
                published.append(catalog.publish_revision(OWNER, "race", peft, base_model=BASE_MODEL))
        finally:
            done.set()

    thread = threading.Thread(target=publisher)
    thread.start()
    while not done.is_set():
        gc.collect(catalog, grace_seconds=0)
    thread.join()
    assert len(published) == 12
    for revision in published:
        catalog.verify(revision)


def test_a_full_database_rolls_back_and_says_so(tmp_path: Path) -> None:
    """SQLite's page cap (PRAGMA max_page_count) makes the database file really full: the write that
    does not fit fails as DiskFull, nothing of it is stored, and the catalog reads and writes on."""
    from sqlalchemy import event

    from mint_server.fsutil import DiskFull

    catalog = Catalog.open(data_dir=tmp_path)
    event.listen(catalog.engine, "connect", lambda conn, _rec: conn.execute("PRAGMA max_page_count = 40"))
    catalog.engine.dispose()  # reconnect under the cap
    made = 0
    with pytest.raises(DiskFull, match="not enough room to write the catalog database"):
        for made in range(10_000):  # noqa: B007 - `made` is read below
            catalog.create_policy("owner", f"p{made}", "base", None, {"pad": "x" * 2000})
    names = [p.name for p in catalog.list_policies("owner", limit=1000).items]
    assert sorted(names) == sorted(f"p{i}" for i in range(made))  # the failed one left nothing
    catalog.close()
    with Catalog.open(data_dir=tmp_path) as reopened:  # without the cap: room again
        reopened.create_policy("owner", "after", "base", None, {})
        assert len(reopened.list_policies("owner", limit=1000).items) == made + 1
