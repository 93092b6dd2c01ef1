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

Experts. On a mixture-of-experts base the expert projections are targets of their own
(`expert_gate_proj`, ...) with an expert dimension after the layer one: A [slots, layers, E, r, in],
B [slots, layers, E, out, r], so an adapter holds one A/B pair per expert (the router stays
frozen). Per-layer target index: a target's layer axis lists only the layers that have it (see
`target_layers`), e.g. expert targets only the sparse layers, the dense MLP targets only the
dense ones; for dense families that is every layer, so index == layer number.
"""

from __future__ import annotations

import math
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor

from mint_server.model import invariant, kernels
from mint_server.model.config import ModelConfig
from mint_server.model.families import family_spec
from mint_server.model.lora_targets import ALL_TARGETS as ALL_TARGETS  # (re-exported: lora's names)
from mint_server.model.lora_targets import (
    ATTN_TARGETS,
    COMPRESSOR_TARGETS,
    EXPERT_TARGETS,
    LINEAR_TARGETS,
    MLA_TARGETS,
    MLP_TARGETS,
    SHARED_TARGETS,
    UNEMBED_TARGET,
    V4_TARGETS,
)
from mint_server.model.lora_targets import EXPERT_PREFIX as EXPERT_PREFIX
from mint_server.model.lora_targets import SHARED_PREFIX as SHARED_PREFIX
from mint_server.model.tp_group import TP, sync_replicated


def target_layers(cfg: ModelConfig) -> dict[str, tuple[int, ...]]:
    """target → the model layers it exists in, in order (its per-target layer index is the position
    in this tuple). Targets a model does not have (experts of a dense model, dense MLPs of a model
    whose every layer is sparse) are absent."""
    family = family_spec(cfg)
    out: dict[str, tuple[int, ...]] = dict.fromkeys(family.attention_targets(cfg), cfg.attention_layers)
    out.update(family.layer_targets(cfg))  # Qwen3.5's linear-attention layers, DeepSeek-V4's compressors
    if cfg.dense_layers:
        out.update(dict.fromkeys(MLP_TARGETS, cfg.dense_layers))
    if cfg.sparse_layers:
        out.update(dict.fromkeys(EXPERT_TARGETS, cfg.sparse_layers))
        if family.shared_expert_size(cfg):
            out.update(dict.fromkeys(SHARED_TARGETS, cfg.sparse_layers))
    out[UNEMBED_TARGET] = (0,)
    return out


def target_shapes(cfg: ModelConfig) -> dict[str, tuple[int, int, int]]:
    """target → (layers, in_features, out_features); expert targets have `target_experts` experts more."""
    h, q, kv, i = cfg.hidden_size, cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim, cfg.intermediate_size
    e = cfg.moe_intermediate_size
    io = {
        "q_proj": (h, q), "k_proj": (h, kv), "v_proj": (h, kv), "o_proj": (q, h),
        "gate_proj": (h, i), "up_proj": (h, i), "down_proj": (i, h),
        "expert_gate_proj": (h, e), "expert_up_proj": (h, e), "expert_down_proj": (e, h),
        "lm_head": (h, cfg.vocab_size),
    }
    io.update(family_spec(cfg).target_io(cfg))  # the widths that are this family's own
    return {t: (len(layers), *io[t]) for t, layers in target_layers(cfg).items()}


def target_experts(cfg: ModelConfig) -> dict[str, int]:
    """Expert targets → number of experts (each has its own A/B); dense targets are absent."""
    return {t: cfg.num_experts for t in target_layers(cfg) if t in EXPERT_TARGETS}


def lora_shapes(
    shape: tuple[int, int, int], experts: int, rank: int, layered: bool = True
) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """The A and B shapes of one adapter's target: [layers, (E,) r, in], [layers, (E,) out, r];
    layered=False drops the layer axis (one layer's pair)."""
    layers, fi, fo = shape
    lead = ((layers,) if layered else ()) + ((experts,) if experts else ())
    return (*lead, rank, fi), (*lead, fo, rank)


def select_targets(train_attn: bool = True, train_mlp: bool = True, train_unembed: bool = True) -> tuple[str, ...]:
    """Tinker's LoraConfig switches → target projection names (train_mlp covers dense MLPs and
    experts alike; a model's adapter gets those of them it has)."""
    return (
        (ATTN_TARGETS + MLA_TARGETS + LINEAR_TARGETS + V4_TARGETS + COMPRESSOR_TARGETS if train_attn else ())
        + (MLP_TARGETS + EXPERT_TARGETS + SHARED_TARGETS if train_mlp else ())
        + ((UNEMBED_TARGET,) if train_unembed else ())
    )


# Below this many gathered LoRA elements (pairs × r × (in + out)) an expert LoRA gathers every
# pair's own A/B and runs one batched matmul (decode: few pairs, many groups); above it, one grouped
# product over the (expert, adapter) segments for A and one for B (kernels.grouped_mm; training, prefill).
EXPERT_GATHER_LIMIT = 1 << 24
# Above that, where the grouped kernel runs the products (kernels.grouped_kernel_on) and the batch's
# n adapters side by side (n·r columns of A, of B) cost at most this fraction of the base
# projection's FLOPs more than one adapter (n·r·(1/in + 1/out)), every adapter's A of an expert is
# one wide product and every adapter's B another, each pair's other adapters' columns zeroed: E
# groups per call instead of n·E tiny (expert, adapter) ones (8 adapters on 128 experts are 1,024
# segments of ~32 pairs at 4K tokens, past CUDA's 1,023 groups a call: two calls over every row).
# A loop of plain matmuls (the CPU default) would pay for the zeroed columns and pays little per
# segment, so it keeps the segments (measured: docs/moe.md).
EXPERT_WIDE_FLOPS = 0.25


@dataclass
class ExpertGroups:
    """The token→expert pairs of one MoE layer, sorted by expert and, within an expert, by adapter.

    Pairs are (token, k-th choice) in token-major order before sorting; `order` maps each sorted
    pair back to it. Groups are the runs of equal (expert, adapter) in sorted order, expert-major,
    one per (expert, adapter slot) whether used or not (empty ones included), so their bounds need
    no host sync; base pairs (adapter -1) sit in their expert's first group (their LoRA scale is 0).
    """

    order: Tensor  # [P] long: unsorted pair index of each sorted pair
    expert: Tensor  # [P] long: expert of each sorted pair
    adapter: Tensor  # [P] long: adapter (index into the batch's n) of each sorted pair; -1 = base
    group_offsets: Tensor  # [E · max(n, 1)] int32: cumulative end of each (expert, adapter) group
    expert_offsets: Tensor  # [E] int32: cumulative end of each expert's pairs


def group_pairs(expert: Tensor, adapter: Tensor, num_experts: int, num_adapters: int) -> ExpertGroups:
    """Sort pairs (expert [P], adapter [P] with -1 = base) into expert-major, adapter-minor groups.

    One stable sort and one bincount, all on the pairs' device: no host sync.
    """
    slots = max(num_adapters, 1)
    key = expert * slots + adapter.clamp(min=0)
    order = torch.argsort(key, stable=True)
    ends = torch.bincount(key, minlength=num_experts * slots).cumsum(0).to(torch.int32)
    return ExpertGroups(order, expert[order], adapter[order], ends, ends[slots - 1 :: slots].contiguous())


@dataclass
class LoraBatch:
    """What one forward needs to apply several adapters to the rows of one batch.

    weights: target → (A [n, layers, (E,) r, in], B [n, layers, (E,) out, r]); targets absent here
             get no LoRA; expert targets carry the expert axis.
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
    plan: MixedPlan | None = None  # fast kernels, mixed rows: how add_lora groups them
    # Batch-invariant mode: each row's real length (its later positions are padding); the tiles of an
    # adapter's tokens start at each of its rows, so its gradient sums are the same in any batch.
    row_lengths: list[int] | None = None
    row_list: list[int] = field(init=False, default_factory=list)  # rows as a Python list
    # plan "gather": each target's A/B of every row, gathered once for all layers
    gathered: dict[str, tuple[Tensor, Tensor]] = field(init=False, default_factory=dict)

    def __post_init__(self) -> None:
        rows = self.row_list = self.rows.tolist()
        first = rows[0] if rows else -1
        self.uniform = first if first >= 0 and all(r == first for r in rows) else None
        self.row_index = self.rows.clamp(min=0)
        self.row_scale = torch.where(self.rows >= 0, self.scale[self.row_index], torch.zeros_like(self.scale[:1]))
        if self.uniform is None and kernels.fast() and not invariant.enabled():
            self.plan = MixedPlan.of(rows, self.rows.device, gather=not torch.is_grad_enabled())

    @property
    def num_adapters(self) -> int:
        return int(self.scale.shape[0])

    def has(self, target: str) -> bool:
        return target in self.weights

    def apply(
        self, target: str, layer: int, x: Tensor, y: Tensor, groups: ExpertGroups | None = None,
        tp: TP | None = None,
    ) -> Tensor:
        """y (the base projection of x) plus this target's LoRA delta; y unchanged if no LoRA on it.

        layer: the target's own layer index (see `target_layers`). groups: for expert targets, how
        the pairs in x [P, in] / y [P, out] are grouped. tp: x, y and the A/B are this rank's share
        (see tp.py); in training the replicated factor's gradient is summed over the ranks.
        """
        ab = self.weights.get(target)
        if ab is None:
            return y
        if self.plan is not None and self.plan.kind == "gather" and groups is None and tp is None:
            if (g := self.gathered.get(target)) is None:
                g = self.gathered[target] = (ab[0].index_select(0, self.row_index), ab[1].index_select(0, self.row_index))
            return add_rows_lora(y, x, g[0][:, layer], g[1][:, layer], self.row_scale)
        A, B = sync_replicated(tp, target, ab[0][:, layer], ab[1][:, layer])
        return add_lora(y, x, A, B, self, groups)


class PerLayer:
    """Stands in for a [n, layers, …] weight stack in a LoraBatch: LoraBatch.apply only ever takes
    `[:, layer]`, which here returns that layer's own [n, …] tensor (a training pass's leaves,
    engine/training_lora.py; no layer's tensor is a view of another's)."""

    def __init__(self, per_layer: list[Tensor]) -> None:
        self.per_layer = per_layer

    def __getitem__(self, key: tuple[slice, int]) -> Tensor:
        return self.per_layer[key[1]]


def add_lora(
    y: Tensor, x: Tensor, A: Tensor, B: Tensor, batch: LoraBatch, groups: ExpertGroups | None = None
) -> Tensor:
    """y + scale · (x Aᵀ) Bᵀ for x [rows, tokens, in], A [n, r, in], B [n, out, r], y [rows, tokens, out].

    One adapter for the whole batch: two plain matmuls. Mixed, fast kernels (`kernels.fast()`):
    rows grouped by adapter, each adapter's A/B read once straight from its slot (see MixedPlan); a
    few rows outside autograd get A/B already gathered per row (plan "gather", see LoraBatch.apply).
    Mixed, reference kernels: gather each row's A/B and run two batched matmuls (copies rows × A/B).
    The scale is applied to the small rank-r intermediate and the second product accumulates into y
    (addmm), so no output-sized temporary is made — it matters for the 49k-wide lm_head.

    Experts (groups given): x [P, in] / y [P, out] are token→expert pairs sorted into `groups`,
    A [n, E, r, in], B [n, E, out, r]; each pair gets its own adapter's own expert's A/B.
    """
    if groups is not None:
        return _add_expert_lora(y, x, A, B, batch, groups)
    if invariant.enabled():
        return _add_lora_invariant(y, x, A, B, batch)
    rows, tokens, out = y.shape
    if batch.uniform is not None:
        u = batch.uniform
        xa = (x.reshape(rows * tokens, -1) @ A[u].transpose(0, 1)) * batch.scale[u].to(x.dtype)
        return add_product(y, xa, B[u].transpose(0, 1))
    if batch.plan is not None and batch.plan.kind != "gather":  # ("gather": LoraBatch.apply's own path)
        return _add_mixed_lora(y, x, A, B, batch.scale, batch.plan)
    return add_rows_lora(y, x, A[batch.row_index], B[batch.row_index], batch.row_scale)


def add_product(y: Tensor, a: Tensor, b: Tensor) -> Tensor:
    """y + a @ b, y viewed as a's leading dims × b's last (a [n, r] or [k, n, r]; b [r, out] or
    [k, r, out]). Into y's own memory when it is contiguous, autograd on or off: y is the fresh
    output of the base projection, which no op saved for backward, and an out-of-place addmm would
    first copy it whole (a training pass's 49k-wide lm_head: hundreds of MB, fresh pages each time)."""
    if y.is_contiguous():
        return _AddProductInPlace.apply(y, a, b)
    product = torch.baddbmm if a.dim() == 3 else torch.addmm
    return product(y.reshape(*a.shape[:-1], b.shape[-1]), a, b).view(y.shape)


class _AddProductInPlace(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, y: Tensor, a: Tensor, b: Tensor) -> Tensor:
        ctx.mark_dirty(y)
        ctx.save_for_backward(a, b)
        flat = y.view(*a.shape[:-1], b.shape[-1])
        if a.dim() == 3:
            flat.baddbmm_(a, b)
        else:
            flat.addmm_(a, b)
        return y

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor, Tensor | None, Tensor | None]:
        a, b = ctx.saved_tensors
        g = grad.reshape(*a.shape[:-1], b.shape[-1])
        grad_a = g @ b.transpose(-1, -2) if ctx.needs_input_grad[1] else None
        grad_b = a.transpose(-1, -2) @ g if ctx.needs_input_grad[2] else None
        return grad, grad_a, grad_b


