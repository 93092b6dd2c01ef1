"""Batch-invariant tensor math: a row's numbers never depend on what else is in its batch.

A BLAS picks its kernel, blocking and reduction order from the matrix shapes, and a reduction or
elementwise kernel splits its work over threads by the tensor's size; so the same token's logits
differ in the last bits between a batch of 1 and a batch of 64, or between the sampler (one token
per step) and the trainer (a whole sequence per pass). In invariant mode (`mint serve
--batch-invariant`, `EngineSettings.batch_invariant`) every operation a token goes through has a
shape that does not depend on the batch:

- products with a weight (base projections, LoRA shrink/expand at the bank's max rank, lm_head)
  run on tiles of TILE tokens (zero-padded), one bmm over the tiles: each token is computed by the
  same [TILE, in] × [in, out] product wherever it sits;
- row reductions (RMSNorm's mean square) and elementwise transcendentals (SiLU) run one [TILE, d]
  tile at a time, so the thread split and the vectorised/scalar split of the work are the same for
  every tile;
- RoPE reads cos/sin from a table computed once per position;
- attention takes keys in blocks of KEY_BLOCK positions: scores per (query tile, key block), a
  row softmax over keys padded to whole blocks with -inf, and the weighted values summed block by
  block in order, so a query sees the same sums whether its keys come from the KV cache one token
  at a time or from a whole training sequence;
- logprobs come from the row-wise log-softmax kernel (one thread per row, same code per row).

That each of these is invariant on this machine's kernels (a tile's rows do not depend on their
position in it or on the tile count, a row softmax does not depend on its padding) is checked when
the mode is switched on (`verify`); a backend that fails it is refused with the failing operation
named. Training adds one rule: tiles of an adapter's tokens are aligned to its own rows
(`LoraBatch.row_lengths`), so the sums that make its gradients see the same tiles in a fused pass
as alone. The cost is padding (a lone decode row still runs a TILE-row product) and more, smaller
kernel calls: benchmarks/invariance.py measures it.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator
from contextlib import contextmanager

import torch
import torch.nn.functional as F
from torch import Tensor

from mint_server.model import kernels
from mint_server.model.families import family_spec

TILE = 16  # tokens per product tile
# Rows per tile of the backward's products: only the trainer runs them (alone or fused, the same
# code), so they need not match the sampler's and can be larger, reading each weight fewer times.
BACKWARD_TILE = 128
KEY_BLOCK = 64  # key positions per attention block

_enabled = False


def enabled() -> bool:
    return _enabled


def set_enabled(value: bool) -> None:
    global _enabled
    _enabled = bool(value)


@contextmanager
def use(value: bool) -> Iterator[None]:
    old = _enabled
    set_enabled(value)
    try:
        yield
    finally:
        set_enabled(old)


def _pad_rows(x: Tensor, multiple: int) -> Tensor:
    return _pad_dim(x, 0, multiple)


def _pad_dim(x: Tensor, dim: int, multiple: int) -> Tensor:
    """x with zeros appended along dim up to a multiple (a cat: F.pad would fill the whole output)."""
    extra = -x.shape[dim] % multiple
    if not extra:
        return x
    shape = list(x.shape)
    shape[dim] = extra
    return torch.cat([x, x.new_zeros(shape)], dim)


def _tiled(x: Tensor, wt: Tensor, tile: int) -> Tensor:
    n = x.shape[0]
    # at least two tiles: a batch of one goes to a plain GEMM, which may split the reduction over
    # threads where a batch of several does not
    xt = _pad_rows(x, tile) if n > tile else F.pad(x, (0, 0, 0, 2 * tile - n))
    nt = xt.shape[0] // tile
    y = torch.bmm(xt.view(nt, tile, -1), wt.expand(nt, *wt.shape))
    return y.view(nt * tile, -1)[:n]


class _Matmul(torch.autograd.Function):
    """x [n, in] @ wt [in, out] in TILE-row products. Backward: x's gradient in BACKWARD_TILE-row
    products (row-wise again); wt's gradient, a sum over all n rows, as one product — its shape
    follows only the rows given, which training lays out per adapter and per row (LoraBatch)."""

    @staticmethod
    def forward(ctx, x: Tensor, wt: Tensor) -> Tensor:  # type: ignore[override]
        ctx.save_for_backward(x, wt)
        return _tiled(x, wt, TILE)

    @staticmethod
    def backward(ctx, grad: Tensor) -> tuple[Tensor | None, Tensor | None]:  # type: ignore[override]
        x, wt = ctx.saved_tensors
        gx = _tiled(grad, wt.t(), BACKWARD_TILE) if ctx.needs_input_grad[0] else None
        gw = x.t() @ grad if ctx.needs_input_grad[1] else None
        return gx, gw


def matmul(x: Tensor, wt: Tensor) -> Tensor:
    """x [n, in] @ wt [in, out] as TILE-row products: row i of the result depends only on x[i]."""
    if torch.is_grad_enabled() and (x.requires_grad or wt.requires_grad):
        return _Matmul.apply(x, wt)
    return _tiled(x, wt, TILE)


def linear(x: Tensor, weight: Tensor, bias: Tensor | None = None) -> Tensor:
    """F.linear, batch-invariant: x [..., in], weight [out, in]."""
    lead = x.shape[:-1]
    y = matmul(x.reshape(-1, x.shape[-1]), weight.t()).view(*lead, weight.shape[0])
    return y if bias is None else y + bias


def per_tile(fn: Callable[[Tensor], Tensor], x: Tensor) -> Tensor:
    """fn applied to [TILE, d] tiles of x [..., d] one at a time (elementwise ops whose result may
    depend on where an element falls in the kernel's split of the work)."""
    flat = x.reshape(-1, x.shape[-1])
    n = flat.shape[0]
    tiles = _pad_rows(flat, TILE).split(TILE)
    if torch.is_grad_enabled() and flat.requires_grad:
        out = torch.cat([fn(t) for t in tiles])
    else:  # written in place of a cat's copy
        first = fn(tiles[0])
        out = first.new_empty(len(tiles) * TILE, first.shape[-1])
        out[:TILE] = first
        for k in range(1, len(tiles)):
            out[k * TILE : (k + 1) * TILE] = fn(tiles[k])
    return out[:n].view(*x.shape[:-1], out.shape[-1])


def row_sum(x: Tensor) -> Tensor:
    """x [..., d] summed over d → [..., 1], one [TILE, d] tile at a time (a reduction kernel splits
    its work by the tensor's size)."""
    return per_tile(lambda t: t.sum(-1, keepdim=True), x)


def rms_norm(x: Tensor, weight: Tensor, eps: float) -> Tensor:
    xf = x.float()
    mean_sq = row_sum(xf * xf) / x.shape[-1]
    return weight * (xf * torch.rsqrt(mean_sq + eps)).to(x.dtype)


def silu_mul(g: Tensor, u: Tensor) -> Tensor:
    return per_tile(F.silu, g) * u


def rope_table(inv_freq: Tensor, length: int) -> tuple[Tensor, Tensor]:
    """cos, sin [length, head_dim] for positions 0..length-1 (float32), computed once in float64."""
    pos = torch.arange(length, dtype=torch.float64, device=inv_freq.device)
    angles = pos[:, None] * inv_freq.double()[None, :]
    angles = torch.cat((angles, angles), dim=-1)
    return angles.cos().float(), angles.sin().float()


def attention(q: Tensor, k: Tensor, v: Tensor, q_positions: Tensor, scale: float) -> Tensor:
    """Causal attention, batch-invariant. q [B, H, T, d]; k, v [B, Hkv, L, d] hold positions
    0..L-1; q_positions [B, T]: each query's absolute position (it sees keys at positions ≤ it)."""
    B, H, T, d = q.shape
    L, dv = k.shape[2], v.shape[-1]
    if k.shape[1] != H:
        k, v = k.repeat_interleave(H // k.shape[1], 1), v.repeat_interleave(H // v.shape[1], 1)
    nq, nk = -(-T // TILE), -(-L // KEY_BLOCK)
    qt = _pad_dim(q, 2, TILE).view(B, H, nq, TILE, d)
    kbt = _pad_dim(k, 2, KEY_BLOCK).view(B, H, nk, KEY_BLOCK, d).transpose(-1, -2)
    vb = _pad_dim(v, 2, KEY_BLOCK).view(B, H, nk, KEY_BLOCK, dv)
    pos = F.pad(q_positions, (0, nq * TILE - T)).view(B, 1, nq, TILE, 1)
    keys = torch.arange(nk * KEY_BLOCK, device=q.device)
    outs = []
    for i in range(nq):  # a query tile against every key block: one [TILE, d] × [d, KEY_BLOCK] product each
        scores = torch.matmul(qt[:, :, i, None], kbt)  # [B, H, nk, TILE, KEY_BLOCK]
        scores = scores.transpose(2, 3).reshape(B, H, TILE, nk * KEY_BLOCK) * scale
        probs = torch.softmax(scores.masked_fill(keys > pos[:, :, i], float("-inf")), dim=-1)
        parts = torch.matmul(probs.view(B, H, TILE, nk, KEY_BLOCK).transpose(2, 3), vb)  # [B, H, nk, TILE, dv]
        # summed block by block in order: trailing all-masked blocks add exact zeros
        outs.append(parts.sum(2))
    return torch.stack(outs, 2).view(B, H, nq * TILE, dv)[:, :, :T]


def softmax_from_log(logp: Tensor) -> Tensor:
    """exp(logp) for [..., vocab] log-probabilities, one [TILE, vocab] tile at a time."""
    return per_tile(torch.exp, logp)


class InvariantBackendError(RuntimeError):
    """This machine's kernels do not give batch-invariant results for an operation the mode needs."""


def verify(shapes: list[tuple[int, int]], widths: list[int], vocab: int, head_dim: int,
           device: torch.device | str = "cpu", dtype: torch.dtype = torch.float32) -> None:
    """Check, on this machine's kernels and thread count, every property invariant mode relies on,
    for the model's own sizes: products with weights of `shapes` [(in, out)], SiLU and row sums
    over `widths`, the row log-softmax over `vocab`, attention blocks of `head_dim`. Raises
    InvariantBackendError naming the first operation that fails."""
    g = torch.Generator(device="cpu").manual_seed(0)

    def rand(*shape: int) -> Tensor:
        return torch.randn(*shape, generator=g, dtype=torch.float32).to(device=device, dtype=dtype)

    def same(a: Tensor, b: Tensor, what: str) -> None:
        if not torch.equal(a, b):
            raise InvariantBackendError(f"batch-invariant mode is not supported by this machine's kernels: {what} "
                                        "depends on the batch (try another MKL_CBWR / thread count, or run without "
                                        "--batch-invariant)")

    perm = torch.randperm(3 * TILE, generator=g).to(device)
    for fi, fo in shapes:
        x, wt = rand(7 * TILE, fi), rand(fo, fi).t()
        y = matmul(x, wt)
        same(matmul(x[perm], wt), y[perm], f"a [{TILE}, {fi}] × [{fi}, {fo}] product's row position")
        for n in (5, 3 * TILE):
            same(matmul(x[:n], wt), y[:n], f"a [{TILE}, {fi}] × [{fi}, {fo}] product's tile count")
    for w in widths:
        x = rand(3 * TILE, w)
        silu, sums = per_tile(F.silu, x), row_sum(x)
        same(per_tile(F.silu, x[perm]), silu[perm], f"SiLU over {w} columns")
        same(per_tile(F.silu, x[:5]), silu[:5], f"SiLU over {w} columns, by tile count")
        same(row_sum(x[perm]), sums[perm], f"a row sum over {w} columns")
        same(row_sum(x[:5]), sums[:5], f"a row sum over {w} columns, by tile count")
    # training's log-softmax (in place, blocks of rows) on one row against the sampler's on a batch
    x = rand(4, vocab)
    same(kernels.log_softmax_(x[1:2].clone()), torch.log_softmax(x, -1)[1:2], f"log-softmax over {vocab}")
    lp = torch.log_softmax(rand(3 * TILE, vocab), -1)
    same(softmax_from_log(lp[perm]), softmax_from_log(lp)[perm], f"exp over {vocab} columns")
    same(softmax_from_log(lp[:5]), softmax_from_log(lp)[:5], f"exp over {vocab} columns, by tile count")
    for fi, fo in shapes:  # the backward's products (the trainer's only)
        grad, w = rand(3 * BACKWARD_TILE, fo), rand(fo, fi)
        y = _tiled(grad, w, BACKWARD_TILE)
        same(_tiled(grad[:7], w, BACKWARD_TILE), y[:7], f"a [{BACKWARD_TILE}, {fo}] × [{fo}, {fi}] product's tile count")
    # attention: one query alone (decode) vs inside a longer sequence's tiles (prefill, training)
    L = 2 * KEY_BLOCK + 5
    q, k, v = rand(1, 2, L, head_dim), rand(1, 2, L, head_dim), rand(1, 2, L, head_dim)
    pos = torch.arange(L, device=device)[None]
    full = attention(q, k, v, pos, 1 / math.sqrt(head_dim))
    p = KEY_BLOCK + 3
    one = attention(q[:, :, p : p + 1], k[:, :, : p + 1], v[:, :, : p + 1], pos[:, p : p + 1], 1 / math.sqrt(head_dim))
    same(one, full[:, :, p : p + 1], f"attention over head_dim {head_dim}")


def enable_for_model(cfg, max_rank: int, device: torch.device | str = "cpu",
                     dtype: torch.dtype = torch.float32) -> None:
    """Switch the mode on for a model of this ModelConfig after checking its family and this
    machine's kernels (verify); InvariantBackendError names what stands in the way."""
    if not family_spec(cfg).batch_invariant:
        raise InvariantBackendError(f"batch-invariant mode supports the dense families (Llama, Qwen3); "
                                    f"{cfg.architecture} is not supported yet")
    h, q, kv = cfg.hidden_size, cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
    i = cfg.intermediate_size
    shapes = {(h, q), (h, kv), (q, h), (h, i), (i, h), (h, cfg.vocab_size)}
    for fi, fo in list(shapes):  # LoRA shrink and expand at the bank's max rank
        shapes |= {(fi, max_rank), (max_rank, fo)}
    verify(sorted(shapes), sorted({h, i, cfg.head_dim}), cfg.vocab_size, cfg.head_dim, device, dtype)
    set_enabled(True)
