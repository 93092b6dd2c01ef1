"""The trainable LoRA of a training pass: each adapter's per-layer A and B as autograd leaves
(`training_lora`, which every rank runs over its own bank share: the whole bank on a shard of one), as a LoraBatch
by row or, for a packed row, by token (`TokenLora`), and their gradients summed per adapter
(`leaf_grads`, `accumulate`)."""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor

from mint_server.engine.optim import Pairs
from mint_server.model import invariant
from mint_server.model.lora import ExpertGroups, LoraBank, LoraBatch, PerLayer, add_product, lora_shapes
from mint_server.model.tp_group import TP


@dataclass(frozen=True)
class LoraRef:
    """What a training op needs of an adapter in a slot (training_lora's protocol): the runner's
    training ops carry this, so the same op body runs on every rank."""

    id: str
    slot: int
    rank: int
    targets: tuple[str, ...]
    scale: float


Leaves = dict[str, dict[str, tuple[list[Tensor], list[Tensor]]]]  # adapter id → target → per-layer (A, B)


def training_lora(bank: LoraBank, adapters: Sequence[Any], row_adapter: list[int], dev: torch.device,
                  dtype: torch.dtype) -> tuple[LoraBatch, Leaves]:
    """The pass's trainable LoRA over a rank's bank (a shard of one holds the whole bank): leaf
    tensors per adapter, read from its slot, and the LoraBatch that applies them by row; adapters
    need .id, .slot, .rank, .targets and .scale."""
    # invariant mode: always the bank's max rank, so the products' shapes do not depend on the batch
    rmax = bank.max_rank if invariant.enabled() else max(a.rank for a in adapters)
    leaves: Leaves = {a.id: {} for a in adapters}
    weights: dict[str, tuple[Any, Any]] = {}
    for t in sorted({t for a in adapters for t in a.targets}):
        L, fi, fo = bank.shapes[t]
        per_adapter = []
        for a in adapters:
            if t in a.targets:
                As = [bank.A[t][a.slot, i][..., : a.rank, :].detach().requires_grad_(True) for i in range(L)]
                Bs = [bank.B[t][a.slot, i][..., : a.rank].detach().requires_grad_(True) for i in range(L)]
                leaves[a.id][t] = (As, Bs)
            else:  # no LoRA on t for this adapter: zeros, no gradient wanted
                a_shape, b_shape = lora_shapes((L, fi, fo), bank.experts.get(t, 0), a.rank, layered=False)
                As = [torch.zeros(a_shape, device=dev, dtype=dtype)] * L
                Bs = [torch.zeros(b_shape, device=dev, dtype=dtype)] * L
            pad = rmax - a.rank  # zero rank-padding keeps the product exact
            per_adapter.append(([F.pad(x, (0, 0, 0, pad)) for x in As] if pad else As,
                                [F.pad(x, (0, pad)) for x in Bs] if pad else Bs))
        weights[t] = (PerLayer([torch.stack([As[i] for As, _ in per_adapter]) for i in range(L)]),
                      PerLayer([torch.stack([Bs[i] for _, Bs in per_adapter]) for i in range(L)]))
    scale = torch.tensor([a.scale for a in adapters], device=dev, dtype=torch.float32)
    rows = torch.tensor(row_adapter, dtype=torch.long, device=dev)
    return LoraBatch(weights=weights, rows=rows, scale=scale), leaves  # type: ignore[arg-type]


@dataclass
class TokenLora(LoraBatch):
    """A LoraBatch whose rows are the tokens of one packed row [1, N] (several datums, several
    adapters): each adapter's LoRA runs over its own contiguous spans of tokens, added in place into
    the base projection's output (`lora.add_product`); expert pairs take their token's adapter
    (`moe.SparseMoE`). Base tokens (-1) get no delta."""

    spans: list[tuple[int, int, int]] = dataclasses.field(init=False, default_factory=list)

    def __post_init__(self) -> None:
        rows = self.row_list = self.rows.tolist()
        self.uniform, self.plan = None, None
        self.row_index = self.rows.clamp(min=0)
        self.row_scale = torch.where(self.rows >= 0, self.scale[self.row_index], torch.zeros_like(self.scale[:1]))
        start = 0
        for i in range(1, len(rows) + 1):  # (adapter, first token, end) of each run of equal adapters
            if i == len(rows) or rows[i] != rows[start]:
                if rows[start] >= 0:
                    self.spans.append((rows[start], start, i))
                start = i

    def window(self, start: int, end: int) -> TokenLora:
        """The same adapters over tokens start..end (a chunk of the row)."""
        return TokenLora(weights=self.weights, rows=self.rows[start:end], scale=self.scale)

    def apply(self, target: str, layer: int, x: Tensor, y: Tensor, groups: ExpertGroups | None = None,
              tp: TP | None = None) -> Tensor:
        if groups is not None:  # expert pairs: each pair's own adapter (lora.add_lora)
            return super().apply(target, layer, x, y, groups, tp)
        ab = self.weights.get(target)
        if ab is None:
            return y
        A, B = ab[0][:, layer], ab[1][:, layer]
        xf, yf = x.reshape(-1, x.shape[-1]), y.view(-1, y.shape[-1])
        for a, s, e in self.spans:
            xa = (xf[s:e] @ A[a].transpose(0, 1)) * self.scale[a].to(x.dtype)
            add_product(yf[s:e], xa, B[a].transpose(0, 1))
        return y


def leaf_grads(leaves: Leaves) -> dict[str, Pairs]:
    """Per-layer leaf gradients → adapter id → target → (grad A [L, r, in], grad B [L, out, r]), float32."""

    def stack(ts: list[Tensor]) -> Tensor:
        return torch.stack([t.grad.float() if t.grad is not None else torch.zeros_like(t, dtype=torch.float32)
                            for t in ts])

    return {aid: {t: (stack(As), stack(Bs)) for t, (As, Bs) in ts.items()} for aid, ts in leaves.items()}


def accumulate(into: dict, grads: Mapping[str, Any]) -> None:
    """into[adapter][target] += grads (or into[target] for one adapter's dict), in float32."""
    for key, value in grads.items():
        if isinstance(value, tuple):
            old = into.get(key)
            into[key] = value if old is None else (old[0] + value[0], old[1] + value[1])
        else:
            accumulate(into.setdefault(key, {}), value)
