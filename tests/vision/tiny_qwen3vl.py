"""Tiny random Qwen3-VL checkpoints (dense and MoE) with an image-capable tokenizer, and tiny images,
all built in code."""

from __future__ import annotations

import io
import json
from pathlib import Path

import torch

from tests.tiny import TINY_VOCAB, save_tiny_tokenizer

IMAGE_SPECIALS = ["<|vision_start|>", "<|image_pad|>", "<|vision_end|>", "<|video_pad|>"]
VOCAB = TINY_VOCAB  # the trained BPE holds fewer entries; the vision specials get the next ids
# patch 4, merge 2: an image is cut into 8 × 8 pixel blocks, one token each; at most 48 × 48 pixels.
PREPROCESSOR = {"size": {"shortest_edge": 256, "longest_edge": 48 * 48}, "patch_size": 4, "merge_size": 2,
                "temporal_patch_size": 2, "image_mean": [0.5, 0.5, 0.5], "image_std": [0.5, 0.5, 0.5]}


def text_kwargs(**overrides) -> dict:
    kw = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=3, num_attention_heads=4,
              num_key_value_heads=2, head_dim=16, max_position_embeddings=512,
              rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "mrope_section": [2, 3, 3],
                               "mrope_interleaved": True},
              bos_token_id=1, eos_token_id=2, pad_token_id=0)
    kw.update(overrides)
    return kw


def vision_kwargs(**overrides) -> dict:
    kw = dict(depth=3, hidden_size=32, intermediate_size=64, num_heads=2, patch_size=4, spatial_merge_size=2,
              temporal_patch_size=2, out_hidden_size=64, num_position_embeddings=16, deepstack_visual_indexes=[0, 2])
    kw.update(overrides)
    return kw


def make_tiny_qwen3vl(dest: Path, moe: bool = False, seed: int = 0, hub_experts: bool = False, **text) -> Path:
    """Save a random tiny Qwen3-VL (moe: Qwen3-VL-MoE, 8 experts top-2, expert width 24) with its
    tokenizer and preprocessor_config.json into dest. hub_experts: write the fused experts transposed,
    as the Hub's Qwen3-VL-MoE checkpoints hold them."""
    from transformers import (
        Qwen3VLConfig,
        Qwen3VLForConditionalGeneration,
        Qwen3VLMoeConfig,
        Qwen3VLMoeForConditionalGeneration,
    )

    dest.mkdir(parents=True, exist_ok=True)
    start, image, end, video = save_vision_tokenizer(dest)
    torch.manual_seed(seed)
    ids = dict(image_token_id=image, video_token_id=video, vision_start_token_id=start, vision_end_token_id=end)
    if moe:
        t = text_kwargs(num_hidden_layers=2, moe_intermediate_size=24, num_experts=8, num_experts_per_tok=2, **text)
        model = Qwen3VLMoeForConditionalGeneration(Qwen3VLMoeConfig(
            text_config=t, vision_config=vision_kwargs(deepstack_visual_indexes=[1]), tie_word_embeddings=False, **ids))
    else:
        model = Qwen3VLForConditionalGeneration(Qwen3VLConfig(text_config=text_kwargs(**text),
                                                              vision_config=vision_kwargs(), **ids))
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("mlp.gate.weight"):
                p.normal_(0.0, 0.5)  # decisive routing: no near-ties between experts
            elif ".experts." in name:
                p.normal_(0.0, 0.1)
            elif "visual" in name and p.dim() > 1:
                p.normal_(0.0, 0.2)  # features big enough that a wrong image or position shows
    model.save_pretrained(dest)
    if hub_experts:
        from safetensors.torch import load_file, save_file

        state = load_file(str(dest / "model.safetensors"))
        for k in list(state):
            if k.endswith(("mlp.experts.gate_up_proj", "mlp.experts.down_proj")):
                state[k] = state[k].transpose(1, 2).contiguous()
        save_file(state, str(dest / "model.safetensors"), metadata={"format": "pt"})
    (dest / "preprocessor_config.json").write_text(json.dumps(PREPROCESSOR))
    return dest


def save_vision_tokenizer(dest: Path) -> list[int]:
    """The tiny tokenizer plus Qwen3-VL's vision specials; returns their ids."""
    from transformers import AutoTokenizer

    save_tiny_tokenizer(dest)
    tok = AutoTokenizer.from_pretrained(dest)
    tok.add_special_tokens({"additional_special_tokens": IMAGE_SPECIALS})
    ids = tok.convert_tokens_to_ids(IMAGE_SPECIALS)
    assert max(ids) < VOCAB, ids
    tok.save_pretrained(dest)
    return ids


def png(width: int, height: int, seed: int) -> bytes:
    """A random RGB PNG."""
    from PIL import Image

    g = torch.Generator().manual_seed(seed)
    pixels = torch.randint(0, 256, (height, width, 3), generator=g, dtype=torch.uint8).numpy()
    buf = io.BytesIO()
    Image.fromarray(pixels, "RGB").save(buf, format="PNG")
    return buf.getvalue()
