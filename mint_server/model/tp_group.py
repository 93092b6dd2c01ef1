"""One rank's place in a tensor-parallel group and the collectives the model calls (autograd-aware).

A leaf of the model package: layers (lora.py, moe.py) use it without importing the model-splitting
code in tp.py, which imports them. The scheme itself is described in tp.py.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor

# LoRA targets by the split of their base layer. Column: output split (A replicated, B split);
# row: input split (A split, B replicated).
COLUMN_TARGETS = ("q_proj", "k_proj", "v_proj", "gate_proj", "up_proj", "expert_gate_proj", "expert_up_proj",
                  "lm_head", "q_b_proj", "kv_b_proj", "shared_gate_proj", "shared_up_proj")
ROW_TARGETS = ("o_proj", "down_proj", "expert_down_proj", "shared_down_proj")
# MLA's query and KV down-projections run whole on every rank (their outputs feed every head): A and B
# replicated, their gradients already summed (the activations entering the split heads carry tp.enter).
REPLICATED_TARGETS = ("q_a_proj", "kv_a_proj_with_mqa")

@dataclass(frozen=True)
class TP:
    """This rank's place in a tensor-parallel group (`group` None: the default process group)."""

    rank: int
    world: int
    group: Any = None
    # where collectives' tensors must live: cpu for gloo, this rank's GPU for NCCL (host-tier shares
    # and scalars are moved there and back)
    device: torch.device = torch.device("cpu")

    # --- the four collectives the model uses (autograd-aware) -------------------------------------
    def enter(self, x: Tensor) -> Tensor:
        """A replicated input entering split work: identity; in backward, sum the ranks' gradients."""
        return _Enter.apply(x, self.group) if x.requires_grad and torch.is_grad_enabled() else x

    def reduce(self, x: Tensor) -> Tensor:
        """Sum the ranks' partial outputs (row-parallel, vocab-parallel lookups); backward: identity."""
        if torch.is_grad_enabled() and x.requires_grad:
            return _Reduce.apply(x, self.group)
        x = x.contiguous()
        dist.all_reduce(x, group=self.group)
        return x

    def gather(self, x: Tensor) -> Tensor:
        """Concatenate the ranks' slices along the last dim (vocab-parallel logits); backward: own slice."""
        return _Gather.apply(x, self.rank, self.world, self.group)

    def target_logprobs(self, local_logits: Tensor, targets: Tensor, vocab_start: int) -> Tensor:
        """log_softmax(logits)[targets] [rows, T, K] in float32 from each rank's vocabulary slice
        (vocab-parallel cross-entropy): three all-reduces of [rows, T, ·] instead of gathering the
        [rows, T, vocab] logits; backward stays local to the slice."""
        return _VocabTargetLogprobs.apply(local_logits, targets, vocab_start, self.group)

    # --- plain (no autograd) helpers ------------------------------------------------------------
    # At world size 1 (a single process: a shard of one) each is the identity, with no process group.
    def all_gather_dim(self, x: Tensor, dim: int) -> Tensor:
        if self.world == 1:
            return x
        y = x.to(self.device).contiguous()
        parts = [torch.empty_like(y) for _ in range(self.world)]
        dist.all_gather(parts, y, group=self.group)
        return torch.cat(parts, dim=dim).to(x.device)

    def all_reduce_sum(self, x: Tensor) -> Tensor:
        if self.world == 1:
            return x
        out = x.to(self.device).contiguous().clone()
        dist.all_reduce(out, group=self.group)
        return out.to(x.device)

    def sum(self, value: float) -> float:
        if self.world == 1:
            return value
        t = torch.tensor([value], dtype=torch.float64, device=self.device)
        dist.all_reduce(t, group=self.group)
        return float(t.item())

    def all_true(self, flag: bool) -> bool:
        if self.world == 1:
            return flag
        t = torch.tensor([0 if flag else 1], dtype=torch.int64, device=self.device)
        dist.all_reduce(t, group=self.group)
        return int(t.item()) == 0


class _Enter(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: Tensor, group: Any) -> Tensor:
        ctx.group = group
        return x.view_as(x)

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor, None]:
        grad = grad.contiguous().clone()
        dist.all_reduce(grad, group=ctx.group)
        return grad, None


class _Reduce(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: Tensor, group: Any) -> Tensor:
        out = x.contiguous().clone()
        dist.all_reduce(out, group=group)
        return out

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor, None]:
        return grad, None


class _Gather(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: Tensor, rank: int, world: int, group: Any) -> Tensor:
        ctx.rank, ctx.world = rank, world
        parts = [torch.empty_like(x) for _ in range(world)]
        dist.all_gather(parts, x.contiguous(), group=group)
        return torch.cat(parts, dim=-1)

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor, None, None, None]:
        return grad.chunk(ctx.world, dim=-1)[ctx.rank].contiguous(), None, None, None


class _VocabTargetLogprobs(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, logits: Tensor, targets: Tensor, vocab_start: int, group: Any) -> Tensor:
        x = logits.float()
        top = x.amax(-1, keepdim=True)
        dist.all_reduce(top, op=dist.ReduceOp.MAX, group=group)
        total = (x - top).exp_().sum(-1, keepdim=True)
        dist.all_reduce(total, group=group)
        lse = top + total.log_()
        local = targets - vocab_start
        inside = (local >= 0) & (local < x.shape[-1])
        local = local.clamp(0, x.shape[-1] - 1)
        picked = x.gather(-1, local) * inside
        dist.all_reduce(picked, group=group)
        ctx.in_dtype = logits.dtype
        ctx.save_for_backward(x, local, inside, lse)
        return picked - lse

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor, None, None, None]:
        x, local, inside, lse = ctx.saved_tensors
        # as losses.TargetLogprobs, on this slice: scatter(g at targets it holds) − softmax·Σ g
        p = x.sub_(lse).exp_().mul_(-grad.sum(-1, keepdim=True))
        p.scatter_add_(-1, local, grad * inside)
        return p.to(ctx.in_dtype), None, None, None


def sync_replicated(tp: TP | None, target: str, A: Tensor, B: Tensor) -> tuple[Tensor, Tensor]:
    """Training: wrap the target's replicated LoRA factor so its gradient is summed over ranks."""
    if tp is None or not torch.is_grad_enabled() or target in REPLICATED_TARGETS:
        return A, B
    if target in ROW_TARGETS:
        return A, tp.enter(B)
    return tp.enter(A), B
