"""The paged KV cache and the views a forward pass reads and writes it through.

`KVCache` holds the pools (fixed at construction: the engine's KV budget); `CacheView` says which
blocks each batch row reads and writes in one forward, `RaggedView` the same for a step whose
sequences are packed as one ragged batch. What a family's cache holds per token (K/V, MLA's latent,
DeepSeek-V4's per-block pools) is the family registry's (families.py).
"""

from __future__ import annotations

import math
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor

from mint_server.model import invariant, kernels
from mint_server.model.config import ModelConfig
from mint_server.model.families import family_spec
from mint_server.model.v4_spec import DEFAULT_BLOCK_SIZE


class KVCache:
    """Paged K/V: a fixed pool of `num_blocks` blocks of `block_size` positions, for every layer.

    A sequence owns a list of blocks (its block table), block i holding its positions
    [i·block_size, (i+1)·block_size); blocks of a shared prompt prefix may sit in several tables.
    Memory is fixed at construction (the engine's KV budget), whatever the sequences' lengths.
    Block `SCRATCH` (0) belongs to nobody: table entries past a row's own blocks point at it, so
    padding tokens write there instead of into someone's block, and what it holds is always masked.
    """

    SCRATCH = 0

    def __init__(
        self,
        cfg: ModelConfig,
        num_blocks: int,
        block_size: int,
        device: torch.device | str,
        dtype: torch.dtype,
    ) -> None:
        if num_blocks < 2 or block_size < 1:
            raise ValueError("a KV cache needs at least 2 blocks (one is scratch) of at least 1 position")
        # Per pool [layers, blocks, positions, *token_shape]: one gather of a table's blocks is
        # already the [rows, positions, ...] attention wants, with no copy to reorder it. Pools:
        # k, v [kv_heads, head_dim] (here as .k / .v); MLA's latent + rope key (+ V3.2's indexer key).
        # Zeros, not empty: masked keys get weight 0 and 0 · NaN would still poison a row.
        # DeepSeek-V4's pools are per block and some are float32 (cache_pool_shapes).
        self.pools = {name: torch.zeros(shape, device=device, dtype=torch.float32 if fp32 else dtype)
                      for name, (shape, fp32) in cache_pool_shapes(cfg, num_blocks, block_size).items()}
        if "k" in self.pools:
            self.k, self.v = self.pools["k"], self.pools["v"]
        self.num_blocks, self.block_size = num_blocks, block_size

    @property
    def nbytes(self) -> int:
        return sum(p.numel() * p.element_size() for p in self.pools.values())

    def save_blocks(self, blocks: list[int]) -> dict[str, Tensor]:
        """A host copy of these blocks in every layer (a preempted sequence's KV, swapped out)."""
        dev = next(iter(self.pools.values())).device
        idx = torch.tensor(blocks, device=dev, dtype=torch.long)
        return {name: p[:, idx].to("cpu", copy=True) for name, p in self.pools.items()}

    def load_blocks(self, saved: dict[str, Tensor], blocks: list[int]) -> None:
        """Put a save_blocks copy back, into these (newly allocated) blocks."""
        dev = next(iter(self.pools.values())).device
        idx = torch.tensor(blocks, device=dev, dtype=torch.long)
        for name, p in self.pools.items():
            p[:, idx] = saved[name].to(dev)

    def copy_blocks(self, src: list[int], dst: list[int]) -> None:
        """Copy block src[i] into dst[i] in every layer (forking a partly filled prompt block)."""
        if dst:
            dev = next(iter(self.pools.values())).device
            s, d = torch.tensor(src, device=dev), torch.tensor(dst, device=dev)
            for p in self.pools.values():
                p[:, d] = p[:, s]


def kv_token_shapes(cfg: ModelConfig) -> dict[str, tuple[int, ...]]:
    """What the KV cache holds per token and layer: pool name → shape (K and V, or a family's own)."""
    return family_spec(cfg).kv_token_shapes(cfg)


def cache_pool_shapes(cfg: ModelConfig, num_blocks: int, block_size: int) -> dict[str, tuple[tuple[int, ...], bool]]:
    """Every pool of the paged cache: name → (full shape [layers, blocks, …], float32 regardless of
    the cache dtype?). Per-token pools are [layers, blocks, block_size, *token shape]."""
    if (paged := family_spec(cfg).block_cache) is not None:  # pools held per block (DeepSeek-V4's)
        return paged.pools(cfg, num_blocks, block_size)
    # Layers: those with softmax attention (a hybrid base's linear-attention layers keep a recurrent
    # state instead, model/recurrent_state.py); layer i of the pools is the i-th of them.
    return {name: ((len(cfg.attention_layers), num_blocks, block_size, *shape), False)
            for name, shape in kv_token_shapes(cfg).items()}


