"""Decoder-only transformer for the Llama, Qwen3 and Qwen3-MoE families, with multi-LoRA built in.

gpt-fast style: small modules, no framework. Every forward takes an optional `LoraBatch` (which
adapter each row uses) and an optional cache view (kv_cache.py: which cache blocks each row writes
and reads).
"""

from __future__ import annotations

import math
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from mint_server.model import invariant, kernels
from mint_server.model.config import ModelConfig
from mint_server.model.families import family_spec
from mint_server.model.kv_cache import CacheView, attend, visible
from mint_server.model.lora import LoraBatch
from mint_server.model.mla_spec import rope_attention_factor
from mint_server.model.moe import SparseMoE
from mint_server.model.tp import TP, embed
from mint_server.model.vision_input import VisionInput


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: Tensor) -> Tensor:
        if invariant.enabled():
            return invariant.rms_norm(x, self.weight, self.eps)
        # One fused op (fp32: no cast to keep parity for). Inference only: its backward measured
        # slower than autograd through the plain form (benchmarks/train.py --only ab).
        if x.dtype == torch.float32 and kernels.fast() and not torch.is_grad_enabled():
            return F.rms_norm(x, self.weight.shape, self.weight, self.eps)
        # Normalise in float32 like HF, then cast back: keeps bf16 parity.
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * xf.to(x.dtype)


def rope_inv_freq(cfg: ModelConfig) -> Tensor:
    dim = family_spec(cfg).rotary_dim(cfg)  # Qwen3.5: partial rotary
    inv_freq = 1.0 / (cfg.rope_theta ** (torch.arange(0, dim, 2, dtype=torch.float64) / dim))
    rs = cfg.rope_scaling
    kind = rs and (rs.get("rope_type") or rs.get("type"))
    if kind == "yarn":
        return yarn_inv_freq(rs, dim, cfg.rope_theta)
    if kind == "linear":  # positions interpolated: every frequency divided by `factor`
        return (inv_freq / float(rs["factor"])).float()
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


