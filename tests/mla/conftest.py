"""Tiny DeepSeek checkpoints shared by the MLA tests (session-scoped: built once)."""

import pytest

from tests.mla.tiny_deepseek import YARN, make_tiny_deepseek


@pytest.fixture(scope="session")
def v3_dir(tmp_path_factory):
    """3 layers (layer 0 dense), q_a/q_b, interleaved yarn rope with mscale_all_dim."""
    return make_tiny_deepseek(tmp_path_factory.mktemp("v3"), "v3", rope_parameters=YARN)


@pytest.fixture(scope="session")
def v3_qproj_dir(tmp_path_factory):
    """q_lora_rank null (one q_proj), rotate-half rope, attention bias, unnormalised top-k, 2 shared experts."""
    return make_tiny_deepseek(tmp_path_factory.mktemp("v3q"), "v3", seed=1, q_lora_rank=None, rope_interleave=False,
                              attention_bias=True, norm_topk_prob=False, n_shared_experts=2)


@pytest.fixture(scope="session")
def v32_dir(tmp_path_factory):
    """DeepSeek-V3.2: the v3 shapes plus an indexer keeping the top 6 keys per query."""
    return make_tiny_deepseek(tmp_path_factory.mktemp("v32"), "v32", seed=2)
