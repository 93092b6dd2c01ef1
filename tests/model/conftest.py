import pytest

from tests.tiny import make_tiny_checkpoint


@pytest.fixture(scope="session")
def tiny_llama(tmp_path_factory):
    return make_tiny_checkpoint(tmp_path_factory.mktemp("tiny-llama"), "llama", tie=False)


@pytest.fixture(scope="session")
def tiny_qwen3(tmp_path_factory):
    return make_tiny_checkpoint(tmp_path_factory.mktemp("tiny-qwen3"), "qwen3", tie=True)
