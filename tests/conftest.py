"""Shared fixtures. The real SmolLM2 checkpoint is prepared once per machine, not once per test run."""

import os
from pathlib import Path

import pytest

from mint_server.model.prepare import prepare


@pytest.fixture(scope="session")
def mint_test_cache() -> Path:
    """A data dir that outlives test runs ($MINT_TEST_CACHE, default ~/.cache/mint-test)."""
    return Path(os.environ.get("MINT_TEST_CACHE") or Path.home() / ".cache" / "mint-test")


@pytest.fixture(scope="session")
def smollm2_dir(mint_test_cache: Path) -> Path:
    """The prepared HuggingFaceTB/SmolLM2-135M-Instruct HF checkpoint dir (converted on first use)."""
    return prepare(None, mint_test_cache).path
