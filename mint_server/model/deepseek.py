"""DeepSeek-V3 / V3.2 (and Kimi-K2, same architecture) in our model code, with multi-LoRA built in.

Multi-head Latent Attention (MLA): see mla_spec.py for the projections. Two ways to attend:
- expanded (training, prefill without a cache, and the reference): `kv_b_proj` turns every key's
  latent into per-head no-RoPE keys and values, then ordinary attention;
- absorbed (whenever a KV cache is given, i.e. sampling): the cache holds only each token's latent
  and RoPE key; `kv_b_proj`'s key half is folded into the query (q_lat = W_kᵀ q_nope, scores =
  q_lat·c + q_rope·k_rope) and its value half into the output (o = W_v Σ p c), so no per-head key or
  value is ever materialised. A LoRA on `kv_b_proj` changes W to W + s·B A per row; its delta enters
  both folded products exactly (q_lat += s·Aᵀ(B_kᵀ q_nope), o += s·B_v(A Σ p c)).

DeepSeek MoE: sigmoid expert scores; a per-expert bias (`e_score_correction_bias`) steers only which
experts are chosen, within the `topk_group` best of `n_group` groups (a group scores the sum of its
two best); the chosen experts' unbiased scores, optionally renormalised, times
`routed_scaling_factor`, weight their outputs; `n_shared_experts` always-on experts (one SwiGLU of
n_shared · moe_intermediate) are added. The routed experts reuse moe.SparseMoE (expert LoRA, pair
grouping); the shared experts are LoRA targets `shared_{gate,up,down}_proj`.

DeepSeek Sparse Attention (V3.2): a lightning indexer scores every earlier token for each query
(Σ_h w_h · relu(q_h · k) with its own small heads and one key per token, cached beside the
latent) and the query attends only to its `index_topk` best. The indexer is frozen: it never
trains, gets no LoRA and no gradient (docs/mla.md says why).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from mint_server.model.config import ModelConfig
from mint_server.model.kv_cache import CacheView
from mint_server.model.lora import LoraBatch
from mint_server.model.moe import SparseMoE
from mint_server.model.tp_group import TP
from mint_server.model.transformer import MLP, RMSNorm, Transformer, apply_rope, project

LATENT_NORM_EPS = 1e-6  # q_a_layernorm / kv_a_layernorm: HF builds them with the default eps


# Score elements one attention product may hold at once (64 MiB in float32): a prefill chunk's queries
# run in tiles of that many against a long prefix, so attention memory grows linearly with the prefix.
SCORE_ELEMENTS = 1 << 24


def apply_rope_interleaved(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    """DeepSeek's layout: pairs (x0, x1), (x2, x3) … each rotated by one frequency; the output is
    de-interleaved (rotated evens, then odds), as in HF. cos/sin: the usual cat(freqs, freqs)."""
    half = x.shape[-1] // 2
    c, s = cos[..., :half], sin[..., :half]
    x1, x2 = x[..., 0::2], x[..., 1::2]
    return torch.cat((x1 * c - x2 * s, x2 * c + x1 * s), dim=-1)


def lora_rows(lora: LoraBatch | None, target: str, layer: int) -> tuple[Tensor, Tensor, Tensor] | None:
    """Each batch row's (A [rows, r, in], B [rows, out, r], scale [rows]) for a target, or None if no
    row's adapter has it. Base rows get scale 0 (their delta vanishes)."""
    if lora is None or not lora.has(target):
        return None
    A, B = lora.weights[target]
    return A[:, layer][lora.row_index], B[:, layer][lora.row_index], lora.row_scale


