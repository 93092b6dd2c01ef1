"""Qwen3-VL (dense and MoE) in our model code: a frozen vision tower beside the shared decoder.

The language model is the Qwen3 / Qwen3-MoE decoder of transformer.py (and moe.py) with two
additions that ride on `VisionInput`, built per forward from the sequences' images:
- multimodal RoPE: every token has three rotary positions (t, h, w; model/images.py says which),
  and rotary frequency j turns with one of them (`Transformer.rope`); text-only sequences have
  all three equal to their position, which is plain RoPE;
- the image tokens' embeddings are the tower's merged patch features, and DeepStack adds the
  features of `deepstack_layers` tower blocks (each through its own merger) to those tokens'
  hidden states after language-model layers 0, 1, ….

The tower (patch embedding, a learned position grid resampled bilinearly to each image, 2-D rotary
attention over one image's patches, gelu MLPs, the 2 × 2 patch merger) never trains and gets no LoRA;
each image is encoded on its own, so its features never depend on the batch, and `FeatureCache`
keeps them by content digest (an image prefilled over several steps, or sent again, is encoded once).
Adapters train the language model's projections only (lora.py targets; PEFT names under
`model.language_model.`, peft_io.py).
"""

from __future__ import annotations

import math
from collections import OrderedDict
from collections.abc import Sequence

import numpy as np
import torch
import torch.nn.functional as F
from torch import Tensor, nn

from mint_server.model.config import ModelConfig
from mint_server.model.images import ImageInput, PromptImages
from mint_server.model.transformer import Transformer
from mint_server.model.vision_input import VisionInput
from mint_server.model.vision_spec import VisionSpec

LAYER_NORM_EPS = 1e-6


def _gelu(name: str, x: Tensor) -> Tensor:
    return F.gelu(x, approximate="tanh" if name == "gelu_pytorch_tanh" else "none")


class PatchMerger(nn.Module):
    """merge × merge patches → one token of the language model's width (LayerNorm, MLP with exact gelu).
    postshuffle: normalise the concatenated block (DeepStack's mergers) instead of each patch."""

    def __init__(self, spec: VisionSpec, postshuffle: bool) -> None:
        super().__init__()
        self.width = spec.hidden_size * spec.spatial_merge_size**2
        self.postshuffle = postshuffle
        self.norm = nn.LayerNorm(self.width if postshuffle else spec.hidden_size, eps=LAYER_NORM_EPS)
        self.linear_fc1 = nn.Linear(self.width, self.width)
        self.linear_fc2 = nn.Linear(self.width, spec.out_hidden_size)

    def forward(self, x: Tensor) -> Tensor:
        x = self.norm(x.reshape(-1, self.width)) if self.postshuffle else self.norm(x).reshape(-1, self.width)
        return self.linear_fc2(F.gelu(self.linear_fc1(x)))


class VisionAttention(nn.Module):
    def __init__(self, spec: VisionSpec) -> None:
        super().__init__()
        self.heads, self.head_dim = spec.num_heads, spec.head_dim
        self.qkv = nn.Linear(spec.hidden_size, 3 * spec.hidden_size)
        self.proj = nn.Linear(spec.hidden_size, spec.hidden_size)

    def forward(self, x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
        n = x.shape[0]
        q, k, v = self.qkv(x).view(n, 3, self.heads, self.head_dim).unbind(1)  # each [n, heads, head_dim]
        q, k = _rotate(q, cos, sin), _rotate(k, cos, sin)
        y = F.scaled_dot_product_attention(q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1))  # one image
        return self.proj(y.transpose(0, 1).reshape(n, -1))


