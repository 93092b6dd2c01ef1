"""Tiny random Qwen3-MoE checkpoints (8 experts, top-2), built in code."""

import pytest

from tests.tiny import make_tiny_checkpoint


@pytest.fixture(scope="session")
def moe_dir(tmp_path_factory):
    """2 layers, both sparse; untied (so a merged lm_head LoRA leaves the embedding alone)."""
    return make_tiny_checkpoint(tmp_path_factory.mktemp("moe"), "qwen3_moe", tie=False)


@pytest.fixture(scope="session")
def moe_fused_dir(tmp_path_factory):
    """Tied, with transformers' fused expert tensors on disk."""
    return make_tiny_checkpoint(tmp_path_factory.mktemp("moe-fused"), "qwen3_moe", tie=True, fused_experts=True)


@pytest.fixture(scope="session")
def moe_mixed_dir(tmp_path_factory):
    """3 layers: layer 1 a dense MLP (mlp_only_layers), layers 0 and 2 sparse; top-3, unnormalised."""
    return make_tiny_checkpoint(tmp_path_factory.mktemp("moe-mixed"), "qwen3_moe", tie=False, seed=1,
                                num_hidden_layers=3, mlp_only_layers=[1], num_experts_per_tok=3,
                                norm_topk_prob=False)
