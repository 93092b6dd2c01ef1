"""Qwen3.5 dense and MoE (`Qwen3_5ForCausalLM`, `Qwen3_5MoeForCausalLM`) in our model code, multi-LoRA built in.

Hybrid layers (hybrid_spec.py): most are gated delta-net linear attention, every few a gated full
attention; each is followed by a SwiGLU MLP (dense) or routed experts plus a sigmoid-gated shared
expert (MoE). Differences from Qwen3 that matter for parity with transformers:
- norms scale by (1 + weight) in float32 (zero-centred weights), the final norm and q/k norms too;
- full attention: `q_proj` yields the query and an output gate per head ([H, 2·D], query first),
  RoPE covers only the first `rotary_dim` dims of a head, the output is multiplied by sigmoid(gate);
- linear attention: `in_proj_qkv` → causal depthwise conv (silu) → q, k (l2-normalised, q scaled by
  1/√d_k), v; β = sigmoid(in_proj_b), decay g = -exp(A_log)·softplus(in_proj_a + dt_bias); the
  gated delta rule per value head (q/k heads shared by consecutive value heads); the output is
  RMS-normed per head, times silu(in_proj_z), through `out_proj`.

The delta rule runs in two forms with transformers' torch math: chunked (training, prefill and every
prefill chunk, from the state the chunk starts in) and recurrent (decode rows, one step each, all
rows of a step in one batch). With a cache (sampling) each sequence's state lives in the sampler's
`recurrent_state.StateCache`, which the executor hands to the layers as `cache.states`.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from mint_server.model import kernels
from mint_server.model.config import ModelConfig
from mint_server.model.kv_cache import CacheView
from mint_server.model.lora import LoraBatch
from mint_server.model.moe import SparseMoE
from mint_server.model.recurrent_state import StateView
from mint_server.model.transformer import MLP, Transformer, apply_rope, project

CHUNK = 64  # the chunked form's chunk length (transformers' default)
L2NORM_EPS = 1e-6


class OffsetRMSNorm(nn.Module):
    """RMSNorm scaling by (1 + weight), computed in float32 and cast back (HF's Qwen3_5RMSNorm)."""

    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.zeros(dim))

    def forward(self, x: Tensor) -> Tensor:
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return (xf * (1.0 + self.weight.float())).to(x.dtype)


class GatedRMSNorm(nn.Module):
    """The delta net's output norm: RMSNorm (plain weight) per head, then times silu(gate) (HF's Qwen3_5RMSNormGated)."""

    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: Tensor, gate: Tensor) -> Tensor:
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return (self.weight * xf.to(x.dtype) * F.silu(gate.float())).to(x.dtype)


def l2norm(x: Tensor) -> Tensor:
    return x * torch.rsqrt((x * x).sum(-1, keepdim=True) + L2NORM_EPS)


def chunk_delta_rule(q: Tensor, k: Tensor, v: Tensor, g: Tensor, beta: Tensor, state: Tensor | None,
                     chunk: int = CHUNK) -> tuple[Tensor, Tensor]:
    """The gated delta rule over whole sequences, `chunk` tokens at a time (a UT transform inside a
    chunk, the state carried between chunks). q, k [B, H, T, Dk] (normalised, q scaled), v [B, H, T, Dv],
    g, beta [B, H, T], all float32; state [B, H, Dk, Dv] or None (zero). → (out [B, H, T, Dv], final state)."""
    B, H, T, Dk = k.shape
    Dv = v.shape[-1]
    pad = -T % chunk  # padded positions have k = v = β = g = 0: they change neither outputs nor state
    q, k, v = (F.pad(x, (0, 0, 0, pad)) for x in (q, k, v))
    g, beta = (F.pad(x, (0, pad)) for x in (g, beta))
    n = (T + pad) // chunk
    k_beta, v_beta = k * beta[..., None], v * beta[..., None]
    q, k, k_beta, v_beta = (x.reshape(B, H, n, chunk, -1) for x in (q, k, k_beta, v_beta))
    cum = g.reshape(B, H, n, chunk).cumsum(-1)  # log of the decay from the chunk's start to each position
    upper = torch.ones(chunk, chunk, dtype=torch.bool, device=q.device).triu(1)
    pair = (cum[..., :, None] - cum[..., None, :]).masked_fill(upper, float("-inf")).exp()  # decay j → i
    ut = (k_beta @ k.transpose(-1, -2)) * pair
    intra = (q @ k.transpose(-1, -2)) * pair
    new_v = torch.linalg.solve_triangular(ut, v_beta, upper=False, unitriangular=True)
    k_cum = torch.linalg.solve_triangular(ut, k_beta * cum.exp()[..., None], upper=False, unitriangular=True)
    S = q.new_zeros(B, H, Dk, Dv) if state is None else state
    q = q * cum.exp()[..., None]
    k = k * (cum[..., -1:] - cum).exp()[..., None]
    decay = cum[..., -1].exp()[..., None, None]
    outs = []
    for i in range(n):
        v_i = new_v[:, :, i] - k_cum[:, :, i] @ S  # what the state does not already predict
        outs.append(q[:, :, i] @ S + intra[:, :, i] @ v_i)
        S = S * decay[:, :, i] + k[:, :, i].transpose(-1, -2) @ v_i
    return torch.stack(outs, 2).reshape(B, H, -1, Dv)[:, :, :T], S


