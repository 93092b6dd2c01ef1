"""Recurrent-state slot bookkeeping for hybrid bases (Qwen3.5's linear-attention layers).

The tensors live in `mint_server.model.recurrent_state.StateCache`; this is only which slots are
free. Every sequence in flight holds one slot: a prompt being prefilled (its chunks continue from
it), then each sample forked off it (the first takes the prompt's slot over, the others get a copy
of it); a preempted sample gives its slot up (its state is swapped out beside its KV) and takes a
new one when it resumes.

How many: the sampler counts each prompt being prefilled on a hybrid base as one batch row more
(it holds a state its samples do not hold yet), so running samples + prompts ≤ max_batch_rows at
every moment, and max_batch_rows slots (+ scratch) always suffice; admission never waits on slots.
"""

from __future__ import annotations

from mint_server.model.recurrent_state import StateCache


class StateSlots:
    """Free list over slots 1..num_slots-1 (slot 0 is the cache's scratch)."""

    def __init__(self, num_slots: int) -> None:
        self.num_slots = num_slots
        self._free = list(range(num_slots - 1, StateCache.SCRATCH, -1))  # low slots first

    @property
    def available(self) -> int:
        return len(self._free)

    def alloc(self) -> int:
        if not self._free:  # the row accounting above makes this unreachable: an admission bug
            raise RuntimeError(f"recurrent-state slots exhausted ({self.num_slots - 1} in use)")
        return self._free.pop()

    def release(self, slot: int) -> None:
        if slot != StateCache.SCRATCH:
            self._free.append(slot)
