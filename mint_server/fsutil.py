"""Crash-safe writes: temp file or dir beside the target, fsync, rename, fsync the parent.

A reader sees the old file (or dir) or the new one, never half of one.
"""

from __future__ import annotations

import errno
import json
import os
import re
import shutil
import tempfile
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

TRASH_PREFIX = ".trash-"  # what publish_dir names a dir it is replacing, until the new one is in place
# Out of room: no space on the device, over quota, or past the process's file-size limit (ulimit -f).
FULL_ERRNOS = frozenset({errno.ENOSPC, errno.EDQUOT, errno.EFBIG})
# The filesystem refuses every write: mounted read-only, or remounted so by the kernel after I/O errors.
READ_ONLY_ERRNOS = frozenset({errno.EROFS})


class DiskFull(OSError):
    """A durable write ran out of room. Raised by the writers below after they removed their temp
    copy, so nothing partial was kept and the old file or dir (if any) is still whole."""

    def __str__(self) -> str:
        return str(self.strerror)


class ReadOnlyStorage(DiskFull):
    """A durable write was refused because the data dir's filesystem is read-only. A kind of
    DiskFull (507: the server cannot store what the request writes), raised the same way: after the
    writer removed what it could, so nothing partial was kept."""


def _full_errno(error: BaseException) -> int | None:
    no_room = FULL_ERRNOS | READ_ONLY_ERRNOS
    if isinstance(error, OSError):
        return error.errno if error.errno in no_room else None
    # safetensors reports I/O failures as SafetensorError("... (os error 28)"), without an errno.
    found = re.search(r"\(os error (\d+)\)", str(error))
    code = int(found.group(1)) if found else None
    return code if code in no_room else None


@contextmanager
def full_disk_named(what: str | os.PathLike) -> Iterator[None]:
    """Turn running out of room while writing `what` into one clear DiskFull. Nested, the outermost
    name wins: it says what the caller was doing (a checkpoint), not which temp file filled up."""
    try:
        yield
    except Exception as e:
        code = _full_errno(e)
        if code is None:
            raise
        cause = e.__cause__ if isinstance(e, DiskFull) else e
        if code in READ_ONLY_ERRNOS:
            raise ReadOnlyStorage(code, f"cannot write {what}: the data dir is read-only ({os.strerror(code)}); "
                                        "nothing of it was kept (make it writable, then retry)") from cause
        raise DiskFull(code, f"not enough room to write {what}: {os.strerror(code)}; nothing of it was kept "
                             "(free disk space, then retry)") from cause


def fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def atomic_write_bytes(path: str | os.PathLike, data: bytes, mode: int = 0o644) -> None:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with full_disk_named(path.name), os.fdopen(fd, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.chmod(tmp, mode)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    fsync_dir(path.parent)


def atomic_write_json(path: Path, obj: Any) -> None:
    atomic_write_bytes(path, json.dumps(obj, indent=1, sort_keys=True).encode())


def read_json(path: Path) -> Any:
    return json.loads(path.read_text())


def new_staging_dir(parent: Path, prefix: str = ".staging-") -> Path:
    """An empty dir next to its final place, so moving it there is one rename on one filesystem."""
    with full_disk_named(f"into {parent}"):  # a read-only or full data dir says so, not a bare OSError
        parent.mkdir(parents=True, exist_ok=True)
        return Path(tempfile.mkdtemp(dir=parent, prefix=prefix))


def publish_dir(staging: Path, final: Path) -> None:
    """fsync a fully written dir and move it into place, replacing any old one."""
    for root, _dirs, files in os.walk(staging):
        for name in files:
            with open(Path(root) / name, "rb") as f:
                os.fsync(f.fileno())
    fsync_dir(staging)
    if final.exists():
        # Two renames: a crash between them leaves the old dir as trash, which
        # recover_replaced_dir puts back.
        trash = final.with_name(f"{TRASH_PREFIX}{final.name}-{os.getpid()}")
        shutil.rmtree(trash, ignore_errors=True)
        os.replace(final, trash)
        try:
            os.replace(staging, final)
        except BaseException:
            os.replace(trash, final)
            raise
        shutil.rmtree(trash, ignore_errors=True)
    else:
        os.replace(staging, final)
    fsync_dir(final.parent)


def recover_replaced_dir(final: Path) -> bool:
    """Put back the old dir of a publish_dir that was cut short between its two renames (`final`
    missing, its predecessor still whole under the trash name). Call before the parent's leftovers
    are removed; returns whether `final` now exists."""
    if final.exists():
        return True
    # The pid suffix is digits: ".trash-a-1-7" is a trash of "a-1", never of "a".
    name = re.compile(rf"{re.escape(TRASH_PREFIX + final.name)}-\d+")
    siblings = final.parent.iterdir() if final.parent.is_dir() else iter(())
    trash = sorted((p for p in siblings if name.fullmatch(p.name)), key=lambda p: p.stat().st_mtime)
    if not trash:
        return False
    os.replace(trash[-1], final)
    fsync_dir(final.parent)
    return True


def atomic_write_dir(path: str | os.PathLike, fill: Callable[[Path], None]) -> None:
    """Build a directory with `fill(tmp_dir)`, then publish it at `path` (replacing any old one)."""
    path = Path(path)
    staging = new_staging_dir(path.parent, prefix=f".{path.name}.")
    try:
        with full_disk_named(path.name):
            fill(staging)
            publish_dir(staging, path)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise


def write_content_dir(path: str | os.PathLike, fill: Callable[[Path], None]) -> None:
    """Build a content-addressed directory (its name is a digest of what it holds) with
    `fill(tmp_dir)` and move it to `path` unless it is already there. Several writers (threads,
    processes, nodes on a shared mount) may race to create the same one: the first rename wins,
    and a later writer verifies that what is there holds the same files, then drops its copy. A
    dir that is there is never replaced, so no reader ever sees it missing."""
    path = Path(path)
    staging = new_staging_dir(path.parent, prefix=f".{path.name}.")
    try:
        with full_disk_named(path.name):
            fill(staging)
        for f in staging.iterdir():
            with open(f, "rb") as fh:
                os.fsync(fh.fileno())
        fsync_dir(staging)
        try:
            os.rename(staging, path)  # fails on a non-empty existing dir (ENOTEMPTY / EEXIST)
        except OSError:
            if not path.is_dir():
                raise
            if not _same_files(staging, path):
                raise OSError(f"{path} already holds different content under the same digest") from None
            shutil.rmtree(staging, ignore_errors=True)
            return
        fsync_dir(path.parent)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise


def _same_files(a: Path, b: Path) -> bool:
    names = sorted(p.name for p in a.iterdir())
    return names == sorted(p.name for p in b.iterdir()) and all(
        (a / n).read_bytes() == (b / n).read_bytes() for n in names)


def dir_size(path: Path) -> int:
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file())