def yarn_inv_freq(rs: dict, dim: int, theta: float) -> Tensor:
    """YaRN (DeepSeek's long-context rope): interpolate the slow frequencies by `factor`, keep the
    fast ones, a linear ramp between the dims that turn beta_fast / beta_slow times in the original
    context. (The cos/sin factor is mla_spec.rope_attention_factor.)"""
    factor, ctx = float(rs["factor"]), rs["original_max_position_embeddings"]
    fast, slow = rs.get("beta_fast") or 32, rs.get("beta_slow") or 1

    def dim_of(turns: float) -> float:
        return dim * math.log(ctx / (turns * 2 * math.pi)) / (2 * math.log(theta))

    low, high = dim_of(fast), dim_of(slow)
    if rs.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    ramp = ((torch.arange(dim // 2, dtype=torch.float32) - low) / ((high - low) or 0.001)).clamp(0, 1)
    freq = 1.0 / theta ** (torch.arange(0, dim, 2, dtype=torch.float32) / dim)
    return freq / factor * ramp + freq * (1 - ramp)


def mrope_axes(section: tuple[int, int, int], half: int) -> Tensor:
    """Which rotary axis (0 t, 1 h, 2 w) each of the head's `half` frequencies turns with (Qwen3-VL's
    interleaved layout: h on j ≡ 1, w on j ≡ 2 (mod 3) up to 3 × their counts, t on the rest)."""
    axes = torch.zeros(half, dtype=torch.long)
    for axis in (1, 2):
        axes[axis : min(3 * section[axis], half) : 3] = axis
    return axes


def apply_rope(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    """x [B, H, T, D]; cos/sin [B, 1, T, D]; HF's rotate-half convention."""
    x1, x2 = x.chunk(2, dim=-1)
    return x * cos + torch.cat((-x2, x1), dim=-1) * sin


def signed_sin(sin: Tensor) -> Tensor:
    """sin with its first half negated: apply_rope_fast's form of rotate-half's sign."""
    half = sin.shape[-1] // 2
    return torch.cat((-sin[..., :half], sin[..., half:]), dim=-1)


def apply_rope_fast(x: Tensor, cos: Tensor, sin_signed: Tensor) -> Tensor:
    """apply_rope with the sign folded into sin (see signed_sin): one copy and one fused multiply-add
    instead of a negation, a concatenation, two products and a sum."""
    x1, x2 = x.chunk(2, dim=-1)
    return torch.addcmul(x * cos, torch.cat((x2, x1), dim=-1), sin_signed)


class PackedView:
    """Training without padding: a micro-batch's datums end to end in one row ([1, N] tokens),
    passed where a cache view goes. Every projection, LoRA delta and MLP runs once over the N real
    tokens; attention runs per datum (block-diagonal causal: each datum's queries see only its own
    earlier keys), one SDPA call on each datum's slice, as RaggedView does for prefill chunks. No KV
    is stored. lengths: each datum's tokens, in row order.
    """

    def __init__(self, lengths: list[int]) -> None:
        self.lengths = list(lengths)
        self.spans: list[tuple[int, int]] = []
        start = 0
        for n in self.lengths:
            self.spans.append((start, n))
            start += n
        self.tokens = start

    def attention(self, layer: int, q: Tensor, k: Tensor, v: Tensor, scale: float, gqa: bool,
                  window: int = 0, sinks: Tensor | None = None) -> Tensor:
        """q [1, H, N, D], k / v [1, Hkv, N, D] → [1, H, N, D], each datum attending to itself only."""
        if len(self.spans) == 1:
            return self._one(q, k, v, scale, gqa, window, sinks)
        return torch.cat([self._one(q[:, :, s : s + n], k[:, :, s : s + n], v[:, :, s : s + n], scale, gqa, window, sinks)
                          for s, n in self.spans], dim=2)

    @staticmethod
    def _one(q: Tensor, k: Tensor, v: Tensor, scale: float, gqa: bool, window: int, sinks: Tensor | None) -> Tensor:
        # the same calls as Attention's uncached path over one padded row
        n = q.shape[2]
        if window or sinks is not None:
            keys = torch.arange(n, device=q.device)
            mask = visible(keys, keys[:, None], window)[None, None] if window else None
            return attend(q, k, v, mask, scale, gqa, sinks)
        return F.scaled_dot_product_attention(q, k, v, is_causal=n > 1, enable_gqa=gqa)


class Attention(nn.Module):
    tp: TP | None = None  # set by tp.shard_model: this rank's heads only, o_proj's partial sums reduced

    def __init__(self, cfg: ModelConfig, layer: int) -> None:
        super().__init__()
        self.layer, self.n_heads, self.n_kv, self.head_dim = layer, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        bias = cfg.family.attention_bias
        self.q_proj = nn.Linear(cfg.hidden_size, cfg.num_heads * cfg.head_dim, bias=bias)
        self.k_proj = nn.Linear(cfg.hidden_size, cfg.num_kv_heads * cfg.head_dim, bias=bias)
        self.v_proj = nn.Linear(cfg.hidden_size, cfg.num_kv_heads * cfg.head_dim, bias=bias)
        self.o_proj = nn.Linear(cfg.num_heads * cfg.head_dim, cfg.hidden_size, bias=cfg.family.o_bias)
        self.window = cfg.window(layer)  # 0: full attention
        self.sinks = nn.Parameter(torch.zeros(cfg.num_heads)) if cfg.family.sinks else None
        self.qk_norm = cfg.family.qk_norm
        if self.qk_norm:
            self.q_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps)
            self.k_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps)

    def forward(self, x: Tensor, cos: Tensor, sin: Tensor, lora: LoraBatch | None, cache: CacheView | None) -> Tensor:
        B, T, _ = x.shape
        tp = self.tp
        if tp is not None:
            x = tp.enter(x)
        q = project(self.q_proj, x, lora, "q_proj", self.layer, tp).view(B, T, self.n_heads, self.head_dim)
        k = project(self.k_proj, x, lora, "k_proj", self.layer, tp).view(B, T, self.n_kv, self.head_dim)
        v = project(self.v_proj, x, lora, "v_proj", self.layer, tp).view(B, T, self.n_kv, self.head_dim)
        if self.qk_norm:
            q, k = self.q_norm(q), self.k_norm(k)
        q, k, v = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)
        if kernels.fast() and not invariant.enabled():  # addcmul's fused multiply-add may round otherwise
            ssin = signed_sin(sin)
            q, k = apply_rope_fast(q, cos, ssin), apply_rope_fast(k, cos, ssin)
        else:
            q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        gqa = self.n_heads != self.n_kv
        if cache is not None and (self.window or self.sinks is not None):
            y = cache.attention(self.layer, q, k, v, 1 / math.sqrt(self.head_dim), gqa, self.window, self.sinks)
        elif cache is not None:
            y = cache.attention(self.layer, q, k, v, 1 / math.sqrt(self.head_dim), gqa)
        elif self.window or self.sinks is not None:
            keys = torch.arange(T, device=x.device)
            mask = visible(keys, keys[:, None], self.window)[None, None] if self.window else None
            y = attend(q, k, v, mask, 1 / math.sqrt(self.head_dim), gqa, self.sinks)
        elif invariant.enabled():
            y = invariant.attention(q, k, v, torch.arange(T, device=x.device).expand(B, T), 1 / math.sqrt(self.head_dim))
        else:
            y = F.scaled_dot_product_attention(q, k, v, is_causal=T > 1, enable_gqa=gqa)
        y = y.transpose(1, 2).reshape(B, T, self.n_heads * self.head_dim)
        out = project(self.o_proj, y, lora, "o_proj", self.layer, tp)
        return out if tp is None else tp.reduce(out)


def project(linear: nn.Linear, x: Tensor, lora: LoraBatch | None, target: str, layer: int,
            tp: TP | None = None) -> Tensor:
    """Base projection plus the batch's LoRA delta for this target (never merged into the base).
    Under tensor parallelism both are this rank's share (see tp.py)."""
    y = invariant.linear(x, linear.weight, linear.bias) if invariant.enabled() else \
        kernels.linear(x, linear.weight, linear.bias)
    return y if lora is None else lora.apply(target, layer, x, y, tp=tp)


class MLP(nn.Module):
    tp: TP | None = None  # set by tp.shard_model: this rank's slice of the intermediate dim

    def __init__(self, cfg: ModelConfig, layer: int) -> None:
        super().__init__()
        self.layer = layer  # index among the dense-MLP layers (== layer number in a dense model)
        self.gate_proj = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=False)
        self.up_proj = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=False)
        self.down_proj = nn.Linear(cfg.intermediate_size, cfg.hidden_size, bias=False)

    def forward(self, x: Tensor, lora: LoraBatch | None) -> Tensor:
        tp = self.tp
        if tp is not None:
            x = tp.enter(x)
        g = project(self.gate_proj, x, lora, "gate_proj", self.layer, tp)
        u = project(self.up_proj, x, lora, "up_proj", self.layer, tp)
        out = project(self.down_proj, silu_mul(g, u), lora, "down_proj", self.layer, tp)
        return out if tp is None else tp.reduce(out)


