"""The data dir turning read-only under a running `mint serve` (as a filesystem does when it is
remounted read-only after I/O errors), and a real full device (a tiny tmpfs).

Tests run as root, where chmod stops no write, so the read-only case is a real read-only mount:
the data dir is a bind mount of itself, remounted read-only (`mount -o remount,bind,ro`) while the
server runs. The full case is a tmpfs of a few MiB, filled up by the test. Both need
CAP_SYS_ADMIN (mount); where it is missing the tests skip (tests/service/test_disk_full.py covers a
full disk everywhere, with the file-size limit).

Either way: saves fail with a clear 507 naming the checkpoint, nothing half-written is left (no
checkpoint, revision, staging dir or temp file), the server keeps serving reads (listing, sampling
a published revision), and once the data dir is writable again the same saves work."""

from __future__ import annotations

import os
import subprocess
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

import httpx
import pytest
import tinker
from tinker import types

from tests.service.live import KEY_A, ServeProcess, train

HEADERS = {"X-API-Key": KEY_A}
PARAMS = types.SamplingParams(max_tokens=2, temperature=0.0, stop=[])
PROMPT = types.ModelInput.from_ints([5, 6])
READY_S = 900.0  # a bound on start-up, not a wait: generous for a shared 2-core machine


def _mount(*args: str) -> None:
    subprocess.run(["mount", *args], check=True, capture_output=True, text=True, timeout=30)


def _umount(path: Path) -> None:
    subprocess.run(["umount", "-l", str(path)], capture_output=True, timeout=30)


@contextmanager
def _mounted(*args: str, at: Path) -> Iterator[None]:
    at.mkdir(parents=True, exist_ok=True)
    try:
        _mount(*args, str(at))
    except (OSError, subprocess.CalledProcessError) as e:
        pytest.skip(f"cannot mount here ({getattr(e, 'stderr', e)!s}): needs root with CAP_SYS_ADMIN")
    try:
        yield
    finally:
        _umount(at)


def files_under(root: Path) -> set[str]:
    return {
        str(p.relative_to(root))
        for p in root.rglob("*")
        if p.is_file() and not p.name.startswith("catalog.db")
    }


def _checkpoints(url: str, run_id: str) -> list[str]:
    listed = httpx.get(f"{url}/api/v1/training_runs/{run_id}/checkpoints", headers=HEADERS, timeout=60).json()
    return sorted(c["checkpoint_id"] for c in listed["checkpoints"])


def _revisions(url: str, policy: str) -> list[int]:
    got = httpx.get(f"{url}/api/v1/mint/catalog/policies/{policy}/revisions", headers=HEADERS, timeout=60)
    return [r["number"] for r in got.json()["items"]]


def _saves_fail_cleanly_then_work(
    server: ServeProcess, data: Path, cut: Callable[[], object], restore: Callable[[], object], why: str
) -> None:
    client = tinker.ServiceClient(base_url=server.url, api_key=KEY_A)
    base = client.get_server_capabilities().supported_models[0].model_name
    tc = client.create_lora_training_client(base_model=base, rank=32, user_metadata={"policy": "ro"}).result()
    train(tc, 1)
    first = tc.save_weights_for_sampler("s0").result().path  # revision 1, before the cut
    published = client.create_sampling_client(model_path="tinker://ro@1").result()
    want = published.sample(PROMPT, 1, PARAMS).result().sequences[0].tokens
    train(tc, 1)
    before = files_under(data)

    cut()
    try:
        for save, name in ((tc.save_state, "w1"), (tc.save_weights_for_sampler, "s1")):
            with pytest.raises(tinker.RequestFailedError, match=why.format(name=name)):
                save(name).result()
        # Reads go on: listings, the published revision, the base model.
        assert _checkpoints(server.url, tc.model_id) == ["sampler_weights/s0"]
        assert _revisions(server.url, "ro") == [1]
        assert published.sample(PROMPT, 1, PARAMS).result().sequences[0].tokens == want
        fresh = client.create_sampling_client(model_path=first).result()
        assert fresh.sample(PROMPT, 1, PARAMS).result().sequences[0].tokens == want
        sampler = client.create_sampling_client(base_model=base).result()
        assert len(sampler.sample(PROMPT, 1, PARAMS).result().sequences[0].tokens) == 2
        train(tc, 1)  # training itself writes nothing
    finally:
        restore()
    assert files_under(data) == before  # no staging dir, temp file, record or blob left behind

    tc.save_state("w1").result()
    path = tc.save_weights_for_sampler("s1").result().path
    assert _checkpoints(server.url, tc.model_id) == ["sampler_weights/s0", "sampler_weights/s1", "weights/w1"]
    assert _revisions(server.url, "ro") == [2, 1]
    client.create_sampling_client(model_path=path).result().sample(PROMPT, 1, PARAMS).result()
    client.close("success")
    assert not [p for p in data.rglob("*") if p.name.startswith((".staging", ".trash")) or p.suffix == ".tmp"]


