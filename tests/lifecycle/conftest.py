"""Fixtures for the policy lifecycle suite: the tiny checkpoint, and the catalog database (SQLite,
and PostgreSQL too when MINT_TEST_POSTGRES_URL is set, as in tests/catalog; see .ci/postgres.sh)."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.pg import fresh_pg_schema
from tests.tiny import make_tiny_checkpoint


@pytest.fixture(scope="session")
def tiny_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_checkpoint(tmp_path_factory.mktemp("tiny") / "llama", family="llama", tie=True)


@pytest.fixture(params=["sqlite", pytest.param("postgres", marks=pytest.mark.postgres)])
def db_url(request: pytest.FixtureRequest) -> Iterator[str | None]:
    """The service's --db-url: None (SQLite in the data dir), or a fresh PostgreSQL schema."""
    if request.param == "sqlite":
        yield None
        return
    with fresh_pg_schema() as url:
        yield url
