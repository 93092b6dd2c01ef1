"""Shared pieces of the vision tests: image prompts as Tinker model inputs, and the transformers oracle."""

from __future__ import annotations

import torch
from tinker import types

from mint_server.model.config import ModelConfig
from mint_server.model.images import ImageProcessing
from tests.tolerance import Tolerance
from tests.vision.tiny_qwen3vl import png


def vl_tolerance(cfg: ModelConfig) -> Tolerance:
    """tests/tolerance.py's bound for this model, its depth counting the tower's blocks too."""
    v = cfg.vision
    widths = [cfg.hidden_size, cfg.intermediate_size, cfg.vocab_size, cfg.num_heads * cfg.head_dim,
              v.intermediate_size, v.hidden_size * v.spatial_merge_size**2]
    if cfg.moe_intermediate_size:
        widths.append(cfg.moe_intermediate_size * cfg.num_experts_per_tok)
    return Tolerance(n=max(widths), depth=cfg.num_layers + v.depth)


def image_chunk(width: int, height: int, seed: int, **kw) -> types.ImageChunk:
    return types.ImageChunk(data=png(width, height, seed), format="png", **kw)


def expected_tokens(width: int, height: int) -> int:
    """Tokens of a width × height image on the tiny models (tiny_qwen3vl.PREPROCESSOR), as a client computes them."""
    from tests.vision.tiny_qwen3vl import PREPROCESSOR

    size = PREPROCESSOR["size"]
    proc = ImageProcessing(patch_size=4, merge_size=2, temporal_patch_size=2, min_pixels=size["shortest_edge"],
                           max_pixels=size["longest_edge"], mean=(0.5,) * 3, std=(0.5,) * 3, image_token_id=0)
    h, w = proc.target_size(height, width)
    return (h // proc.factor) * (w // proc.factor)


def image_input(cfg: ModelConfig, text: list[list[int]], images: list[tuple[int, int, int]]) -> types.ModelInput:
    """Text pieces with an image (width, height, seed) between each two, wrapped in vision start / end;
    each image chunk says its expected_tokens (the SDK needs them for a model input's length)."""
    v = cfg.vision
    chunks: list = []
    for i, piece in enumerate(text):
        tail = [v.vision_start_token_id] if i < len(images) else []
        head = [v.vision_end_token_id] if i else []
        chunks.append(types.EncodedTextChunk(tokens=head + piece + tail))
        if i < len(images):
            chunks.append(image_chunk(*images[i], expected_tokens=expected_tokens(*images[i][:2])))
    return types.ModelInput(chunks=chunks)


def hf_inputs(cfg: ModelConfig, model_dir, model_input: types.ModelInput) -> dict:
    """transformers' inputs for one model input: ids with image tokens, pixel patches, grids, token types."""
    proc = ImageProcessing.for_model(cfg.vision, model_dir)
    ids, patches, grids = [], [], []
    for chunk in model_input.chunks:
        if isinstance(chunk, types.ImageChunk):
            im = proc.read(chunk.data, chunk.format, start=len(ids))
            ids += [cfg.vision.image_token_id] * im.tokens
            patches.append(torch.from_numpy(im.patches))
            grids.append(im.grid)
        else:
            ids += list(chunk.tokens)
    input_ids = torch.tensor([ids])
    out = {"input_ids": input_ids, "mm_token_type_ids": (input_ids == cfg.vision.image_token_id).int()}
    if patches:
        out.update(pixel_values=torch.cat(patches), image_grid_thw=torch.tensor(grids))
    return out


def load_hf(model_dir):
    """A fresh transformers model (to change: merge into, wrap with PEFT)."""
    from transformers import AutoModelForImageTextToText

    return AutoModelForImageTextToText.from_pretrained(model_dir, dtype=torch.float32).eval()


_SHARED: dict = {}


def shared_hf(model_dir):
    """One transformers model per checkpoint for the tests that only read it (loading is the slow part)."""
    key = str(model_dir)
    if key not in _SHARED:
        _SHARED[key] = load_hf(model_dir).requires_grad_(False)
    return _SHARED[key]


def vl_preparer(cfg: ModelConfig, model_dir):
    """The engine's job parser for a vision-language base (it reads image chunks)."""
    from tests.engine.helpers import preparer

    prep = preparer(cfg)
    prep.images = ImageProcessing.for_model(cfg.vision, model_dir)
    return prep