def test_read_only_data_dir_refuses_saves_and_keeps_serving(tiny_dir: Path, tmp_path: Path) -> None:
    data = tmp_path / "data"
    data.mkdir()
    with _mounted("--bind", str(data), at=data):
        # The catalog database elsewhere (as on PostgreSQL): a bind mount cannot be remounted
        # read-only while a process holds a file in it open for writing (EBUSY), as SQLite does.
        db_url = f"sqlite:///{tmp_path / 'catalog.db'}"
        with ServeProcess(
            "--base-model",
            str(tiny_dir),
            "--data-dir",
            str(data),
            "--db-url",
            db_url,
            "--device-slots",
            "4",
            ready_timeout_s=READY_S,
        ) as server:
            _saves_fail_cleanly_then_work(
                server, data,
                cut=lambda: _mount("-o", "remount,bind,ro", str(data)),
                restore=lambda: _mount("-o", "remount,bind,rw", str(data)),
                why=r"cannot write (checkpoint \w+/{name}|into \S+): the data dir is read-only .*; nothing of it was kept",
            )  # fmt: skip
            server.stop()


def test_full_device_refuses_saves_and_keeps_serving(tiny_dir: Path, tmp_path: Path) -> None:
    data = tmp_path / "data"
    filler = data / "filler"

    def fill() -> None:
        # Everything but a few KB: room for the catalog's small writes, not for a save.
        st = os.statvfs(data)
        with open(filler, "wb") as f:
            f.truncate(0)
            f.write(b"\0" * max(0, st.f_bavail * st.f_frsize - 64 * 1024))

    serve = ServeProcess("--base-model", str(tiny_dir), "--data-dir", str(data), "--device-slots", "4",
                         ready_timeout_s=READY_S)  # fmt: skip
    with _mounted("-t", "tmpfs", "-o", "size=48m", "tmpfs", at=data), serve as server:  # the catalog too
        _saves_fail_cleanly_then_work(
            server,
            data,
            cut=fill,
            restore=lambda: filler.unlink(),
            why=r"not enough room to write checkpoint \w+/{name}: .*; nothing of it was kept",
        )
        server.stop()


def test_read_only_errors_are_a_507_that_says_so() -> None:
    """EROFS from any durable write becomes ReadOnlyStorage (a DiskFull, so 507 and the same
    clean-up), naming what was being written; other errors pass through."""
    import errno

    from mint_server.api.http.statuses import status_for
    from mint_server.fsutil import DiskFull, ReadOnlyStorage, full_disk_named

    refused = pytest.raises(
        ReadOnlyStorage, match=r"cannot write checkpoint weights/w0: the data dir is read-only"
    )
    with refused as e, full_disk_named("checkpoint weights/w0"), full_disk_named("a blob"):
        raise OSError(errno.EROFS, os.strerror(errno.EROFS))
    assert isinstance(e.value, DiskFull) and status_for(e.value) == 507
    with pytest.raises(PermissionError), full_disk_named("x"):
        raise PermissionError(errno.EACCES, "denied")
