"""The sampler's recurrent-state cache for hybrid bases (Qwen3.5), beside the paged KV cache.

A linear-attention layer carries, per sequence, the delta rule's state [v_heads, k_dim, v_dim]
(float32) and its conv's last kernel - 1 inputs [conv_dim, kernel - 1]: fixed size, whatever the
sequence's length, so they live in slots (one per sequence in flight), not in KV blocks. Slot
`SCRATCH` (0) belongs to nobody: work without a slot of its own (the sampler's cost probes) runs
there. The sampler hands slots out (engine/state_cache.py); this holds the tensors and the per-step
`StateView` that tells each linear layer which slot every sequence of the step reads and writes.
"""

from __future__ import annotations

import torch
from torch import Tensor

from mint_server.model.config import ModelConfig


class StateCache:
    SCRATCH = 0

    def __init__(self, cfg: ModelConfig, num_slots: int, device: torch.device | str, dtype: torch.dtype) -> None:
        hy = cfg.hybrid
        assert hy is not None, "a recurrent-state cache is for hybrid (linear-attention) bases"
        if num_slots < 2:
            raise ValueError("a recurrent-state cache needs at least 2 slots (one is scratch)")
        layers, shapes = len(hy.linear_layers), hy.state_shapes()
        # [linear layers, slots, ...]; the conv state in the model's dtype (it holds projections), the
        # delta rule's state in float32 (as transformers keeps it)
        self.conv = torch.zeros((layers, num_slots, *shapes["conv"]), device=device, dtype=dtype)
        self.recurrent = torch.zeros((layers, num_slots, *shapes["recurrent"]), device=device, dtype=torch.float32)
        self.num_slots = num_slots

    @classmethod
    def for_model(cls, cfg: ModelConfig, num_slots: int, device: torch.device | str,
                  dtype: torch.dtype) -> StateCache | None:
        """The cache a sampler on this base needs (None: the base has no linear-attention layers)."""
        return None if cfg.hybrid is None else cls(cfg, num_slots, device, dtype)

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (self.conv, self.recurrent))

    def reset(self, slots: Tensor) -> None:
        """Zero these slots in every layer (a sequence starting at position 0)."""
        self.conv.index_fill_(1, slots, 0)
        self.recurrent.index_fill_(1, slots, 0)

    def copy(self, src: list[int], dst: list[int]) -> None:
        """Slot src[i]'s state into dst[i] (the samples forked off one prompt)."""
        if dst:
            dev = self.conv.device
            s, d = torch.tensor(src, device=dev), torch.tensor(dst, device=dev)
            for t in (self.conv, self.recurrent):
                t[:, d] = t[:, s]

    def save(self, slot: int) -> dict[str, Tensor]:
        """A host copy of one slot (a preempted sequence's state, swapped out beside its KV blocks)."""
        return {"state.conv": self.conv[:, slot].to("cpu", copy=True),
                "state.recurrent": self.recurrent[:, slot].to("cpu", copy=True)}

    def load(self, saved: dict[str, Tensor], slot: int) -> None:
        """Put a `save` copy back, into this (newly handed out) slot."""
        self.conv[:, slot] = saved["state.conv"].to(self.conv.device)
        self.recurrent[:, slot] = saved["state.recurrent"].to(self.recurrent.device)


class StateView:
    """One forward's sequences as the linear-attention layers see them: the tokens (flattened in
    batch order) form consecutive segments, one per sequence, each with its state slot. A segment
    whose first position is 0 starts from a zero state (its slot is reset here, once per forward);
    any other continues from what its slot holds — a decode row from its last token, a prefill chunk
    from the chunks before it. Layers run all one-token segments as one batch of recurrent steps and
    each longer one in the chunked form."""

    def __init__(self, cache: StateCache, slots: list[int], lengths: list[int], fresh: list[bool],
                 device: torch.device) -> None:
        if not len(slots) == len(lengths) == len(fresh):
            raise ValueError("a StateView needs one slot, length and fresh flag per segment")
        self.cache = cache
        starts, at = [], 0
        for n in lengths:
            starts.append(at)
            at += n
        self.tokens = at
        restart = sorted({s for s, f in zip(slots, fresh, strict=True) if f})
        if restart:
            cache.reset(torch.tensor(restart, device=device))
        singles = [(a, s) for a, n, s in zip(starts, lengths, slots, strict=True) if n == 1]
        self.single_tokens = torch.tensor([a for a, _ in singles], device=device, dtype=torch.long)
        self.single_slots = torch.tensor([s for _, s in singles], device=device, dtype=torch.long)
        self.runs = [(a, n, s) for a, n, s in zip(starts, lengths, slots, strict=True) if n > 1]

    @classmethod
    def of_rows(cls, cache: StateCache, slots: list[int], positions: Tensor) -> StateView:
        """Rows of a [B, T] batch as sequences (a plain CacheView's layout): row b is slot slots[b]."""
        B, T = positions.shape
        return cls(cache, slots, [T] * B, (positions[:, 0] == 0).tolist(), positions.device)
