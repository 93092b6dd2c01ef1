"""Continuous-batching sampler: many requests, many LoRA adapters, one forward per decode step.

The engine worker hands it parsed `SampleJob`s (`submit`, see `jobs.Preparer`) and calls `step`
whenever `has_work()`. Each step
  1. decodes one token for every running sequence in a single forward — each row on its own adapter
     (or the base) through `bank.batch(row_slots)` — and finishes the rows that stopped;
  2. admits queued work whose adapter is in a device slot, while the KV budget, the batch-row cap
     and the step's token budget allow. Admission is fair across keys (tenants): the key with the
     fewest KV blocks in use goes first, first come first served within a key; the first request
     that does not fit stops admission, so a large request is never starved by a stream of small
     ones from a key that already holds more. Requests whose adapter is still loading wait without
     holding anyone up (cold loads are the residency manager's scheduled work);
  3. prefills what it admitted in one forward: one prompt row per (adapter, prompt), however many
     samples and identical requests it serves, then forks the samples off it and draws each one's
     first token.
Prefill and decode run as two forwards because padding every decode row to the longest prompt
would cost far more than the second launch.

KV memory is the paged `KVCache`: a fixed pool of `kv_budget_tokens` positions, so short sequences
leave room for more of them.
Admission reserves each sample's blocks for prompt + max_tokens up front, so a running sequence
never waits for memory and nothing is ever preempted. Forked samples share the prompt's full blocks
and copy only its last, partly filled one.

Each sample draws from its own generator seeded from (request seed, sample index), and the token
math is row-wise, so the same request and seed give the same tokens whatever else is in the batch.
Reported logprobs are the raw model's (see `sampler_ops`). A request holds a reference on its
adapter from submit until it finishes (the adapter is not dropped, even if released meanwhile) and
a pin from admission (its slot is not evicted while rows read it).
"""

from __future__ import annotations

import logging
import math
import threading
import time
from collections import deque
from collections.abc import Iterable
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch
from tinker import types
from tinker.types.topk_logprobs import TopkLogprobs

from mint_server.engine.interface import EngineError, TopLogprobs
from mint_server.engine.jobs import SampleJob
from mint_server.engine.kv import BlockPool, blocks_for
from mint_server.engine.records import SamplingRecord, SamplingRecords
from mint_server.engine.residency import Adapter, Residency
from mint_server.engine.sampler_ops import (
    PromptScores,
    choose_tokens,
    penalties,
    sample_seed,
    score_prompt,
    uniforms,
)
from mint_server.model.lora import LoraBatch
from mint_server.model.transformer import CacheView, KVCache, Transformer

log = logging.getLogger(__name__)


class SampleCancelled(EngineError):
    """The job's cancel event was set: its sequences stopped and their KV blocks were freed."""


class SampleFuture(Future):
    """A Future for a SampleResponse that knows its sequence ids from the start.

    Tinker returns the ids in the submit response, before any token is sampled.
    """

    def __init__(self, sequence_ids: list[str]) -> None:
        super().__init__()
        self.sequence_ids = sequence_ids


@dataclass
class SamplerStats:
    steps: int = 0
    prefill_forwards: int = 0
    prefill_rows: int = 0  # prompt rows actually run (after sharing)
    prefill_tokens: int = 0  # real (unpadded) prompt tokens run
    prefill_s: float = 0.0
    decode_forwards: int = 0
    decode_tokens: int = 0
    decode_s: float = 0.0
    peak_rows: int = 0


@dataclass(eq=False)
class _Request:
    future: Future
    adapter: Adapter | None
    job: SampleJob
    started: bool = False
    pinned: bool = False
    closed: bool = False
    admitted: int = 0
    finished: int = 0
    cache_hit: bool = False  # its prefill was another request's
    scores: PromptScores | None = None
    results: list[types.SampledSequence | None] = field(default_factory=list)

    @property
    def slot(self) -> int:
        return -1 if self.adapter is None or self.adapter.slot is None else self.adapter.slot

    @property
    def ready(self) -> bool:
        return self.adapter is None or self.adapter.slot is not None

    @property
    def cancelled(self) -> bool:
        return self.job.cancel is not None and self.job.cancel.is_set()

    # the job's fields, read often
    @property
    def prompt(self) -> tuple[int, ...]:
        return self.job.prompt

    @property
    def params(self) -> Any:
        return self.job.params

    @property
    def num_samples(self) -> int:
        return self.job.num_samples

    @property
    def score_only(self) -> bool:
        return self.job.score_only

    @property
    def topk_prompt_logprobs(self) -> int:
        return self.job.topk_prompt_logprobs

    @property
    def wants_scores(self) -> bool:
        return self.job.score_only or self.job.prompt_logprobs or self.job.topk_prompt_logprobs > 0


