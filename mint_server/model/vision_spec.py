"""Vision-language switches read from an HF config (Qwen3-VL, dense and MoE). Torch-free, so the
CLI's memory planner and the engine's job parser can read them without loading a model.

A Qwen3-VL checkpoint nests its language model's fields under `text_config` (a Qwen3 / Qwen3-MoE
decoder with multimodal RoPE) and its vision tower's under `vision_config`. `flatten_text_config`
lifts the former to the top level so the rest of ModelConfig reads it like any decoder; `parse_vision`
reads the latter. How an image becomes tokens (resize, patches, merge) is model/images.py; the tower
itself is model/qwen3_vl.py.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from mint_server.model.errors import ModelError

# Activations the tower's MLP may name (transformers' ACT2FN keys); others are refused by name.
VISION_ACTS = ("gelu_pytorch_tanh", "gelu")


@dataclass(frozen=True)
class VisionSpec:
    depth: int
    hidden_size: int
    intermediate_size: int
    num_heads: int
    in_channels: int
    patch_size: int
    temporal_patch_size: int
    spatial_merge_size: int
    out_hidden_size: int  # = the language model's hidden size (the merger's output)
    num_position_embeddings: int  # the learned position grid: its square root per side
    deepstack_layers: tuple[int, ...]  # tower blocks whose output is merged and added to LM layers 0, 1, …
    hidden_act: str
    rope_theta: float  # the tower's 2-D (h, w) rotary embedding
    # The token ids an image is written with: <|vision_start|> <|image_pad|> × N <|vision_end|>.
    image_token_id: int
    vision_start_token_id: int
    vision_end_token_id: int

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_heads

    @property
    def patch_dim(self) -> int:
        """Numbers per patch the processor writes: channels × frames × patch × patch."""
        return self.in_channels * self.temporal_patch_size * self.patch_size**2

    def num_params(self) -> int:
        """Parameters of the tower (patch embedding, position grid, blocks, merger and deepstack mergers)."""
        d, i, m = self.hidden_size, self.intermediate_size, self.hidden_size * self.spatial_merge_size**2
        block = 2 * 2 * d + (3 * d * d + 3 * d) + (d * d + d) + (d * i + i) + (i * d + d)
        merger = m * m + m + m * self.out_hidden_size + self.out_hidden_size
        return (self.patch_dim * d + d + self.num_position_embeddings * d + self.depth * block
                + (merger + 2 * d) + len(self.deepstack_layers) * (merger + 2 * m))


def flatten_text_config(hf: dict[str, Any]) -> dict[str, Any]:
    """A Qwen3-VL config with its text_config's fields at the top level. The top-level
    tie_word_embeddings decides (as in transformers); eos/bos fall back to the top level."""
    text = hf.get("text_config")
    if not isinstance(text, dict):
        raise KeyError("text_config")
    out = {**text, "architectures": hf.get("architectures"), "model_type": hf.get("model_type")}
    for key in ("tie_word_embeddings", "eos_token_id", "bos_token_id"):
        if key in hf and (key == "tie_word_embeddings" or out.get(key) is None):
            out[key] = hf[key]
    out.setdefault("tie_word_embeddings", False)
    return out


def parse_vision(hf: dict[str, Any], text_hidden: int) -> VisionSpec:
    """The vision tower of a Qwen3-VL config; ModelError names a field we cannot build."""
    v = hf.get("vision_config")
    if not isinstance(v, dict):
        raise KeyError("vision_config")

    def single(name: str) -> int:
        value = v.get(name)
        if isinstance(value, list | tuple):
            if len(set(value)) != 1:
                raise ModelError(f"vision_config.{name} {value!r}: only square patches are supported")
            value = value[0]
        return int(value)

    act = v.get("hidden_act", "gelu_pytorch_tanh")
    if act not in VISION_ACTS:
        raise ModelError(f"vision_config.hidden_act {act!r} is not supported (supported: {list(VISION_ACTS)})")
    rope = v.get("rope_parameters") or {}
    if rope.get("rope_type", "axial") != "axial":
        raise ModelError(f"vision_config.rope_parameters.rope_type {rope.get('rope_type')!r}: only 'axial'")
    spec = VisionSpec(
        depth=int(v["depth"]), hidden_size=int(v["hidden_size"]), intermediate_size=int(v["intermediate_size"]),
        num_heads=int(v["num_heads"]), in_channels=int(v.get("in_channels", 3)), patch_size=single("patch_size"),
        temporal_patch_size=single("temporal_patch_size"), spatial_merge_size=int(v.get("spatial_merge_size", 2)),
        out_hidden_size=int(v["out_hidden_size"]), num_position_embeddings=int(v["num_position_embeddings"]),
        deepstack_layers=tuple(int(i) for i in v.get("deepstack_visual_indexes") or ()), hidden_act=act,
        rope_theta=float(rope.get("rope_theta", 10000.0)),
        image_token_id=int(hf.get("image_token_id", 151655)),
        vision_start_token_id=int(hf.get("vision_start_token_id", 151652)),
        vision_end_token_id=int(hf.get("vision_end_token_id", 151653)),
    )
    if spec.out_hidden_size != text_hidden:
        raise ModelError(f"vision_config.out_hidden_size {spec.out_hidden_size} differs from the language "
                         f"model's hidden_size {text_hidden}")
    side = round(spec.num_position_embeddings**0.5)
    if side * side != spec.num_position_embeddings:
        raise ModelError(f"vision_config.num_position_embeddings {spec.num_position_embeddings} is not a square")
    if any(not 0 <= i < spec.depth for i in spec.deepstack_layers):
        raise ModelError(f"vision_config.deepstack_visual_indexes {list(spec.deepstack_layers)} name blocks "
                         f"outside 0..{spec.depth - 1}")
    return spec


def mrope_section(rope: dict[str, Any], head_dim: int) -> tuple[int, int, int]:
    """Frequencies per M-RoPE axis (t, h, w), which must add up to head_dim / 2. Qwen3-VL always
    interleaves them (frequency j turns with axis h when j % 3 == 1 and j < 3·h_count, with w when
    j % 3 == 2 and j < 3·w_count, else with t), whatever `mrope_interleaved` says, as transformers does."""
    section = rope.get("mrope_section") or [24, 20, 20]
    if len(section) != 3 or sum(section) != head_dim // 2:
        raise ModelError(f"rope_parameters.mrope_section {section!r} must be 3 numbers adding up to "
                         f"head_dim / 2 = {head_dim // 2}")
    return int(section[0]), int(section[1]), int(section[2])
