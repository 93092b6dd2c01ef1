"""Block bookkeeping for the paged KV cache: which blocks are free, and how many tables use each.

The tensors live in `mint_server.model.transformer.KVCache`; this is only the allocator the sampler
uses to hand blocks out, share a prompt's full blocks between the samples forked from it, and take
them back when the last sequence using them finishes.
"""

from __future__ import annotations

from mint_server.model.transformer import KVCache


def blocks_for(tokens: int, block_size: int) -> int:
    """Blocks needed to hold `tokens` positions."""
    return -(-tokens // block_size)


class BlockPool:
    """Reference-counted free list over blocks 1..num_blocks-1 (block 0 is the cache's scratch)."""

    def __init__(self, num_blocks: int) -> None:
        self.num_blocks = num_blocks
        # Popped from the end, so low block ids go first: reuse stays cache-friendly and predictable.
        self._free = list(range(num_blocks - 1, KVCache.SCRATCH, -1))
        self._refs = [0] * num_blocks
        self.peak_used = 0

    @property
    def capacity(self) -> int:
        return self.num_blocks - 1

    @property
    def available(self) -> int:
        return len(self._free)

    @property
    def used(self) -> int:
        return self.capacity - len(self._free)

    def alloc(self, n: int) -> list[int]:
        if n > len(self._free):
            raise RuntimeError(f"KV pool exhausted: {n} blocks wanted, {len(self._free)} free")  # admission bug
        out = [self._free.pop() for _ in range(n)]
        for b in out:
            self._refs[b] = 1
        self.peak_used = max(self.peak_used, self.used)
        return out

    def share(self, blocks: list[int]) -> None:
        """One more table uses these blocks."""
        for b in blocks:
            self._refs[b] += 1

    def exclusive(self, blocks: list[int]) -> int:
        """How many of these blocks releasing them would free (no other table uses them)."""
        return sum(1 for b in blocks if self._refs[b] == 1)

    def release(self, blocks: list[int]) -> None:
        """One table stops using these blocks; a block is free again when no table uses it."""
        for b in blocks:
            self._refs[b] -= 1
            if self._refs[b] == 0:
                self._free.append(b)