def recurrent_delta_step(q: Tensor, k: Tensor, v: Tensor, g: Tensor, beta: Tensor, state: Tensor) -> tuple[Tensor, Tensor]:
    """One token of the gated delta rule for R rows at once: q, k [R, H, Dk], v [R, H, Dv], g, beta [R, H],
    state [R, H, Dk, Dv], float32 → (out [R, H, Dv], new state)."""
    state = state * g.exp()[..., None, None]
    remembered = (state * k[..., None]).sum(-2)
    delta = (v - remembered) * beta[..., None]
    state = state + k[..., None] * delta[..., None, :]
    return (state * q[..., None]).sum(-2), state


class GatedDeltaNet(nn.Module):
    """A linear-attention layer; `index` is its position among the linear layers (its LoRA targets'
    layer axis and its recurrent-state layer)."""

    def __init__(self, cfg: ModelConfig, index: int) -> None:
        super().__init__()
        hy = cfg.hybrid
        assert hy is not None
        h = cfg.hidden_size
        self.index, self.spec = index, hy
        self.in_proj_qkv = nn.Linear(h, hy.conv_dim, bias=False)
        self.in_proj_z = nn.Linear(h, hy.value_dim, bias=False)
        self.in_proj_b = nn.Linear(h, hy.num_v_heads, bias=False)
        self.in_proj_a = nn.Linear(h, hy.num_v_heads, bias=False)
        self.conv1d = nn.Conv1d(hy.conv_dim, hy.conv_dim, hy.conv_kernel, groups=hy.conv_dim, bias=False,
                                padding=hy.conv_kernel - 1)
        self.dt_bias = nn.Parameter(torch.ones(hy.num_v_heads))
        self.A_log = nn.Parameter(torch.zeros(hy.num_v_heads))
        self.norm = GatedRMSNorm(hy.v_head_dim, cfg.rms_norm_eps)
        self.out_proj = nn.Linear(hy.value_dim, h, bias=False)

    def forward(self, x: Tensor, lora: LoraBatch | None, cache: CacheView | None) -> Tensor:
        B, T, _ = x.shape
        L, hy = self.index, self.spec
        qkv = project(self.in_proj_qkv, x, lora, "in_proj_qkv", L)
        z = project(self.in_proj_z, x, lora, "in_proj_z", L)
        beta = project(self.in_proj_b, x, lora, "in_proj_b", L).sigmoid()
        a = project(self.in_proj_a, x, lora, "in_proj_a", L)
        g = -self.A_log.float().exp() * F.softplus(a.float() + self.dt_bias)  # float32 like HF (A may be large)
        if cache is None:  # whole sequences from a zero state (training, a forward without a cache)
            mixed = F.silu(self.conv1d(qkv.transpose(1, 2))[..., :T]).transpose(1, 2)
            y, _ = self._rule(mixed, g, beta, None)
        else:
            states = cache.states
            if not isinstance(states, StateView):
                raise ValueError("a hybrid model's cached forward needs the sequences' state slots (cache.states)")
            y = self._cached(qkv.reshape(B * T, -1), g.reshape(B * T, -1), beta.reshape(B * T, -1), states)
            y = y.view(B, T, hy.num_v_heads, hy.v_head_dim)
        y = self.norm(y, z.view(B, T, hy.num_v_heads, hy.v_head_dim)).reshape(B, T, hy.value_dim)
        return project(self.out_proj, y, lora, "out_proj", L)

    def _heads(self, mixed: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        """Conv output [..., conv_dim] → q, k [..., Hv, Dk] (normalised, scaled, shared by value-head groups)
        and v [..., Hv, Dv], float32."""
        hy = self.spec
        q, k, v = mixed.float().split([hy.key_dim, hy.key_dim, hy.value_dim], dim=-1)
        lead = mixed.shape[:-1]
        q, k = (x.reshape(*lead, hy.num_k_heads, hy.k_head_dim) for x in (q, k))
        v = v.reshape(*lead, hy.num_v_heads, hy.v_head_dim)
        if hy.num_v_heads != hy.num_k_heads:
            rep = hy.num_v_heads // hy.num_k_heads
            q, k = q.repeat_interleave(rep, dim=-2), k.repeat_interleave(rep, dim=-2)
        return l2norm(q) * hy.k_head_dim**-0.5, l2norm(k), v

    def _rule(self, mixed: Tensor, g: Tensor, beta: Tensor, state: Tensor | None) -> tuple[Tensor, Tensor]:
        """Chunked delta rule over rows [B, T, ·] → (out [B, T, Hv, Dv] in mixed's dtype, final state)."""
        q, k, v = (x.transpose(1, 2) for x in self._heads(mixed))
        y, S = chunk_delta_rule(q, k, v, g.transpose(1, 2), beta.float().transpose(1, 2), state)
        return y.transpose(1, 2).to(mixed.dtype), S

    def _cached(self, qkv: Tensor, g: Tensor, beta: Tensor, st: StateView) -> Tensor:
        """Tokens [N, ·] of the step's sequences, each continuing from (and updating) its slot's state."""
        hy, L = self.spec, self.index
        conv, rec = st.cache.conv[L], st.cache.recurrent[L]  # [slots, C, K-1], [slots, Hv, Dk, Dv]
        w = self.conv1d.weight  # [C, 1, K]
        out = qkv.new_empty(qkv.shape[0], hy.num_v_heads, hy.v_head_dim)
        if st.single_tokens.numel():  # decode rows (and one-token chunks): one recurrent step each, batched
            t, s = st.single_tokens, st.single_slots
            window = torch.cat((conv.index_select(0, s), qkv[t][:, :, None]), dim=-1)  # [R, C, K]
            conv.index_copy_(0, s, window[:, :, 1:])
            mixed = F.silu(F.conv1d(window, w, groups=hy.conv_dim))[:, :, 0]
            q, k, v = self._heads(mixed)
            y, S = recurrent_delta_step(q, k, v, g[t], beta[t].float(), rec.index_select(0, s))
            rec.index_copy_(0, s, S)
            out[t] = y.to(out.dtype)
        for a, n, s in st.runs:  # prefill chunks: the chunked form from the slot's state
            window = torch.cat((conv[s], qkv[a : a + n].transpose(0, 1)), dim=-1)[None]  # [1, C, K-1+n]
            conv[s] = window[0, :, -(hy.conv_kernel - 1):]
            mixed = F.silu(F.conv1d(window, w, groups=hy.conv_dim)).transpose(1, 2)  # [1, n, C]
            y, S = self._rule(mixed, g[a : a + n][None], beta[a : a + n][None], rec[s][None])
            rec[s] = S[0]
            out[a : a + n] = y[0]
        return out


class GatedAttention(nn.Module):
    """Qwen3.5's full attention; `index` is its position among the attention layers (its LoRA targets'
    layer axis and its KV-cache layer)."""

    def __init__(self, cfg: ModelConfig, index: int) -> None:
        super().__init__()
        assert cfg.hybrid is not None
        h, H, Hkv, D = cfg.hidden_size, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        self.index, self.n_heads, self.n_kv, self.head_dim = index, H, Hkv, D
        self.rotary = cfg.hybrid.rotary_dim
        self.q_proj = nn.Linear(h, 2 * H * D, bias=False)
        self.k_proj = nn.Linear(h, Hkv * D, bias=False)
        self.v_proj = nn.Linear(h, Hkv * D, bias=False)
        self.o_proj = nn.Linear(H * D, h, bias=False)
        self.q_norm = OffsetRMSNorm(D, cfg.rms_norm_eps)
        self.k_norm = OffsetRMSNorm(D, cfg.rms_norm_eps)

    def forward(self, x: Tensor, cos: Tensor, sin: Tensor, lora: LoraBatch | None, cache: CacheView | None) -> Tensor:
        B, T, _ = x.shape
        i, H, D, r = self.index, self.n_heads, self.head_dim, self.rotary
        q, gate = project(self.q_proj, x, lora, "q_proj", i).view(B, T, H, 2 * D).chunk(2, dim=-1)
        q = self.q_norm(q).transpose(1, 2)
        k = self.k_norm(project(self.k_proj, x, lora, "k_proj", i).view(B, T, self.n_kv, D)).transpose(1, 2)
        v = project(self.v_proj, x, lora, "v_proj", i).view(B, T, self.n_kv, D).transpose(1, 2)
        q = torch.cat((apply_rope(q[..., :r], cos, sin), q[..., r:]), dim=-1)
        k = torch.cat((apply_rope(k[..., :r], cos, sin), k[..., r:]), dim=-1)
        gqa = self.n_kv != H
        if cache is not None:
            y = cache.attention(i, q, k, v, 1 / math.sqrt(D), gqa)
        else:
            y = F.scaled_dot_product_attention(q, k, v, is_causal=T > 1, enable_gqa=gqa)
        y = y.transpose(1, 2).reshape(B, T, H * D) * torch.sigmoid(gate.reshape(B, T, H * D))
        return project(self.o_proj, y, lora, "o_proj", i)


class SharedExpert(nn.Module):
    def __init__(self, cfg: ModelConfig, index: int, width: int) -> None:
        super().__init__()
        self.index = index
        self.gate_proj = nn.Linear(cfg.hidden_size, width, bias=False)
        self.up_proj = nn.Linear(cfg.hidden_size, width, bias=False)
        self.down_proj = nn.Linear(width, cfg.hidden_size, bias=False)

    def forward(self, x: Tensor, lora: LoraBatch | None) -> Tensor:
        g = project(self.gate_proj, x, lora, "shared_gate_proj", self.index)
        u = project(self.up_proj, x, lora, "shared_up_proj", self.index)
        return project(self.down_proj, F.silu(g) * u, lora, "shared_down_proj", self.index)


class SharedExpertMoE(SparseMoE):
    """Routed experts (softmax top-k, renormalised) plus a shared expert scaled by sigmoid(shared_expert_gate(x)).
    The shared expert's gate is frozen, like the router."""

    def __init__(self, cfg: ModelConfig, index: int) -> None:
        super().__init__(cfg, index)
        assert cfg.hybrid is not None
        self.shared_expert = SharedExpert(cfg, index, cfg.hybrid.shared_expert_intermediate_size)
        self.shared_expert_gate = nn.Linear(cfg.hidden_size, 1, bias=False)

    def forward(self, x: Tensor, lora: LoraBatch | None) -> Tensor:
        routed = super().forward(x, lora)
        return routed + torch.sigmoid(self.shared_expert_gate(x)) * self.shared_expert(x, lora)


class HybridBlock(nn.Module):
    def __init__(self, cfg: ModelConfig, layer: int) -> None:
        super().__init__()
        hy = cfg.hybrid
        assert hy is not None
        self.input_layernorm = OffsetRMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.post_attention_layernorm = OffsetRMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.linear = layer in hy.linear_layers
        if self.linear:
            self.linear_attn = GatedDeltaNet(cfg, hy.linear_layers.index(layer))
        else:
            self.self_attn = GatedAttention(cfg, cfg.attention_layers.index(layer))
        self.mlp: MLP | SharedExpertMoE = (
            SharedExpertMoE(cfg, cfg.sparse_layers.index(layer)) if cfg.is_sparse(layer)
            else MLP(cfg, cfg.dense_layers.index(layer))
        )

    def forward(self, x: Tensor, cos: Tensor, sin: Tensor, lora: LoraBatch | None, cache: CacheView | None) -> Tensor:
        h = self.input_layernorm(x)
        mixed = self.linear_attn(h, lora, cache) if self.linear else self.self_attn(h, cos, sin, lora, cache)
        if kernels.fast() and not torch.is_grad_enabled():  # residual adds in place: x is ours (see hidden_states)
            x = x.add_(mixed)
            return x.add_(self.mlp(self.post_attention_layernorm(x), lora))
        x = x + mixed
        return x + self.mlp(self.post_attention_layernorm(x), lora)


class HybridTransformer(Transformer):
    """Qwen3.5: `Transformer` with `HybridBlock`s and the (1 + weight) final norm. Ragged: a sampler step
    runs as one forward; the linear layers split it into sequences by `cache.states`."""

    def __init__(self, cfg: ModelConfig) -> None:
        if cfg.hybrid is None:
            raise ValueError("HybridTransformer needs a hybrid (Qwen3.5) config")
        super().__init__(cfg, block=HybridBlock)
        self.norm = OffsetRMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
