"""PEFT directories as tar/zip archives, for export and upload over HTTP.

Archives hold the adapter files flat at the top level. Unpacking accepts that layout or one
wrapping directory, and refuses anything that could escape the destination or smuggle in
non-regular files (links, devices, absolute or `..` paths), or that unpacks to more than a limit.
"""

from __future__ import annotations

import os
import shutil
import tarfile
import zipfile
from pathlib import Path, PurePosixPath
from typing import Literal

from mint_server.catalog.errors import InvalidArgument

Format = Literal["tar", "zip"]
FORMATS: tuple[Format, ...] = ("tar", "zip")
MEDIA_TYPES: dict[Format, str] = {"tar": "application/x-tar", "zip": "application/zip"}
DEFAULT_MAX_BYTES = 16 << 30


def pack(src_dir: str | os.PathLike[str], dest: str | os.PathLike[str], fmt: Format = "tar") -> Path:
    """Archive the regular files directly inside `src_dir` (sorted, so archives are reproducible)."""
    src, dest = Path(src_dir), Path(dest)
    files = sorted(p for p in src.iterdir() if p.is_file())
    if fmt == "tar":
        with tarfile.open(dest, "w", format=tarfile.PAX_FORMAT) as tar:
            for f in files:
                tar.add(f, arcname=f.name, recursive=False)
    elif fmt == "zip":
        # Stored, not deflated: safetensors weights barely compress and this keeps export fast.
        with zipfile.ZipFile(dest, "w", compression=zipfile.ZIP_STORED) as zf:
            for f in files:
                zf.write(f, arcname=f.name)
    else:
        raise InvalidArgument(f"format must be one of {', '.join(FORMATS)}, got {fmt!r}", field="format")
    return dest


def unpack(
    archive: str | os.PathLike[str], dest_dir: str | os.PathLike[str], *, max_bytes: int = DEFAULT_MAX_BYTES
) -> Path:
    """Unpack a tar or zip (detected from its content) into `dest_dir`; returns the directory that
    holds the files (dest_dir itself, or the single directory the archive wrapped them in)."""
    archive, dest = Path(archive), Path(dest_dir)
    dest.mkdir(parents=True, exist_ok=True)
    try:
        if zipfile.is_zipfile(archive):
            _unzip(archive, dest, max_bytes)
        elif tarfile.is_tarfile(archive):
            _untar(archive, dest, max_bytes)
        else:
            raise InvalidArgument("archive is neither a tar nor a zip file", field="archive")
    except (tarfile.TarError, zipfile.BadZipFile, EOFError) as e:
        raise InvalidArgument(f"archive is corrupt: {e}", field="archive") from None
    entries = list(dest.iterdir())
    if len(entries) == 1 and entries[0].is_dir():
        return entries[0]
    return dest


def _safe_parts(name: str) -> tuple[str, ...]:
    path = PurePosixPath(name.replace("\\", "/"))
    parts = tuple(p for p in path.parts if p not in ("", "."))
    if path.is_absolute() or ".." in parts or not parts or len(parts) > 2:
        raise InvalidArgument(f"archive member {name!r} has an unsafe or unexpected path", field="archive")
    return parts


def _untar(archive: Path, dest: Path, max_bytes: int) -> None:
    total = 0
    with tarfile.open(archive) as tar:
        for member in tar:
            parts = _safe_parts(member.name)
            if member.isdir():
                continue
            if not member.isfile():
                raise InvalidArgument(
                    f"archive member {member.name!r} is not a regular file", field="archive"
                )
            total += member.size
            if total > max_bytes:
                raise InvalidArgument(f"archive unpacks to more than {max_bytes} bytes", field="archive")
            target = dest.joinpath(*parts)
            target.parent.mkdir(parents=True, exist_ok=True)
            source = tar.extractfile(member)
            assert source is not None  # regular files always have content
            with source, open(target, "wb") as out:
                shutil.copyfileobj(source, out, 1 << 20)


def _unzip(archive: Path, dest: Path, max_bytes: int) -> None:
    total = 0
    with zipfile.ZipFile(archive) as zf:
        for info in zf.infolist():
            parts = _safe_parts(info.filename)
            if info.is_dir():
                continue
            # Unix mode bits live in the top half of external_attr; refuse symlinks and the like.
            mode = info.external_attr >> 16
            if mode and (mode & 0o170000) not in (0, 0o100000):
                raise InvalidArgument(
                    f"archive member {info.filename!r} is not a regular file", field="archive"
                )
            total += info.file_size
            if total > max_bytes:
                raise InvalidArgument(f"archive unpacks to more than {max_bytes} bytes", field="archive")
            target = dest.joinpath(*parts)
            target.parent.mkdir(parents=True, exist_ok=True)
            with zf.open(info) as source, open(target, "wb") as out:
                shutil.copyfileobj(source, out, 1 << 20)
