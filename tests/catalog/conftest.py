"""Fixtures for the catalog suite: every backend-dependent test runs on SQLite, and on PostgreSQL
when MINT_TEST_POSTGRES_URL is set (see .ci/postgres.sh); each test gets a fresh database schema."""

from __future__ import annotations

import socket
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Annotated

import pytest
import uvicorn
from fastapi import FastAPI, Header, HTTPException

from mint_server.api import CATALOG_PREFIX as API_PREFIX
from mint_server.api.catalog.routes import make_catalog_router
from mint_server.api.http.plumbing import install_error_handlers
from mint_server.catalog import Catalog
from tests.pg import fresh_pg_schema


@pytest.fixture(params=["sqlite", pytest.param("postgres", marks=pytest.mark.postgres)])
def db_url(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[str]:
    if request.param == "sqlite":
        yield f"sqlite:///{tmp_path / 'catalog.db'}"
        return
    with fresh_pg_schema() as url:
        yield url


@pytest.fixture
def data_dir(tmp_path: Path) -> Path:
    path = tmp_path / "data"
    path.mkdir()
    return path


@pytest.fixture
def catalog(db_url: str, data_dir: Path) -> Iterator[Catalog]:
    with Catalog.open(db_url, data_dir=data_dir) as cat:
        yield cat


def owner_from_key(x_api_key: Annotated[str | None, Header()] = None) -> str:
    """What the service does with real API keys, reduced to a header lookup."""
    if not x_api_key:
        raise HTTPException(status_code=401, detail="missing X-API-Key")
    return f"owner-{x_api_key}"


@pytest.fixture
def app(catalog: Catalog) -> FastAPI:
    """A service stand-in: the catalog router mounted where the service will mount it."""
    app = FastAPI()
    install_error_handlers(app)
    app.include_router(
        make_catalog_router(lambda: catalog, owner_from_key, enable_seed=True), prefix=API_PREFIX
    )
    return app


@pytest.fixture
def server(app: FastAPI) -> Iterator[str]:
    """The app served by real uvicorn on a loopback port, in a thread."""
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM, socket.IPPROTO_TCP)  # asyncio sets TCP_NODELAY only then
    sock.bind(("127.0.0.1", 0))
    port = sock.getsockname()[1]
    server = uvicorn.Server(uvicorn.Config(app, log_level="warning"))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    deadline = time.monotonic() + 20
    while not server.started:
        assert time.monotonic() < deadline, "uvicorn did not start"
        time.sleep(0.01)
    yield f"http://127.0.0.1:{port}"
    server.should_exit = True
    thread.join(timeout=20)
    sock.close()


@pytest.fixture(scope="session")
def s3_endpoint() -> Iterator[str]:
    from tests.s3 import s3_server

    with s3_server() as endpoint:
        yield endpoint


@pytest.fixture
def s3_url(s3_endpoint: str) -> Iterator[str]:
    """s3://<a fresh bucket>/<prefix>, with this process's AWS_* variables pointing at the test server."""
    from tests.s3 import new_bucket, s3_environ

    with s3_environ(s3_endpoint):
        yield f"s3://{new_bucket(s3_endpoint)}/mint-store"