def add_rows_lora(y: Tensor, x: Tensor, a: Tensor, b: Tensor, row_scale: Tensor) -> Tensor:
    """y + scale · (x aᵀ) bᵀ with each row's own a [rows, r, in], b [rows, out, r] and scale [rows]."""
    xa = torch.bmm(x, a.transpose(1, 2)) * row_scale[:, None, None].to(x.dtype)
    return torch.baddbmm(y, xa, b.transpose(1, 2))


@dataclass
class MixedPlan:
    """How the fast kernels apply several adapters to one batch without copying any A/B per row.

    range:    the rows' adapters lie in lo..hi (a few unused ones in between are fine); rows are laid
              out as [hi - lo + 1, per, tokens] (adapter-major, zero padding where an adapter has
              fewer than `per` rows) so one bmm reads A[lo:hi + 1] / B[lo:hi + 1] — plain views of
              the bank — each adapter's weights exactly once (BGMV-style for decode rows, and for
              training rows grouped by adapter with no copy of x at all when `identity`).
    segments: adapters too spread out or too uneven for that padding: rows sorted by adapter, one
              matmul pair per adapter's segment (SGMV-style), the segment's weights read once.
    Base rows (-1) get no delta in either.
    """

    kind: str  # "range" | "segments" | "gather"
    src: Tensor  # rows with an adapter (range: in padded order; segments: sorted by adapter)
    lo: int = 0
    hi: int = -1
    per: int = 1
    dest: Tensor | None = None  # range: padded position of each src row; None = every position has one
    identity: bool = False  # range: rows already are the padded layout (no copy of x or y)
    adapters: list[int] = field(default_factory=list)  # segments: adapter of each segment
    sizes: list[int] = field(default_factory=list)  # segments: rows in each

    @classmethod
    def of(cls, rows: list[int], device: torch.device, gather: bool = False) -> MixedPlan | None:
        """gather (outside autograd): at most GATHER_ROWS rows take each row's A/B, gathered once per
        forward for every layer (`LoraBatch.apply`), then one batched product pair per layer."""
        used = [(a, i) for i, a in enumerate(rows) if a >= 0]
        if not used:
            return None
        if gather and len(rows) <= GATHER_ROWS:
            return cls("gather", torch.empty(0, dtype=torch.long, device=device))
        counts: dict[int, int] = {}
        for a, _ in used:
            counts[a] = counts.get(a, 0) + 1
        lo, hi, per = min(counts), max(counts), max(counts.values())
        width = hi - lo + 1
        # Padding costs compute on zero rows and reads the weights of unused adapters in the range;
        # a Python-level segment costs a few matmul launches. Allow up to about 2× rows of padding.
        if width * per <= 2 * len(used):
            seen: dict[int, int] = {}
            dest = []
            for a, _ in used:
                dest.append((a - lo) * per + seen.get(a, 0))
                seen[a] = seen.get(a, 0) + 1
            order = sorted(range(len(used)), key=dest.__getitem__)
            src = [used[j][1] for j in order]
            dest = [dest[j] for j in order]
            full = len(used) == width * per
            identity = full and len(rows) == len(used) and src == list(range(len(rows)))
            return cls("range", torch.tensor(src, device=device), lo, hi, per,
                       None if full else torch.tensor(dest, device=device), identity)
        used.sort()
        adapters = sorted(counts)
        return cls("segments", torch.tensor([i for _, i in used], device=device),
                   adapters=adapters, sizes=[counts[a] for a in adapters])


