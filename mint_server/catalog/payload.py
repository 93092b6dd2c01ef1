"""PEFT adapter directories as revision payloads.

A payload is the set of regular files at the top level of a PEFT LoRA directory (dotfiles are
skipped); it must contain adapter_config.json and adapter_model.safetensors. Each file is stored
as its own blob, and the revision's sha256 is the sha256 of the canonical manifest

    <name> <sha256 of the file> <size in bytes>\n     (one line per file, sorted by name)

so equal payloads have equal revision hashes, a revision's identity does not depend on archive
formats or file order, and unchanged files (e.g. the config) are shared between revisions.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
import struct
import uuid
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from mint_server.catalog.blobs import BlobStore, fsync_dir
from mint_server.catalog.errors import AlreadyExists, IntegrityError, InvalidArgument

ADAPTER_CONFIG = "adapter_config.json"
ADAPTER_WEIGHTS = "adapter_model.safetensors"
FILE_NAME_RE = re.compile(r"[A-Za-z0-9_][A-Za-z0-9._+-]{0,254}")
MAX_SAFETENSORS_HEADER = 100 << 20  # the safetensors format's own upper bound


@dataclass(frozen=True)
class ManifestEntry:
    name: str
    sha256: str
    size: int


@dataclass(frozen=True)
class PeftDir:
    files: list[Path]  # sorted by name
    adapter_config: dict[str, Any]

    @property
    def rank(self) -> int:
        return int(self.adapter_config["r"])


def scan_peft_dir(path: str | os.PathLike[str], field: str = "peft_dir") -> PeftDir:
    """Validate a PEFT LoRA directory; InvalidArgument names what is wrong."""
    root = Path(path)
    if not root.is_dir():
        raise InvalidArgument(f"{field} {str(root)!r} is not a directory", field=field)
    files = []
    for entry in sorted(root.iterdir(), key=lambda p: p.name):
        if entry.name.startswith("."):
            continue
        if not entry.is_file() or entry.is_symlink():
            raise InvalidArgument(
                f"{field} {str(root)!r}: {entry.name!r} is not a regular file (a PEFT adapter dir is flat)",
                field=field,
            )
        if not FILE_NAME_RE.fullmatch(entry.name):
            raise InvalidArgument(f"{field} {str(root)!r}: unsupported file name {entry.name!r}", field=field)
        files.append(entry)
    names = {f.name for f in files}
    for required in (ADAPTER_CONFIG, ADAPTER_WEIGHTS):
        if required not in names:
            raise InvalidArgument(f"{field} {str(root)!r} has no {required}; not a PEFT adapter", field=field)
    config = _read_adapter_config(root / ADAPTER_CONFIG, field)
    _check_safetensors(root / ADAPTER_WEIGHTS, field)
    return PeftDir(files, config)


def _read_adapter_config(path: Path, field: str) -> dict[str, Any]:
    try:
        config = json.loads(path.read_text())
    except (ValueError, UnicodeDecodeError) as e:
        raise InvalidArgument(f"{field}: {path.name} is not valid JSON ({e})", field=field) from None
    if not isinstance(config, dict):
        raise InvalidArgument(f"{field}: {path.name} must hold a JSON object", field=field)
    peft_type = config.get("peft_type", "LORA")
    if str(peft_type).upper() != "LORA":
        raise InvalidArgument(
            f"{field}: {path.name} has peft_type {peft_type!r}, expected 'LORA'", field=field
        )
    rank = config.get("r")
    if isinstance(rank, bool) or not isinstance(rank, int) or rank < 1:
        raise InvalidArgument(
            f"{field}: {path.name} needs a positive integer 'r' (LoRA rank), got {rank!r}", field=field
        )
    for flag, why in _UNSUPPORTED_VARIANTS.items():
        if config.get(flag):
            raise InvalidArgument(f"{field}: {path.name} has {flag}=true: {why}", field=field)
    return config


# LoRA variants PEFT can write that the engine does not compute: refused at import, with the reason,
# rather than stored and then served or trained as a plain LoRA (which would compute something else).
_UNSUPPORTED_VARIANTS = {
    "use_rslora": "rank-stabilized LoRA (scale alpha/sqrt(r)) is not supported; MinT scales by alpha/r as "
                  "plain LoRA does (re-save the adapter with use_rslora=false and lora_alpha = alpha*sqrt(r) "
                  "for the same weights)",
    "use_dora": "DoRA (weight-decomposed LoRA, a learned magnitude vector per layer) is not supported; only "
                "plain LoRA adapters can be served and trained",
    "fan_in_fan_out": "transposed (Conv1D-style) LoRA weights are not supported",
    "rank_pattern": "per-module ranks are not supported (one rank for every target)",
    "alpha_pattern": "per-module alphas are not supported (one lora_alpha for every target)",
}


def _check_safetensors(path: Path, field: str) -> None:
    """Check the framing of a safetensors file (u64 header length + JSON header) without loading tensors."""
    size = path.stat().st_size
    with open(path, "rb") as f:
        head = f.read(8)
        if len(head) < 8:
            raise InvalidArgument(f"{field}: {path.name} is too short to be safetensors", field=field)
        (header_len,) = struct.unpack("<Q", head)
        if header_len > MAX_SAFETENSORS_HEADER or 8 + header_len > size:
            raise InvalidArgument(f"{field}: {path.name} has a bad safetensors header length", field=field)
        try:
            header = json.loads(f.read(header_len))
        except (ValueError, UnicodeDecodeError):
            raise InvalidArgument(
                f"{field}: {path.name} has a corrupt safetensors header", field=field
            ) from None
    if not isinstance(header, dict):
        raise InvalidArgument(f"{field}: {path.name} has a corrupt safetensors header", field=field)
    _check_finite(path, 8 + header_len, header, field)


# Float dtypes as safetensors names them → (unsigned view, exponent mask): a value is NaN or inf
# exactly when its exponent bits are all ones, whatever the format (bf16 included, which numpy lacks).
_EXPONENT = {
    "F64": (np.uint64, 0x7FF0000000000000), "F32": (np.uint32, 0x7F800000),
    "F16": (np.uint16, 0x7C00), "BF16": (np.uint16, 0x7F80),
}


def _check_finite(path: Path, data_start: int, header: dict[str, Any], field: str) -> None:
    """Refuse a weights file holding NaN or inf: the catalog never stores an adapter that cannot serve."""
    data = np.memmap(path, dtype=np.uint8, mode="r", offset=data_start) if path.stat().st_size > data_start else None
    for name, info in header.items():
        if name == "__metadata__" or not isinstance(info, dict) or info.get("dtype") not in _EXPONENT:
            continue
        view, mask = _EXPONENT[info["dtype"]]
        offsets = info.get("data_offsets")
        if (not isinstance(offsets, list) or len(offsets) != 2 or not all(isinstance(o, int) for o in offsets)
                or data is None or not 0 <= offsets[0] <= offsets[1] <= len(data)
                or (offsets[1] - offsets[0]) % np.dtype(view).itemsize):
            raise InvalidArgument(f"{field}: {path.name}: tensor {name!r} has bad data offsets", field=field)
        bits = data[offsets[0]:offsets[1]].view(view)
        if np.any((bits & view(mask)) == view(mask)):
            raise InvalidArgument(f"{field}: {path.name}: tensor {name!r} holds NaN or inf; the catalog stores "
                                  "finite adapters only", field=field)


def lora_config_from_adapter(adapter_config: dict[str, Any]) -> dict[str, Any]:
    """The policy-level LoRA settings implied by a PEFT adapter_config.json."""
    out: dict[str, Any] = {"rank": adapter_config["r"]}
    for key, name in (
        ("lora_alpha", "alpha"),
        ("target_modules", "target_modules"),
        ("lora_dropout", "dropout"),
    ):
        if adapter_config.get(key) is not None:
            value = adapter_config[key]
            out[name] = sorted(value) if isinstance(value, list | set | tuple) else value
    return out


def manifest_bytes(entries: Iterable[ManifestEntry]) -> bytes:
    lines = sorted(f"{e.name} {e.sha256} {e.size}\n" for e in entries)
    return "".join(lines).encode()


def manifest_sha256(entries: Iterable[ManifestEntry]) -> str:
    return hashlib.sha256(manifest_bytes(entries)).hexdigest()


def hash_dir(files: Iterable[Path]) -> list[ManifestEntry]:
    """Manifest entries for files on disk (what a payload's entries would be)."""
    entries = []
    for path in files:
        digest = hashlib.sha256()
        with open(path, "rb") as f:
            while chunk := f.read(1 << 20):
                digest.update(chunk)
        entries.append(ManifestEntry(path.name, digest.hexdigest(), path.stat().st_size))
    return entries


def staging_dir(dest: str | os.PathLike[str]) -> tuple[Path, Path]:
    """Check `dest` is absent or an empty directory and create a hidden sibling to build it in
    (same filesystem, so `commit_dir` can rename it into place). Returns (dest, staging)."""
    dest = Path(dest).absolute()
    if dest.exists() and (not dest.is_dir() or any(dest.iterdir())):
        raise AlreadyExists(f"dest {str(dest)!r} exists and is not an empty directory", field="dest")
    dest.parent.mkdir(parents=True, exist_ok=True)
    staging = dest.parent / f".{dest.name}.partial-{uuid.uuid4().hex[:12]}"
    staging.mkdir()
    return dest, staging


def commit_dir(staging: Path, dest: Path) -> Path:
    """Durably rename a finished staging directory to `dest`."""
    fsync_dir(staging)
    if dest.exists():
        dest.rmdir()  # an empty directory, checked by staging_dir
    os.rename(staging, dest)
    fsync_dir(dest.parent)
    return dest


def write_peft_dir(
    store: BlobStore, entries: list[ManifestEntry], expected_sha256: str, dest: str | os.PathLike[str]
) -> Path:
    """Materialize a payload into `dest` (absent or an empty directory). Everything is written and
    verified in a hidden sibling directory first and renamed into place at the end, so on any
    failure `dest` is left as it was."""
    if manifest_sha256(entries) != expected_sha256:
        raise IntegrityError(
            f"revision sha256:{expected_sha256}: its recorded file list does not hash to the revision sha",
            field="sha256",
        )
    dest, staging = staging_dir(dest)
    try:
        for entry in entries:
            target = staging / entry.name
            store.copy_to(entry.sha256, target)
            if target.stat().st_size != entry.size:  # cannot differ if the hash matched; guards the DB
                raise IntegrityError(f"file {entry.name!r} has the wrong size", field="size")
        return commit_dir(staging, dest)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
