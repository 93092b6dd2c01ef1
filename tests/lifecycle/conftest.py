"""Fixtures for the policy lifecycle suite: the tiny checkpoint, and the catalog database (SQLite,
and PostgreSQL too when MINT_TEST_POSTGRES_URL is set, as in tests/catalog; see .ci/postgres.sh)."""

from __future__ import annotations

import os
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest
from sqlalchemy import create_engine
from sqlalchemy.engine import make_url

from tests.tiny import make_tiny_checkpoint

PG_URL = os.environ.get("MINT_TEST_POSTGRES_URL")


@pytest.fixture(scope="session")
def tiny_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_checkpoint(tmp_path_factory.mktemp("tiny") / "llama", family="llama", tie=True)


@pytest.fixture(params=["sqlite", pytest.param("postgres", marks=pytest.mark.postgres)])
def db_url(request: pytest.FixtureRequest) -> Iterator[str | None]:
    """The service's --db-url: None (SQLite in the data dir), or a fresh PostgreSQL schema."""
    if request.param == "sqlite":
        yield None
        return
    if not PG_URL:
        pytest.skip('MINT_TEST_POSTGRES_URL is not set (eval "$(.ci/postgres.sh)")')
    # A schema per test, selected through search_path, is a fresh database for the catalog.
    schema = f"t_{uuid.uuid4().hex[:16]}"
    admin = create_engine(PG_URL, isolation_level="AUTOCOMMIT")
    with admin.connect() as conn:
        conn.exec_driver_sql(f'CREATE SCHEMA "{schema}"')
    try:
        url = make_url(PG_URL).update_query_dict({"options": f"-csearch_path={schema}"})
        yield url.render_as_string(hide_password=False)
    finally:
        with admin.connect() as conn:
            conn.exec_driver_sql(f'DROP SCHEMA "{schema}" CASCADE')
        admin.dispose()
