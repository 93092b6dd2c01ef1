"""Decoder-only transformer for the dense Llama and Qwen3 families, with multi-LoRA built in.

gpt-fast style: small modules, no framework. Every forward takes an optional `LoraBatch` (which
adapter each row uses) and an optional `KVCache` view (which cache slot each row writes and reads).
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from mint_server.model.config import ModelConfig
from mint_server.model.lora import LoraBatch


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: Tensor) -> Tensor:
        # Normalise in float32 like HF, then cast back: keeps bf16 parity.
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * xf.to(x.dtype)


def rope_inv_freq(cfg: ModelConfig) -> Tensor:
    dim = cfg.head_dim
    inv_freq = 1.0 / (cfg.rope_theta ** (torch.arange(0, dim, 2, dtype=torch.float64) / dim))
    rs = cfg.rope_scaling
    if rs:  # llama3: long wavelengths scaled down by `factor`, a smooth ramp between the two cut-offs
        factor, low, high = rs["factor"], rs["low_freq_factor"], rs["high_freq_factor"]
        old_ctx = rs["original_max_position_embeddings"]
        wavelen = 2 * math.pi / inv_freq
        smooth = (old_ctx / wavelen - low) / (high - low)
        scaled = torch.where(wavelen > old_ctx / low, inv_freq / factor, inv_freq)
        mid = (1 - smooth) * inv_freq / factor + smooth * inv_freq
        is_mid = (wavelen <= old_ctx / low) & (wavelen >= old_ctx / high)
        inv_freq = torch.where(is_mid, mid, scaled)
    return inv_freq.float()


def apply_rope(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    """x [B, H, T, D]; cos/sin [B, 1, T, D]; HF's rotate-half convention."""
    x1, x2 = x.chunk(2, dim=-1)
    return x * cos + torch.cat((-x2, x1), dim=-1) * sin


class KVCache:
    """Preallocated K/V for `num_slots` sequences of up to `max_len` tokens, per layer.

    A forward writes the new keys/values of row i into slot `slots[i]` at its absolute positions and
    attends over that slot's prefix; memory is fixed at construction (the engine's KV budget).
    """

    def __init__(
        self, cfg: ModelConfig, num_slots: int, max_len: int, device: torch.device | str, dtype: torch.dtype
    ) -> None:
        shape = (cfg.num_layers, num_slots, cfg.num_kv_heads, max_len, cfg.head_dim)
        self.k = torch.zeros(shape, device=device, dtype=dtype)
        self.v = torch.zeros(shape, device=device, dtype=dtype)
        self.num_slots, self.max_len = num_slots, max_len

    @property
    def nbytes(self) -> int:
        return self.k.numel() * self.k.element_size() * 2

    def copy_prefix(self, src: int, dsts: list[int], length: int) -> None:
        """Fork: the first `length` positions of slot `src` into each of `dsts` (shared-prefix sampling)."""
        if dsts:
            idx = torch.tensor(dsts, device=self.k.device)
            self.k[:, idx, :, :length] = self.k[:, src : src + 1, :, :length]
            self.v[:, idx, :, :length] = self.v[:, src : src + 1, :, :length]


class CacheView:
    """Which cache slot each batch row uses, and how far attention must look (set per forward)."""

    def __init__(self, cache: KVCache, slots: Tensor, positions: Tensor) -> None:
        self.cache, self.slots, self.positions = cache, slots, positions
        self.kv_len = int(positions.max()) + 1
        # [B, 1, T, kv_len]: a query sees keys at positions ≤ its own; stale keys beyond are masked.
        keys = torch.arange(self.kv_len, device=positions.device)
        self.mask = (keys[None, None, None, :] <= positions[:, None, :, None])

    def update(self, layer: int, k: Tensor, v: Tensor) -> tuple[Tensor, Tensor]:
        c = self.cache
        rows = self.slots[:, None].expand_as(self.positions)
        # Advanced indices around a slice put (row, token) first: [B, T, H, D].
        c.k[layer][rows, :, self.positions] = k.transpose(1, 2)
        c.v[layer][rows, :, self.positions] = v.transpose(1, 2)
        return c.k[layer][self.slots, :, : self.kv_len], c.v[layer][self.slots, :, : self.kv_len]