# A few mixed rows (a decode step of a handful of requests): gathering their A/B once per forward
# costs little, and each layer then runs the three ops of a single adapter instead of a plan's index
# ops and per-adapter products (those launches dominate when the products are this small).
GATHER_ROWS = 8

# Invariant mode, sampling: above this many gathered B elements (adapters × out × r) the adapters
# run one by one instead of in one bmm over gathered weights (the lm_head's B is large).
_INVARIANT_GATHER_ELEMENTS = 1 << 25


def _add_lora_invariant(y: Tensor, x: Tensor, A: Tensor, B: Tensor, batch: LoraBatch) -> Tensor:
    """add_lora in batch-invariant mode: each adapter's tokens through invariant.matmul (TILE-row
    products at a fixed rank), so a token's delta never depends on the batch. With autograd on, an
    adapter's tiles start at each of its rows and stop at the row's length (its gradient sums over
    the same tiles in any batch); without, its tokens are packed densely."""
    rows, T, out = y.shape
    fi = x.shape[-1]
    n = rows * T
    aligned = torch.is_grad_enabled()
    lengths = batch.row_lengths or [T] * rows
    members: dict[int, list[int]] = {}
    for i, a in enumerate(batch.row_list):
        if a >= 0:
            members.setdefault(a, []).append(i)
    xf = torch.cat([x.reshape(n, fi), x.new_zeros(1, fi)])  # row n: the zero row padding tiles read
    yf = y.reshape(n, out)
    if not aligned and len(members) > 1 and len(members) * out * A.shape[1] <= _INVARIANT_GATHER_ELEMENTS:
        # sampling, several adapters: every adapter's tokens in whole tiles of one bmm, each tile
        # with its adapter's A/B gathered (the same [TILE, in] × [in, r] products as one by one)
        idx, tile_adapter = [], []
        for a, rows_of_a in members.items():
            mine = [i * T + t for i in rows_of_a for t in range(min(lengths[i], T))]
            pad = -len(mine) % invariant.TILE
            idx.extend(mine + [n] * pad)
            tile_adapter.extend([a] * ((len(mine) + pad) // invariant.TILE))
        index = torch.tensor(idx, device=y.device)
        which = torch.tensor(tile_adapter, device=y.device)
        xt = xf.index_select(0, index).view(len(tile_adapter), invariant.TILE, fi)
        xa = torch.bmm(xt, A.index_select(0, which).transpose(1, 2)) * batch.scale[which].to(x.dtype)[:, None, None]
        delta = torch.bmm(xa, B.index_select(0, which).transpose(1, 2)).view(-1, out)
        real = index < n
        return yf.index_add_(0, index[real], delta[real]).view(rows, T, out)
    for a, rows_of_a in members.items():
        idx: list[int] = []
        for i in rows_of_a:
            m = min(lengths[i], T)
            idx.extend(range(i * T, i * T + m))
            if aligned:
                idx.extend([n] * (-m % invariant.TILE))
        index = torch.tensor(idx, device=y.device)
        xa = invariant.matmul(xf.index_select(0, index), A[a].transpose(0, 1)) * batch.scale[a].to(x.dtype)
        delta = invariant.matmul(xa, B[a].transpose(0, 1))
        if aligned:
            real = index < n
            index, delta = index[real], delta[real]
        yf = yf.index_add(0, index, delta) if aligned else yf.index_add_(0, index, delta)
    return yf.view(rows, T, out)


def _add_mixed_lora(y: Tensor, x: Tensor, A: Tensor, B: Tensor, scale: Tensor, plan: MixedPlan) -> Tensor:
    """Fast mixed-adapter LoRA (see MixedPlan): y [rows, T, out] + each row's delta; no per-row A/B.

    In place into y when autograd is off (y is the fresh output of the base projection).
    """
    rows, T, out = y.shape
    fi = x.shape[-1]
    grad = torch.is_grad_enabled() and (x.requires_grad or A.requires_grad or B.requires_grad)
    if plan.kind == "range":
        lo, hi, per = plan.lo, plan.hi + 1, plan.per
        width = hi - lo
        Aw, Bw = A[lo:hi].transpose(1, 2), B[lo:hi].transpose(1, 2)  # [S, in, r], [S, r, out]: views
        s = scale[lo:hi].to(x.dtype)[:, None, None]
        if plan.identity:
            return add_product(y, torch.bmm(x.reshape(width, per * T, fi), Aw) * s, Bw)
        xs = x.index_select(0, plan.src)
        if plan.dest is not None:  # zero rows where an adapter has fewer than `per` rows
            xs = x.new_zeros(width * per, T, fi).index_copy(0, plan.dest, xs)
        xa = torch.bmm(xs.view(width, per * T, fi), Aw) * s
        delta = torch.bmm(xa, Bw).view(width * per, T, out)
        if plan.dest is not None:
            delta = delta.index_select(0, plan.dest)
        return y.index_add(0, plan.src, delta) if grad else y.index_add_(0, plan.src, delta)
    xs = x.index_select(0, plan.src).split(plan.sizes)
    parts = []
    for a, xa_in in zip(plan.adapters, xs, strict=True):
        xa = (xa_in.reshape(-1, fi) @ A[a].transpose(0, 1)) * scale[a].to(x.dtype)
        parts.append((xa @ B[a].transpose(0, 1)).view(-1, T, out))
    delta = torch.cat(parts)
    return y.index_add(0, plan.src, delta) if grad else y.index_add_(0, plan.src, delta)


def _add_expert_lora(y: Tensor, x: Tensor, A: Tensor, B: Tensor, batch: LoraBatch, groups: ExpertGroups) -> Tensor:
    if all(r < 0 for r in batch.row_list):
        return y
    P, (n, E, r, fan_in), fan_out = x.shape[0], A.shape, B.shape[-2]
    a = groups.adapter.clamp(min=0)
    s = torch.where(groups.adapter >= 0, batch.scale[a], torch.zeros_like(batch.scale[:1])).to(x.dtype)
    if P * r * (fan_in + fan_out) <= EXPERT_GATHER_LIMIT:
        # Few pairs: gather each pair's (adapter, expert) A/B; base pairs get scale 0.
        xa = torch.bmm(A[a, groups.expert], x[:, :, None]) * s[:, None, None]  # [P, r, 1]
        return torch.baddbmm(y[:, :, None], B[a, groups.expert], xa).squeeze(-1)
    if kernels.grouped_kernel_on(x) and n * r * (1 / fan_in + 1 / fan_out) <= EXPERT_WIDE_FLOPS:
        # Few adapters: one grouped product over the experts' segments for all adapters' A (column
        # a·r + j is adapter a's j-th), the pair's own adapter's columns kept and scaled (none on
        # base pairs), then one for all adapters' B over the same columns.
        Aw = A.transpose(0, 1).reshape(E, n * r, fan_in)
        Bw = B.permute(1, 2, 0, 3).reshape(E, fan_out, n * r)
        column_adapter = torch.arange(n * r, device=x.device) // r
        keep = (column_adapter[None, :] == groups.adapter[:, None]).to(x.dtype) * s[:, None]
        xa = kernels.grouped_mm(x, Aw, groups.expert_offsets) * keep
        return y + kernels.grouped_mm(xa, Bw, groups.expert_offsets)
    # Many adapters: one grouped product over the (expert, adapter) segments for A, one for B; the
    # per-pair scale (0 on base pairs) is applied to the rank-r intermediate.
    Ag = A.transpose(0, 1).reshape(E * n, r, fan_in)
    Bg = B.transpose(0, 1).reshape(E * n, fan_out, r)
    xa = kernels.grouped_mm(x, Ag, groups.group_offsets) * s[:, None]
    return y + kernels.grouped_mm(xa, Bg, groups.group_offsets)


def init_lora_weights(
    shapes: dict[str, tuple[int, int, int]],
    targets: Sequence[str],
    rank: int,
    seed: int,
    dtype: torch.dtype,
    experts: dict[str, int] | None = None,
) -> dict[str, tuple[Tensor, Tensor]]:
    """PEFT's default init (A kaiming-uniform with a=√5, B zero), deterministic in `seed`. On CPU.

    Targets the model does not have (not in `shapes`) are skipped; experts[t] adds an expert axis.
    """
    gen = torch.Generator().manual_seed(seed)
    out = {}
    for t in targets:
        if t not in shapes:
            continue
        a_shape, b_shape = lora_shapes(shapes[t], (experts or {}).get(t, 0), rank)
        # kaiming_uniform_(a=sqrt(5)) on [r, in]: bound = sqrt(6 / ((1 + a²) · fan_in)) = 1/sqrt(fan_in)
        bound = 1.0 / math.sqrt(a_shape[-1])
        a = (torch.rand(a_shape, generator=gen, dtype=torch.float64) * 2 - 1) * bound
        out[t] = (a.to(dtype), torch.zeros(b_shape, dtype=dtype))
    return out


class LoraBank:
    """Fixed-capacity slots of adapter weights for every target; a slot id is an int in [0, num_slots)."""

    def __init__(
        self, cfg: ModelConfig, num_slots: int, max_rank: int, device: torch.device | str, dtype: torch.dtype,
        shapes: dict[str, tuple[int, int, int]] | None = None,
    ) -> None:
        """shapes: (layers, in, out) per target when not the model's own (a tensor-parallel rank's share)."""
        self.num_slots, self.max_rank = num_slots, max_rank
        self.full_shapes = target_shapes(cfg)  # what adapters on disk and in the host tier have
        self.shapes = shapes or self.full_shapes
        self.experts = target_experts(cfg)
        self.A: dict[str, Tensor] = {}
        self.B: dict[str, Tensor] = {}
        for t, shape in self.shapes.items():
            a_shape, b_shape = lora_shapes(shape, self.experts.get(t, 0), max_rank)
            self.A[t] = torch.zeros(num_slots, *a_shape, device=device, dtype=dtype)
            self.B[t] = torch.zeros(num_slots, *b_shape, device=device, dtype=dtype)
        self.scale = torch.zeros(num_slots, device=device, dtype=torch.float32)
        self.rank = [0] * num_slots
        self.targets: list[tuple[str, ...]] = [()] * num_slots

    def write(self, slot: int, weights: dict[str, tuple[Tensor, Tensor]], rank: int, alpha: float) -> None:
        """Fill a slot: weights[target] = (A [layers, (E,) r, in], B [layers, (E,) out, r]); other targets zeroed."""
        if not 0 < rank <= self.max_rank:
            raise ValueError(f"rank {rank} is outside 1..{self.max_rank} (the bank's max_rank)")
        for t in weights:
            if t not in self.shapes:
                raise ValueError(f"unknown LoRA target {t!r}")
        with torch.no_grad():
            for t in self.shapes:
                A, B = self.A[t][slot], self.B[t][slot]
                if t in weights:  # copy in, zero only the rank padding (one pass over the slot, not two)
                    a, b = weights[t]
                    A[..., :rank, :].copy_(a)
                    B[..., :rank].copy_(b)
                    A[..., rank:, :].zero_()
                    B[..., rank:].zero_()
                else:
                    A.zero_()
                    B.zero_()
            self.scale[slot] = alpha / rank
        self.rank[slot] = rank
        self.targets[slot] = tuple(t for t in self.shapes if t in weights)

    @contextmanager
    def probing(self, slots: Sequence[int], rank: int) -> Iterator[None]:
        """Empty slots that a forward treats as rank-`rank` adapters on every target (their weights
        stay zero) while the block runs: what a step's LoRA costs can be measured before any adapter
        is loaded."""
        empty = [s for s in slots if self.rank[s] == 0]
        for s in empty:
            self.rank[s], self.targets[s] = rank, tuple(self.shapes)
        try:
            yield
        finally:
            for s in empty:
                self.rank[s], self.targets[s] = 0, ()

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
        return {t: (self.A[t][slot][..., :r, :].clone(), self.B[t][slot][..., :r].clone()) for t in self.targets[slot]}

    def batch(self, row_slots: Sequence[int], device: torch.device | str | None = None) -> LoraBatch:
        """A LoraBatch over the whole bank (no copies) for rows given as slot ids (-1 = base)."""
        used = {s for s in row_slots if s >= 0}
        rank = max((self.rank[s] for s in used), default=0)
        if rank and invariant.enabled():  # one product shape whatever the batch's adapters
            rank = self.max_rank
        targets = {t for s in used for t in self.targets[s]}
        weights = {t: (self.A[t][..., :rank, :], self.B[t][..., :rank]) for t in targets} if rank else {}
        rows = torch.tensor(list(row_slots), dtype=torch.long, device=device or self.scale.device)
        return LoraBatch(weights=weights, rows=rows, scale=self.scale)
