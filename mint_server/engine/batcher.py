"""The KV-holding work of a continuous-batching sampler (sampling.Sampler is its front): admitted
requests' prompt rows and sample rows, their blocks in the KV pool, and one ragged forward per step.

Admitting a request reserves KV for prompt + max_tokens of each admitted sample, so an admitted
sequence never waits for memory. A prompt row (`PromptGroup`) is shared by every admitted sample and
every identical (adapter, prompt) request of the same owner that joins it while it is still being
prefilled; when its last chunk has run, its samples fork off it (`SampleRow`s) sharing its full KV
blocks and copying only its last, partly filled one. Full blocks outlive their requests in the
prefix cache (prefix_keys.py, kv.py): a later prompt with the same prefix starts its prefill after
the blocks it finds there. Preempted rows and prompts swap their KV out to host memory and resume
later from exactly that KV.

A step runs the scheduler's plan as one forward over a ragged batch (`executor`): decode rows and
prefill chunks together, each row on its own adapter; then draws the decode rows' next tokens and,
where a prompt's last chunk ran, forks its samples off it and draws their first tokens. Each sample
draws from its own generator seeded from (request seed, sample index), and the token math is
row-wise, so the same request and seed give the same tokens whatever else is in the batch, preempted
or not. Reported logprobs are the raw model's (see `sampler_ops`). A request holds a pin on its
adapter from admission (its slot is not evicted while rows read it).
"""

from __future__ import annotations

import itertools
import logging
import time
from collections import deque
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from tinker import types
from tinker.types.topk_logprobs import TopkLogprobs

from mint_server.engine.executor import Executor, StepBatch
from mint_server.engine.grammar import Grammars
from mint_server.engine.kv import BlockPool, blocks_for
from mint_server.engine.prefix_keys import PrefixKeys
from mint_server.engine.records import SamplingRecord, SamplingRecords
from mint_server.engine.residency import Residency
from mint_server.engine.sample_request import PromptGroup, PromptMember, SampleRequest, SampleRow
from mint_server.engine.sampler_ops import (
    PromptScores,
    ScorePiece,
    ScoreSpec,
    choose_tokens,
    logit_biases,
    penalties,
    sample_seed,
    seen_tokens,
    uniforms,
)
from mint_server.engine.scheduler import NO_FIT, Fit, Scheduler
from mint_server.engine.state_cache import StateSlots
from mint_server.engine.values import SampleCancelled
from mint_server.model.families import family_spec
from mint_server.model.transformer import Transformer

log = logging.getLogger(__name__)


@dataclass
class SamplerStats:
    steps: int = 0
    forwards: int = 0
    prompt_rows: int = 0  # prompt rows prefilled (after sharing)
    prefill_tokens: int = 0  # prompt tokens run
    prefill_chunks: int = 0  # prefill pieces run (a prompt longer than a step's budget takes several)
    decode_tokens: int = 0
    step_s: float = 0.0  # in the forwards
    peak_rows: int = 0
    peak_step_tokens: int = 0
    preempted: int = 0  # rows swapped out to make room
    resumed: int = 0
    prefix_query_tokens: int = 0  # prompt tokens of new prompt rows that could use the prefix cache
    prefix_hit_tokens: int = 0  # of those, positions taken from the cache (never computed)


