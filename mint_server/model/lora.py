"""Multi-LoRA: a bank of adapter slots resident beside one base model, and the per-layer LoRA math.

Layout. For each target projection the bank holds A as [slots, layers, r_max, in] and B as
[slots, layers, out, r_max], so one slot is a contiguous block that can be filled, evicted and
refilled in place; the base weights are never touched. An adapter of rank r < r_max occupies the
first r rows of A / columns of B; the rest stay zero, which keeps the math exact (zero rows get
zero gradient and AdamW leaves them at zero).

A forward pass receives a `LoraBatch`: per target, the stacked A/B of the n adapters it uses, the
index of each batch row into them (-1 = bare base), and the per-adapter scale (lora_alpha / r, as
PEFT). `add_lora` is the one place the LoRA math lives, so MoE experts, MLA projections or a
fused kernel plug in here.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import Tensor

from mint_server.model.config import ModelConfig

ATTN_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj")
MLP_TARGETS = ("gate_proj", "up_proj", "down_proj")
UNEMBED_TARGET = "lm_head"
ALL_TARGETS = ATTN_TARGETS + MLP_TARGETS + (UNEMBED_TARGET,)


def target_shapes(cfg: ModelConfig) -> dict[str, tuple[int, int, int]]:
    """target → (layers, in_features, out_features)."""
    h, q, kv, i = cfg.hidden_size, cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim, cfg.intermediate_size
    L = cfg.num_layers
    return {
        "q_proj": (L, h, q),
        "k_proj": (L, h, kv),
        "v_proj": (L, h, kv),
        "o_proj": (L, q, h),
        "gate_proj": (L, h, i),
        "up_proj": (L, h, i),
        "down_proj": (L, i, h),
        "lm_head": (1, h, cfg.vocab_size),
    }


def select_targets(train_attn: bool = True, train_mlp: bool = True, train_unembed: bool = True) -> tuple[str, ...]:
    """Tinker's LoraConfig switches → target projection names."""
    return (
        (ATTN_TARGETS if train_attn else ())
        + (MLP_TARGETS if train_mlp else ())
        + ((UNEMBED_TARGET,) if train_unembed else ())
    )


@dataclass
class LoraBatch:
    """What one forward needs to apply several adapters to the rows of one batch.

    weights: target → (A [n, layers, r, in], B [n, layers, out, r]); targets absent here get no LoRA.
    rows:    [batch] long, index into n per row; -1 = bare base.
    scale:   [n] per-adapter lora_alpha / r.
    """

    weights: dict[str, tuple[Tensor, Tensor]]
    rows: Tensor
    scale: Tensor
    # Computed once per forward so each layer avoids a host sync.
    uniform: int | None = None  # every row uses this adapter
    row_scale: Tensor | None = None
    row_index: Tensor | None = None

    def __post_init__(self) -> None:
        rows = self.rows.tolist()
        first = rows[0] if rows else -1
        self.uniform = first if first >= 0 and all(r == first for r in rows) else None
        self.row_index = self.rows.clamp(min=0)
        self.row_scale = torch.where(self.rows >= 0, self.scale[self.row_index], torch.zeros_like(self.scale[:1]))

    @property
    def is_base_only(self) -> bool:
        return not self.weights or bool((self.rows < 0).all())

    def apply(self, target: str, layer: int, x: Tensor, y: Tensor) -> Tensor:
        """y (the base projection of x) plus this target's LoRA delta; y unchanged if no LoRA on it."""
        ab = self.weights.get(target)
        if ab is None:
            return y
        return add_lora(y, x, ab[0][:, layer], ab[1][:, layer], self)


def add_lora(y: Tensor, x: Tensor, A: Tensor, B: Tensor, batch: LoraBatch) -> Tensor:
    """y + scale · (x Aᵀ) Bᵀ for x [rows, tokens, in], A [n, r, in], B [n, out, r], y [rows, tokens, out].

    One adapter for the whole batch: two plain matmuls. Mixed: gather each row's A/B and run two
    batched matmuls, so cost grows with rows × rank, never with a Python loop over rows or adapters.
    The scale is applied to the small rank-r intermediate and the second product accumulates into y
    (addmm), so no output-sized temporary is made — it matters for the 49k-wide lm_head.
    """
    rows, tokens, out = y.shape
    if batch.uniform is not None:
        u = batch.uniform
        xa = (x.reshape(rows * tokens, -1) @ A[u].transpose(0, 1)) * batch.scale[u].to(x.dtype)
        return torch.addmm(y.reshape(rows * tokens, out), xa, B[u].transpose(0, 1)).view(rows, tokens, out)
    a = A[batch.row_index]  # [rows, r, in]
    b = B[batch.row_index]  # [rows, out, r]
    xa = torch.bmm(x, a.transpose(1, 2)) * batch.row_scale[:, None, None].to(x.dtype)
    return torch.baddbmm(y, xa, b.transpose(1, 2))