class Attention(nn.Module):
    def __init__(self, cfg: ModelConfig, layer: int) -> None:
        super().__init__()
        self.layer, self.n_heads, self.n_kv, self.head_dim = layer, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        bias = cfg.family.attention_bias
        self.q_proj = nn.Linear(cfg.hidden_size, cfg.num_heads * cfg.head_dim, bias=bias)
        self.k_proj = nn.Linear(cfg.hidden_size, cfg.num_kv_heads * cfg.head_dim, bias=bias)
        self.v_proj = nn.Linear(cfg.hidden_size, cfg.num_kv_heads * cfg.head_dim, bias=bias)
        self.o_proj = nn.Linear(cfg.num_heads * cfg.head_dim, cfg.hidden_size, bias=False)
        self.qk_norm = cfg.family.qk_norm
        if self.qk_norm:
            self.q_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps)
            self.k_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps)

    def forward(self, x: Tensor, cos: Tensor, sin: Tensor, lora: LoraBatch | None, cache: CacheView | None) -> Tensor:
        B, T, _ = x.shape
        q = project(self.q_proj, x, lora, "q_proj", self.layer).view(B, T, self.n_heads, self.head_dim)
        k = project(self.k_proj, x, lora, "k_proj", self.layer).view(B, T, self.n_kv, self.head_dim)
        v = project(self.v_proj, x, lora, "v_proj", self.layer).view(B, T, self.n_kv, self.head_dim)
        if self.qk_norm:
            q, k = self.q_norm(q), self.k_norm(k)
        q, k, v = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        gqa = self.n_heads != self.n_kv
        if cache is None:
            y = F.scaled_dot_product_attention(q, k, v, is_causal=T > 1, enable_gqa=gqa)
        else:
            k, v = cache.update(self.layer, k, v)
            y = F.scaled_dot_product_attention(q, k, v, attn_mask=cache.mask, enable_gqa=gqa)
        y = y.transpose(1, 2).reshape(B, T, self.n_heads * self.head_dim)
        return project(self.o_proj, y, lora, "o_proj", self.layer)


def project(linear: nn.Linear, x: Tensor, lora: LoraBatch | None, target: str, layer: int) -> Tensor:
    """Base projection plus the batch's LoRA delta for this target (never merged into the base)."""
    y = linear(x)
    if lora is not None:
        d = lora.delta(target, layer, x)
        if d is not None:
            y = y + d
    return y


class MLP(nn.Module):
    def __init__(self, cfg: ModelConfig, layer: int) -> None:
        super().__init__()
        self.layer = layer
        self.gate_proj = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=False)
        self.up_proj = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=False)
        self.down_proj = nn.Linear(cfg.intermediate_size, cfg.hidden_size, bias=False)

    def forward(self, x: Tensor, lora: LoraBatch | None) -> Tensor:
        g = project(self.gate_proj, x, lora, "gate_proj", self.layer)
        u = project(self.up_proj, x, lora, "up_proj", self.layer)
        return project(self.down_proj, F.silu(g) * u, lora, "down_proj", self.layer)


class Block(nn.Module):
    def __init__(self, cfg: ModelConfig, layer: int) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn = Attention(cfg, layer)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp = MLP(cfg, layer)

    def forward(self, x: Tensor, cos: Tensor, sin: Tensor, lora: LoraBatch | None, cache: CacheView | None) -> Tensor:
        x = x + self.self_attn(self.input_layernorm(x), cos, sin, lora, cache)
        return x + self.mlp(self.post_attention_layernorm(x), lora)


class Transformer(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.config = cfg
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(Block(cfg, i) for i in range(cfg.num_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.lm_head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        if cfg.tie_word_embeddings:
            self.lm_head.weight = self.embed_tokens.weight
        self.register_buffer("inv_freq", rope_inv_freq(cfg), persistent=False)

    def hidden_states(
        self,
        tokens: Tensor,
        positions: Tensor | None = None,
        lora: LoraBatch | None = None,
        cache: CacheView | None = None,
    ) -> Tensor:
        """tokens [B, T] → final-norm hidden states [B, T, hidden]. positions default to 0..T-1."""
        B, T = tokens.shape
        if positions is None:
            positions = torch.arange(T, device=tokens.device).expand(B, T)
        angles = positions[:, None, :, None].float() * self.inv_freq[None, None, None, :]
        angles = torch.cat((angles, angles), dim=-1)
        x = self.embed_tokens(tokens)
        cos, sin = angles.cos().to(x.dtype), angles.sin().to(x.dtype)
        for block in self.layers:
            x = block(x, cos, sin, lora, cache)
        return self.norm(x)

    def logits(self, h: Tensor, lora: LoraBatch | None = None) -> Tensor:
        return project(self.lm_head, h, lora, "lm_head", 0)

    def forward(
        self,
        tokens: Tensor,
        positions: Tensor | None = None,
        lora: LoraBatch | None = None,
        cache: CacheView | None = None,
    ) -> Tensor:
        return self.logits(self.hidden_states(tokens, positions, lora, cache), lora)
