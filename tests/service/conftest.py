from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
import tinker

from tests.service.fake_engine import FakeEngine
from tests.service.live import KEY_A, LiveServer


@pytest.fixture
def fake_server(tmp_path: Path) -> Iterator[LiveServer]:
    engine = FakeEngine(model_dir=tmp_path / "model")
    with LiveServer(engine, tmp_path / "data") as server:
        yield server


@pytest.fixture
def client_a(fake_server: LiveServer) -> Iterator[tinker.ServiceClient]:
    client = tinker.ServiceClient(base_url=fake_server.url, api_key=KEY_A)
    yield client
    client.close("success")