@dataclass(eq=False)
class _Row:
    """One running sample: its blocks, how many positions of them are filled, what it drew so far."""

    request: _Request
    index: int  # sample index within the request
    blocks: list[int]
    length: int  # positions in the cache; the last sampled token is not among them yet
    generator: torch.Generator | None  # None = greedy
    tokens: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    top: list[TopLogprobs] = field(default_factory=list)  # per token, when the job asked for top_logprobs


@dataclass(eq=False)
class _Member:
    request: _Request
    index: int
    own_blocks: list[int]  # reserved at admission, past the shared prompt blocks


@dataclass(eq=False)
class _Group:
    """One prompt row of a prefill, serving every admitted sample with this adapter and prompt."""

    slot: int
    prompt: tuple[int, ...]
    blocks: list[int]  # the prompt's blocks (the last one partly filled unless the prompt fills it)
    members: list[_Member] = field(default_factory=list)
    requests: list[_Request] = field(default_factory=list)

    @property
    def has_sampler(self) -> bool:
        return any(not m.request.score_only for m in self.members)


class Sampler:
    def __init__(
        self,
        model: Transformer,
        registry: Residency,
        kv_budget_tokens: int,
        max_seq_len: int,
        records: SamplingRecords | None = None,
        block_size: int = 16,
        max_batch_rows: int = 256,
        max_step_tokens: int = 16384,
        dedupe_prompts: bool = True,
    ) -> None:
        """kv_budget_tokens positions is the KV pool; max_seq_len bounds prompt + max_tokens.

        max_batch_rows caps the running sequences; max_step_tokens caps one prefill's padded tokens
        (rows × longest prompt), so admitting a burst never stalls the running batch for long (a
        longer prompt still runs, alone). dedupe_prompts shares one prefill among identical
        (adapter, prompt) requests admitted together (off only to measure what that saves).
        """
        if kv_budget_tokens < max_seq_len or max_seq_len < 2:
            raise ValueError("kv_budget_tokens must hold one sequence of max_seq_len ≥ 2")
        self.model, self.registry, self.records = model, registry, records
        cfg = model.config
        self.vocab_size, self.max_seq_len = cfg.vocab_size, max_seq_len
        self.block_size, self.max_batch_rows = block_size, max_batch_rows
        self.max_prefill_tokens = max_step_tokens
        self.dedupe_prompts = dedupe_prompts
        weight = model.embed_tokens.weight
        self.device = weight.device
        # tensor-parallel: every rank holds the same blocks of its own KV heads (tp_runner's ops)
        self.runner = registry.runner
        if self.runner is not None:
            self.runner.call("make_cache", num_blocks=blocks_for(kv_budget_tokens, block_size) + 1,
                             block_size=block_size)
            self.cache = self.runner.shard.cache
        else:
            self.cache = KVCache(cfg, blocks_for(kv_budget_tokens, block_size) + 1, block_size,
                                 self.device, weight.dtype)
        self.pool = BlockPool(self.cache.num_blocks)
        self.stats = SamplerStats()
        self._queue: deque[_Request] = deque()
        self._lock = threading.Lock()  # guards _queue: has_work/queued are read from other threads
        self._rows: list[_Row] = []
        self._prefilling: list[_Group] = []
        self._rows_by_key: dict[str, int] = {}  # running sequences per key (fair admission)

    # --- submission (the engine worker) ---------------------------------------------------------
    def submit(self, job: SampleJob, adapter: Adapter | None, future: Future | None = None) -> SampleFuture | Future:
        """Queue a parsed job on `adapter` (None: the base), whose reference the caller took and
        the request now owns. The future's result is a SampleResponse (or, for a score-only job,
        the prompt's logprobs); a SampleFuture knows its sequence ids from the start."""
        if future is None:
            future = SampleFuture(list(job.sequence_ids))
        self._enqueue(_Request(future=future, adapter=adapter, job=job,
                               results=[None] * (0 if job.score_only else job.num_samples)))
        return future

    def has_work(self) -> bool:
        return bool(self._rows) or bool(self._queue)

    def has_ready_work(self) -> bool:
        """Running rows, or queued requests whose adapter is on the device."""
        return bool(self._rows) or any(r.ready or r.cancelled for r in list(self._queue))

    def waiting_adapters(self, limit: int | None = None) -> list[Adapter]:
        """Adapters that queued requests need, most urgent first (the residency manager's wants): in
        the order admission will take them, so a quiet key's adapter is not loaded behind a storm."""
        with self._lock:
            out = [r.adapter for r in self._fair_order(self._queue) if r.adapter is not None]
        return out if limit is None else list(dict.fromkeys(out))[:limit]

    def fail_waiting(self, adapter: Adapter, exc: BaseException) -> None:
        """Its adapter could not be loaded: fail the queued requests that wait for it."""
        with self._lock:
            failed = [r for r in self._queue if r.adapter is adapter and r.admitted == 0]
            self._queue = deque(r for r in self._queue if r not in failed)
        for r in failed:
            self._fail(r, exc)

    def totals(self) -> dict[str, dict[str, float]]:
        """Cumulative seconds and tokens of the decode and prefill forwards (for /metrics)."""
        s = self.stats
        return {"seconds": {"decode": s.decode_s, "prefill": s.prefill_s},
                "tokens": {"decode": float(s.decode_tokens), "prefill": float(s.prefill_tokens)},
                "forwards": {"decode": float(s.decode_forwards), "prefill": float(s.prefill_forwards)}}

    @property
    def kv_blocks_in_use(self) -> int:
        return self.pool.used

    def _enqueue(self, request: _Request) -> None:
        with self._lock:
            self._queue.append(request)

    # --- the worker's step ----------------------------------------------------------------------
    def step(self) -> None:
        """Decode one token for every running sequence, then admit and prefill queued work."""
        self.stats.steps += 1
        try:
            self._drop_cancelled()
            if self._rows:
                self._decode()
            self._admit()
            if self._prefilling:
                self._prefill(self._prefilling)
            self._prefilling = []
        except BaseException as exc:  # fail what was in flight (rows share tensors), keep the queue
            self._fail_in_flight(exc)
            raise

    def fail_all(self, exc: BaseException) -> None:
        """Fail every queued and running request (engine shutdown without draining)."""
        self._fail_in_flight(exc)
        with self._lock:
            queued, self._queue = list(self._queue), deque()
        for r in queued:
            self._fail(r, exc)

    def _drop_cancelled(self) -> None:
        """Stop the rows and queued work of cancelled jobs; their blocks go back to the pool."""
        with self._lock:
            gone = [r for r in self._queue if r.cancelled]
            if gone:
                self._queue = deque(r for r in self._queue if not r.cancelled)
        if any(r.request.cancelled for r in self._rows):
            keep = []
            for row in self._rows:
                if row.request.cancelled:
                    self.pool.release(row.blocks)
                    self._count_rows(row.request.job.key, -1)
                    gone.append(row.request)
                else:
                    keep.append(row)
            self._rows = keep
        for req in set(gone):
            self._fail(req, SampleCancelled("the request was cancelled"))

    def _count_rows(self, key: str, delta: int) -> None:
        left = self._rows_by_key.get(key, 0) + delta
        if left:
            self._rows_by_key[key] = left
        else:
            self._rows_by_key.pop(key, None)

    def _admit(self) -> None:
        """Take queued work whose adapter is on the device while its KV blocks, batch rows and the
        step's token budget fit; reserve its blocks now. Keys with fewer running sequences go first.

        The groups to prefill go to self._prefilling as they form, so a failure finds them.
        """
        bs = self.block_size
        groups: dict[tuple, _Group] = {}
        free, rows, longest = self.pool.available, len(self._rows), 0
        # The step's token budget: running rows decode one token each, prefills get the rest (at
        # least one group, so a prompt longer than the budget still runs, alone).
        budget = self.max_prefill_tokens - rows
        with self._lock:
            for req in self._admission_order():
                if not req.started:
                    if not req.future.set_running_or_notify_cancel():  # cancelled while queued
                        self._queue.remove(req)
                        self._close(req)
                        continue
                    req.started = True
                n = len(req.prompt)
                key = (req.slot, req.prompt) if self.dedupe_prompts else (req.slot, req.prompt, id(req))
                group = groups.get(key)
                # Prompts are right-padded to the longest, so the prefill's cost is rows × longest.
                if group is None and groups and (len(groups) + 1) * max(longest, n) > budget:
                    break
                new_blocks = 0 if group else blocks_for(n, bs)
                if req.score_only:
                    take = 1 if new_blocks <= free else 0
                    own = reuse = 0
                else:
                    own = blocks_for(n + req.params.max_tokens, bs) - n // bs
                    # The group's first sample takes over the prompt's partly filled last block.
                    reuse = 1 if n % bs and (group is None or not group.has_sampler) else 0
                    take = min(req.num_samples - req.admitted, self.max_batch_rows - rows,
                               (free - new_blocks + reuse) // own)
                if take <= 0:
                    break
                if group is None:
                    group = groups[key] = _Group(req.slot, req.prompt, self.pool.alloc(new_blocks))
                    self._prefilling.append(group)
                    longest = max(longest, n)
                elif req not in group.requests:
                    req.cache_hit = True
                if req not in group.requests:
                    group.requests.append(req)
                if req.adapter is not None and not req.pinned:
                    self.registry.pin(req.adapter)
                    req.pinned = True
                for _ in range(take):
                    first = reuse and not group.has_sampler
                    group.members.append(_Member(req, req.admitted, self.pool.alloc(own - first)))
                    req.admitted += 1
                free -= new_blocks + take * own - reuse
                if not req.score_only:
                    rows += take
                    self._rows_by_key[req.job.key] = self._rows_by_key.get(req.job.key, 0) + take
                if req.admitted < req.num_samples:
                    break  # it keeps its place: the rest of its samples come next
                self._queue.remove(req)

    def _admission_order(self) -> list[_Request]:
        """Queued requests whose adapter is in a slot (or that were cancelled), in fair order."""
        return self._fair_order(r for r in self._queue if r.ready or not r.started and r.future.cancelled())

    def _fair_order(self, requests: Iterable[_Request]) -> list[_Request]:
        """Keys with the fewest running sequences first, arrival order within a key."""
        by_key: dict[str, list[_Request]] = {}
        for req in requests:
            by_key.setdefault(req.job.key, []).append(req)
        keys = sorted(by_key, key=lambda k: self._rows_by_key.get(k, 0))  # stable: first arrival breaks ties
        return [req for k in keys for req in by_key[k]]

    def _prefill(self, groups: list[_Group]) -> None:
        t0 = time.perf_counter()
        bs, dev = self.block_size, self.device
        lengths = [len(g.prompt) for g in groups]
        width = max(lengths)
        tokens = torch.tensor([list(g.prompt) + [0] * (width - len(g.prompt)) for g in groups], device=dev)
        positions = torch.arange(width, device=dev).expand(len(groups), width)
        table = self._table([g.blocks for g in groups], blocks_for(width, bs))
        if self.runner is not None:
            logits = self._prefill_tp(groups, tokens, positions, table, lengths)
            return self._after_prefill(groups, lengths, logits, t0)
        lora = self._lora([g.slot for g in groups])
        with torch.no_grad():
            hidden = self.model.hidden_states(tokens, positions, lora, CacheView(self.cache, table, positions))
            last = hidden[torch.arange(len(groups), device=dev), torch.tensor(lengths, device=dev) - 1]
            logits = self.model.logits(last[:, None], lora)[:, 0]
            for i, g in enumerate(groups):
                wanting = [r for r in g.requests if r.wants_scores]
                if wanting:
                    k = max(r.topk_prompt_logprobs for r in wanting)
                    one = self._lora([g.slot])
                    scores = score_prompt(lambda h, one=one: self.model.logits(h, one), hidden[i, : lengths[i]],
                                          g.prompt, k)
                    for r in wanting:
                        r.scores = scores
        self._after_prefill(groups, lengths, logits, t0)

    def _prefill_tp(self, groups: list[_Group], tokens: torch.Tensor, positions: torch.Tensor, table: torch.Tensor,
                    lengths: list[int]) -> torch.Tensor:
        """The prefill forward on every tensor-parallel rank (tp_runner.prefill), prompt scores included;
        returns the last-position logits."""
        scoring = []
        for i, g in enumerate(groups):
            wanting = [r for r in g.requests if r.wants_scores]
            if wanting:
                scoring.append((i, g.slot, g.prompt, max(r.topk_prompt_logprobs for r in wanting)))
        logits, scores = self.runner.call(
            "prefill", tokens=tokens.cpu(), positions=positions.cpu(), table=table.cpu(), slots=[g.slot for g in groups],
            lengths=lengths, scoring=scoring)
        for i, g in enumerate(groups):
            for r in g.requests:
                if r.wants_scores:
                    r.scores = scores[i]
        return logits

    def _after_prefill(self, groups: list[_Group], lengths: list[int], logits: torch.Tensor, t0: float) -> None:
        """Fork the samples off their prompt rows and draw each one's first token."""
        dev = self.device
        rows, row_group, copies = self._fork(groups)
        if self.runner is not None:
            if copies:
                self.runner.call("copy_blocks", src=[s for s, _ in copies], dst=[d for _, d in copies])
        else:
            self.cache.copy_blocks([s for s, _ in copies], [d for _, d in copies])
        if rows:
            self._advance(rows, logits[torch.tensor(row_group, device=dev)])
        for g in groups:
            for r in g.requests:
                if r.score_only:
                    self._respond(r)
        s = self.stats
        s.prefill_forwards += 1
        s.prefill_rows += len(groups)
        s.prefill_tokens += sum(lengths)
        s.prefill_s += time.perf_counter() - t0

    def _fork(self, groups: list[_Group]) -> tuple[list[_Row], list[int], list[tuple[int, int]]]:
        """Turn each group's sampling members into rows over the prompt's blocks.

        Full prompt blocks are shared (reference-counted); the partly filled last one goes to the
        first sample and is copied for the others, whose own next tokens would otherwise collide in it.
        """
        bs = self.block_size
        rows: list[_Row] = []
        row_group: list[int] = []
        copies: list[tuple[int, int]] = []
        for gi, g in enumerate(groups):
            n = len(g.prompt)
            full, partial = g.blocks[: n // bs], g.blocks[n // bs :]
            samplers = [m for m in g.members if not m.request.score_only]
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
                rows.append(_Row(m.request, m.index, blocks, n, gen))
                row_group.append(gi)
            if not samplers:
                self.pool.release(g.blocks)
        return rows, row_group, copies

    def _decode(self) -> None:
        t0 = time.perf_counter()
        rows, dev = self._rows, self.device
        positions = torch.tensor([[r.length] for r in rows], device=dev)
        tokens = torch.tensor([[r.tokens[-1]] for r in rows], device=dev)
        width = blocks_for(max(r.length for r in rows) + 1, self.block_size)
        table = self._table([r.blocks for r in rows], width)
        if self.runner is not None:
            logits = self.runner.call("decode", tokens=tokens.cpu(), positions=positions.cpu(), table=table.cpu(),
                                      slots=[r.request.slot for r in rows])
        else:
            with torch.no_grad():
                logits = self.model(tokens, positions, self._lora([r.request.slot for r in rows]),
                                    CacheView(self.cache, table, positions))[:, 0]
        for r in rows:
            r.length += 1
        self._rows = []
        self._advance(rows, logits)
        self.stats.decode_forwards += 1
        self.stats.decode_tokens += len(rows)
        self.stats.decode_s += time.perf_counter() - t0

    def _table(self, block_lists: list[list[int]], width: int) -> torch.Tensor:
        pad = KVCache.SCRATCH
        return torch.tensor([b[:width] + [pad] * (width - len(b[:width])) for b in block_lists], device=self.device)

    def _lora(self, slots: list[int]) -> LoraBatch | None:
        if all(s < 0 for s in slots):
            return None
        return self.registry.bank.batch(slots, self.device)

    # --- choosing tokens and finishing ----------------------------------------------------------
    def _advance(self, rows: list[_Row], logits: torch.Tensor) -> None:
        """Draw each row's next token from its logits [len(rows), V]; keep it running or finish it."""
        dev = self.device
        params = [r.request.params for r in rows]
        penalty = None
        if any(p.penalized for p in params):
            penalty = penalties([r.tokens for r in rows], [p.frequency_penalty for p in params],
                                [p.presence_penalty for p in params], logits.shape[-1], dev)
        top_n = max(r.request.job.top_logprobs for r in rows)
        chosen = choose_tokens(
            logits,
            torch.tensor([p.temperature for p in params], device=dev),
            torch.tensor([p.top_k for p in params], device=dev),
            torch.tensor([p.top_p for p in params], device=dev),
            uniforms([r.generator for r in rows]).to(dev),
            penalty=penalty,
            top_n=top_n,
        )
        top_ids = top_lps = None
        if chosen.top_ids is not None and chosen.top_logprobs is not None:
            top_ids, top_lps = chosen.top_ids.tolist(), chosen.top_logprobs.tolist()
        for j, (r, t, lp) in enumerate(zip(rows, chosen.tokens.tolist(), chosen.logprobs.tolist(), strict=True)):
            r.tokens.append(t)
            r.logprobs.append(lp)
            top = None
            if (k := r.request.job.top_logprobs) and top_ids is not None and top_lps is not None:
                top = list(zip(top_ids[j][:k], top_lps[j][:k], strict=True))
                r.top.append(top)
            if r.request.job.on_token is not None:
                try:
                    r.request.job.on_token(r.index, t, lp, top)
                except Exception:  # a listener's bug must not fail the batch; the future still answers
                    log.exception("token callback failed")
            p = r.request.params
            if p.stop.hit(r.tokens):
                self._finish(r, "stop")
            elif len(r.tokens) >= p.max_tokens:
                self._finish(r, "length")
            else:
                self._rows.append(r)
        self.stats.peak_rows = max(self.stats.peak_rows, len(self._rows))

    def _finish(self, row: _Row, reason: types.StopReason) -> None:
        self.pool.release(row.blocks)
        req = row.request
        self._count_rows(req.job.key, -1)
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

    def _respond(self, req: _Request) -> None:
        if req.score_only:
            assert req.scores is not None
            result: Any = [None if math.isnan(x) else x for x in req.scores.logprobs.tolist()]
        else:
            s = req.scores
            result = types.SampleResponse(
                sequences=list(req.results),  # type: ignore[arg-type]  # all filled by now
                prompt_logprobs_np=s.logprobs if s is not None and req.job.prompt_logprobs else None,
                topk_prompt_logprobs_np=s.topk(req.topk_prompt_logprobs) if s is not None and req.topk_prompt_logprobs else None,
                prompt_cache_hit_tokens=len(req.prompt) if req.cache_hit else 0,
            )
        self._close(req)
        req.future.set_result(result)

    def _close(self, req: _Request) -> None:
        """Drop the request's adapter pin and reference (once)."""
        if not req.closed:
            req.closed = True
            if req.adapter is not None:
                if req.pinned:
                    self.registry.unpin(req.adapter)
                self.registry.unref(req.adapter)

    def _fail(self, req: _Request, exc: BaseException) -> None:
        self._close(req)
        if not req.future.done():
            req.future.set_exception(exc)

    def cancel(self, future: Future) -> bool:
        """Stop the request behind `future` (worker thread, between steps): its queued samples are
        dropped, its running rows end and their KV blocks return to the pool. False if unknown
        (already finished)."""
        with self._lock:
            req = next((r for r in self._queue if r.future is future), None)
            if req is not None:
                self._queue.remove(req)
        if req is None:
            req = next((row.request for row in self._rows if row.request.future is future), None)
        if req is None:
            return False
        kept = []
        for row in self._rows:
            if row.request is not req:
                kept.append(row)
                continue
            self.pool.release(row.blocks)
            self._rows_by_key[req.job.key] -= 1
            if not self._rows_by_key[req.job.key]:
                del self._rows_by_key[req.job.key]
        self._rows = kept
        self._fail(req, EngineError("sample request was cancelled"))
        return True

    def queue_index(self, future: Future) -> tuple[int | None, int]:
        """(its index among the requests not yet admitted, or None; how many of those there are)."""
        with self._lock:
            waiting = [r.future for r in self._queue if r.admitted == 0]
        return (waiting.index(future) if future in waiting else None), len(waiting)

    def _fail_in_flight(self, exc: BaseException) -> None:
        failed = {r.request for r in self._rows}
        failed.update(req for g in self._prefilling for req in g.requests)
        with self._lock:
            self._queue = deque(r for r in self._queue if r not in failed)
        for req in failed:
            self._fail(req, exc)
        # Everything holding blocks was in flight, so the whole pool is free again.
        self._rows, self._prefilling, self._rows_by_key = [], [], {}
        self.pool = BlockPool(self.cache.num_blocks)
