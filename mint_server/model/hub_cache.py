"""Make a prepared model dir answer to its hub id offline, through the Hugging Face hub cache.

Clients (transformers, tinker's `SamplingClient.get_tokenizer`, tinker-cookbook) load tokenizers
and configs by hub id. With no network those loads read the local hub cache, laid out as
`models--ORG--NAME/refs/main` (a commit id) and `snapshots/<commit>/<files>`. We add such an
entry whose files are links to the prepared dir, so `from_pretrained("ORG/NAME")` finds it with
`HF_HUB_OFFLINE=1`. A real download already in the cache is left alone.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
from pathlib import Path

from mint_server.fsutil import atomic_write_bytes, fsync_dir, new_staging_dir


def hub_cache_dir() -> Path:
    """Where huggingface_hub keeps its cache, by the same variables it reads (at call time)."""
    if env := os.environ.get("HF_HUB_CACHE") or os.environ.get("HUGGINGFACE_HUB_CACHE"):
        return Path(env).expanduser()
    if env := os.environ.get("HF_HOME"):
        return Path(env).expanduser() / "hub"
    xdg = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(xdg).expanduser() / "huggingface" / "hub"


def repo_dir(repo_id: str, cache: Path | None = None) -> Path:
    return (cache or hub_cache_dir()) / ("models--" + repo_id.replace("/", "--"))


def snapshot_of(repo_id: str, cache: Path | None = None) -> Path | None:
    """The snapshot dir `refs/main` names, if the cache has one for `repo_id`."""
    repo = repo_dir(repo_id, cache)
    try:
        commit = (repo / "refs" / "main").read_text().strip()
    except OSError:
        return None
    snap = repo / "snapshots" / commit
    return snap if (snap / "config.json").exists() else None


def link_prepared(repo_id: str, model_dir: Path, files: list[str], cache: Path | None = None) -> Path | None:
    """Point the hub cache entry of `repo_id` at `model_dir` (atomic, idempotent).

    Returns the snapshot dir, or None when the cache already holds a real download of the repo
    (its files are not links into a prepared dir), which then stays as it is.
    """
    model_dir = model_dir.resolve()
    repo = repo_dir(repo_id, cache)
    current = snapshot_of(repo_id, cache)
    if current is not None and not (current / "config.json").is_symlink():
        return None
    # The commit id names the content and where it lives, so a moved data dir gets a new snapshot.
    commit = hashlib.sha1(json.dumps([repo_id, str(model_dir), sorted(files)]).encode()).hexdigest()
    snap = repo / "snapshots" / commit
    if current == snap and all((snap / f).resolve() == model_dir / f for f in files):
        return snap
    if not snap.is_dir() or not all((snap / f).exists() for f in files):
        staging = new_staging_dir(repo / "snapshots", prefix=f".{commit}.")
        try:
            for f in files:
                (staging / f).symlink_to(model_dir / f)
            fsync_dir(staging)
            if snap.exists():
                shutil.rmtree(snap)
            os.replace(staging, snap)
        except BaseException:
            shutil.rmtree(staging, ignore_errors=True)
            raise
        fsync_dir(snap.parent)
    atomic_write_bytes(repo / "refs" / "main", commit.encode())
    return snap
