"""What one forward needs of its sequences' images (vision-language families, model/qwen3_vl.py
builds it): every token's multimodal rotary positions, and the image tokens with their features."""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor


@dataclass
class VisionInput:
    """What one forward needs of its sequences' images: every token's rotary positions, and the
    image tokens (flat indices into the [B, T] batch) with their features."""

    rope_positions: Tensor  # [3, B, T] long
    index: Tensor  # [n] long: flat positions of image tokens
    embeds: Tensor  # [n, hidden]: their input embeddings (the merger's output)
    deepstack: list[Tensor]  # per deepstack layer [n, hidden]: added after LM layer i

    def splice(self, x: Tensor) -> Tensor:
        """x [B, T, hidden] with the image tokens' embeddings replaced by their features."""
        if not self.index.numel():
            return x
        B, T, H = x.shape
        return x.reshape(B * T, H).index_copy(0, self.index, self.embeds.to(x.dtype)).view(B, T, H)

    def after_layer(self, layer: int, x: Tensor) -> Tensor:
        """DeepStack: layer `layer`'s output plus that layer's features on the image tokens."""
        if layer >= len(self.deepstack) or not self.index.numel():
            return x
        B, T, H = x.shape
        add = self.deepstack[layer].to(x.dtype)
        if torch.is_grad_enabled() and x.requires_grad:
            return x.reshape(B * T, H).index_add(0, self.index, add).view(B, T, H)
        x.view(B * T, H).index_add_(0, self.index, add)  # x is the block's fresh output
        return x