def kv_bytes_per_token(cfg: ModelConfig, dtype: torch.dtype, block_size: int = DEFAULT_BLOCK_SIZE) -> int:
    """Cache bytes one token position costs, all layers together (the sampler's budget unit); pools
    held per block (DeepSeek-V4's) are counted per position at `block_size`."""
    size = torch.empty((), dtype=dtype).element_size()
    if (paged := family_spec(cfg).block_cache) is not None:
        return -(-paged.bytes_per_block(cfg, block_size, size) // block_size)
    elems = sum(math.prod(s) for s in kv_token_shapes(cfg).values())
    return elems * len(cfg.attention_layers) * size


class CacheView:
    """Which blocks each batch row reads and writes, and at which absolute positions (set per forward).

    block_table [B, n] long: row b's i-th block holds its positions [i·bs, (i+1)·bs); entries past
    the row's own blocks are KVCache.SCRATCH, and n must cover the largest position. positions [B, T]:
    each query token's absolute position. Attention reads only the first ⌈(max position + 1) / bs⌉
    blocks, so its cost follows the longest sequence in the batch, not the cache's capacity.
    """

    # Hybrid bases: each sequence's recurrent-state slot (recurrent_state.StateView), set by whoever builds the view.
    states: Any = None

    def __init__(self, cache: KVCache, block_table: Tensor, positions: Tensor) -> None:
        self.cache, self.positions = cache, positions
        bs = cache.block_size
        self.kv_len = int(positions.max()) + 1
        self.table = block_table[:, : -(-self.kv_len // bs)]
        self.write_block = block_table.gather(1, positions // bs)  # [B, T]
        self.write_offset = positions % bs
        # fast kernels: one flat index per token into [blocks · positions] (index_copy_/index_select
        # dispatch less than two-index assignment and tensor __getitem__).
        self.write_flat = (self.write_block * bs + self.write_offset).flatten() if kernels.fast() else None
        # [B, 1, T, kv_len]: a query sees keys at positions ≤ its own; whatever lies beyond (stale
        # entries, padding, the scratch block) is masked.
        keys = torch.arange(self.kv_len, device=positions.device)
        self.mask = keys[None, None, None, :] <= positions[:, None, :, None]

    def update(self, layer: int, k: Tensor, v: Tensor) -> tuple[Tensor, Tensor]:
        """Store this forward's k, v [B, H, T, D]; return each row's keys/values [B, H, kv_len, D]."""
        ck, cv = self.cache.k[layer], self.cache.v[layer]
        if self.write_flat is not None:
            B, H, T, D = k.shape
            ck.view(-1, H, D).index_copy_(0, self.write_flat, k.transpose(1, 2).reshape(B * T, H, D))
            cv.view(-1, H, D).index_copy_(0, self.write_flat, v.transpose(1, 2).reshape(B * T, H, D))
        else:
            ck[self.write_block, self.write_offset] = k.transpose(1, 2)
            cv[self.write_block, self.write_offset] = v.transpose(1, 2)
        return self._read(ck), self._read(cv)

    def store(self, pool: str, layer: int, x: Tensor) -> Tensor:
        """Store this forward's x [B, T, ...] in a named pool (MLA's latents); return each row's
        entries [B, kv_len, ...]."""
        c = self.cache.pools[pool][layer]
        c[self.write_block, self.write_offset] = x
        return c[self.table].flatten(1, 2)[:, : self.kv_len]

    def _read(self, c: Tensor) -> Tensor:
        return read_blocks(c, self.table, self.kv_len)

    def attention(self, layer: int, q: Tensor, k: Tensor, v: Tensor, scale: float, gqa: bool,
                  window: int = 0, sinks: Tensor | None = None) -> Tensor:
        """Store this forward's k, v [B, Hkv, T, D] and attend q [B, H, T, D] to each row's keys
        (window, sinks: see `attend`)."""
        k, v = self.update(layer, k, v)
        if invariant.enabled():
            return invariant.attention(q, k, v, self.positions, scale)
        mask = self.mask
        if window:
            keys = torch.arange(self.kv_len, device=q.device)
            mask = visible(keys, self.positions[:, None, :, None], window)
        return attend(q, k, v, mask, scale, gqa, sinks)


def visible(keys: Tensor, pos: Tensor, window: int = 0) -> Tensor:
    """Which key positions a query at `pos` sees: all up to its own, or with a sliding `window` only
    the last `window` of them (its own included), as transformers' sliding-window mask."""
    mask = keys <= pos
    return mask & (keys > pos - window) if window else mask


def attend(q: Tensor, k: Tensor, v: Tensor, mask: Tensor | None, scale: float, gqa: bool,
           sinks: Tensor | None = None) -> Tensor:
    """softmax(q·kᵀ·scale over the keys `mask` [B|1, 1, T, S] allows) · v for q [B, H, T, D], k / v
    [B, Hkv, S, D]; mask None: causal (S == T).

    sinks [H] (gpt-oss): each head's learned logit joins the softmax as one more key with a zero value,
    so it only takes weight off the real keys. It rides through SDPA as that key: q gains a column
    holding sink / scale, the sink key is 1 there and 0 elsewhere, the real keys 0 — so q·k is
    unchanged for them and the sink's logit is its own; its value is 0. q, k and v all get 8 more
    columns (one head size, a multiple of 8, as fused kernels want); v's are sliced off the output.
    """
    if sinks is None:
        if mask is None:
            return F.scaled_dot_product_attention(q, k, v, is_causal=q.shape[2] > 1, scale=scale, enable_gqa=gqa)
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale, enable_gqa=gqa)
    B, H, T, D = q.shape
    Bk, Hkv, S, _ = k.shape
    if mask is None:
        mask = torch.ones(T, S, dtype=torch.bool, device=q.device).tril(S - T)[None, None]
    sink_col = (sinks.float() / scale).to(q.dtype).view(1, H, 1, 1).expand(B, H, T, 1)
    q = torch.cat((q, sink_col, q.new_zeros(B, H, T, 7)), dim=-1)
    sink_key = F.pad(k.new_ones(1, 1, 1, 1), (D, 7)).expand(Bk, Hkv, 1, D + 8)
    k = torch.cat((sink_key, F.pad(k, (0, 8))), dim=2)
    v = F.pad(v, (0, 8, 1, 0))
    mask = torch.cat((mask.new_ones(*mask.shape[:-1], 1), mask), dim=-1)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale, enable_gqa=gqa)[..., :D]


def read_blocks(c: Tensor, table: Tensor, kv_len: int) -> Tensor:
    """Each table row's first kv_len positions of pool c [blocks, positions, H, D] → [rows, H, kv_len, D]."""
    rows = table.shape[0]
    if kernels.fast():  # index_select dispatches less than tensor __getitem__
        blocks = c.index_select(0, table.flatten())
        return blocks.view(rows, -1, *c.shape[2:])[:, :kv_len].transpose(1, 2)
    return c[table].flatten(1, 2)[:, :kv_len].transpose(1, 2)


class RaggedView(CacheView):
    """One step of many sequences packed as one ragged batch: token i is batch row i ([N, 1] tokens),
    so every projection, LoRA delta and MLP runs once over all of them, whatever their lengths.

    segments: (first row, length, block-table row) of each sequence's consecutive tokens, in row
    order. Attention runs per kind of segment: all length-1 segments (decode rows) as one batch of
    single queries; each longer one (a prefill chunk) as one causal run of its queries against its
    own blocks, which already hold this forward's keys (they are written before they are read), so
    a chunk that starts mid-prompt sees the earlier chunks' keys. block_table [S, n]: one row per
    segment. Only the standard attention path reads it; MLA's store/mask are per query row.
    """

    def __init__(self, cache: KVCache, block_table: Tensor, positions: Tensor,
                 segments: list[tuple[int, int, int]]) -> None:
        dev = positions.device
        self.cache, self.positions = cache, positions  # positions [N, 1]
        bs = cache.block_size
        row_of = torch.tensor([t for _, n, t in segments for _ in range(n)], device=dev)
        token_table = block_table[row_of]  # [N, n]
        self.kv_len = int(positions.max()) + 1
        self.write_block = token_table.gather(1, positions // bs)
        self.write_offset = positions % bs
        self.write_flat = (self.write_block * bs + self.write_offset).flatten() if kernels.fast() else None
        singles = [(s, t) for s, n, t in segments if n == 1]
        self.single_rows = torch.tensor([s for s, _ in singles], device=dev)
        self.single_positions = positions[self.single_rows] if singles else positions[:0]
        self.single_len = int(self.single_positions.max()) + 1 if singles else 0
        rows = torch.tensor([t for _, t in singles], device=dev, dtype=torch.long)
        self.single_table = block_table[rows, : -(-self.single_len // bs)]  # only the blocks attention reads
        keys = torch.arange(self.single_len, device=dev)
        self.single_mask = keys[None, None, None, :] <= self.single_positions[:, None, :, None]
        self.runs = [(s, n, block_table[t : t + 1]) for s, n, t in segments if n > 1]  # cut to kv_len when read

    def update(self, layer: int, k: Tensor, v: Tensor) -> tuple[Tensor, Tensor]:
        raise NotImplementedError("a ragged step stores through attention()")

    def store(self, pool: str, layer: int, x: Tensor) -> Tensor:
        raise NotImplementedError("MLA runs its steps per segment kind (its model has ragged = False)")

    def attention(self, layer: int, q: Tensor, k: Tensor, v: Tensor, scale: float, gqa: bool,
                  window: int = 0, sinks: Tensor | None = None) -> Tensor:
        ck, cv = self.cache.k[layer], self.cache.v[layer]
        N, Hkv, _, D = k.shape
        if self.write_flat is not None:
            ck.view(-1, Hkv, D).index_copy_(0, self.write_flat, k.reshape(N, Hkv, D))
            cv.view(-1, Hkv, D).index_copy_(0, self.write_flat, v.reshape(N, Hkv, D))
        else:
            ck[self.write_block, self.write_offset] = k.transpose(1, 2)
            cv[self.write_block, self.write_offset] = v.transpose(1, 2)
        out = q.new_empty(q.shape[0], q.shape[1], 1, v.shape[-1])
        bs = ck.shape[1]
        windowed = bool(window) and not invariant.enabled()  # read only the blocks a window can reach
        if self.single_len and windowed:
            # each decode row's last `window` positions lie in at most ⌈window / bs⌉ + 1 of its blocks
            table, pos = self.single_table, self.single_positions
            nb = min(-(-window // bs) + 1, table.shape[1])
            cols = (pos - window + 1).clamp(min=0) // bs + torch.arange(nb, device=q.device)  # [rows, nb]
            table = table.gather(1, cols.clamp(max=table.shape[1] - 1))  # past the row's end: masked below
            ks, vs = read_blocks(ck, table, nb * bs), read_blocks(cv, table, nb * bs)
            keys = (cols[:, :, None] * bs + torch.arange(bs, device=q.device)).flatten(1)  # their positions
            mask = visible(keys[:, None, None, :], pos[:, None, :, None], window)
            out[self.single_rows] = attend(q[self.single_rows], ks, vs, mask, scale, gqa, sinks)
        elif self.single_len:
            rows = self.single_rows
            ks, vs = read_blocks(ck, self.single_table, self.single_len), read_blocks(cv, self.single_table, self.single_len)
            if invariant.enabled():
                out[rows] = invariant.attention(q[rows], ks, vs, self.single_positions, scale)
            elif sinks is not None:
                keys = torch.arange(self.single_len, device=q.device)
                mask = visible(keys, self.single_positions[:, None, :, None])
                out[rows] = attend(q[rows], ks, vs, mask, scale, gqa, sinks)
            else:
                out[rows] = F.scaled_dot_product_attention(q[rows], ks, vs, attn_mask=self.single_mask, enable_gqa=gqa)
        for start, n, table in self.runs:
            pos = self.positions[start : start + n, 0]
            first, kv_len = int(pos[0]), int(pos[-1]) + 1
            qr = q[start : start + n, :, 0].transpose(0, 1)[None]  # [1, H, n, D]
            lo = max(0, first - window + 1) // bs * bs if windowed else 0  # earlier keys: out of every window
            table = table[:, lo // bs : -(-kv_len // bs)]
            kr, vr = read_blocks(ck, table, kv_len - lo), read_blocks(cv, table, kv_len - lo)
            if invariant.enabled():
                y = invariant.attention(qr, kr, vr, pos[None], scale)
            elif window or sinks is not None:
                mask = visible(torch.arange(lo, kv_len, device=pos.device), pos[:, None], window)
                y = attend(qr, kr, vr, mask[None, None], scale, gqa, sinks)
            elif first == 0:  # the whole prefix is this run: plain causal attention
                y = F.scaled_dot_product_attention(qr, kr, vr, is_causal=True, enable_gqa=gqa)
            else:  # a chunk after earlier ones: its queries are the last n positions of kv_len
                y = kernels.chunk_attention(qr, kr, vr, scale)
            out[start : start + n, :, 0] = y[0].transpose(0, 1)
        return out
