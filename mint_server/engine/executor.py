"""The sampler's model runner: one step's plan in, logits and prompt scores out.

The sampler (scheduling, token choice, bookkeeping) describes a step as a `StepBatch` — pieces of
sequences packed back to back: decode rows of one token and prefill chunks of many, each with its
adapter slot and KV blocks — and the executor runs it as one forward over that ragged batch
(`RaggedView`), every row on its own adapter through the one `add_lora`. The same op functions run
on every rank: `Executor` calls them through the `Runner` (engine/runner.py; a shard of one on a
single process), so nothing above this seam knows how many ranks there are.

Preempted sequences swap their KV out to host memory and back in (`swap_out` / `swap_in`): a
resumed sequence continues from exactly the KV it had, so its tokens are those of an uninterrupted
run.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

import numpy as np
import torch
from torch import Tensor

from mint_server.engine import runner as runner_mod
from mint_server.engine.runner import Runner
from mint_server.engine.sampler_ops import score_targets
from mint_server.model.compiled import CompileStats, StepGraph, configure_cache, unsupported
from mint_server.model.images import PromptImages
from mint_server.model.kv_cache import CacheView, KVCache, RaggedView
from mint_server.model.lora import LoraBank, LoraBatch
from mint_server.model.recurrent_state import StateCache, StateView
from mint_server.model.transformer import Transformer


@dataclass
class StepBatch:
    """One step's work, packed: segment i is lengths[i] consecutive tokens of one sequence."""

    tokens: list[int]
    positions: list[int]  # each token's absolute position in its sequence
    lengths: list[int]
    slots: list[int]  # per segment: its adapter's bank slot (-1: the base)
    tables: list[list[int]]  # per segment: its sequence's KV blocks (covering its last position)
    logits_at: list[int]  # segments whose last token's next-token logits the step returns, in order
    scoring: list[tuple[int, list[int], int]] = field(default_factory=list)  # (segment, targets, top-k)
    images: dict[int, PromptImages] = field(default_factory=dict)  # segment → its sequence's images (VL bases)
    states: list[int] = field(default_factory=list)  # hybrid bases: per segment, its recurrent-state slot (none: scratch)

    @property
    def starts(self) -> list[int]:
        out, at = [], 0
        for n in self.lengths:
            out.append(at)
            at += n
        return out


@dataclass
class StepResult:
    logits: Tensor  # [len(logits_at), vocab]
    scores: list[tuple[np.ndarray, np.ndarray, np.ndarray]]  # per scoring entry: score_targets' arrays


class RankState(Protocol):
    """What the ops read of one rank (runner.Shard)."""

    model: Transformer
    bank: LoraBank
    device: torch.device
    cache: KVCache | None
    swapped: dict[int, dict[str, Tensor]]


def lora_for(bank: LoraBank, slots: list[int], device: torch.device) -> LoraBatch | None:
    return None if all(s < 0 for s in slots) else bank.batch(slots, device)


def _hidden(st: RankState, b: StepBatch) -> Tensor:
    """Final hidden states [N, hidden] of every packed token."""
    dev, cache = st.device, st.cache
    assert cache is not None
    tokens = torch.tensor(b.tokens, device=dev)[:, None]
    positions = torch.tensor(b.positions, device=dev)[:, None]
    width = max(len(t) for t in b.tables)
    table = torch.tensor([t + [KVCache.SCRATCH] * (width - len(t)) for t in b.tables], device=dev)
    starts = b.starts
    if st.model.ragged:
        token_slots = [s for s, n in zip(b.slots, b.lengths, strict=True) for _ in range(n)]
        segments = [(a, n, i) for i, (a, n) in enumerate(zip(starts, b.lengths, strict=True))]
        view = RaggedView(cache, table, positions, segments)
        view.states = _state_view(st, b, starts)  # --- hybrid bases (recurrent_state.py)
        vision = None
        if b.images:  # token i is row i: a segment's tokens are rows starts[s] … (tensor parallel never has images)
            vision = st.model.vision_input(  # type: ignore[operator]
                positions, [(starts[s], b.lengths[s], im) for s, im in b.images.items()], st.features)  # type: ignore[attr-defined]
        return st.model.hidden_states(tokens, positions, lora_for(st.bank, token_slots, dev), view, vision=vision)[:, 0]
    # Per segment kind: all decode rows as one [rows, 1] batch, each chunk as one [1, n] row.
    out = torch.empty(len(b.tokens), st.model.config.hidden_size, device=dev, dtype=st.model.embed_tokens.weight.dtype)
    singles = [i for i, n in enumerate(b.lengths) if n == 1]
    if singles:
        rows = torch.tensor([starts[i] for i in singles], device=dev)
        pos = positions[rows]
        h = st.model.hidden_states(tokens[rows], pos, lora_for(st.bank, [b.slots[i] for i in singles], dev),
                                   CacheView(cache, table[singles], pos))
        out[rows] = h[:, 0]
    for i, n in enumerate(b.lengths):
        if n > 1:
            a = starts[i]
            pos = positions[a : a + n, 0][None]
            h = st.model.hidden_states(tokens[a : a + n, 0][None], pos, lora_for(st.bank, [b.slots[i]], dev),
                                       CacheView(cache, table[i : i + 1], pos))
            out[a : a + n] = h[0]
    return out


def _state_view(st: RankState, b: StepBatch, starts: list[int]) -> StateView | None:
    """Hybrid bases: which state slot each segment continues; a segment at position 0 starts afresh.
    (Tensor-parallel ranks have no `states`: hybrid bases refuse --tp > 1.)"""
    states: StateCache | None = getattr(st, "states", None)
    if states is None:
        return None
    slots = b.states or [StateCache.SCRATCH] * len(b.lengths)
    return StateView(states, slots, b.lengths, [b.positions[a] == 0 for a in starts], st.device)


