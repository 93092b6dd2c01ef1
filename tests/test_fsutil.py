"""Content-addressed directory writes under a race: every writer reaches its rename at once (a
barrier inside `fill`), the first one wins, the others verify and drop their copies."""

from __future__ import annotations

import threading
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from mint_server.fsutil import write_content_dir

WRITERS = 8
FILES = {"adapter_config.json": b'{"r": 2}', "adapter_model.safetensors": b"\x00" * 1000}


def test_racing_writers_of_one_content_dir_all_succeed(tmp_path: Path) -> None:
    final = tmp_path / "ab12"
    barrier = threading.Barrier(WRITERS)

    def fill(d: Path) -> None:
        for name, data in FILES.items():
            (d / name).write_bytes(data)
        barrier.wait(timeout=30)  # all staged: the renames now race

    with ThreadPoolExecutor(WRITERS) as pool:
        for f in [pool.submit(write_content_dir, final, fill) for _ in range(WRITERS)]:
            f.result()
    assert {p.name: p.read_bytes() for p in final.iterdir()} == FILES
    assert [p.name for p in tmp_path.iterdir()] == ["ab12"]  # no staging copy left behind


def test_an_existing_dir_is_kept_and_different_content_is_an_error(tmp_path: Path) -> None:
    final = tmp_path / "cd34"
    write_content_dir(final, lambda d: (d / "a").write_bytes(b"one"))
    inode = final.stat().st_ino
    write_content_dir(final, lambda d: (d / "a").write_bytes(b"one"))
    assert final.stat().st_ino == inode  # never replaced: a reader never sees it missing
    with pytest.raises(OSError, match="different content"):
        write_content_dir(final, lambda d: (d / "a").write_bytes(b"two"))
    assert (final / "a").read_bytes() == b"one" and [p.name for p in tmp_path.iterdir()] == ["cd34"]
