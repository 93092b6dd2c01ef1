"""Tiny random DeepSeek-V4 checkpoints (CSA, HCA and sliding layers, mHC streams, hash and top-k MoE), built in code."""

from __future__ import annotations

from pathlib import Path

import torch

from tests.tiny import TINY_VOCAB, save_tiny_tokenizer

LAYER_TYPES = ["sliding_attention", "compressed_sparse_attention", "heavily_compressed_attention",
               "compressed_sparse_attention"]
YARN = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 128, "beta_fast": 32, "beta_slow": 1}


def tiny_v4_kwargs(**overrides) -> dict:
    kw = dict(
        vocab_size=TINY_VOCAB, hidden_size=64, moe_intermediate_size=32, num_hidden_layers=4,
        num_attention_heads=4, num_key_value_heads=1, head_dim=32, q_lora_rank=24, partial_rotary_factor=0.25,
        n_routed_experts=8, num_experts_per_tok=2, n_shared_experts=1, routed_scaling_factor=1.5,
        layer_types=LAYER_TYPES, mlp_layer_types=["hash_moe", "moe", "moe", "moe"],
        compress_rates={"compressed_sparse_attention": 4, "heavily_compressed_attention": 8},
        sliding_window=6, o_groups=2, o_lora_rank=16, index_n_heads=8, index_head_dim=16, index_topk=3,
        hc_mult=3, hc_sinkhorn_iters=5, swiglu_limit=0.8, max_position_embeddings=512,
        bos_token_id=1, eos_token_id=2, pad_token_id=0,
    )
    kw.update(overrides)
    return kw


def make_tiny_v4(dest: Path, seed: int = 0, **overrides) -> Path:
    """Save a random tiny DeepSeek-V4 (transformers' DeepseekV4ForCausalLM) plus tokenizer into dest.

    Everything transformers initialises to a constant (sinks, position biases, the hyper-connections'
    biases and scales, the hash table, the choice bias) gets random values, so every path counts; the
    router is decisive (no near-ties). swiglu_limit is small enough that the clamp acts."""
    from transformers import DeepseekV4Config, DeepseekV4ForCausalLM

    torch.manual_seed(seed)
    cfg = DeepseekV4Config(**tiny_v4_kwargs(**overrides))
    model = DeepseekV4ForCausalLM(cfg)
    g = torch.Generator().manual_seed(seed + 100)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("mlp.gate.weight"):
                p.normal_(0.0, 0.5, generator=g)
            elif ".experts." in name or "indexer" in name:
                p.normal_(0.0, 0.1, generator=g)
            elif name.endswith(("sinks", "position_bias", ".base", "hc_base")):
                p.normal_(0.0, 0.5, generator=g)
            elif name.endswith(("scale", "hc_scale")):
                p.uniform_(0.5, 1.5, generator=g)
            elif name.endswith(("fn", "hc_fn")):
                p.normal_(0.0, 0.1, generator=g)
        for name, b in model.named_buffers():
            if name.endswith("e_score_correction_bias"):
                b.normal_(0.0, 0.3, generator=g)
            elif name.endswith("tid2eid"):  # k distinct experts per token
                b.copy_(torch.rand(b.shape[0], cfg.n_routed_experts, generator=g).argsort(-1)[:, : b.shape[1]])
    dest.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(dest)
    save_tiny_tokenizer(dest)
    return dest
