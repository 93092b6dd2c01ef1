from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
import tinker

from tests.service.live import KEY_A, LiveServer, tiny_engine
from tests.tiny import make_tiny_checkpoint


@pytest.fixture(scope="session")
def tiny_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Built once: writing the checkpoint (and importing transformers for it) is the slow part."""
    return make_tiny_checkpoint(tmp_path_factory.mktemp("tiny") / "llama", family="llama", tie=True)


@pytest.fixture
def server(tiny_dir: Path, tmp_path: Path) -> Iterator[LiveServer]:
    """A fresh engine and server per test (an engine on the tiny model starts in well under a second)."""
    with LiveServer(tiny_engine(tiny_dir), tmp_path / "data") as s:
        yield s


@pytest.fixture
def client_a(server: LiveServer) -> Iterator[tinker.ServiceClient]:
    client = tinker.ServiceClient(base_url=server.url, api_key=KEY_A)
    yield client
    client.close("success")
