"""A fresh PostgreSQL schema per test, when MINT_TEST_POSTGRES_URL is set (CI: .ci/postgres.sh)."""

from __future__ import annotations

import os
import uuid
from collections.abc import Iterator
from contextlib import contextmanager

import pytest
from sqlalchemy import create_engine
from sqlalchemy.engine import make_url

PG_URL = os.environ.get("MINT_TEST_POSTGRES_URL")


@contextmanager
def fresh_pg_schema() -> Iterator[str]:
    """A URL whose search_path is a new, empty schema: a fresh database for the catalog."""
    if not PG_URL:
        if os.environ.get("CI"):  # CI promises PostgreSQL (.ci/run): its absence is a failure, not a skip
            pytest.fail("MINT_TEST_POSTGRES_URL is not set in CI (.ci/run starts PostgreSQL)")
        pytest.skip('MINT_TEST_POSTGRES_URL is not set (eval "$(.ci/postgres.sh)")')
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
