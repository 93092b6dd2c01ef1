"""Tiny random gpt-oss and GLM-5 checkpoints (built in code, saved by transformers) for fast tests."""

from __future__ import annotations

from pathlib import Path

import torch

from tests.mla.tiny_deepseek import tiny_deepseek_kwargs
from tests.tiny import TINY_VOCAB, save_tiny_tokenizer

GPT_OSS_YARN = {"rope_type": "yarn", "factor": 4.0, "beta_fast": 32.0, "beta_slow": 1.0, "truncate": False,
                "original_max_position_embeddings": 128, "rope_theta": 10000.0}


def make_tiny_gpt_oss(dest: Path, seed: int = 0, **overrides) -> Path:
    """2 layers (sliding window 5, then full), 8 experts top-2, GQA 4/2, biases, sinks, YaRN rope.

    Router, experts and sinks get a larger init than HF's 0.02 so routing is decisive and the sinks
    and clamps matter (some gate/up values reach the ±limit clamp: swiglu_limit is lowered to 1)."""
    from transformers import GptOssConfig, GptOssForCausalLM

    torch.manual_seed(seed)
    kw = dict(vocab_size=TINY_VOCAB, hidden_size=64, intermediate_size=32, num_hidden_layers=2,
              num_attention_heads=4, num_key_value_heads=2, head_dim=16, num_local_experts=8, num_experts_per_tok=2,
              sliding_window=5, swiglu_limit=1.0, max_position_embeddings=512, tie_word_embeddings=False,
              rope_parameters=GPT_OSS_YARN, bos_token_id=1, eos_token_id=2, pad_token_id=0)
    kw.update(overrides)
    model = GptOssForCausalLM(GptOssConfig(**kw))
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "router" in name:
                p.normal_(0.0, 0.5)
            elif name.endswith("sinks"):
                p.normal_(0.0, 1.0)
            elif ".experts." in name or name.endswith("bias"):
                p.normal_(0.0, 0.1)
    dest.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(dest)
    save_tiny_tokenizer(dest)
    return dest


def make_tiny_glm(dest: Path, seed: int = 0, **overrides) -> Path:
    """4 layers (layer 0 dense), DeepSeek-V3.2's tiny shapes, indexers on layers 0 and 2; layers 1 and 3
    reuse their selection (indexer_types full/shared)."""
    from transformers import GlmMoeDsaConfig, GlmMoeDsaForCausalLM

    torch.manual_seed(seed)
    kw = tiny_deepseek_kwargs(num_hidden_layers=4, index_topk=6, index_head_dim=16, index_n_heads=8,
                              indexer_types=["full", "shared", "full", "shared"])
    kw.update(overrides)
    model = GlmMoeDsaForCausalLM(GlmMoeDsaConfig(**kw))
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
