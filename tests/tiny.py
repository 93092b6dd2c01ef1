"""Tiny random checkpoints of the real architectures, built in code (no hub), for fast tests."""

from __future__ import annotations

from pathlib import Path

import torch

TINY_VOCAB = 320
CHAT_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)

# ChatML with tools in the Hermes format (as Qwen2.5/Qwen3 templates write them): tools listed in a
# system turn, calls as <tool_call>{"name": …, "arguments": …}</tool_call>, results in `tool` turns.
TOOL_CHAT_TEMPLATE = (
    "{% if tools %}<|im_start|>system\nTools:\n{% for t in tools %}{{ t | tojson }}\n{% endfor %}"
    "Call one as <tool_call>JSON</tool_call>.<|im_end|>\n{% endif %}"
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n"
    "{% if m.tool_calls %}{% for c in m.tool_calls %}<tool_call>\n"
    "{{ {'name': c.function.name, 'arguments': c.function.arguments} | tojson }}\n</tool_call>{% endfor %}"
    "{% else %}{{ m['content'] }}{% endif %}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
# Lines the tool tokenizer learns merges from, so a whole tool call is a few tokens.
TOOL_CORPUS = ['<tool_call>\n{"name": "add", "arguments": {"a": 2, "b": 3}}\n</tool_call>', "the answer is 5"]


def save_tiny_tokenizer(dest: Path, tools: bool = False) -> None:
    """A byte-level BPE tokenizer trained on a few lines, vocab TINY_VOCAB, ChatML specials; with
    `tools`, a tool-capable chat template and merges for the tool-call test's lines."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    specials = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
    trainer = trainers.BpeTrainer(
        vocab_size=TINY_VOCAB, special_tokens=specials, initial_alphabet=pre_tokenizers.ByteLevel.alphabet()
    )
    corpus = ["the quick brown fox jumps over the lazy dog", "hello world, hello mint", "1 2 3 4 5 6 7 8 9 10"] * 20
    if tools:
        corpus += TOOL_CORPUS * 40
    tok.train_from_iterator(corpus, trainer)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok, bos_token="<|im_start|>", eos_token="<|im_end|>", pad_token="<|endoftext|>"
    )
    fast.chat_template = TOOL_CHAT_TEMPLATE if tools else CHAT_TEMPLATE
    fast.save_pretrained(dest)


def tiny_moe_config(tie: bool = True, **overrides):
    """A tiny Qwen3-MoE config: 8 experts, top-2, 2 layers (both sparse unless overridden)."""
    from transformers import Qwen3MoeConfig

    kw = dict(
        vocab_size=TINY_VOCAB, hidden_size=64, intermediate_size=96, moe_intermediate_size=32,
        num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=32, num_experts=8,
        num_experts_per_tok=2, norm_topk_prob=True, max_position_embeddings=512, tie_word_embeddings=tie,
        bos_token_id=1, eos_token_id=2, pad_token_id=0,
    )
    kw.update(overrides)
    return Qwen3MoeConfig(**kw)


def make_tiny_checkpoint(
    dest: Path, family: str = "llama", tie: bool = True, seed: int = 0, fused_experts: bool = False,
    tools: bool = False, layers: int = 2, **moe
) -> Path:
    """Save a random tiny `family` model (llama | qwen3 | qwen3_moe) plus tokenizer into dest; returns dest.

    tools: a tokenizer with a tool-capable chat template (see save_tiny_tokenizer).
    layers: llama / qwen3 depth (qwen3_moe takes num_hidden_layers in `moe`).

    qwen3_moe: `moe` overrides tiny_moe_config's fields; the router gets a larger init than HF's
    0.02 so routing is decisive (no near-ties between experts). fused_experts: write transformers'
    in-memory fused expert tensors instead of the per-expert ones save_pretrained writes.
    """
    from transformers import LlamaConfig, LlamaForCausalLM, Qwen3Config, Qwen3ForCausalLM, Qwen3MoeForCausalLM

    torch.manual_seed(seed)
    common = dict(
        vocab_size=TINY_VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=layers,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
        tie_word_embeddings=tie, bos_token_id=1, eos_token_id=2, pad_token_id=0,
    )
    if family == "llama":
        cfg = LlamaConfig(**common, rope_scaling={
            "rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
            "original_max_position_embeddings": 64,
        })
        model = LlamaForCausalLM(cfg)
    elif family == "qwen3":
        model = Qwen3ForCausalLM(Qwen3Config(**common, head_dim=32))
    elif family == "qwen3_moe":
        model = Qwen3MoeForCausalLM(tiny_moe_config(tie, **moe))
        with torch.no_grad():
            for name, p in model.named_parameters():
                if name.endswith("mlp.gate.weight"):
                    p.normal_(0.0, 0.5)
                elif ".experts." in name:
                    p.normal_(0.0, 0.1)
    else:
        raise ValueError(family)
    dest.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(dest)
    if fused_experts:
        from safetensors.torch import save_file

        state = {k: v.contiguous() for k, v in model.state_dict().items()}
        if tie:
            state.pop("lm_head.weight", None)
        for f in dest.glob("model*.safetensors*"):
            f.unlink()
        save_file(state, str(dest / "model.safetensors"), metadata={"format": "pt"})
    save_tiny_tokenizer(dest, tools=tools)
    return dest
