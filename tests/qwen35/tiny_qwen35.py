"""Tiny random Qwen3.5 dense and MoE checkpoints (hybrid linear / full attention), built in code."""

from __future__ import annotations

from pathlib import Path

import torch

from tests.tiny import TINY_VOCAB, save_tiny_tokenizer

# two of each kind, so both layer-index maps (attention layers, linear layers) are exercised
LAYER_TYPES = ["linear_attention", "full_attention", "linear_attention", "full_attention"]


def tiny_qwen35_kwargs(moe: bool, **overrides) -> dict:
    kw = dict(
        vocab_size=TINY_VOCAB, hidden_size=64, num_hidden_layers=4, layer_types=LAYER_TYPES,
        num_attention_heads=4, num_key_value_heads=2, head_dim=16, linear_num_key_heads=2,
        linear_num_value_heads=4, linear_key_head_dim=8, linear_value_head_dim=12, linear_conv_kernel_dim=4,
        max_position_embeddings=512, tie_word_embeddings=False, bos_token_id=1, eos_token_id=2, pad_token_id=0,
    )
    if moe:
        kw.update(num_experts=8, num_experts_per_tok=2, moe_intermediate_size=32, shared_expert_intermediate_size=48)
    else:
        kw.update(intermediate_size=96)
    kw.update(overrides)
    return kw


def make_tiny_qwen35(dest: Path, moe: bool = False, seed: int = 0, **overrides) -> Path:
    """Save a random tiny Qwen3_5ForCausalLM (or Qwen3_5MoeForCausalLM) plus tokenizer into dest.

    Decays are kept moderate (A = exp(A_log) in 0.05..0.5, not HF's up to 16) so a token's state
    still matters tens of tokens later; norms get nonzero (1 + w) offsets; the router a large init so
    routing is decisive (no near-ties between experts)."""
    from transformers import (
        Qwen3_5ForCausalLM,
        Qwen3_5MoeForCausalLM,
        Qwen3_5MoeTextConfig,
        Qwen3_5TextConfig,
    )

    torch.manual_seed(seed)
    if moe:
        model = Qwen3_5MoeForCausalLM(Qwen3_5MoeTextConfig(**tiny_qwen35_kwargs(True, **overrides)))
    else:
        model = Qwen3_5ForCausalLM(Qwen3_5TextConfig(**tiny_qwen35_kwargs(False, **overrides)))
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("A_log"):
                p.copy_(torch.empty_like(p).uniform_(0.05, 0.5).log())
            elif name.endswith("dt_bias"):
                p.normal_(0.0, 0.5)
            elif name.endswith("norm.weight"):
                p.normal_(0.0, 0.1)
            elif name.endswith("mlp.gate.weight"):
                p.normal_(0.0, 0.5)
            elif ".experts." in name or name.endswith("conv1d.weight"):
                p.normal_(0.0, 0.1 if ".experts." in name else 0.3)
    dest.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(dest)
    save_tiny_tokenizer(dest)
    return dest