# --- the ops (run on every rank) -------------------------------------------------------------------
def step(st: RankState, batch: StepBatch, hidden: Tensor | None = None) -> StepResult:
    """One forward over the packed batch: next-token logits of `logits_at`, prompt scores of `scoring`.
    hidden: the batch's final hidden states when the compiled decode step already ran them."""
    dev, model = st.device, st.model
    with torch.no_grad():
        if hidden is None:
            hidden = _hidden(st, batch)
        starts = batch.starts
        ends = [starts[i] + batch.lengths[i] - 1 for i in batch.logits_at]
        if ends:
            last = hidden[torch.tensor(ends, device=dev)][:, None]
            logits = model.logits(last, lora_for(st.bank, [batch.slots[i] for i in batch.logits_at], dev))[:, 0]
        else:
            logits = hidden.new_empty(0, model.config.vocab_size)
        scores = []
        for i, targets, k in batch.scoring:
            one = lora_for(st.bank, [batch.slots[i]], dev)
            piece = hidden[starts[i] : starts[i] + batch.lengths[i]]
            scores.append(score_targets(lambda h, one=one: model.logits(h, one), piece, targets, k))
    return StepResult(logits, scores)


def copy_blocks(st: RankState, src: list[int], dst: list[int]) -> None:
    assert st.cache is not None
    st.cache.copy_blocks(src, dst)


def swap_out(st: RankState, handle: int, blocks: list[int], state: int | None = None) -> None:
    """`state`: a hybrid base's sequence's state slot, saved beside its KV."""
    assert st.cache is not None
    saved = st.cache.save_blocks(blocks)
    if state is not None:
        saved.update(_states(st).save(state))
    st.swapped[handle] = saved


def swap_in(st: RankState, handle: int, blocks: list[int], state: int | None = None) -> None:
    assert st.cache is not None
    saved = st.swapped.pop(handle)
    st.cache.load_blocks(saved, blocks)
    if state is not None:
        _states(st).load(saved, state)


def copy_states(st: RankState, src: list[int], dst: list[int]) -> None:
    """Hybrid bases: slot src[i]'s recurrent state into dst[i] (the samples forked off one prompt)."""
    _states(st).copy(src, dst)


def _states(st: RankState) -> StateCache:
    states = getattr(st, "states", None)
    assert states is not None, "recurrent-state op on a base without linear-attention layers"
    return states


def drop_swapped(st: RankState, handles: list[int]) -> None:
    for h in handles:
        st.swapped.pop(h, None)


OPS: dict[str, Callable[..., Any]] = {f.__name__: f for f in (step, copy_blocks, swap_out, swap_in, drop_swapped,
                                                              copy_states)}
runner_mod.OPS.update(OPS)  # the same functions on every rank, through the runner


class Executor:
    """Runs the sampler's ops on every rank through `runner` (default: a shard of one on `model`)."""

    def __init__(self, model: Transformer, bank: LoraBank, device: torch.device, num_blocks: int, block_size: int,
                 runner: Any = None, state_slots: int = 0, compile: str = "off",
                 compile_cache_dir: Path | None = None) -> None:
        """state_slots: a hybrid base's recurrent-state slots (one per sequence in flight, plus scratch).
        compile: "auto" runs steps through the compiled graphs (model/compiled.py) once
        `compile` (or a warm-up) has built them, where the model allows; "off" stays eager."""
        dtype = model.embed_tokens.weight.dtype
        self.runner = runner or Runner.single(bank, torch.device(device), dtype)  # default: a shard of one
        self.rank: runner_mod.Shard = self.runner.shard
        self.rank.model = model
        self.runner.call("make_cache", num_blocks=num_blocks, block_size=block_size, dtype=dtype,
                         state_slots=state_slots)
        self.cache: KVCache = self.rank.cache
        self.states: StateCache | None = self.rank.states
        self.compile_stats = CompileStats()
        self.graph: StepGraph | None = None
        self._eager_reason = "compile off" if compile == "off" else unsupported(model)
        if self._eager_reason is None:
            configure_cache(compile_cache_dir)
            self.graph = StepGraph(model, bank, self.cache, self.compile_stats)

    def compile(self) -> None:
        """Compile the step's variants now, on this thread (the engine compiles before it serves)."""
        if self.graph is not None:
            self.graph.warm_up()

    def call(self, name: str, **inputs: Any) -> Any:
        return self.runner.call(name, **inputs)

    def step(self, batch: StepBatch) -> StepResult:
        graph = self.graph
        reason = self._eager_reason if graph is None else graph.eager_reason(batch.lengths, batch.slots,
                                                                            bool(batch.scoring), bool(batch.images))
        if graph is not None and reason is None:
            hidden = graph.hidden(batch.tokens, batch.positions, batch.lengths, batch.tables, batch.slots)
            if hidden is not None:
                return step(self.rank, batch, hidden)
            reason = "compile failed"
        self.compile_stats.note_eager(reason)
        return self.call("step", batch=batch)

    def copy_blocks(self, src: list[int], dst: list[int]) -> None:
        if dst:
            self.call("copy_blocks", src=src, dst=dst)

    def swap_out(self, handle: int, blocks: list[int], state: int | None = None) -> None:
        self.call("swap_out", handle=handle, blocks=blocks, state=state)

    def swap_in(self, handle: int, blocks: list[int], state: int | None = None) -> None:
        self.call("swap_in", handle=handle, blocks=blocks, state=state)

    def copy_states(self, src: list[int], dst: list[int]) -> None:
        if dst:
            self.call("copy_states", src=src, dst=dst)

    def drop_swapped(self, handles: list[int]) -> None:
        if handles:
            self.call("drop_swapped", handles=handles)
