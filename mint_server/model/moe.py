"""Mixture-of-experts MLP (Qwen3-MoE): a frozen softmax top-k router over SwiGLU experts, expert LoRA.

Each token picks `top_k` experts (softmax over all router logits, then top-k, optionally
renormalised to sum to 1: `norm_topk_prob`); its output is the routing-weighted sum of those
experts' SwiGLU MLPs. The (token, expert) pairs are sorted by expert and, within an expert, by the
adapter of the token's batch row (`group_pairs`), so the base expert matmuls are one grouped
product over the experts' segments and the expert LoRA one over the (expert, adapter) segments
(`kernels.grouped_mm`), or one gathered batched matmul when the pairs are few — never a Python loop
over rows. The LoRA math itself stays in `lora.add_lora`.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from mint_server.model import kernels
from mint_server.model.config import ModelConfig
from mint_server.model.lora import EXPERT_PREFIX, EXPERT_TARGETS, ExpertGroups, LoraBatch, group_pairs
from mint_server.model.tp_group import TP

EXPERT_PROJS = ("gate_proj", "up_proj", "down_proj")


class Experts(nn.Module):
    """All experts' weights of one layer as [E, out, in] stacks (transformers' fused layout, with
    gate and up kept apart so each has its own LoRA)."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        E, h, i = cfg.num_experts, cfg.hidden_size, cfg.moe_intermediate_size
        self.gate_proj = nn.Parameter(torch.empty(E, i, h))
        self.up_proj = nn.Parameter(torch.empty(E, i, h))
        self.down_proj = nn.Parameter(torch.empty(E, h, i))


class SparseMoE(nn.Module):
    tp: TP | None = None  # set by tp.shard_model: this rank's slice of every expert's intermediate dim

    def __init__(self, cfg: ModelConfig, index: int) -> None:
        super().__init__()
        self.index = index  # this layer's position among the sparse layers: the expert targets' layer axis
        self.num_experts, self.top_k, self.norm_topk_prob = cfg.num_experts, cfg.num_experts_per_tok, cfg.norm_topk_prob
        self.gate = nn.Linear(cfg.hidden_size, cfg.num_experts, bias=False)  # the router; never trained
        self.experts = Experts(cfg)

    def route(self, x: Tensor) -> tuple[Tensor, Tensor]:
        """x [N, hidden] → (weights [N, k] in x's dtype, experts [N, k]); softmax in float32 like HF."""
        probs = torch.softmax(self.gate(x), dim=-1, dtype=torch.float32)
        weights, chosen = torch.topk(probs, self.top_k, dim=-1)
        if self.norm_topk_prob:
            weights = weights / weights.sum(dim=-1, keepdim=True)
        return weights.to(x.dtype), chosen

    def act(self, g: Tensor, u: Tensor) -> Tensor:
        """The experts' gated activation of the gate and up projections (SwiGLU; a family may clamp it:
        gpt_oss.py, deepseek_v4.py)."""
        return F.silu(g) * u

    def forward(self, x: Tensor, lora: LoraBatch | None, tokens: Tensor | None = None) -> Tensor:
        """tokens [B, T]: for families whose routing reads the token ids (DeepSeek-V4's hash layers)."""
        B, T, H = x.shape
        flat = x.reshape(B * T, H)
        tp = self.tp
        if tp is not None:  # routing and experts both read it; each rank's gradient is partial
            flat = tp.enter(flat)
        weights, chosen = self.route(flat) if tokens is None else self.route(flat, tokens.reshape(-1))
        k = self.top_k
        expert = chosen.reshape(-1)  # pairs in token-major order
        token = torch.arange(B * T, device=x.device).repeat_interleave(k)
        if lora is not None and any(lora.has(t) for t in EXPERT_TARGETS):
            # rows per batch row, or per token (a packed training row holds several datums' tokens)
            per_token = lora.rows.numel() == B * T != B
            adapter, n = lora.rows.repeat_interleave(k if per_token else T * k), lora.num_adapters
        else:
            adapter, n = torch.full_like(expert, -1), 0
        groups = group_pairs(expert, adapter, self.num_experts, n)
        pair_token = token[groups.order]
        xs = flat[pair_token]  # [P, hidden], sorted by (expert, adapter)
        g = self._project("gate_proj", xs, groups, lora)
        u = self._project("up_proj", xs, groups, lora)
        d = self._project("down_proj", self.act(g, u), groups, lora)
        d = d * weights.reshape(-1)[groups.order, None]
        out = torch.zeros_like(flat).index_add_(0, pair_token, d).view(B, T, H)
        return out if tp is None else tp.reduce(out)

    def _project(self, name: str, x: Tensor, groups: ExpertGroups, lora: LoraBatch | None) -> Tensor:
        """Each pair through its expert's base projection (one grouped product over the experts' segments), plus LoRA."""
        y = kernels.grouped_mm(x, getattr(self.experts, name), groups.expert_offsets)
        return y if lora is None else lora.apply(EXPERT_PREFIX + name, self.index, x, y, groups, tp=self.tp)
