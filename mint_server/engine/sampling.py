"""Continuous-batching sampler: many requests, many LoRA adapters, one forward per decode step.

HTTP threads call `submit` / `compute_logprobs` (validated at once, then queued); the engine's worker
thread calls `step` whenever `has_work()`. Each step
  1. decodes one token for every running sequence in a single forward — each row on its own adapter
     (or the base) through `bank.batch(row_slots)` — and finishes the rows that stopped;
  2. admits queued work while the KV budget and the batch-row cap allow (first come, first served;
     what does not fit waits in the queue, a request's samples may be admitted in several waves);
  3. prefills what it admitted in one forward: one prompt row per (adapter, prompt), however many
     samples and identical requests it serves, then forks the samples off it and draws each one's
     first token.
Prefill and decode run as two forwards because padding every decode row to the longest prompt
would cost far more than the second launch.

KV memory is the paged `KVCache`: a fixed pool of blocks sized `kv_slots × max_seq_len` positions
(as much as `kv_slots` full-length sequences), so short sequences leave room for more of them.
Admission reserves each sample's blocks for prompt + max_tokens up front, so a running sequence
never waits for memory and nothing is ever preempted. Forked samples share the prompt's full blocks
and copy only its last, partly filled one.

Each sample draws from its own generator seeded from (request seed, sample index), and the token
math is row-wise, so the same request and seed give the same tokens whatever else is in the batch.
Reported logprobs are the raw model's (see `sampler_ops`). A request holds a pin on its adapter
from submit until its last sample finishes, so it runs on the slot (revision) it was submitted on
even if that adapter is released or superseded meanwhile.
"""

from __future__ import annotations

import math
import secrets
import threading
import time
import uuid
from collections import deque
from collections.abc import Sequence
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any, Protocol

import numpy as np
import torch
from tinker import types

from mint_server.engine.adapters import Adapter, AdapterRegistry
from mint_server.engine.interface import EngineError
from mint_server.engine.kv import BlockPool, blocks_for
from mint_server.engine.records import SamplingRecord, SamplingRecords
from mint_server.engine.sampler_ops import (
    Decode,
    PromptScores,
    StopCondition,
    choose_tokens,
    sample_seed,
    score_prompt,
    uniforms,
)
from mint_server.model.lora import LoraBatch
from mint_server.model.transformer import CacheView, KVCache, Transformer

# Temperatures this small are greedy: dividing logits by them overflows to inf, and the draw would
# be the argmax anyway.
GREEDY_BELOW = 1e-5


class Tokenizer(Protocol):
    def decode(self, token_ids: list[int]) -> str: ...


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


@dataclass(frozen=True)
class _Params:
    max_tokens: int
    temperature: float
    top_k: int  # 0 = no limit
    top_p: float
    seed: int
    stop: StopCondition


