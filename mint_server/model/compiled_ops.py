"""The two opaque ops a compiled prefill layer calls (model/compiled.py): attention over each segment's
paged KV, and each token's LoRA delta. Everything per segment lives here, outside the graph.

A step that holds prefill chunks is ragged: its segments (decode rows, chunks of any length starting
anywhere in their prompt) differ in number and length every step. Traced, a loop over them would
be a new graph per step; as custom ops (vLLM's way with its attention) the compiled layer sees two
calls of fixed signature, tensors in and one tensor out, and the per-segment work runs eagerly
inside them from a per-step context (`StepContext`, set by the caller around the layers; thread
local, so a warm-up on the compile thread and a step on the worker never see each other's).

The work inside is the eager step's own code: `RaggedView`'s attention (decode rows as one batch,
each chunk causally against its blocks — `kernels.chunk_attention` for a chunk after a prefix) and
`lora.add_lora` (one adapter: two products; mixed: grouped by adapter, each adapter read once).
"""

from __future__ import annotations

import threading
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor

from mint_server.model import kernels
from mint_server.model.kv_cache import RaggedView, read_blocks
from mint_server.model.lora import LoraBatch, add_lora


@dataclass
class StepContext:
    """What the ops read of the step in flight: its segments (a RaggedView, built once per step) and
    its LoRA batch (None: no token has an adapter) and the largest rank among its adapters."""

    view: RaggedView
    lora: LoraBatch | None
    rank: int


_current = threading.local()


def set_step(ctx: StepContext | None) -> None:
    _current.ctx = ctx


def _step() -> StepContext:
    ctx = getattr(_current, "ctx", None)
    assert ctx is not None, "a compiled prefill layer ran outside its step"
    return ctx


@torch.library.custom_op("mint::ragged_attention", mutates_args=())
def ragged_attention(q: Tensor, k_pool: Tensor, v_pool: Tensor) -> Tensor:
    """q [N, H, D] of the step's tokens → their attention outputs [N, H, D], each token over its own
    sequence's keys up to its position; k_pool / v_pool [positions, Hkv, D] already hold the step's
    keys (the layer writes them first)."""
    view = _step().view
    bs = view.cache.block_size
    ck, cv = k_pool.view(-1, bs, *k_pool.shape[1:]), v_pool.view(-1, bs, *v_pool.shape[1:])
    gqa = q.shape[1] != k_pool.shape[1]
    out = torch.empty_like(q)
    if view.single_len:  # decode rows: one batch of single queries, masked past each row's position
        rows = view.single_rows
        ks, vs = read_blocks(ck, view.single_table, view.single_len), read_blocks(cv, view.single_table, view.single_len)
        out[rows] = F.scaled_dot_product_attention(q[rows][:, :, None], ks, vs, attn_mask=view.single_mask,
                                                   enable_gqa=gqa)[:, :, 0]
    for start, n, table in view.runs:  # each chunk causally against its blocks
        pos = view.positions[start : start + n, 0]
        first, kv_len = int(pos[0]), int(pos[-1]) + 1
        qr = q[start : start + n].transpose(0, 1)[None]  # [1, H, n, D]
        table = table[:, : -(-kv_len // bs)]
        kr, vr = read_blocks(ck, table, kv_len), read_blocks(cv, table, kv_len)
        if first == 0:
            y = F.scaled_dot_product_attention(qr, kr, vr, is_causal=True, enable_gqa=gqa)
        else:  # a chunk after earlier ones (a prefix-cached start or a later chunk)
            y = kernels.chunk_attention(qr, kr, vr, q.shape[-1] ** -0.5)
        out[start : start + n] = y[0].transpose(0, 1)
    return out


@ragged_attention.register_fake
def _(q: Tensor, k_pool: Tensor, v_pool: Tensor) -> Tensor:
    return torch.empty_like(q)


@torch.library.custom_op("mint::step_lora", mutates_args=())
def step_lora(x: Tensor, A: Tensor, B: Tensor) -> Tensor:
    """x [N, in] → each token's LoRA delta [N, out] from a layer's bank stacks A [slots, r_max, in],
    B [slots, out, r_max] (base tokens: 0)."""
    ctx = _step()
    assert ctx.lora is not None, "the LoRA variant of a prefill layer ran on a step without adapters"
    y = x.new_zeros(x.shape[0], 1, B.shape[1])
    return add_lora(y, x[:, None], A[:, : ctx.rank], B[..., : ctx.rank], ctx.lora)[:, 0]


@step_lora.register_fake
def _(x: Tensor, A: Tensor, B: Tensor) -> Tensor:
    return x.new_empty(x.shape[0], B.shape[1])
