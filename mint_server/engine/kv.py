"""Block bookkeeping for the paged KV cache: which blocks are free, how many tables use each, and
which full blocks the prefix cache keeps for later requests.

The tensors live in `mint_server.model.kv_cache.KVCache`; this is only the allocator the sampler
uses to hand blocks out, share a prompt's full blocks between the samples forked from it, and take
them back when the last sequence using them finishes.

**Prefix cache.** A full block (every position of it computed) can be registered under a key, a
hash chain over (the cache's root — base, adapter revision, owner salt —, the block's tokens, the
parent block's key): `block_keys`. A registered block that no table uses is not freed but kept,
least recently released first, among the `available` blocks: `alloc` takes free blocks first and
evicts kept ones (forgetting their keys) only when none is free, so the cache only ever holds
memory nobody else wants, and a block a table uses is never evicted. `lookup` finds the longest run
of kept blocks for a chain of keys; `share` takes them (reference-counted like any shared block).
"""

from __future__ import annotations

import hashlib
from collections import OrderedDict
from collections.abc import Sequence

import numpy as np

from mint_server.model.kv_cache import KVCache


def blocks_for(tokens: int, block_size: int) -> int:
    """Blocks needed to hold `tokens` positions."""
    return -(-tokens // block_size)


def cache_root(*parts: str) -> bytes:
    """The key a chain of block keys starts from (base, adapter revision, salt): equal only for
    equal parts, whatever characters they hold."""
    h = hashlib.blake2b(digest_size=16)
    for p in parts:
        b = p.encode()
        h.update(len(b).to_bytes(8, "little") + b)
    return h.digest()


def block_keys(parent: bytes, tokens: Sequence[int], block_size: int, start: int = 0) -> list[bytes]:
    """Keys of the full blocks of `tokens` from block `start` on, chained from `parent` (the key of
    block start - 1, or the root when start is 0)."""
    out = []
    arr = np.asarray(tokens, dtype=np.int64)
    for k in range(start, len(tokens) // block_size):
        h = hashlib.blake2b(parent, digest_size=16)
        h.update(arr[k * block_size : (k + 1) * block_size].tobytes())
        parent = h.digest()
        out.append(parent)
    return out


class BlockPool:
    """Reference-counted free list over blocks 1..num_blocks-1 (block 0 is the cache's scratch),
    with the prefix cache's kept blocks (see the module doc)."""

    def __init__(self, num_blocks: int) -> None:
        self.num_blocks = num_blocks
        # Popped from the end, so low block ids go first: reuse stays cache-friendly and predictable.
        self._free = list(range(num_blocks - 1, KVCache.SCRATCH, -1))
        self._refs = [0] * num_blocks
        self.peak_used = 0
        self._key_of: dict[int, bytes] = {}  # registered block → its key
        self._block_of: dict[bytes, int] = {}  # key → its block
        self._idle: OrderedDict[int, None] = OrderedDict()  # registered blocks no table uses, LRU first
        self.evictions = 0  # kept blocks taken for other use (their keys forgotten)

    @property
    def capacity(self) -> int:
        return self.num_blocks - 1

    @property
    def available(self) -> int:
        """Blocks an `alloc` may take: free ones and kept (cached, unused) ones."""
        return len(self._free) + len(self._idle)

    @property
    def used(self) -> int:
        """Blocks some table uses."""
        return self.capacity - self.available

    @property
    def cached(self) -> int:
        """Registered blocks (in use or kept)."""
        return len(self._key_of)

    def alloc(self, n: int) -> list[int]:
        if n > self.available:
            raise RuntimeError(f"KV pool exhausted: {n} blocks wanted, {self.available} free")  # admission bug
        out = [self._free.pop() if self._free else self._evict() for _ in range(n)]
        for b in out:
            self._refs[b] = 1
        self.peak_used = max(self.peak_used, self.used)
        return out

    def _evict(self) -> int:
        b, _ = self._idle.popitem(last=False)
        del self._block_of[self._key_of.pop(b)]
        self.evictions += 1
        return b

    def share(self, blocks: list[int]) -> None:
        """One more table uses these blocks (a kept block leaves the cache's idle list)."""
        for b in blocks:
            if self._refs[b] == 0:
                del self._idle[b]
            self._refs[b] += 1
        self.peak_used = max(self.peak_used, self.used)

    def exclusive(self, blocks: list[int]) -> int:
        """How many of these blocks releasing them would free (no other table uses them)."""
        return sum(1 for b in blocks if self._refs[b] == 1)

    def release(self, blocks: list[int]) -> None:
        """One table stops using these blocks; a block is free again when no table uses it (a
        registered one is kept, most recently released last, until an alloc needs it)."""
        for b in blocks:
            self._refs[b] -= 1
            if self._refs[b] == 0:
                if b in self._key_of:
                    self._idle[b] = None
                else:
                    self._free.append(b)

    # --- the prefix cache ------------------------------------------------------------------------
    def register(self, key: bytes, block: int) -> bool:
        """Keep `block` (full, computed, in use) under `key` for later lookups; False if the key or
        the block is taken already (an identical block computed beside it stays uncached)."""
        if key in self._block_of or block in self._key_of or self._refs[block] == 0:
            return False
        self._block_of[key] = block
        self._key_of[block] = key
        return True

    def lookup(self, keys: Sequence[bytes]) -> list[int]:
        """The blocks of the longest run of `keys`, from the first, that the cache holds."""
        out = []
        for k in keys:
            b = self._block_of.get(k)
            if b is None:
                break
            out.append(b)
        return out

    def clear_cache(self) -> None:
        """Forget every key; kept blocks are free again."""
        self._free.extend(self._idle)
        self._idle.clear()
        self._key_of.clear()
        self._block_of.clear()