class Indexer(nn.Module):
    """V3.2's lightning indexer (frozen). Its key per token is cached in the `index_k` pool."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        m = cfg.mla
        assert m is not None and m.q_lora_rank is not None
        self.n_heads, self.head_dim, self.top_k, self.rope_dim = m.index_n_heads, m.index_head_dim, m.index_topk, m.qk_rope_head_dim
        self.rope = apply_rope_interleaved if m.index_rope_interleave else apply_rope  # V3.2: rotate-half
        self.wq_b = nn.Linear(m.q_lora_rank, m.index_n_heads * m.index_head_dim, bias=False)
        self.wk = nn.Linear(cfg.hidden_size, m.index_head_dim, bias=False)
        self.k_norm = nn.LayerNorm(m.index_head_dim, eps=1e-6)
        self.weights_proj = nn.Linear(cfg.hidden_size, m.index_n_heads, bias=False)

    @torch.no_grad()
    def select(self, x: Tensor, q_resid: Tensor, cos: Tensor, sin: Tensor, visible: Tensor,
               cache: CacheView | None, layer: int) -> Tensor:
        """visible [B|1, 1, T, L] bool (causal) → the same mask narrowed to each query's top-k keys."""
        B, T, _ = x.shape
        q = self.wq_b(q_resid).view(B, T, self.n_heads, self.head_dim)
        k = self.k_norm(self.wk(x))  # [B, T, D]
        r = self.rope_dim
        # The indexer rotates its first `r` dims.
        q = torch.cat((self.rope(q[..., :r], cos.transpose(1, 2), sin.transpose(1, 2)), q[..., r:]), dim=-1)
        k = torch.cat((self.rope(k[..., :r], cos[:, 0], sin[:, 0]), k[..., r:]), dim=-1)
        if cache is not None:
            k = cache.store("index_k", layer, k)  # [B, L, D]
        w = self.weights_proj(x).float() * self.n_heads**-0.5  # [B, T, H]
        q, k = q.float(), k.float()
        # Queries in tiles: a prefill chunk's [tile, heads, L] scores stay bounded however long the prefix.
        tile = max(1, SCORE_ELEMENTS // (self.n_heads * k.shape[1]))
        chosen = []
        for i in range(0, T, tile):
            scores = torch.einsum("bthd,bld->bthl", q[:, i : i + tile], k) * self.head_dim**-0.5
            index = torch.einsum("bth,bthl->btl", w[:, i : i + tile], F.relu(scores))
            index = index.masked_fill(~visible[:, 0, i : i + tile], float("-inf"))
            top = index.topk(min(self.top_k, index.shape[-1]), dim=-1).indices
            chosen.append(torch.zeros_like(index, dtype=torch.bool).scatter_(-1, top, True))
        return visible & torch.cat(chosen, dim=1)[:, None]


class MLAttention(nn.Module):
    # Decode with the cache in absorbed form (False: expand the cached latents per head — the naive
    # reference path; tests and benchmarks/mla.py flip it).
    absorb = True
    # set by tp.shard_model: this rank's heads only (q_b_proj / q_proj and kv_b_proj column-parallel,
    # o_proj row-parallel); q_a_proj, kv_a_proj_with_mqa, the latent and its cache, the indexer whole
    tp: TP | None = None

    def __init__(self, cfg: ModelConfig, layer: int) -> None:
        super().__init__()
        m = cfg.mla
        assert m is not None
        self.spec, self.layer, self.n_heads = m, layer, cfg.num_heads
        h, H, bias = cfg.hidden_size, cfg.num_heads, m.attention_bias
        if m.q_lora_rank is None:
            self.q_proj = nn.Linear(h, H * m.qk_head_dim, bias=False)
        else:
            self.q_a_proj = nn.Linear(h, m.q_lora_rank, bias=bias)
            self.q_a_layernorm = RMSNorm(m.q_lora_rank, LATENT_NORM_EPS)
            self.q_b_proj = nn.Linear(m.q_lora_rank, H * m.qk_head_dim, bias=False)
        self.kv_a_proj_with_mqa = nn.Linear(h, m.kv_lora_rank + m.qk_rope_head_dim, bias=bias)
        self.kv_a_layernorm = RMSNorm(m.kv_lora_rank, LATENT_NORM_EPS)
        self.kv_b_proj = nn.Linear(m.kv_lora_rank, H * (m.qk_nope_head_dim + m.v_head_dim), bias=False)
        self.o_proj = nn.Linear(H * m.v_head_dim, h, bias=bias)
        # GLM-5's "shared" layers have no indexer: they reuse an earlier layer's choice of keys.
        self.indexer = Indexer(cfg) if m.has_indexer(layer) else None

    def forward(self, x: Tensor, cos: Tensor, sin: Tensor, lora: LoraBatch | None, cache: CacheView | None) -> Tensor:
        return self.attend(x, cos, sin, lora, cache)[0]

    def attend(self, x: Tensor, cos: Tensor, sin: Tensor, lora: LoraBatch | None, cache: CacheView | None,
               selection: Tensor | None = None) -> tuple[Tensor, Tensor | None]:
        """The attention output and the DSA key selection it used (None without DSA). A layer
        without its own indexer attends to `selection`, an earlier layer's (same queries, same keys)."""
        m, L, H, tp = self.spec, self.layer, self.n_heads, self.tp
        B, T, _ = x.shape
        # Under tensor parallelism the whole (replicated) activations enter this rank's heads through
        # tp.enter, so their gradients — and the replicated down-projections' LoRA — are summed over ranks.
        enter = (lambda t: t) if tp is None else tp.enter
        if m.q_lora_rank is None:
            q_resid, q = None, project(self.q_proj, enter(x), lora, "q_proj", L, tp)
        else:
            q_resid = self.q_a_layernorm(project(self.q_a_proj, x, lora, "q_a_proj", L))
            q = project(self.q_b_proj, enter(q_resid), lora, "q_b_proj", L, tp)
        q_nope, q_rope = q.view(B, T, H, m.qk_head_dim).transpose(1, 2).split([m.qk_nope_head_dim, m.qk_rope_head_dim], -1)
        latent, k_rope = project(self.kv_a_proj_with_mqa, x, lora, "kv_a_proj_with_mqa", L).split(
            [m.kv_lora_rank, m.qk_rope_head_dim], -1)
        latent = self.kv_a_layernorm(latent)  # [B, T, r]
        rope = apply_rope_interleaved if m.rope_interleave else apply_rope
        q_rope, k_rope = rope(q_rope, cos, sin), rope(k_rope[:, None], cos, sin)[:, 0]  # [B, T, dr]
        latent, k_rope = enter(latent), enter(k_rope)
        if cache is None:
            visible = None if not m.dsa else torch.ones(T, T, dtype=torch.bool, device=x.device).tril()[None, None]
        else:
            latent, k_rope, visible = cache.store("latent", L, latent), cache.store("k_rope", L, k_rope), cache.mask
        if self.indexer is not None:
            assert q_resid is not None and visible is not None
            visible = self.indexer.select(x, q_resid, cos, sin, visible, cache, L)
        elif m.dsa:
            if selection is None:
                raise ValueError(f"layer {L} reuses an earlier layer's DSA selection but none was given")
            visible = selection
        if cache is not None and self.absorb:
            y = self._absorbed(q_nope, q_rope, latent, k_rope, visible, lora)
        else:
            y = self._expanded(q_nope, q_rope, latent, k_rope, visible, lora)
        out = project(self.o_proj, y.transpose(1, 2).reshape(B, T, H * m.v_head_dim), lora, "o_proj", L, tp)
        return out if tp is None else tp.reduce(out), visible if m.dsa else None

    def _expanded(self, q_nope: Tensor, q_rope: Tensor, latent: Tensor, k_rope: Tensor, visible: Tensor | None,
                  lora: LoraBatch | None) -> Tensor:
        """Per-head keys/values from the latents [B, S, r] (kv_b_proj with its LoRA), then attention."""
        m, H = self.spec, self.n_heads
        B, S, _ = latent.shape
        kv = project(self.kv_b_proj, latent, lora, "kv_b_proj", self.layer, self.tp).view(B, S, H, -1).transpose(1, 2)
        k_nope, v = kv.split([m.qk_nope_head_dim, m.v_head_dim], -1)
        k = torch.cat((k_nope, k_rope[:, None].expand(B, H, S, m.qk_rope_head_dim)), dim=-1)
        q = torch.cat((q_nope, q_rope), dim=-1)
        causal = visible is None and q.shape[2] > 1
        return F.scaled_dot_product_attention(q, k, v, attn_mask=visible, is_causal=causal, scale=m.softmax_scale)

    def _absorbed(self, q_nope: Tensor, q_rope: Tensor, latent: Tensor, k_rope: Tensor, visible: Tensor,
                  lora: LoraBatch | None) -> Tensor:
        """Attention straight over the cached latents [B, S, r] and rope keys [B, S, dr]."""
        m, H = self.spec, self.n_heads
        dn = m.qk_nope_head_dim
        W = self.kv_b_proj.weight.view(H, dn + m.v_head_dim, m.kv_lora_rank)
        q_lat = torch.einsum("bhtd,hdr->bhtr", q_nope, W[:, :dn])
        delta = lora_rows(lora, "kv_b_proj", self.layer)
        if delta is not None:
            A, Bm, s = delta
            Bm = Bm.view(Bm.shape[0], H, dn + m.v_head_dim, -1)
            t = torch.einsum("bhtd,bhdk->bhtk", q_nope, Bm[:, :, :dn]) * s[:, None, None, None].to(q_nope.dtype)
            q_lat = q_lat + torch.einsum("bhtk,bkr->bhtr", t, A)
        # A prefill chunk's queries in tiles: the [H, tile, S] scores stay bounded however long the prefix.
        tile = max(1, SCORE_ELEMENTS // (H * latent.shape[1]))
        T = q_lat.shape[2]
        u = torch.cat([self._latent_attention(q_lat[:, :, i : i + tile], q_rope[:, :, i : i + tile], latent, k_rope,
                                              visible[:, :, i : i + tile]) for i in range(0, T, tile)], dim=2)
        y = torch.einsum("bhtr,hvr->bhtv", u, W[:, dn:])
        if delta is not None:
            t = torch.einsum("bhtr,bkr->bhtk", u, A) * s[:, None, None, None].to(u.dtype)
            y = y + torch.einsum("bhtk,bhvk->bhtv", t, Bm[:, :, dn:])
        return y


    def _latent_attention(self, q_lat: Tensor, q_rope: Tensor, latent: Tensor, k_rope: Tensor,
                          visible: Tensor) -> Tensor:
        """The attention-weighted latent [B, H, T, r] of queries q_lat [B, H, T, r], q_rope [B, H, T, dr]."""
        # Heads fold into the row's query axis: one bmm per product against the row's shared latents,
        # never an H-fold broadcast copy of the cache.
        B, H, T, r = q_lat.shape
        S = latent.shape[1]
        scores = torch.baddbmm(q_rope.reshape(B, H * T, -1) @ k_rope.transpose(1, 2), q_lat.reshape(B, H * T, r),
                               latent.transpose(1, 2)).view(B, H, T, S) * self.spec.softmax_scale
        p = scores.masked_fill(~visible, float("-inf")).softmax(-1, dtype=torch.float32).to(q_lat.dtype)
        return (p.view(B, H * T, S) @ latent).view(B, H, T, r)


class Router(nn.Module):
    """HF's `mlp.gate`: weight [E, hidden] and the choice-only bias; both kept in float32."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(cfg.num_experts, cfg.hidden_size))
        self.register_buffer("e_score_correction_bias", torch.zeros(cfg.num_experts))


class SharedExperts(nn.Module):
    tp: TP | None = None  # set by tp.shard_model: this rank's slice of the intermediate dim, like a dense MLP

    def __init__(self, cfg: ModelConfig, index: int) -> None:
        super().__init__()
        m = cfg.mla
        assert m is not None
        self.index, inter = index, m.n_shared_experts * cfg.moe_intermediate_size
        self.gate_proj = nn.Linear(cfg.hidden_size, inter, bias=False)
        self.up_proj = nn.Linear(cfg.hidden_size, inter, bias=False)
        self.down_proj = nn.Linear(inter, cfg.hidden_size, bias=False)

    def forward(self, x: Tensor, lora: LoraBatch | None) -> Tensor:
        tp = self.tp
        if tp is not None:
            x = tp.enter(x)
        g = project(self.gate_proj, x, lora, "shared_gate_proj", self.index, tp)
        u = project(self.up_proj, x, lora, "shared_up_proj", self.index, tp)
        out = project(self.down_proj, F.silu(g) * u, lora, "shared_down_proj", self.index, tp)
        return out if tp is None else tp.reduce(out)


class DeepseekMoE(SparseMoE):
    def __init__(self, cfg: ModelConfig, index: int) -> None:
        super().__init__(cfg, index)
        m = cfg.mla
        assert m is not None
        if cfg.num_experts % m.n_group:
            raise ValueError(f"n_routed_experts {cfg.num_experts} is not a multiple of n_group {m.n_group}")
        self.n_group, self.topk_group, self.scaling = m.n_group, m.topk_group, m.routed_scaling_factor
        self.gate = Router(cfg)  # type: ignore[assignment]
        self.shared_experts = SharedExperts(cfg, index) if m.n_shared_experts else None

    def route(self, x: Tensor) -> tuple[Tensor, Tensor]:
        N, E = x.shape[0], self.num_experts
        scores = F.linear(x.float(), self.gate.weight.float()).sigmoid()
        choice = scores + self.gate.e_score_correction_bias.float()
        groups = choice.view(N, self.n_group, E // self.n_group)
        group_score = groups.topk(min(2, groups.shape[-1]), dim=-1).values.sum(-1)
        keep = torch.zeros_like(group_score, dtype=torch.bool)
        keep.scatter_(1, group_score.topk(self.topk_group, dim=-1).indices, True)
        choice = choice.masked_fill(~keep.repeat_interleave(E // self.n_group, dim=1), float("-inf"))
        chosen = choice.topk(self.top_k, dim=-1).indices
        weights = scores.gather(1, chosen)
        if self.norm_topk_prob:
            weights = weights / (weights.sum(-1, keepdim=True) + 1e-20)
        return (weights * self.scaling).to(x.dtype), chosen

    def forward(self, x: Tensor, lora: LoraBatch | None) -> Tensor:
        y = super().forward(x, lora)
        return y if self.shared_experts is None else y + self.shared_experts(x, lora)


class DeepseekBlock(nn.Module):
    def __init__(self, cfg: ModelConfig, layer: int) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn = MLAttention(cfg, layer)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp: MLP | DeepseekMoE = (
            DeepseekMoE(cfg, cfg.sparse_layers.index(layer)) if cfg.is_sparse(layer)
            else MLP(cfg, cfg.dense_layers.index(layer))
        )

    def forward(self, x: Tensor, cos: Tensor, sin: Tensor, lora: LoraBatch | None, cache: CacheView | None) -> Tensor:
        x = x + self.self_attn(self.input_layernorm(x), cos, sin, lora, cache)
        return x + self.mlp(self.post_attention_layernorm(x), lora)


class DeepseekTransformer(Transformer):
    ragged = False  # MLA's latent store reads per query row: the executor runs its steps per segment kind
    def __init__(self, cfg: ModelConfig, block: type[nn.Module] | None = None) -> None:
        if cfg.mla is None:
            raise ValueError("DeepseekTransformer needs a DeepSeek (MLA) config")
        super().__init__(cfg, block=block or DeepseekBlock)

