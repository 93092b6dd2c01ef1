"""docs/architecture.md stays true: every module it names exists, and every room of the package (each
subpackage of `mint_server`, and each room of `mint_server/api`) is described in it. A file moved or
a room added without the page following fails here."""

from __future__ import annotations

import re
from pathlib import Path

import mint_server

PACKAGE = Path(mint_server.__file__).parent
REPO = PACKAGE.parent
PAGE = (REPO / "docs" / "architecture.md").read_text()

# `engine/jobs.py`, `api/tinker/codec.py`, `fsutil.py`, `tests/tolerance.py` — a path in backticks
NAMED_FILE = re.compile(r"`((?:[a-z_0-9]+/)*[a-z_0-9]+\.py)\b")


def _rooms(root: Path) -> list[str]:
    return sorted(p.parent.relative_to(PACKAGE).as_posix() for p in root.glob("*/__init__.py")
                  if "migrations" not in p.parts)  # fmt: skip


def test_every_module_the_page_names_exists() -> None:
    named = set(NAMED_FILE.findall(PAGE))
    assert len(named) > 30  # the pattern reads the page's real references
    missing = sorted(n for n in named if not ((PACKAGE / n).is_file() or (REPO / n).is_file()))
    assert missing == []


def test_every_room_is_described() -> None:
    rooms = _rooms(PACKAGE) + _rooms(PACKAGE / "api")
    assert {"api", "engine", "model", "catalog", "api/tinker", "api/openai"} <= set(rooms)
    undescribed = [room for room in rooms if f"{room}/" not in PAGE]
    assert undescribed == []
