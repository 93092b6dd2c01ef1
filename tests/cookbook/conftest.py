"""The cookbook suite: tinker-cookbook recipes and our examples against a live server on loopback
(the real app and LocalEngine over the tiny random checkpoint), reached through the cookbook's
own clients. The base model is named by its checkpoint dir, which the cookbook loads the
tokenizer from and the server takes as the served base model."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.service.live import KEY_A, LiveServer, tiny_engine
from tests.tiny import make_tiny_checkpoint

pytest.importorskip("tinker_cookbook", reason="tinker-cookbook is not installed (make setup installs it)")


@pytest.fixture(scope="session")
def tiny_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_checkpoint(tmp_path_factory.mktemp("tiny") / "llama", family="llama", tie=True)


@pytest.fixture
def server(tiny_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[LiveServer]:
    monkeypatch.setenv("TINKER_API_KEY", KEY_A)
    with LiveServer(tiny_engine(tiny_dir), tmp_path / "data") as s:
        monkeypatch.setenv("TINKER_BASE_URL", s.url)
        yield s