def silu_mul(g: Tensor, u: Tensor) -> Tensor:
    """silu(g) · u; fast kernels without autograd reuse g's memory (it is a fresh projection output)."""
    if invariant.enabled():
        return invariant.silu_mul(g, u)
    if kernels.fast() and not torch.is_grad_enabled():
        return F.silu(g, inplace=True).mul_(u)
    return F.silu(g) * u


class Block(nn.Module):
    def __init__(self, cfg: ModelConfig, layer: int) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn = Attention(cfg, layer)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp: MLP | SparseMoE = (
            SparseMoE(cfg, cfg.sparse_layers.index(layer)) if cfg.is_sparse(layer)
            else MLP(cfg, cfg.dense_layers.index(layer))
        )

    def forward(self, x: Tensor, cos: Tensor, sin: Tensor, lora: LoraBatch | None, cache: CacheView | None) -> Tensor:
        if kernels.fast() and not torch.is_grad_enabled():  # residual adds in place: x is ours (see hidden_states)
            x = x.add_(self.self_attn(self.input_layernorm(x), cos, sin, lora, cache))
            return x.add_(self.mlp(self.post_attention_layernorm(x), lora))
        x = x + self.self_attn(self.input_layernorm(x), cos, sin, lora, cache)
        return x + self.mlp(self.post_attention_layernorm(x), lora)


