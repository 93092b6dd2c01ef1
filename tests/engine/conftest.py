"""Fixtures for the engine tests."""

import pytest

from tests.tiny import make_tiny_checkpoint

# --- sampling -----------------------------------------------------------------------------------


@pytest.fixture(scope="session")
def sampling_llama_dir(tmp_path_factory):
    """A tiny untied Llama checkpoint + tokenizer for the sampler tests."""
    return make_tiny_checkpoint(tmp_path_factory.mktemp("sampling-llama"), "llama", tie=False)


@pytest.fixture(scope="session")
def sampling_qwen3_dir(tmp_path_factory):
    """A tiny tied Qwen3 checkpoint + tokenizer for the sampler tests."""
    return make_tiny_checkpoint(tmp_path_factory.mktemp("sampling-qwen3"), "qwen3", tie=True)


@pytest.fixture(scope="module")
def model(sampling_llama_dir):
    """The sampler tests' model (test modules with their own `model` override it)."""
    from mint_server.model.loader import load_model

    return load_model(sampling_llama_dir, device="cpu")


@pytest.fixture
def residency(model):
    from tests.engine.helpers import make_residency

    return make_residency(model.config, num_slots=6, max_rank=8)


# --- training -----------------------------------------------------------------------------------


@pytest.fixture(scope="session")
def train_llama_dir(tmp_path_factory):
    """A tiny untied Llama checkpoint (llama3 rope scaling) for the trainer tests."""
    return make_tiny_checkpoint(tmp_path_factory.mktemp("train-llama"), "llama", tie=False)


@pytest.fixture(scope="session")
def train_qwen3_dir(tmp_path_factory):
    """A tiny tied Qwen3 checkpoint (qk-norm) for the trainer tests."""
    return make_tiny_checkpoint(tmp_path_factory.mktemp("train-qwen3"), "qwen3", tie=True)
