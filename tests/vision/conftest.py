"""Tiny Qwen3-VL checkpoints shared by the vision tests (session-scoped: built once)."""

import pytest

from tests.vision.tiny_qwen3vl import make_tiny_qwen3vl


@pytest.fixture(scope="session")
def vl_dir(tmp_path_factory):
    """Dense Qwen3-VL: 3 decoder layers, a 3-block tower with DeepStack after blocks 0 and 2."""
    return make_tiny_qwen3vl(tmp_path_factory.mktemp("vl") / "qwen3-vl")


@pytest.fixture(scope="session")
def vl_moe_dir(tmp_path_factory):
    """Qwen3-VL-MoE (8 experts, top-2), its fused experts written transposed as the Hub ships them."""
    return make_tiny_qwen3vl(tmp_path_factory.mktemp("vlmoe") / "qwen3-vl-moe", moe=True, hub_experts=True)


@pytest.fixture(scope="module")
def tiny_text_server(tmp_path_factory):
    """A live server over a text-only tiny Llama (it refuses images by name)."""
    from tests.service.live import LiveServer, tiny_engine
    from tests.tiny import make_tiny_checkpoint

    model_dir = make_tiny_checkpoint(tmp_path_factory.mktemp("text") / "llama", "llama")
    with LiveServer(tiny_engine(model_dir), tmp_path_factory.mktemp("text-serve") / "data") as server:
        yield server