class Transformer(nn.Module):
    tp: TP | None = None  # set by tp.shard_model: vocab-parallel embedding and lm_head
    ragged = True  # its attention takes a RaggedView (a step's sequences packed as one batch)
    vocab_start = 0  # first vocabulary row this rank holds
    # compiled_training.TrainingGraph (set by its attach; not imported here: it imports this module)
    training_graph: Any = None

    def __init__(self, cfg: ModelConfig, block: type[nn.Module] | None = None) -> None:
        super().__init__()
        self.config = cfg
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList((block or Block)(cfg, i) for i in range(cfg.num_layers))
        self.rope_factor = rope_attention_factor(cfg.rope_scaling)  # yarn scales cos/sin
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.lm_head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        if cfg.tie_word_embeddings:
            self.lm_head.weight = self.embed_tokens.weight
        self.register_buffer("inv_freq", rope_inv_freq(cfg), persistent=False)
        if cfg.mrope_section is not None:  # multimodal RoPE: the axis (t, h, w) each frequency turns with
            self.register_buffer("mrope_axes", mrope_axes(cfg.mrope_section, cfg.head_dim // 2), persistent=False)

    def reset_buffers(self, device: torch.device | str) -> None:
        """Compute the non-persistent buffers on `device` (a model built on the meta device has none)."""
        self.inv_freq = rope_inv_freq(self.config).to(device)
        if self.config.mrope_section is not None:
            self.mrope_axes = mrope_axes(self.config.mrope_section, self.config.head_dim // 2).to(device)

    def hidden_states(
        self,
        tokens: Tensor,
        positions: Tensor | None = None,
        lora: LoraBatch | None = None,
        cache: CacheView | None = None,
        recomputed_blocks: int = 0,
        vision: VisionInput | None = None,
    ) -> Tensor:
        """tokens [B, T] → final-norm hidden states [B, T, hidden]. positions default to 0..T-1.

        recomputed_blocks: the first k blocks keep only their input for backward and run again then
        (activation checkpointing: long training batches fit in memory for k/L of one more forward).
        Ignored without autograd.
        vision: the batch's images (qwen3_vl.VisionInput): their features, rotary positions, DeepStack.
        """
        B, T = tokens.shape
        if positions is None:
            positions = torch.arange(T, device=tokens.device).expand(B, T)
        # a fresh tensor: blocks may add into it in place
        x = self.embed_tokens(tokens) if self.tp is None else embed(self, tokens)
        if vision is not None:
            x = vision.splice(x)
        cos, sin = self.rope(positions if vision is None else vision.rope_positions)
        if self.rope_factor != 1.0:
            cos, sin = cos * self.rope_factor, sin * self.rope_factor
        cos, sin = cos.to(x.dtype), sin.to(x.dtype)
        recompute = recomputed_blocks if cache is None and torch.is_grad_enabled() else 0
        return self.norm(self.blocks(x, cos, sin, lora, cache, recompute, vision))

    def packed_hidden_states(self, tokens: Tensor, lengths: list[int], lora: LoraBatch | None = None,
                             recomputed_blocks: int = 0) -> Tensor:
        """Training without padding: tokens [1, N] are datums of `lengths` end to end; each datum's
        positions restart at 0 and it attends only to itself (PackedView). → [1, N, hidden], equal
        to hidden_states of each datum alone. For the families whose blocks are this module's
        (training.packing_unsupported says which)."""
        positions = torch.cat([torch.arange(n, device=tokens.device) for n in lengths])[None]
        x = self.embed_tokens(tokens)
        cos, sin = self.rope(positions)
        if self.rope_factor != 1.0:
            cos, sin = cos * self.rope_factor, sin * self.rope_factor
        cos, sin = cos.to(x.dtype), sin.to(x.dtype)
        recompute = recomputed_blocks if torch.is_grad_enabled() else 0
        return self.norm(self.blocks(x, cos, sin, lora, PackedView(lengths), recompute))  # type: ignore[arg-type]

    def blocks(self, x: Tensor, cos: Tensor, sin: Tensor, lora: LoraBatch | None, cache: CacheView | None,
               recomputed_blocks: int, vision: VisionInput | None = None) -> Tensor:
        """run_layers, or for a training pass (no KV cache) the trainer's compiled blocks where they
        apply (model/compiled_training.py; each eager pass counted with its reason)."""
        graph = self.training_graph
        if graph is None or not (cache is None or isinstance(cache, PackedView)):
            return self.run_layers(x, cos, sin, lora, cache, recomputed_blocks, vision)
        reason = graph.eager_reason(x, lora, cache, vision)
        if reason is None:
            out = graph.run_layers(x, cos, sin, lora, cache, recomputed_blocks)  # type: ignore[arg-type]
            if out is not None:
                return out
            reason = "compile failed"
        graph.note_eager(reason)
        return self.run_layers(x, cos, sin, lora, cache, recomputed_blocks, vision)

    def run_layers(self, x: Tensor, cos: Tensor, sin: Tensor, lora: LoraBatch | None, cache: CacheView | None,
                   recomputed_blocks: int, vision: VisionInput | None = None) -> Tensor:
        """The blocks in order, the first `recomputed_blocks` checkpointed (a family whose blocks hand
        state to the next overrides this)."""
        for i, block in enumerate(self.layers):
            if i < recomputed_blocks:
                x = torch.utils.checkpoint.checkpoint(block, x, cos, sin, lora, cache, use_reentrant=False)
            else:
                x = block(x, cos, sin, lora, cache)
            if vision is not None:
                x = vision.after_layer(i, x)
        return x

    def rope(self, positions: Tensor) -> tuple[Tensor, Tensor]:
        """cos, sin [B, 1, T, head_dim] of positions [B, T] (float32). Invariant mode reads them from a
        table computed once, so a position's values do not depend on how many are computed at once.
        Multimodal RoPE: positions [3, B, T] (t, h, w), each frequency turning with its own axis."""
        if positions.dim() == 3:
            angles = positions[..., None].float() * self.inv_freq  # [3, B, T, half]
            axes = self.mrope_axes.view(1, 1, 1, -1).expand(1, *angles.shape[1:])
            angles = angles.gather(0, axes)[0][:, None]
            angles = torch.cat((angles, angles), dim=-1)
            return angles.cos(), angles.sin()
        if invariant.enabled():
            need = int(positions.max()) + 1
            table = getattr(self, "_rope_table", None)
            if table is None or table[0].shape[0] < need or table[0].device != positions.device:
                length = max(need, self.config.max_position_embeddings)
                self._rope_table = table = invariant.rope_table(self.inv_freq.to(positions.device), length)
            return table[0][positions][:, None], table[1][positions][:, None]
        angles = positions[:, None, :, None].float() * self.inv_freq[None, None, None, :]
        angles = torch.cat((angles, angles), dim=-1)
        return angles.cos(), angles.sin()

    def logits(self, h: Tensor, lora: LoraBatch | None = None) -> Tensor:
        if self.tp is None:
            return project(self.lm_head, h, lora, "lm_head", 0)
        return self.tp.gather(self.local_logits(h, lora))

    def local_logits(self, h: Tensor, lora: LoraBatch | None = None) -> Tensor:
        """Tensor-parallel: this rank's vocabulary slice of the logits (rows vocab_start…), not gathered."""
        assert self.tp is not None
        return project(self.lm_head, self.tp.enter(h), lora, "lm_head", 0, self.tp)

    def forward(
        self,
        tokens: Tensor,
        positions: Tensor | None = None,
        lora: LoraBatch | None = None,
        cache: CacheView | None = None,
        vision: VisionInput | None = None,
    ) -> Tensor:
        return self.logits(self.hidden_states(tokens, positions, lora, cache, vision=vision), lora)