def init_lora_weights(
    shapes: dict[str, tuple[int, int, int]], targets: Sequence[str], rank: int, seed: int, dtype: torch.dtype
) -> dict[str, tuple[Tensor, Tensor]]:
    """PEFT's default init (A kaiming-uniform with a=√5, B zero), deterministic in `seed`. On CPU."""
    gen = torch.Generator().manual_seed(seed)
    out = {}
    for t in targets:
        layers, fan_in, fan_out = shapes[t]
        # kaiming_uniform_(a=sqrt(5)) on [r, in]: bound = sqrt(6 / ((1 + a²) · fan_in)) = 1/sqrt(fan_in)
        bound = 1.0 / math.sqrt(fan_in)
        a = (torch.rand(layers, rank, fan_in, generator=gen, dtype=torch.float64) * 2 - 1) * bound
        out[t] = (a.to(dtype), torch.zeros(layers, fan_out, rank, dtype=dtype))
    return out


class LoraBank:
    """Fixed-capacity slots of adapter weights for every target; a slot id is an int in [0, num_slots)."""

    def __init__(
        self, cfg: ModelConfig, num_slots: int, max_rank: int, device: torch.device | str, dtype: torch.dtype
    ) -> None:
        self.num_slots, self.max_rank = num_slots, max_rank
        self.shapes = target_shapes(cfg)
        self.A = {
            t: torch.zeros(num_slots, L, max_rank, fi, device=device, dtype=dtype) for t, (L, fi, _) in self.shapes.items()
        }
        self.B = {
            t: torch.zeros(num_slots, L, fo, max_rank, device=device, dtype=dtype) for t, (L, _, fo) in self.shapes.items()
        }
        self.scale = torch.zeros(num_slots, device=device, dtype=torch.float32)
        self.rank = [0] * num_slots
        self.targets: list[tuple[str, ...]] = [()] * num_slots

    def write(self, slot: int, weights: dict[str, tuple[Tensor, Tensor]], rank: int, alpha: float) -> None:
        """Fill a slot: weights[target] = (A [layers, r, in], B [layers, out, r]); other targets zeroed."""
        if not 0 < rank <= self.max_rank:
            raise ValueError(f"rank {rank} is outside 1..{self.max_rank} (the bank's max_rank)")
        for t in weights:
            if t not in self.shapes:
                raise ValueError(f"unknown LoRA target {t!r}")
        with torch.no_grad():
            for t in self.shapes:
                self.A[t][slot].zero_()
                self.B[t][slot].zero_()
                if t in weights:
                    a, b = weights[t]
                    self.A[t][slot, :, :rank].copy_(a)
                    self.B[t][slot, :, :, :rank].copy_(b)
            self.scale[slot] = alpha / rank
        self.rank[slot] = rank
        self.targets[slot] = tuple(t for t in self.shapes if t in weights)

    def clear(self, slot: int) -> None:
        with torch.no_grad():
            for t in self.shapes:
                self.A[t][slot].zero_()
                self.B[t][slot].zero_()
            self.scale[slot] = 0.0
        self.rank[slot] = 0
        self.targets[slot] = ()

    def read(self, slot: int) -> dict[str, tuple[Tensor, Tensor]]:
        """A copy of the slot's weights at its own rank (for export)."""
        r = self.rank[slot]
        return {t: (self.A[t][slot, :, :r].clone(), self.B[t][slot, :, :, :r].clone()) for t in self.targets[slot]}

    def batch(self, row_slots: Sequence[int], device: torch.device | str | None = None) -> LoraBatch:
        """A LoraBatch over the whole bank (no copies) for rows given as slot ids (-1 = base)."""
        used = {s for s in row_slots if s >= 0}
        rank = max((self.rank[s] for s in used), default=0)
        targets = {t for s in used for t in self.targets[s]}
        weights = {t: (self.A[t][:, :, :rank], self.B[t][:, :, :, :rank]) for t in targets} if rank else {}
        rows = torch.tensor(list(row_slots), dtype=torch.long, device=device or self.scale.device)
        return LoraBatch(weights=weights, rows=rows, scale=self.scale)