class Batcher:
    def __init__(
        self,
        model: Transformer,
        residency: Residency,
        kv_budget_tokens: int,
        max_seq_len: int,
        records: SamplingRecords | None = None,
        block_size: int = 16,
        max_batch_rows: int = 256,
        max_step_tokens: int = 2048,
        max_slowdown: float = 2.0,
        step_overhead_tokens: int = 0,
        dedupe_prompts: bool = True,
        linger_s: float = 0.0,
        grammars: Grammars | None = None,
        compile: str = "off",
        compile_cache_dir: Path | None = None,
        prefix_cache: bool = True,
        salt_per_owner: bool = True,
    ) -> None:
        """kv_budget_tokens positions is the KV pool; max_seq_len bounds prompt + max_tokens.
        compile, compile_cache_dir: the executor's compiled decode step (EngineSettings.compile).
        prefix_cache, salt_per_owner: the prefix cache's (prefix_keys.PrefixKeys).

        max_batch_rows caps the sequences holding KV; max_step_tokens, max_slowdown,
        step_overhead_tokens and linger_s are the scheduler's (see scheduler.py). dedupe_prompts shares one
        prefill among identical (adapter, prompt) requests (off only to measure what that saves).
        """
        if kv_budget_tokens < max_seq_len or max_seq_len < 2:
            raise ValueError("kv_budget_tokens must hold one sequence of max_seq_len ≥ 2")
        self.model, self.residency, self.records = model, residency, records
        cfg = model.config
        self.vocab_size, self.max_seq_len = cfg.vocab_size, max_seq_len
        self.block_size, self.max_batch_rows = block_size, max_batch_rows
        self.dedupe_prompts = dedupe_prompts
        self.grammars = grammars  # the engine's (its Preparer accepts response_format only with them)
        self.device = model.embed_tokens.weight.device
        # --- hybrid bases: a recurrent-state slot per sequence in flight (state_cache.py)
        self.states = StateSlots(max_batch_rows + 1) if family_spec(cfg).recurrent_state else None
        if self.states is not None and max_batch_rows < 2:
            raise ValueError("max_batch_rows must be at least 2 on a hybrid (linear-attention) base: "
                             "a prompt and its first sample each hold a recurrent state")
        self.executor = Executor(model, residency.bank, self.device, blocks_for(kv_budget_tokens, block_size) + 1,
                                 block_size, runner=residency.runner,
                                 state_slots=0 if self.states is None else self.states.num_slots,
                                 compile=compile, compile_cache_dir=compile_cache_dir)
        self.cache = self.executor.cache
        self.pool = BlockPool(self.cache.num_blocks)
        self.prefix = PrefixKeys(model, block_size, prefix_cache, salt_per_owner)
        self._evictions_before = 0  # of pools replaced after a failed step
        self.scheduler = Scheduler(max_step_tokens, max_slowdown, step_overhead_tokens, linger_s=linger_s)
        self.stats = SamplerStats()
        self._rows: list[SampleRow] = []
        self._groups: list[PromptGroup] = []
        self._handles = itertools.count(1)
        # (priority, "ttft" | "itl" | "queue", seconds), drained by `drain_latencies` for /metrics
        self._latencies: deque[tuple[int, str, float]] = deque(maxlen=100_000)  # nobody drains: keep the newest

    # --- admission -------------------------------------------------------------------------------
    def _joinable(self, req: SampleRequest) -> PromptGroup | None:
        """A prompt row still being prefilled that `req` can share (same adapter and prompt, and the
        prompt scores it wants are or will be computed)."""
        if not self.dedupe_prompts:
            return None
        for g in self._groups:
            if g.swapped is None and g.slot == req.slot and g.prompt == req.prompt and g.images == req.job.images and \
                    g.salt == self.prefix.salt(req) and (
                    g.computed == 0 or (not req.job.prompt_extras and (not req.wants_scores or (
                        g.score_k >= req.topk_prompt_logprobs and g.score_from <= req.job.score_from)))):
                return g
        return None

    def hit_tokens(self, req: SampleRequest) -> int:
        """Prompt positions a new prompt row for `req` would take from the prefix cache now."""
        return self.prefix.hit_tokens(req, self.pool)

    def admission_fit(self, req: SampleRequest, free_blocks: int, free_rows: int) -> Fit:
        """What admitting the rest of `req`'s samples (as many as fit) would take now."""
        bs, n = self.block_size, len(req.prompt)
        group = self._joinable(req)
        # A prefix-cache hit counts as the new block it replaces: taking a kept block out of the idle
        # list costs the pool one available block as an alloc does, and counting hits on blocks in use
        # as free would let a preemption or another admission of this step make the pool short.
        new_blocks = 0 if group else blocks_for(n, bs)
        state_row = self._state_rows(1 if group is None else 0)  # a new prompt's recurrent state
        if req.score_only:
            return Fit(1, new_blocks, state_row) if new_blocks <= free_blocks and state_row <= free_rows else NO_FIT
        own = blocks_for(n + req.params.max_tokens, bs) - n // bs
        # The group's first sample takes over the prompt's partly filled last block.
        reuse = 1 if n % bs and (group is None or not group.has_sampler) else 0
        left = req.num_samples - req.admitted
        take = min(left, free_rows - state_row, (free_blocks - new_blocks + reuse) // own)
        if take <= 0:
            return NO_FIT
        return Fit(take, new_blocks + take * own - reuse, take + state_row, take == left)

    def _state_rows(self, prompts: int) -> int:
        """Hybrid bases count each prompt being prefilled as one batch row more: it holds a recurrent
        state its samples do not hold yet (state_cache.py says why that bounds the slots)."""
        return prompts if self.states is not None else 0

    def _admit(self, req: SampleRequest, fit: Fit) -> PromptGroup | None:
        """Reserve `fit`'s samples of `req` on a (new or shared) prompt row; None if none fit. The
        caller takes it off the queue once all its samples are admitted."""
        if fit.take == 0:
            return None
        bs, n = self.block_size, len(req.prompt)
        group = self._joinable(req)
        if group is None:
            root, keys = self.prefix.prefix(req)
            hit = self.pool.lookup(keys[: self.prefix.usable_blocks(req)])
            self.pool.share(hit)  # before the alloc, which may evict kept blocks
            blocks = hit + self.pool.alloc(blocks_for(n, bs) - len(hit))
            group = PromptGroup(req.slot, req.prompt, blocks, images=req.job.images, prompt_blocks=len(blocks), pool=self.pool,
                                state_rows=self._state_rows(1), root=root, keys=keys, registered=len(hit),
                                cached=len(hit) * bs, computed=len(hit) * bs, salt=self.prefix.salt(req))
            req.cache_hit_tokens = group.cached
            if root is not None:
                self.stats.prefix_query_tokens += n
                self.stats.prefix_hit_tokens += group.cached
            if self.states is not None:
                group.state = self.states.alloc()
            self._groups.append(group)
            self.stats.prompt_rows += 1
        elif req not in group.requests:
            req.cache_hit = True
        if req not in group.requests:
            group.requests.append(req)
        if req.wants_scores:  # the group has computed nothing yet, or already scores this top-k (_joinable)
            group.score_k = max(group.score_k, req.topk_prompt_logprobs)
            group.score_from = min(group.score_from, req.job.score_from)
        if req.job.prompt_extras and req not in group.asks:  # the group has computed nothing yet (_joinable)
            req.start_extras()
            group.asks.append(req)
        if req.adapter is not None and not req.pinned:
            self.residency.pin(req.adapter)
            req.pinned = True
        if req.admitted == 0:
            self._latencies.append((req.priority, "queue", time.perf_counter() - req.submitted))
        if req.score_only:
            group.members.append(PromptMember(req, 0, []))
            req.admitted = 1
        else:
            own = blocks_for(n + req.params.max_tokens, bs) - n // bs
            for _ in range(fit.take):
                first = 1 if n % bs and not group.has_sampler else 0
                group.members.append(PromptMember(req, req.admitted, self.pool.alloc(own - first)))
                req.admitted += 1
        return group

    # --- preemption ------------------------------------------------------------------------------
    def _swap_out(self, item: SampleRow | PromptGroup) -> None:
        """Preempt: its KV (a prompt: the part computed so far) to host memory, its blocks back."""
        handle = next(self._handles)
        if isinstance(item, SampleRow):
            self.executor.swap_out(handle, item.blocks, self._state_of(item))
            item.reserve = len(item.blocks)
        else:
            self.executor.swap_out(handle, item.blocks[: blocks_for(item.computed, self.block_size)],
                                   self._state_of(item))
            for m in item.members:
                self.pool.release(m.own_blocks)
                m.own_blocks = []
        self.pool.release(item.blocks)
        item.blocks, item.swapped = [], handle
        self._release_state(item)
        self.stats.preempted += 1

    def _swap_in(self, item: SampleRow | PromptGroup) -> None:
        assert item.swapped is not None
        if self.states is not None:
            item.state = self.states.alloc()
        if isinstance(item, SampleRow):
            item.blocks = self.pool.alloc(item.reserve)
            self.executor.swap_in(item.swapped, item.blocks, self._state_of(item))
        else:
            item.blocks = self.pool.alloc(item.prompt_blocks)
            self.executor.swap_in(item.swapped, item.blocks[: blocks_for(item.computed, self.block_size)],
                                  self._state_of(item))
            for m in item.members:
                m.own_blocks = self.pool.alloc(m.own_count)
        item.swapped = None
        self.stats.resumed += 1

    def _state_of(self, item: SampleRow | PromptGroup) -> int | None:
        return None if self.states is None else item.state

    def _release_state(self, item: SampleRow | PromptGroup) -> None:
        if self.states is not None:
            self.states.release(item.state)
            item.state = 0

    # --- cancels -------------------------------------------------------------------------------
    def _drop(self, gone: dict[int, SampleRequest]) -> None:
        """Stop the requests in `gone` (by id) now: their rows and prompt rows end, their blocks go
        back, their futures fail with SampleCancelled."""
        keep, dropped_handles = [], []
        for row in self._rows:
            if id(row.request) in gone:
                self.pool.release(row.blocks)
                self._release_state(row)
                if row.swapped is not None:
                    dropped_handles.append(row.swapped)
            else:
                keep.append(row)
        self._rows = keep
        for g in list(self._groups):
            members = [m for m in g.members if id(m.request) in gone]
            for m in members:
                self.pool.release(m.own_blocks)
            g.members = [m for m in g.members if id(m.request) not in gone]
            g.requests = [r for r in g.requests if id(r) not in gone]
            g.asks = [r for r in g.asks if id(r) not in gone]
            if not g.requests:
                self.pool.release(g.blocks)
                self._release_state(g)
                self._groups.remove(g)
                if g.swapped is not None:
                    dropped_handles.append(g.swapped)
        self.executor.drop_swapped(dropped_handles)
        for r in gone.values():
            self._fail(r, SampleCancelled())

    # --- the forward -----------------------------------------------------------------------------
    def _run(self, runs: list[tuple[SampleRow | PromptGroup, int]]) -> None:
        t0 = time.perf_counter()
        batch = StepBatch([], [], [], [], [], [])
        decoding: list[SampleRow] = []
        finishing: list[PromptGroup] = []  # prompts whose last chunk runs now
        # (group, first position, its asks' requests with their cells' slices) per scoring entry
        scored: list[tuple[PromptGroup, int, list[tuple[SampleRequest, int, int]]]] = []
        decode_tokens = prefill_tokens = 0
        for item, n in runs:
            seg = len(batch.lengths)
            if isinstance(item, SampleRow):
                batch.tokens.append(item.tokens[-1])
                batch.positions.append(item.length)
                batch.lengths.append(1)
                batch.slots.append(item.request.slot)
                batch.tables.append(item.blocks)
                batch.states.append(item.state)
                batch.logits_at.append(seg)
                if item.request.job.images is not None:
                    batch.images[seg] = item.request.job.images
                decoding.append(item)
                decode_tokens += 1
            else:
                a, plen = item.computed, len(item.prompt)
                batch.tokens.extend(item.prompt[a : a + n])
                batch.positions.extend(range(a, a + n))
                batch.lengths.append(n)
                batch.slots.append(item.slot)
                batch.tables.append(item.blocks)
                if item.images is not None:
                    batch.images[seg] = item.images
                batch.states.append(item.state)
                if item.score_k >= 0 or item.asks:
                    targets = [item.prompt[p + 1] if p + 1 < plen and p >= item.score_from and item.score_k >= 0
                               else -1 for p in range(a, a + n)]
                    asked = [(r, *r.ask(a, n)) for r in item.asks]
                    spec: list[int] | ScoreSpec = targets
                    if asked:
                        spec = ScoreSpec(targets, tuple(ask for _, ask, _, _ in asked))
                    batch.scoring.append((seg, spec, max(item.score_k, 0)))
                    scored.append((item, a, [(r, lo, hi) for r, _, lo, hi in asked]))
                if a + n == plen:
                    finishing.append(item)
                    if item.has_sampler:
                        batch.logits_at.append(seg)
                prefill_tokens += n
            self.scheduler.charge(item.key, item.policy, n)
        result = self.executor.step(batch)
        for (g, a, asked), piece in zip(scored, result.scores, strict=True):
            if g.score_k >= 0:
                if g.scores is None or g.scores.topk_ids.shape[1] != g.score_k:  # first chunk (a == 0)
                    g.scores = PromptScores.empty(len(g.prompt), g.score_k)
                g.scores.fill(a, piece)
            if asked:
                assert isinstance(piece, ScorePiece)
                for (r, lo, hi), cells, alts in zip(asked, piece.cells, piece.alts, strict=True):
                    r.took(a, lo, hi, cells, alts)
        for item, n in runs:
            if isinstance(item, PromptGroup):
                item.computed += n
            else:
                item.length += 1
            if self.prefix.on:
                self.prefix.register(item, self.pool)
        # logits rows: decode rows first (in run order), then finishing prompts, as laid out above
        logits_of_seg = dict(zip(batch.logits_at, range(len(batch.logits_at)), strict=True))
        rows, index = list(decoding), [logits_of_seg[i] for i, (it, _) in enumerate(runs) if isinstance(it, SampleRow)]
        seg_of = {id(it): i for i, (it, _) in enumerate(runs)}
        copies: list[tuple[int, int]] = []
        for g in finishing:
            for r in g.requests:
                if r.wants_scores:
                    r.scores = g.scores
            self._groups.remove(g)
            forked = self._fork(g, copies)
            if forked:
                rows += forked
                index += [logits_of_seg[seg_of[id(g)]]] * len(forked)
        self.executor.copy_blocks([s for s, _ in copies], [d for _, d in copies])
        if rows:
            self._advance(rows, result.logits[torch.tensor(index, device=result.logits.device)])
        for g in finishing:
            for r in g.requests:
                if r.score_only:
                    self._respond(r)
        self._rows = [r for r in self._rows if not r.done]
        s = self.stats
        s.forwards += 1
        s.decode_tokens += decode_tokens
        s.prefill_tokens += prefill_tokens
        s.prefill_chunks += len(runs) - len(decoding)
        s.peak_step_tokens = max(s.peak_step_tokens, decode_tokens + prefill_tokens)
        s.peak_rows = max(s.peak_rows, sum(1 for r in self._rows if r.running))
        s.step_s += time.perf_counter() - t0

    def _fork(self, g: PromptGroup, copies: list[tuple[int, int]]) -> list[SampleRow]:
        """Turn the group's sampling members into rows over the prompt's blocks.

        Full prompt blocks are shared (reference-counted); the partly filled last one goes to the
        first sample and is copied for the others, whose own next tokens would otherwise collide in it.
        """
        bs, n = self.block_size, len(g.prompt)
        full, partial = g.blocks[: n // bs], g.blocks[n // bs :]
        rows: list[SampleRow] = []
        samplers = [m for m in g.members if not m.request.score_only]
        state_copies: list[tuple[int, int]] = []
        for j, m in enumerate(samplers):
            if j == 0:
                blocks = full + partial + m.own_blocks  # takes over the group's references
            else:
                self.pool.share(full)
                blocks = full + m.own_blocks
                if partial:
                    copies.append((partial[0], m.own_blocks[0]))
            p = m.request.params
            gen = None
            if p.temperature > 0:
                gen = torch.Generator().manual_seed(sample_seed(p.seed, m.index))
            row = SampleRow(m.request, m.index, blocks, n, gen, pool=self.pool)
            if g.root is not None:
                row.keys, row.root = list(g.keys), g.root
            if self.states is not None:  # the first sample continues the prompt's state, the others a copy
                row.state = g.state if j == 0 else self.states.alloc()
                if j:
                    state_copies.append((g.state, row.state))
            rows.append(row)
        if not samplers:
            self.pool.release(g.blocks)
            self._release_state(g)
        if state_copies:
            self.executor.copy_states([s for s, _ in state_copies], [d for _, d in state_copies])
        self._rows += rows
        return rows

    # --- choosing tokens and finishing ----------------------------------------------------------
    def _advance(self, rows: list[SampleRow], logits: torch.Tensor) -> None:
        """Draw each row's next token from its logits [len(rows), V]; keep it running or finish it."""
        dev = logits.device
        params = [r.request.params for r in rows]
        penalty = repetition = min_p = None
        if any(p.frequency_penalty or p.presence_penalty for p in params):
            penalty = penalties([r.tokens for r in rows], [p.frequency_penalty for p in params],
                                [p.presence_penalty for p in params], logits.shape[-1], dev)
        if any(p.repetition_penalty != 1.0 for p in params):
            repetition = (seen_tokens([(*r.request.prompt, *r.tokens) for r in rows], logits.shape[-1], dev),
                          torch.tensor([p.repetition_penalty for p in params], device=dev))
        if any(p.min_p > 0 for p in params):
            min_p = torch.tensor([p.min_p for p in params], device=dev)
        processed = None
        if any(p.processed_logprobs for p in params):
            processed = torch.tensor([p.processed_logprobs for p in params], device=dev)
        constrained = [j for j, p in enumerate(params) if p.grammar is not None]
        allowed = None
        if constrained:
            assert self.grammars is not None  # the Preparer accepts a grammar only when the engine has them
            for j in constrained:  # a sample's first token: a matcher of its own (samples fork here)
                if rows[j].grammar is None:
                    rows[j].grammar = self.grammars.start(params[j].grammar)
            allowed = (torch.tensor(constrained, device=dev),
                       self.grammars.masks([rows[j].grammar for j in constrained]).to(dev))
        top_n = max(r.request.job.top_logprobs for r in rows)
        chosen = choose_tokens(
            logits,
            torch.tensor([p.temperature for p in params], device=dev),
            torch.tensor([p.top_k for p in params], device=dev),
            torch.tensor([p.top_p for p in params], device=dev),
            uniforms([r.generator for r in rows]).to(dev),
            penalty=penalty,
            top_n=top_n,
            repetition=repetition,
            min_p=min_p,
            allowed=allowed,
            bias=logit_biases([p.logit_bias for p in params], dev),
            processed=processed,
        )
        top_ids = top_lps = None
        if chosen.top_ids is not None and chosen.top_logprobs is not None:
            top_ids, top_lps = chosen.top_ids.tolist(), chosen.top_logprobs.tolist()
        now = time.perf_counter()
        for j, (r, t, lp) in enumerate(zip(rows, chosen.tokens.tolist(), chosen.logprobs.tolist(), strict=True)):
            req = r.request
            if not req.first_token:
                req.first_token = True
                self._latencies.append((req.priority, "ttft", now - req.submitted))
            elif r.tokens:
                self._latencies.append((req.priority, "itl", now - r.last_token_at))
            r.last_token_at = now
            r.tokens.append(t)
            r.logprobs.append(lp)
            top = None
            if (k := req.job.top_logprobs) and top_ids is not None and top_lps is not None:
                top = list(zip(top_ids[j][:k], top_lps[j][:k], strict=True))
                r.top.append(top)
            if req.job.on_token is not None:
                try:
                    req.job.on_token(r.index, t, lp, top)
                except Exception:  # a listener's bug must not fail the batch; the future still answers
                    log.exception("token callback failed")
            p = req.params
            complete = r.grammar is not None and Grammars.advance(r.grammar, t)  # its grammar is complete
            if complete or p.stop.hit(r.tokens):
                self._finish(r, "stop")
            elif len(r.tokens) >= p.max_tokens:
                self._finish(r, "length")

    def _finish(self, row: SampleRow, reason: types.StopReason) -> None:
        self.pool.release(row.blocks)
        self._release_state(row)
        row.done = True
        req = row.request
        tokens = np.asarray(row.tokens, dtype=np.int32)
        logprobs = np.asarray(row.logprobs, dtype=np.float32)
        sid = req.job.sequence_ids[row.index]
        top = None
        if req.job.top_logprobs:
            top = TopkLogprobs(token_ids=np.array([[t for t, _ in pos] for pos in row.top], dtype=np.int32),
                               logprobs=np.array([[lp for _, lp in pos] for pos in row.top], dtype=np.float32))
        req.results[row.index] = types.SampledSequence(
            stop_reason=reason, sequence_id=sid, tokens_np=tokens, logprobs_np=logprobs, topk_logprobs_np=top
        )
        if req.job.record and self.records is not None:
            self.records.put(sid, SamplingRecord(
                prompt_tokens=np.asarray(req.prompt, dtype=np.int32), tokens=tokens, logprobs=logprobs,
                adapter_id=None if req.adapter is None else req.adapter.id,
            ))
        req.finished += 1
        if req.finished == req.num_samples:
            self._respond(req)

    def _respond(self, req: SampleRequest) -> None:
        result = req.response()
        self._close(req)
        req.future.set_result(result)

    def _close(self, req: SampleRequest) -> None:
        """Drop the request's adapter pin and reference (once)."""
        if not req.closed:
            req.closed = True
            self.scheduler.note_end(req.key, time.perf_counter())
            if req.adapter is not None:
                if req.pinned:
                    self.residency.unpin(req.adapter)
                self.residency.unref(req.adapter)

    def _fail(self, req: SampleRequest, exc: BaseException) -> None:
        self._close(req)
        if not req.future.done():
            req.future.set_exception(exc)

    def _in_flight(self) -> set[SampleRequest]:
        """The requests holding KV: running rows' and prompts'."""
        return {r.request for r in self._rows} | {req for g in self._groups for req in g.requests}

    def _fail_in_flight(self, exc: BaseException) -> None:
        for req in self._in_flight():
            self._fail(req, exc)
        # Everything holding blocks was in flight, so the whole pool is free again.
        self.executor.drop_swapped([x.swapped for x in (*self._rows, *self._groups) if x.swapped is not None])
        self._rows, self._groups = [], []
        self._evictions_before += self.pool.evictions
        self.pool = BlockPool(self.cache.num_blocks)
        if self.states is not None:
            self.states = StateSlots(self.states.num_slots)
