"""Tiny checkpoints of every attention kind for the long-context tests, each with the rope scaling its
family's configs carry, its original context well below 32K so the scaling matters there."""

from __future__ import annotations

from pathlib import Path

import torch

from tests.tiny import TINY_VOCAB, save_tiny_tokenizer

ORIGINAL_CONTEXT = 4096
LONG = 65536  # max_position_embeddings: room for 32K prompts

LLAMA3 = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
          "original_max_position_embeddings": ORIGINAL_CONTEXT, "rope_theta": 500000.0}
LINEAR = {"rope_type": "linear", "factor": 4.0, "rope_theta": 10000.0}
YARN = {"rope_type": "yarn", "factor": 8.0, "original_max_position_embeddings": ORIGINAL_CONTEXT, "rope_theta": 1e6}
DEEPSEEK_YARN = {"rope_type": "yarn", "factor": 8.0, "original_max_position_embeddings": ORIGINAL_CONTEXT,
                 "beta_fast": 32, "beta_slow": 1, "mscale": 1.0, "mscale_all_dim": 1.0, "rope_theta": 10000.0}

# kind → what it stands for (the test ids)
KINDS = {
    "llama": "full attention (MHA), llama3 rope",
    "llama_linear": "GQA, linear rope",
    "qwen3": "GQA with qk-norm, YaRN rope",
    "deepseek_v3": "MLA, DeepSeek YaRN rope",
    "deepseek_v32": "MLA + DSA indexer (top-64 keys), DeepSeek YaRN rope",
    "gpt_oss": "sliding window (128) / full layers with sinks, YaRN rope",
    "qwen3_5": "hybrid: gated delta-net linear attention / gated full attention, partial rotary",
}


def _dense(family: str, rope: dict, kv_heads: int) -> torch.nn.Module:
    from transformers import LlamaConfig, LlamaForCausalLM, Qwen3Config, Qwen3ForCausalLM

    kw = dict(vocab_size=TINY_VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
              num_attention_heads=4, num_key_value_heads=kv_heads, max_position_embeddings=LONG,
              tie_word_embeddings=False, bos_token_id=1, eos_token_id=2, pad_token_id=0, rope_parameters=rope)
    if family == "qwen3":
        return Qwen3ForCausalLM(Qwen3Config(head_dim=32, **kw))
    return LlamaForCausalLM(LlamaConfig(**kw))


def build(kind: str, dest: Path, seed: int = 0) -> Path:
    """Save the tiny `kind` checkpoint (a KINDS key) plus tokenizer into dest; returns dest."""
    torch.manual_seed(seed)
    if kind == "llama":
        model = _dense("llama", LLAMA3, kv_heads=4)
    elif kind == "llama_linear":
        model = _dense("llama", LINEAR, kv_heads=2)
    elif kind == "qwen3":
        model = _dense("qwen3", YARN, kv_heads=2)
    elif kind in ("deepseek_v3", "deepseek_v32"):
        from tests.mla.tiny_deepseek import make_tiny_deepseek

        extra = {"index_topk": 64} if kind == "deepseek_v32" else {}
        return make_tiny_deepseek(dest, "v3" if kind == "deepseek_v3" else "v32", seed=seed,
                                  rope_parameters=DEEPSEEK_YARN, max_position_embeddings=LONG, **extra)
    elif kind == "gpt_oss":
        from tests.families.tiny_families import make_tiny_gpt_oss

        rope = {**YARN, "beta_fast": 32.0, "beta_slow": 1.0, "truncate": False, "rope_theta": 150000.0}
        return make_tiny_gpt_oss(dest, seed=seed, sliding_window=128, rope_parameters=rope,
                                 max_position_embeddings=LONG)
    elif kind == "qwen3_5":
        from tests.qwen35.tiny_qwen35 import make_tiny_qwen35

        return make_tiny_qwen35(dest, seed=seed, max_position_embeddings=LONG)
    else:
        raise ValueError(kind)
    dest.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(dest)
    save_tiny_tokenizer(dest)
    return dest


if __name__ == "__main__":
    import sys

    build(sys.argv[1], Path(sys.argv[2]))
