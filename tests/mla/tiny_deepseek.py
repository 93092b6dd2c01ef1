"""Tiny random DeepSeek-V3 / V3.2 checkpoints (MLA, grouped sigmoid MoE, shared experts, DSA), built in code."""

from __future__ import annotations

from pathlib import Path

import torch

from tests.tiny import TINY_VOCAB, save_tiny_tokenizer

YARN = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32, "beta_fast": 32,
        "beta_slow": 1, "mscale": 1.0, "mscale_all_dim": 0.707, "rope_theta": 10000.0}


def tiny_deepseek_kwargs(**overrides) -> dict:
    kw = dict(
        vocab_size=TINY_VOCAB, hidden_size=64, intermediate_size=96, moe_intermediate_size=32,
        num_hidden_layers=3, first_k_dense_replace=1, num_attention_heads=4, n_routed_experts=8,
        n_group=4, topk_group=2, num_experts_per_tok=2, n_shared_experts=1, routed_scaling_factor=2.5,
        kv_lora_rank=16, q_lora_rank=24, qk_rope_head_dim=8, qk_nope_head_dim=16, v_head_dim=12,
        max_position_embeddings=512, tie_word_embeddings=False, bos_token_id=1, eos_token_id=2, pad_token_id=0,
    )
    kw.update(overrides)
    return kw


def make_tiny_deepseek(dest: Path, version: str = "v3", seed: int = 0, **overrides) -> Path:
    """Save a random tiny DeepSeek `version` (v3 | v32) model plus tokenizer into dest; returns dest.

    The router and its choice bias get a large init so routing is decisive (no near-ties)."""
    from transformers import (
        DeepseekV3Config,
        DeepseekV3ForCausalLM,
        DeepseekV32Config,
        DeepseekV32ForCausalLM,
    )

    torch.manual_seed(seed)
    if version == "v3":
        model = DeepseekV3ForCausalLM(DeepseekV3Config(**tiny_deepseek_kwargs(**overrides)))
    elif version == "v32":
        kw = tiny_deepseek_kwargs(index_topk=6, index_head_dim=16, index_n_heads=8)
        kw.update(overrides)
        model = DeepseekV32ForCausalLM(DeepseekV32Config(**kw))
    else:
        raise ValueError(version)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("mlp.gate.weight"):
                p.normal_(0.0, 0.5)
            elif ".experts." in name or "indexer" in name:
                p.normal_(0.0, 0.1)
        for name, b in model.named_buffers():
            if name.endswith("e_score_correction_bias"):
                b.normal_(0.0, 0.3)
    dest.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(dest)
    save_tiny_tokenizer(dest)
    return dest

# Why 8 indexer heads: an index score is Σ_h w_h·relu(q_h·k), exactly 0 when every head's dot product is
# negative; with 2 heads that is 1 key in 4, and top-k between exactly tied keys is arbitrary (a batched
# and a single-row forward may break the tie differently). With 8 heads it is 1 in 256.
