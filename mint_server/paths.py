"""Where MinT keeps its durable state: the data dir ($MINT_HOME, default ~/.mint)."""

import os
from pathlib import Path


def data_dir(override: str | os.PathLike | None = None) -> Path:
    """The data dir: an explicit override, else $MINT_HOME, else ~/.mint. Created if missing."""
    path = Path(override) if override else Path(os.environ.get("MINT_HOME", Path.home() / ".mint"))
    path = path.expanduser().resolve()
    path.mkdir(parents=True, exist_ok=True)
    return path