@dataclass(eq=False)
class _Request:
    future: Future
    adapter: Adapter | None
    prompt: tuple[int, ...]
    params: _Params
    num_samples: int
    sequence_ids: list[str]
    want_prompt_logprobs: bool
    topk_prompt_logprobs: int
    record: bool
    score_only: bool = False  # compute_logprobs: prefill, score, no sampling
    started: bool = False
    closed: bool = False
    admitted: int = 0
    finished: int = 0
    cache_hit: bool = False  # its prefill was another request's
    scores: PromptScores | None = None
    results: list[types.SampledSequence | None] = field(default_factory=list)

    @property
    def slot(self) -> int:
        return -1 if self.adapter is None else self.adapter.slot

    @property
    def wants_scores(self) -> bool:
        return self.score_only or self.want_prompt_logprobs or self.topk_prompt_logprobs > 0


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
        registry: AdapterRegistry,
        kv_slots: int,
        max_seq_len: int,
        records: SamplingRecords | None = None,
        tokenizer: Tokenizer | None = None,
        decode: Decode | None = None,
        eos_token_ids: Sequence[int] | None = None,
        block_size: int = 16,
        max_batch_rows: int = 256,
        max_prefill_tokens: int = 16384,
        max_num_samples: int = 1024,
        dedupe_prompts: bool = True,
    ) -> None:
        """kv_slots × max_seq_len positions is the KV budget; max_seq_len bounds prompt + max_tokens.

        decode (or tokenizer.decode) turns token ids into text for stop strings; eos_token_ids (default:
        the model config's) stop a sequence when SamplingParams.stop is None. max_batch_rows caps the
        running sequences; max_prefill_tokens caps one prefill's padded tokens (rows × longest prompt),
        so admitting a burst never stalls the running batch for long (a longer prompt still runs,
        alone). dedupe_prompts shares one prefill among identical (adapter, prompt) requests admitted
        together (off only to measure what that saves).
        """
        if kv_slots < 1 or max_seq_len < 2:
            raise ValueError("kv_slots must be ≥ 1 and max_seq_len ≥ 2")
        self.model, self.registry, self.records = model, registry, records
        cfg = model.config
        self.vocab_size, self.max_seq_len = cfg.vocab_size, max_seq_len
        self.block_size, self.max_batch_rows = block_size, max_batch_rows
        self.max_prefill_tokens, self.max_num_samples = max_prefill_tokens, max_num_samples
        self.dedupe_prompts = dedupe_prompts
        self.decode = decode if decode is not None else (tokenizer.decode if tokenizer is not None else None)
        eos = cfg.eos_token_ids if eos_token_ids is None else eos_token_ids
        self.eos = StopCondition(token_ids=frozenset(int(t) for t in eos))
        weight = model.embed_tokens.weight
        self.device = weight.device
        self.cache = KVCache(cfg, blocks_for(kv_slots * max_seq_len, block_size) + 1, block_size,
                             self.device, weight.dtype)
        self.pool = BlockPool(self.cache.num_blocks)
        self.stats = SamplerStats()
        self._queue: deque[_Request] = deque()
        self._lock = threading.Lock()  # guards _queue: submit runs on other threads
        self._rows: list[_Row] = []
        self._prefilling: list[_Group] = []

    # --- submission (any thread) ----------------------------------------------------------------
    def submit(
        self,
        adapter_id: str | None,
        prompt_tokens: Sequence[int],
        num_samples: int,
        params: types.SamplingParams,
        prompt_logprobs: bool = False,
        topk_prompt_logprobs: int = 0,
        *,
        record_stability_info: bool = False,
        sequence_ids: Sequence[str] | None = None,
    ) -> SampleFuture:
        """Validate (EngineError naming the field), pin the adapter, queue; the future's
        `sequence_ids` are the sequences' ids (given, or generated), in sample order."""
        prompt = self._check_prompt(prompt_tokens, room=1)
        if not isinstance(num_samples, int) or not 1 <= num_samples <= self.max_num_samples:
            raise EngineError(f"num_samples must be an integer in 1..{self.max_num_samples}, got {num_samples!r}")
        sampling = self._check_params(params, len(prompt))
        if not isinstance(topk_prompt_logprobs, int) or not 0 <= topk_prompt_logprobs <= self.vocab_size:
            raise EngineError(f"topk_prompt_logprobs must be in 0..{self.vocab_size}, got {topk_prompt_logprobs!r}")
        if sequence_ids is None:
            run = uuid.uuid4().hex[:16]
            ids = [f"seq-{run}-{i}" for i in range(num_samples)]
        else:
            ids = [str(s) for s in sequence_ids]
            if len(ids) != num_samples or len(set(ids)) != num_samples or not all(ids):
                raise EngineError("sequence_ids must be num_samples distinct non-empty ids")
        future = SampleFuture(ids)
        self._enqueue(_Request(
            future=future, adapter=self._pin(adapter_id), prompt=prompt, params=sampling,
            num_samples=num_samples, sequence_ids=ids, want_prompt_logprobs=bool(prompt_logprobs),
            topk_prompt_logprobs=topk_prompt_logprobs, record=record_stability_info,
            results=[None] * num_samples,
        ))
        return future

    def compute_logprobs(self, adapter_id: str | None, tokens: Sequence[int]) -> Future[list[float | None]]:
        """SamplingClient.compute_logprobs: logprob of every token given the ones before (None first)."""
        prompt = self._check_prompt(tokens, room=0)
        future: Future[list[float | None]] = Future()
        self._enqueue(_Request(
            future=future, adapter=self._pin(adapter_id), prompt=prompt,
            params=_Params(max_tokens=0, temperature=0.0, top_k=0, top_p=1.0, seed=0, stop=StopCondition()),
            num_samples=1, sequence_ids=[], want_prompt_logprobs=True, topk_prompt_logprobs=0, record=False,
            score_only=True,
        ))
        return future

    def has_work(self) -> bool:
        return bool(self._rows) or bool(self._queue)

    @property
    def kv_blocks_in_use(self) -> int:
        return self.pool.used

    def _enqueue(self, request: _Request) -> None:
        with self._lock:
            self._queue.append(request)

    def _pin(self, adapter_id: str | None) -> Adapter | None:
        return None if adapter_id is None else self.registry.pin(adapter_id)

    # --- validation -----------------------------------------------------------------------------
    def _check_prompt(self, tokens: Sequence[int], room: int) -> tuple[int, ...]:
        try:
            prompt = tuple(int(t) for t in tokens)
        except (TypeError, ValueError):
            raise EngineError("prompt must be a list of integer token ids") from None
        if not prompt:
            raise EngineError("prompt must hold at least one token")
        for i, t in enumerate(prompt):
            if not 0 <= t < self.vocab_size:
                raise EngineError(f"prompt: token id {t} at position {i} is outside the vocabulary [0, {self.vocab_size})")
        if len(prompt) + room > self.max_seq_len:
            raise EngineError(
                f"prompt: {len(prompt)} tokens leave no room in the context length {self.max_seq_len}"
                if room else f"prompt: {len(prompt)} tokens exceed the context length {self.max_seq_len}"
            )
        return prompt

    def _check_params(self, p: types.SamplingParams, prompt_len: int) -> _Params:
        room = self.max_seq_len - prompt_len
        max_tokens = room if p.max_tokens is None else p.max_tokens
        if not isinstance(max_tokens, int) or max_tokens < 1:
            raise EngineError(f"max_tokens must be a positive integer, got {p.max_tokens!r}")
        if max_tokens > room:
            raise EngineError(
                f"max_tokens: prompt ({prompt_len} tokens) + max_tokens ({max_tokens}) exceeds the "
                f"context length {self.max_seq_len}"
            )
        temperature = float(p.temperature)
        if not math.isfinite(temperature) or temperature < 0:
            raise EngineError(f"temperature must be ≥ 0 (0 = greedy), got {p.temperature!r}")
        if temperature < GREEDY_BELOW:
            temperature = 0.0
        top_p = float(p.top_p)
        if not 0 < top_p <= 1:
            raise EngineError(f"top_p must be in (0, 1], got {p.top_p!r}")
        if not isinstance(p.top_k, int) or p.top_k < -1:
            raise EngineError(f"top_k must be -1 (no limit) or a positive integer, got {p.top_k!r}")
        seed = p.seed if p.seed is not None else secrets.randbits(63)
        if not isinstance(seed, int):
            raise EngineError(f"seed must be an integer, got {p.seed!r}")
        return _Params(max_tokens, temperature, max(p.top_k, 0), top_p, seed, self._check_stop(p.stop))

    def _check_stop(self, stop: Any) -> StopCondition:
        if stop is None:  # the SDK's default: stop at EOS; an explicit list replaces it ([] = never stop)
            return self.eos
        items = [stop] if isinstance(stop, str) else list(stop)
        if all(isinstance(s, str) for s in items):
            if not all(items):
                raise EngineError("stop: stop strings must be non-empty")
            if items and self.decode is None:
                raise EngineError("stop: stop strings need a tokenizer, and this sampler has none")
            return StopCondition(strings=tuple(items), decode=self.decode)
        if all(isinstance(s, int) and not isinstance(s, bool) for s in items):
            bad = [t for t in items if not 0 <= t < self.vocab_size]
            if bad:
                raise EngineError(f"stop: token id {bad[0]} is outside the vocabulary [0, {self.vocab_size})")
            return StopCondition(token_ids=frozenset(items))
        raise EngineError("stop must be a string, a list of strings or a list of token ids")

    # --- the worker's step ----------------------------------------------------------------------
    def step(self) -> None:
        """Decode one token for every running sequence, then admit and prefill queued work."""
        self.stats.steps += 1
        try:
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

    def _admit(self) -> None:
        """Take queued work, FIFO, while its KV blocks and batch rows fit; reserve its blocks now.

        The groups to prefill go to self._prefilling as they form, so a failure finds them.
        """
        bs = self.block_size
        groups: dict[tuple, _Group] = {}
        free, rows, longest = self.pool.available, len(self._rows), 0
        with self._lock:
            while self._queue:
                req = self._queue[0]
                if not req.started:
                    if not req.future.set_running_or_notify_cancel():  # cancelled while queued
                        self._queue.popleft()
                        self._close(req)
                        continue
                    req.started = True
                n = len(req.prompt)
                key = (req.slot, req.prompt) if self.dedupe_prompts else (req.slot, req.prompt, id(req))
                group = groups.get(key)
                # Prompts are right-padded to the longest, so the prefill's cost is rows × longest.
                if group is None and groups and (len(groups) + 1) * max(longest, n) > self.max_prefill_tokens:
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
                for _ in range(take):
                    first = reuse and not group.has_sampler
                    group.members.append(_Member(req, req.admitted, self.pool.alloc(own - first)))
                    req.admitted += 1
                free -= new_blocks + take * own - reuse
                rows += 0 if req.score_only else take
                if req.admitted < req.num_samples:
                    break  # head of line keeps its place: the rest of its samples come next
                self._queue.popleft()

    def _prefill(self, groups: list[_Group]) -> None:
        t0 = time.perf_counter()
        bs, dev = self.block_size, self.device
        lengths = [len(g.prompt) for g in groups]
        width = max(lengths)
        tokens = torch.tensor([list(g.prompt) + [0] * (width - len(g.prompt)) for g in groups], device=dev)
        positions = torch.arange(width, device=dev).expand(len(groups), width)
        table = self._table([g.blocks for g in groups], blocks_for(width, bs))
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
        rows, row_group, copies = self._fork(groups)
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
        tokens, logprobs = choose_tokens(
            logits,
            torch.tensor([p.temperature for p in params], device=dev),
            torch.tensor([p.top_k for p in params], device=dev),
            torch.tensor([p.top_p for p in params], device=dev),
            uniforms([r.generator for r in rows]).to(dev),
        )
        for r, t, lp in zip(rows, tokens.tolist(), logprobs.tolist(), strict=True):
            r.tokens.append(t)
            r.logprobs.append(lp)
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
        tokens = np.asarray(row.tokens, dtype=np.int32)
        logprobs = np.asarray(row.logprobs, dtype=np.float32)
        sid = req.sequence_ids[row.index]
        req.results[row.index] = types.SampledSequence(
            stop_reason=reason, sequence_id=sid, tokens_np=tokens, logprobs_np=logprobs
        )
        if req.record and self.records is not None:
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
                prompt_logprobs_np=s.logprobs if s is not None and req.want_prompt_logprobs else None,
                topk_prompt_logprobs_np=s.topk(req.topk_prompt_logprobs) if s is not None and req.topk_prompt_logprobs else None,
                prompt_cache_hit_tokens=len(req.prompt) if req.cache_hit else 0,
            )
        self._close(req)
        req.future.set_result(result)

    def _close(self, req: _Request) -> None:
        """Drop the request's adapter pin (once)."""
        if not req.closed:
            req.closed = True
            if req.adapter is not None:
                self.registry.unpin(req.adapter)

    def _fail(self, req: _Request, exc: BaseException) -> None:
        self._close(req)
        if not req.future.done():
            req.future.set_exception(exc)

    def _fail_in_flight(self, exc: BaseException) -> None:
        failed = {r.request for r in self._rows}
        failed.update(req for g in self._prefilling for req in g.requests)
        with self._lock:
            self._queue = deque(r for r in self._queue if r not in failed)
        for req in failed:
            self._fail(req, exc)
        # Everything holding blocks was in flight, so the whole pool is free again.
        self._rows, self._prefilling = [], []
        self.pool = BlockPool(self.cache.num_blocks)