def _rotate(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    """Rotate-half RoPE in float32 (as transformers' vision rotary), back to x's dtype."""
    xf = x.float()
    x1, x2 = xf.chunk(2, dim=-1)
    return (xf * cos[:, None] + torch.cat((-x2, x1), dim=-1) * sin[:, None]).to(x.dtype)


class VisionBlock(nn.Module):
    def __init__(self, spec: VisionSpec) -> None:
        super().__init__()
        self.act = spec.hidden_act
        self.norm1 = nn.LayerNorm(spec.hidden_size, eps=LAYER_NORM_EPS)
        self.norm2 = nn.LayerNorm(spec.hidden_size, eps=LAYER_NORM_EPS)
        self.attn = VisionAttention(spec)
        self.mlp = nn.Module()
        self.mlp.linear_fc1 = nn.Linear(spec.hidden_size, spec.intermediate_size)
        self.mlp.linear_fc2 = nn.Linear(spec.intermediate_size, spec.hidden_size)

    def forward(self, x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
        x = x + self.attn(self.norm1(x), cos, sin)
        return x + self.mlp.linear_fc2(_gelu(self.act, self.mlp.linear_fc1(self.norm2(x))))


class VisionTower(nn.Module):
    """Qwen3-VL's vision encoder (HF names under `model.visual.`); frozen."""

    def __init__(self, spec: VisionSpec) -> None:
        super().__init__()
        self.spec = spec
        self.patch_embed = nn.Module()
        k = (spec.temporal_patch_size, spec.patch_size, spec.patch_size)
        self.patch_embed.proj = nn.Conv3d(spec.in_channels, spec.hidden_size, kernel_size=k, stride=k)
        self.pos_embed = nn.Embedding(spec.num_position_embeddings, spec.hidden_size)
        self.blocks = nn.ModuleList(VisionBlock(spec) for _ in range(spec.depth))
        self.merger = PatchMerger(spec, postshuffle=False)
        self.deepstack_merger_list = nn.ModuleList(PatchMerger(spec, postshuffle=True) for _ in spec.deepstack_layers)
        self.register_buffer("inv_freq", self._inv_freq(), persistent=False)

    def _inv_freq(self) -> Tensor:
        half = self.spec.head_dim // 2  # rows and columns each turn half of the head's frequencies
        return 1.0 / (self.spec.rope_theta ** (torch.arange(0, half, 2, dtype=torch.float) / half))

    def reset_buffers(self, device: torch.device | str) -> None:
        """Recompute the non-persistent buffers (a model built on the meta device has none)."""
        self.inv_freq = self._inv_freq().to(device)

    def forward(self, image: ImageInput) -> tuple[Tensor, list[Tensor]]:
        """One image's merged features [tokens, out_hidden] and its DeepStack features (one per deepstack layer)."""
        w = self.patch_embed.proj.weight
        patches = torch.from_numpy(image.patches).to(device=w.device, dtype=w.dtype)
        x = F.linear(patches, w.flatten(1), self.patch_embed.proj.bias)  # the conv with kernel = stride
        rows, cols = _patch_coordinates(image.grid, image.merge, x.device)
        x = x + self._grid_embedding(rows, cols, image.grid).to(x.dtype)
        angles = torch.cat((rows[:, None].float() * self.inv_freq, cols[:, None].float() * self.inv_freq), dim=-1)
        angles = torch.cat((angles, angles), dim=-1)
        cos, sin = angles.cos(), angles.sin()
        deepstack = []
        for i, block in enumerate(self.blocks):
            x = block(x, cos, sin)
            if i in self.spec.deepstack_layers:
                deepstack.append(self.deepstack_merger_list[self.spec.deepstack_layers.index(i)](x))
        return self.merger(x), deepstack

    def _grid_embedding(self, rows: Tensor, cols: Tensor, grid: tuple[int, int, int]) -> Tensor:
        """The learned side × side position grid resampled bilinearly (corners aligned) to the image's grid."""
        side = math.isqrt(self.spec.num_position_embeddings)
        _, h, w = grid

        def taps(index: Tensor, size: int) -> tuple[Tensor, Tensor]:
            src = index.float() * (side - 1) / max(size - 1, 1)
            lo = src.floor()
            offsets = torch.arange(2, device=index.device)
            weight = (1 - (src[:, None] - lo[:, None] - offsets).abs()).clamp(min=0)
            return (lo.long()[:, None] + offsets).clamp(0, side - 1), weight

        h_idx, h_w = taps(rows, h)
        w_idx, w_w = taps(cols, w)
        index = (h_idx[:, :, None] * side + w_idx[:, None, :]).flatten(1)  # [n, 4]
        weight = (h_w[:, :, None] * w_w[:, None, :]).flatten(1)
        return (self.pos_embed(index) * weight[:, :, None].to(self.pos_embed.weight.dtype)).sum(1)


def _patch_coordinates(grid: tuple[int, int, int], merge: int, device: torch.device) -> tuple[Tensor, Tensor]:
    """(row, col) of every patch in the processor's merge-block order, repeated per frame."""
    t, h, w = grid
    r = torch.arange(h, device=device)[:, None].expand(h, w)
    c = torch.arange(w, device=device)[None, :].expand(h, w)
    block = (h // merge, merge, w // merge, merge)
    rows = r.reshape(block).transpose(1, 2).flatten().repeat(t)
    cols = c.reshape(block).transpose(1, 2).flatten().repeat(t)
    return rows, cols


class FeatureCache:
    """Encoded images by digest, least recently used dropped past `max_bytes` (the tower is frozen, so
    an image's features depend only on its bytes)."""

    def __init__(self, max_bytes: int = 256 * 2**20) -> None:
        self.max_bytes = max_bytes
        self._entries: OrderedDict[str, tuple[Tensor, list[Tensor]]] = OrderedDict()
        self._bytes = 0
        self.encoded = 0  # images run through the tower (tests and metrics)

    def features(self, tower: VisionTower, image: ImageInput) -> tuple[Tensor, list[Tensor]]:
        hit = self._entries.get(image.digest)
        if hit is not None:
            self._entries.move_to_end(image.digest)
            return hit
        with torch.no_grad():
            out = tower(image)
        self.encoded += 1
        size = sum(t.numel() * t.element_size() for t in (out[0], *out[1]))
        self._entries[image.digest] = out
        self._bytes += size
        while self._bytes > self.max_bytes and len(self._entries) > 1:
            _, (e, ds) = self._entries.popitem(last=False)
            self._bytes -= sum(t.numel() * t.element_size() for t in (e, *ds))
        return out


class VisionLanguageModel(Transformer):
    """The decoder (with M-RoPE) plus `visual`, the frozen tower."""

    def __init__(self, cfg: ModelConfig, block: type[nn.Module] | None = None) -> None:
        super().__init__(cfg, block)
        assert cfg.vision is not None
        self.visual = VisionTower(cfg.vision)

    def reset_buffers(self, device: torch.device | str) -> None:
        super().reset_buffers(device)
        self.visual.reset_buffers(device)

    def vision_input(self, positions: Tensor, segments: Sequence[tuple[int, int, PromptImages | None]],
                     cache: FeatureCache | None = None) -> VisionInput | None:
        """positions [B, T]: every token's sequence position. segments: (first flat index, length,
        images) of runs of consecutive tokens of one sequence (a padded row, a prefill chunk, a decode
        row); None when no segment has images (plain RoPE then)."""
        if not any(images is not None and images.images for _, _, images in segments):
            return None
        cache = cache or FeatureCache()
        B, T = positions.shape
        flat = positions.reshape(-1).cpu().numpy()
        rope = np.repeat(flat[None], 3, axis=0)
        index: list[np.ndarray] = []
        rows: list[tuple[ImageInput, int, int]] = []  # (image, first token, end) per piece, in index order
        for first, n, images in segments:
            if images is None or not images.images:
                continue
            pos = flat[first : first + n]
            rope[:, first : first + n] = images.rope_positions(pos)
            # Consecutive positions (a row, a chunk): image tokens are where the positions fall in an image.
            for im, lo, hi in images.within(int(pos[0]), int(pos[-1]) + 1):
                index.append(first + np.arange(lo, hi) - int(pos[0]))
                rows.append((im, lo - im.start, hi - im.start))
        dev = positions.device
        feats = [cache.features(self.visual, im) for im, _, _ in rows]
        depth = len(self.config.vision.deepstack_layers)  # type: ignore[union-attr]
        if rows:
            embeds = torch.cat([e[a:b] for (e, _), (_, a, b) in zip(feats, rows, strict=True)])
            deepstack = [torch.cat([ds[d][a:b] for (_, ds), (_, a, b) in zip(feats, rows, strict=True)])
                         for d in range(depth)]
            idx = torch.from_numpy(np.concatenate(index)).to(dev)
        else:
            w = self.embed_tokens.weight
            embeds, deepstack = w.new_empty(0, w.shape[1]), [w.new_empty(0, w.shape[1])] * depth
            idx = torch.empty(0, dtype=torch.long, device=dev)
        return VisionInput(torch.from_numpy(rope).view(3, B, T).to(dev), idx, embeds, deepstack)
