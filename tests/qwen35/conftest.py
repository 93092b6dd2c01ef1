"""Tiny Qwen3.5 checkpoints shared by the hybrid tests (session-scoped: built once)."""

import pytest

from tests.qwen35.tiny_qwen35 import make_tiny_qwen35


@pytest.fixture(scope="session")
def q35_dir(tmp_path_factory):
    """Dense: layers linear, full, linear, full; untied."""
    return make_tiny_qwen35(tmp_path_factory.mktemp("q35"))


@pytest.fixture(scope="session")
def q35_moe_dir(tmp_path_factory):
    """MoE: the same layout, every MLP 8 routed experts (top-2) plus a gated shared expert."""
    return make_tiny_qwen35(tmp_path_factory.mktemp("q35-moe"), moe=True, seed=1)
