"""Continuous-batching sampler: many requests, many LoRA adapters, one ragged forward per step.

The engine worker hands it parsed `SampleJob`s (`submit`, see `jobs.Preparer`) and calls `step`
whenever `has_ready_work()`. Each step
  1. drops cancelled work — every cancel that arrived since the last step, at once — and frees its KV;
  2. asks the `Scheduler` (pure policy) for a step plan over everything it holds: running decode rows
     (one token each), prompts being prefilled (a chunk each), preempted rows and queued requests
     waiting for KV. The plan fills the step's token budget by priority class and fair share across
     keys, admits what fits and names the rows to preempt;
  3. swaps the preempted rows' KV out to host memory (they resume later from exactly that KV),
     admits — reserves KV for prompt + max_tokens of each admitted sample, so an admitted sequence
     never waits for memory — and swaps resumed rows back in;
  4. runs the plan as one forward over a ragged batch (`executor`): decode rows and prefill chunks
     together, each row on its own adapter; then draws the decode rows' next tokens and, where a
     prompt's last chunk ran, forks its samples off it and draws their first tokens.

A prompt row is shared by every admitted sample and every identical (adapter, prompt) request that
joins it while it is still being prefilled; forked samples share the prompt's full KV blocks and
copy only its last, partly filled one. Full blocks outlive their requests in the prefix cache
(kv.py; keyed by base, adapter revision, owner and tokens): a later prompt with the same prefix starts
its prefill after the blocks it finds there (`_prefix`, docs/engine.md "Prefix cache"), and only a
request of the same owner joins a prompt row in flight. Requests whose adapter is still loading wait without holding
anyone up (cold loads are the residency manager's scheduled work, `waiting_adapters` its wants).

Each sample draws from its own generator seeded from (request seed, sample index), and the token
math is row-wise, so the same request and seed give the same tokens whatever else is in the batch,
preempted or not. Reported logprobs are the raw model's (see `sampler_ops`). A request holds a
reference on its adapter from submit until it finishes (the adapter is not dropped, even if released
meanwhile) and a pin from admission (its slot is not evicted while rows read it).
"""

from __future__ import annotations

import contextlib
import functools
import itertools
import logging
import math
import threading
import time
from collections import deque
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch
from tinker import types
from tinker.types.topk_logprobs import TopkLogprobs

from mint_server.engine.executor import Executor, StepBatch
from mint_server.engine.grammar import Grammars
from mint_server.engine.jobs import SampleJob
from mint_server.engine.kv import BlockPool, block_keys, blocks_for, cache_root
from mint_server.engine.records import SamplingRecord, SamplingRecords
from mint_server.engine.residency import Adapter, Residency
from mint_server.engine.sampler_ops import (
    PromptAsk,
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
from mint_server.engine.scheduler import NO_FIT, Fit, Scheduler, StepCost
from mint_server.engine.state_cache import StateSlots
from mint_server.engine.values import REVISION_KEY_PREFIX, Priority, SampleCancelled, TopLogprobs
from mint_server.model import kernels
from mint_server.model.images import PromptImages
from mint_server.model.transformer import Transformer

log = logging.getLogger(__name__)


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


@dataclass(eq=False)
class _Request:
    future: Future
    adapter: Adapter | None
    job: SampleJob
    arrival: int
    submitted: float  # perf_counter at submit (queue wait and time to first token)
    started: bool = False
    pinned: bool = False
    closed: bool = False
    admitted: int = 0
    finished: int = 0
    first_token: bool = False
    cache_hit: bool = False  # its prefill was another request's
    cache_hit_tokens: int = 0  # prompt positions its prompt row took from the prefix cache
    prefix: tuple[bytes | None, list[bytes]] | None = None  # (root, full prompt blocks' keys): Sampler._prefix
    scores: PromptScores | None = None
    results: list[types.SampledSequence | None] = field(default_factory=list)
    # target_prompt_logprobs / prompt_alt_tokens_k (set up when admitted, filled chunk by chunk):
    # its wanted cells (index among the listed cells, row, token id), their logprobs, and the draws
    cells: tuple[np.ndarray, np.ndarray, np.ndarray] | None = None
    cell_values: np.ndarray | None = None
    alt_tokens: np.ndarray | None = None
    alt_logprobs: np.ndarray | None = None

    def start_extras(self) -> None:
        job, rows = self.job, len(self.job.prompt) - 1
        if job.target_prompt_logprobs is not None and self.cells is None:
            self.cells = job.target_prompt_logprobs.wanted()
            self.cell_values = np.zeros(len(job.target_prompt_logprobs.ids), dtype=np.float32)
        if job.prompt_alt_tokens_k and self.alt_tokens is None:
            self.alt_tokens = np.zeros((rows, job.prompt_alt_tokens_k), dtype=np.int64)
            self.alt_logprobs = np.zeros((rows, job.prompt_alt_tokens_k), dtype=np.float32)

    def ask(self, a: int, n: int) -> tuple[PromptAsk, int, int]:
        """Its extra prompt work in the chunk of positions a .. a + n (and the slice of its cells in it)."""
        lo = hi = 0
        rows = ids = np.zeros(0, dtype=np.int64)
        if self.cells is not None:
            _, cell_rows, cell_ids = self.cells
            lo, hi = np.searchsorted(cell_rows, a), np.searchsorted(cell_rows, a + n)
            rows, ids = cell_rows[lo:hi] - a, cell_ids[lo:hi]
        alt_rows = max(0, min(a + n, len(self.prompt) - 1) - a)
        p = self.params
        return PromptAsk(rows, ids, self.job.prompt_alt_tokens_k, alt_rows, p.temperature, p.seed, a), int(lo), int(hi)

    def took(self, a: int, lo: int, hi: int, cells: np.ndarray, alts: tuple[np.ndarray, np.ndarray] | None) -> None:
        """The answer to `ask(a, …)`."""
        if self.cells is not None and self.cell_values is not None:
            self.cell_values[self.cells[0][lo:hi]] = cells
        if alts is not None and self.alt_tokens is not None and self.alt_logprobs is not None:
            self.alt_tokens[a : a + len(alts[0])] = alts[0]
            self.alt_logprobs[a : a + len(alts[1])] = alts[1]

    @property
    def slot(self) -> int:
        return -1 if self.adapter is None or self.adapter.slot is None else self.adapter.slot

    @property
    def ready(self) -> bool:
        return self.adapter is None or self.adapter.slot is not None

    @property
    def cancelled(self) -> bool:
        return self.job.cancel is not None and self.job.cancel.is_set()

    # what the scheduler reads (scheduler.Work)
    @property
    def key(self) -> str:
        return self.job.key

    @property
    def policy(self) -> str:
        return "" if self.adapter is None else self.adapter.id

    @property
    def priority(self) -> int:
        return int(self.job.priority)

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
    """One running sample: its blocks, how many positions of them are filled, what it drew so far.
    Preempted, its KV waits in host memory under `swapped` and `blocks` is empty."""

    request: _Request
    index: int  # sample index within the request
    blocks: list[int]
    length: int  # positions in the cache; the last sampled token is not among them yet
    generator: torch.Generator | None  # None = greedy
    tokens: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    top: list[TopLogprobs] = field(default_factory=list)  # per token, when the job asked for top_logprobs
    swapped: int | None = None  # its host copy's handle while preempted
    reserve: int = 0  # blocks it takes back when resumed
    last_token_at: float = 0.0
    done: bool = False
    pool: BlockPool | None = None  # for held_blocks
    state: int = 0  # hybrid bases: its recurrent-state slot while running (state_cache.py; 0: none)
    grammar: Any = None  # its own grammar matcher (grammar.Grammars.start), from its first token
    # prefix cache: the keys of its full blocks so far (None: it caches nothing), chained from `root`
    keys: list[bytes] | None = None
    root: bytes = b""

    # scheduler.Work
    key = property(lambda self: self.request.key)
    policy = property(lambda self: self.request.policy)
    priority = property(lambda self: self.request.priority)
    arrival = property(lambda self: self.request.arrival)
    running = property(lambda self: self.swapped is None)
    decoding = True
    pending = 1
    ready = True
    preemptible = True
    held_rows = 1

    @property
    def held_blocks(self) -> int:
        assert self.pool is not None
        return self.pool.exclusive(self.blocks)

    def fit(self, free_blocks: int, free_rows: int) -> Fit:
        return Fit(1, self.reserve, 1) if self.reserve <= free_blocks and free_rows >= 1 else NO_FIT


@dataclass(eq=False)
class _Member:
    request: _Request
    index: int
    own_blocks: list[int]  # reserved at admission, past the shared prompt blocks
    own_count: int = 0  # how many (they are given back while its prompt is preempted)

    def __post_init__(self) -> None:
        self.own_count = len(self.own_blocks)


@dataclass(eq=False)
class _Group:
    """One prompt being prefilled (in chunks), serving every admitted sample with this adapter and
    prompt; its samples fork off it when its last chunk has run."""

    slot: int
    prompt: tuple[int, ...]
    blocks: list[int]  # the prompt's blocks (the last one partly filled unless the prompt fills it)
    members: list[_Member] = field(default_factory=list)
    requests: list[_Request] = field(default_factory=list)
    computed: int = 0  # prompt positions already in the cache
    score_k: int = -1  # top-k of the prompt scores its chunks compute (-1: none wanted)
    score_from: int = 1 << 62  # the first position whose next-token logprob they compute (last_n: later)
    asks: list[_Request] = field(default_factory=list)  # requests with target cells or draws (PromptAsk)
    scores: PromptScores | None = None
    swapped: int | None = None  # preempted: the host copy of its computed KV; blocks given back
    prompt_blocks: int = 0  # blocks its prompt takes (taken back when resumed)
    pool: BlockPool | None = None  # for held_blocks
    images: PromptImages | None = None  # part of the prompt's identity: other images, another prompt
    state: int = 0  # hybrid bases: the prompt's recurrent-state slot (state_cache.py; 0: none)
    state_rows: int = 0  # hybrid bases: 1, the batch row its state counts as (Sampler._state_rows)
    # prefix cache: its chain's root (None: nothing cached), its full blocks' keys, how many of them
    # are registered (or were taken from the cache), the positions it took from the cache, and the
    # salt that requests joining it must share
    root: bytes | None = None
    keys: list[bytes] = field(default_factory=list)
    registered: int = 0
    cached: int = 0
    salt: str = ""

    @property
    def has_sampler(self) -> bool:
        return any(not m.request.score_only for m in self.members)

    @property
    def sampler_members(self) -> int:
        return sum(1 for m in self.members if not m.request.score_only)

    # scheduler.Work: it holds KV (its prompt's blocks and its samples' reservations) and runs until
    # its prompt is in. Preempted, its computed KV goes to host memory and every block back to the
    # pool; resumed, it continues from that KV (no chunk is recomputed).
    key = property(lambda self: self.requests[0].key)
    policy = property(lambda self: self.requests[0].policy)
    priority = property(lambda self: min(r.priority for r in self.requests))
    arrival = property(lambda self: self.requests[0].arrival)
    running = property(lambda self: self.swapped is None)
    decoding = False
    ready = True
    preemptible = True

    @property
    def pending(self) -> int:
        return len(self.prompt) - self.computed

    @property
    def reserve(self) -> int:
        """Blocks it holds when running: its prompt's and its samples' own."""
        return self.prompt_blocks + sum(m.own_count for m in self.members)

    @property
    def held_blocks(self) -> int:
        assert self.pool is not None
        return self.pool.exclusive(self.blocks) + sum(len(m.own_blocks) for m in self.members)

    @property
    def held_rows(self) -> int:
        """Batch rows it holds: its samples' (and, on a hybrid base, its recurrent state's)."""
        return self.sampler_members + self.state_rows if self.swapped is None else 0

    def fit(self, free_blocks: int, free_rows: int) -> Fit:
        if self.swapped is None:
            return NO_FIT
        rows = self.sampler_members + self.state_rows
        return Fit(1, self.reserve, rows) if self.reserve <= free_blocks and rows <= free_rows else NO_FIT


@dataclass(eq=False)
class _Waiting:
    """A queued request as the scheduler sees it: no KV yet; `fit` asks the sampler what admitting
    more of its samples would take."""

    request: _Request
    sampler: Sampler
    running = False
    decoding = False
    preemptible = False
    held_blocks = 0
    held_rows = 0
    key = property(lambda self: self.request.key)
    policy = property(lambda self: self.request.policy)
    priority = property(lambda self: self.request.priority)
    arrival = property(lambda self: self.request.arrival)
    ready = property(lambda self: self.request.ready)

    @property
    def pending(self) -> int:
        return len(self.request.prompt) - self.sampler._hit_tokens(self.request)

    def fit(self, free_blocks: int, free_rows: int) -> Fit:
        return self.sampler._fit(self.request, free_blocks, free_rows)


class Sampler:
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
        prefix_cache: keep full KV blocks for later requests with the same prefix (kv.py; off on
        hybrid and vision bases, whose state is not all in blocks); salt_per_owner: only a request of
        the same key (owner) reads them, or joins a prompt being prefilled.

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
        self.states = StateSlots(max_batch_rows + 1) if cfg.hybrid is not None else None
        if self.states is not None and max_batch_rows < 2:
            raise ValueError("max_batch_rows must be at least 2 on a hybrid (linear-attention) base: "
                             "a prompt and its first sample each hold a recurrent state")
        self.executor = Executor(model, residency.bank, self.device, blocks_for(kv_budget_tokens, block_size) + 1,
                                 block_size, runner=residency.runner,
                                 state_slots=0 if self.states is None else self.states.num_slots,
                                 compile=compile, compile_cache_dir=compile_cache_dir)
        self.cache = self.executor.cache
        self.pool = BlockPool(self.cache.num_blocks)
        self.prefix_cache, self.salt_per_owner = prefix_cache, salt_per_owner
        self.prefix_cache_off = "" if prefix_cache else "off by setting"
        if prefix_cache and cfg.hybrid is not None:
            self.prefix_cache_off = "a hybrid base: its recurrent state is not in the KV blocks"
        elif prefix_cache and getattr(model, "vision_input", None) is not None:
            self.prefix_cache_off = "a vision base: a prompt's image features are not in its tokens"
        if prefix_cache and self.prefix_cache_off:
            self.prefix_cache = False
            log.info("prefix cache off: %s", self.prefix_cache_off)
        self._evictions_before = 0  # of pools replaced after a failed step
        self.scheduler = Scheduler(max_step_tokens, max_slowdown, step_overhead_tokens, linger_s=linger_s)
        self.stats = SamplerStats()
        self._queue: deque[_Request] = deque()
        self._lock = threading.Lock()  # guards _queue, _cancels: has_work/queued/cancel come from other threads
        self._last_adapter: dict[str, Adapter | None] = {}  # key → its latest request's adapter
        self._cancels: set[Future] = set()
        self._rows: list[_Row] = []
        self._groups: list[_Group] = []
        self._arrivals = itertools.count()
        self._handles = itertools.count(1)
        # (priority, "ttft" | "itl" | "queue", seconds), drained by `drain_latencies` for /metrics
        self._latencies: deque[tuple[int, str, float]] = deque(maxlen=100_000)  # nobody drains: keep the newest

    # --- submission and queries (any thread) ----------------------------------------------------
    def submit(self, job: SampleJob, adapter: Adapter | None, future: Future | None = None,
               arrived: float | None = None) -> SampleFuture | Future:
        """Queue a parsed job on `adapter` (None: the base), whose reference the caller took and
        the request now owns. The future's result is a SampleResponse (or, for a score-only job,
        the prompt's logprobs); a SampleFuture knows its sequence ids from the start. `arrived`:
        when the request reached the engine (time.perf_counter; default now)."""
        if future is None:
            future = SampleFuture(list(job.sequence_ids))
        arrived = time.perf_counter() if arrived is None else arrived
        req = _Request(future=future, adapter=adapter, job=job, arrival=next(self._arrivals),
                       submitted=arrived, results=[None] * (0 if job.score_only else job.num_samples))
        with self._lock:
            self._queue.append(req)
            self._last_adapter[job.key] = adapter
            self.scheduler.note_arrival(job.key, arrived)
        return future

    def hold(self) -> float:
        """Seconds the worker should wait for a protected key's next request before the next step
        (Scheduler.hold)."""
        now = time.perf_counter()
        if not self.scheduler.lingering(now):  # nobody to wait for: skip gathering the busy keys
            return 0.0
        with self._lock:
            busy = {r.key for r in self._queue}
        busy.update(r.key for r in self._rows)
        busy.update(r.key for g in self._groups for r in g.requests)
        return self.scheduler.hold(now, busy)

    def cancel(self, future: Future) -> None:
        """Stop the request behind `future` (any thread): at the next step its queued samples are
        dropped, its rows end, their KV returns to the pool and its future fails."""
        with self._lock:
            self._cancels.add(future)

    def has_work(self) -> bool:
        return bool(self._rows or self._groups or self._queue or self._cancels)

    def has_ready_work(self) -> bool:
        """Something a step would do: rows or prompts running, cancels to apply, or queued
        requests whose adapter is on the device."""
        if self._rows or self._groups or self._cancels:
            return True
        return any(r.ready or r.cancelled for r in list(self._queue))

    def waiting_adapters(self, limit: int | None = None) -> list[Adapter]:
        """Adapters that queued requests need, most urgent first (the residency manager's wants): in
        the order the scheduler will take them, so a quiet key's adapter is not loaded behind a storm.
        First of all the last adapter of each key the scheduler lets linger: a closed-loop client's
        next request is on its way, and between its requests its adapter, idle and unpinned, was the
        one slot a storm of cold adapters (every other slot read by running work) took from it."""
        served = self.scheduler.served
        lingering = self.scheduler.lingering(time.perf_counter())
        with self._lock:
            order = sorted(self._queue, key=lambda r: (r.priority, served.get(r.key, 0.0), r.arrival))
            queued = {r.key for r in order}
            self._last_adapter = {k: a for k, a in self._last_adapter.items() if k in lingering or k in queued}
            recent = [a for k, a in self._last_adapter.items() if k in lingering]
        out = [a for a in recent + [r.adapter for r in order] if a is not None]
        return list(dict.fromkeys(out))[:limit]

    def fail_waiting(self, adapter: Adapter, exc: BaseException) -> None:
        """Its adapter could not be loaded: fail the queued requests that wait for it."""
        with self._lock:
            failed = [r for r in self._queue if r.adapter is adapter and r.admitted == 0]
            self._queue = deque(r for r in self._queue if r not in failed)
        for r in failed:
            self._fail(r, exc)

    def queue_index(self, future: Future) -> tuple[int | None, int]:
        """(its index among the requests not yet admitted, or None; how many of those there are)."""
        with self._lock:
            waiting = [r.future for r in self._queue if r.admitted == 0]
        return (waiting.index(future) if future in waiting else None), len(waiting)

    def totals(self) -> dict[str, dict[str, float]]:
        """Cumulative figures of the step forwards (for /metrics)."""
        s = self.stats
        return {"seconds": {"step": s.step_s},
                "tokens": {"decode": float(s.decode_tokens), "prefill": float(s.prefill_tokens)},
                "forwards": {"step": float(s.forwards)},
                "rows": {"preempted": float(s.preempted), "resumed": float(s.resumed)},
                "prefix_cache": {"hit_tokens": float(s.prefix_hit_tokens), "query_tokens": float(s.prefix_query_tokens),
                                 "evictions": float(self._evictions_before + self.pool.evictions),
                                 "blocks": float(self.pool.cached)}}

    def drain_latencies(self) -> list[tuple[int, str, float]]:
        out = []
        while self._latencies:  # popleft is atomic: the worker may append meanwhile
            out.append(self._latencies.popleft())
        return out

    @property
    def kv_blocks_in_use(self) -> int:
        return self.pool.used

    def measure_costs(self, sizes: tuple[int, ...] = (1, 2, 4, 8, 16, 32, 64, 128), repeats: int = 4) -> StepCost:
        """The scheduler's cost model on this machine, from base-model steps on scratch blocks: decode
        batches of `sizes` rows, each with its rows' token draw (temperature 1, the costliest); one
        prefill step of 64 tokens as 8 chunks against one of 64 (a chunk's own cost); what a row's
        adapter, and a second adapter in the step, add (LoRA's own products and their launches). Each
        figure is the least of `repeats` rounds with every probe taken in turn (`kernels.fastest`: a
        spell of noise on a shared machine then slows one run of each probe, not every run of one,
        which would bend the curve or the differences). Measured at start-up: the weights' read against
        the compute, and where BLAS changes method, are the machine's. The unit is the marginal cost of
        a token at the largest size."""
        sizes = tuple(k for k in sizes if k <= self.max_batch_rows) or (1,)
        bs = self.block_size
        # a 64-token prompt, and the same as 8 chunks of their own, where the pool holds them
        chunks = max(1, min(8, (self.pool.available - 2 - blocks_for(64, bs)) // blocks_for(8, bs)))
        chunk_len = max(1, min(8, (self.pool.available - 2) * bs // (2 * chunks)))
        probe = chunks * chunk_len
        held: list[int] = []

        def alloc(n: int) -> list[int]:
            blocks = self.pool.alloc(n)
            held.extend(blocks)
            return blocks

        position = min(2 * self.block_size - 1, 31)  # decode rows a little into their context
        vocab = self.vocab_size

        def step(batch: StepBatch, draws: int = 0) -> Callable[[], None]:
            logits = torch.randn(draws, vocab)
            params = (torch.ones(draws), torch.zeros(draws, dtype=torch.long), torch.ones(draws))
            gens = [torch.Generator().manual_seed(i) for i in range(draws)]

            def run() -> None:
                self.executor.step(batch)
                if draws:
                    choose_tokens(logits, *params, uniforms(gens))

            return run

        def decode(k: int, slots: list[int] | None = None) -> Callable[[], None]:
            return step(StepBatch([0] * k, [position] * k, [1] * k, slots or [-1] * k, [row_blocks] * k,
                                  list(range(k))), k)

        try:
            row_blocks = alloc(2)
            runs = {("rows", k): decode(k) for k in sizes}
            runs["one"] = step(StepBatch([0] * probe, list(range(probe)), [probe], [-1], [alloc(blocks_for(probe, bs))], [0]))
            tables = [alloc(blocks_for(chunk_len, bs)) for _ in range(chunks)]
            runs["chunked"] = step(StepBatch([0] * probe, [p for _ in range(chunks) for p in range(chunk_len)],
                                             [chunk_len] * chunks, [-1] * chunks, tables, [chunks - 1]))
            # LoRA, where it matters for a protected key: one row on an adapter against one on the base,
            # and what each further adapter adds, as a busy step meets them: 2 rows on each of up to 8
            # adapters spread over the bank (past a few rows the mixed products run per adapter) against
            # the same rows on one (empty bank slots probed as adapters; on one rank only: under tensor
            # parallelism each rank's bank is its own)
            bank, spread = self.residency.bank, 0
            lora = self.executor.runner is None and bank.num_slots > 0
            if lora:
                runs["base row"], runs["adapter row"] = decode(1), decode(1, [0])
                if (spread := min(8, bank.num_slots, self.max_batch_rows // 2)) > 1:
                    slots = [round(i * (bank.num_slots - 1) / (spread - 1)) for i in range(spread)]
                    runs["spread"] = decode(2 * spread, [s for s in slots for _ in range(2)])
                    runs["together"] = decode(2 * spread, [0] * 2 * spread)
            with bank.probing(range(bank.num_slots), min(16, bank.max_rank)) if lora else contextlib.nullcontext():
                measured = dict(zip(runs, kernels.fastest(list(runs.values()), repeats), strict=True))
        finally:
            self.pool.release(held)
        times = [measured["rows", k] for k in sizes]
        one, chunked = measured["one"], measured["chunked"]
        first = measured["adapter row"] - measured["base row"] if lora else 0.0
        each = (measured["spread"] - measured["together"]) / (spread - 1) if lora and spread > 1 else 0.0
        if len(sizes) < 2:
            return StepCost.linear(0.0)
        unit = max((times[-1] - times[-2]) / (sizes[-1] - sizes[-2]), 1e-9)
        costs = [max(t / unit, 1.0) for t in times]
        for i in range(1, len(costs)):  # noise must not make a bigger batch cheaper
            costs[i] = max(costs[i], costs[i - 1] + 1e-3)
        return StepCost(sizes, tuple(costs), chunk=max(0.0, (chunked - one) / unit / max(1, chunks - 1)),
                        adapter_first=max(0.0, first / unit), adapter_each=max(0.0, each / unit), unit_s=unit)

    def measure_chunk_tokens(self, start: int, limit: int = 8192, share: float = 0.9) -> int:
        """The default of the tokens a step with prompt chunks may run: prompt throughput of one chunk
        (a prompt's start, on the base) at start, 2 × start, … tokens while a doubling still gains
        1 / share (else the smaller size already reaches `share` of the larger) and the KV pool holds
        both (up to `limit`); the fewest that reach `share` of the best. Each doubling times the two
        sizes in turn (`kernels.fastest`, two rounds after a warm-up): a spell of noise on one of
        them stopped the doubling early (a start-up here chose 128, where 256 prefills a long prompt
        1.3× faster)."""
        bs, rates = self.block_size, {}
        n = max(1, start)
        while 2 * n <= limit and blocks_for(n, bs) + blocks_for(2 * n, bs) <= self.pool.available:
            held = [self.pool.alloc(blocks_for(k, bs)) for k in (n, 2 * n)]
            try:
                small, big = kernels.fastest([
                    functools.partial(self.executor.step, StepBatch([0] * k, list(range(k)), [k], [-1], [blocks], [0]))
                    for k, blocks in zip((n, 2 * n), held, strict=True)], rounds=2)
            finally:
                for blocks in held:
                    self.pool.release(blocks)
            rates[n] = max(rates.get(n, 0.0), n / max(small, 1e-9))
            rates[2 * n] = 2 * n / max(big, 1e-9)
            if rates[2 * n] * share < rates[n]:
                break
            n *= 2
        best = max(rates.values(), default=0.0)
        return next((k for k, r in sorted(rates.items()) if r >= share * best), start)

    # --- the worker's step ----------------------------------------------------------------------
    def step(self) -> None:
        """One scheduled step: cancels, plan, preempt, admit, one forward, tokens."""
        self.stats.steps += 1
        try:
            self._drop_cancelled()
            waiting = self._start_waiting()
            items: list[Any] = [*self._rows, *self._groups, *waiting]
            if not items:
                return
            free_rows = self.max_batch_rows - sum(1 for r in self._rows if r.running) - \
                sum(g.held_rows for g in self._groups)
            plan = self.scheduler.plan(items, self.pool.available, free_rows, time.perf_counter())
            for victim in plan.preempt:
                self._swap_out(victim)
            runs: list[tuple[_Row | _Group, int]] = []
            seen: set[int] = set()
            for item, n in plan.run:
                if isinstance(item, _Waiting):
                    group = self._admit(item.request, plan.admit[id(item)])
                    if group is None or id(group) in seen:
                        continue
                    item, n = group, min(n, group.pending)
                elif isinstance(item, _Row | _Group) and item.swapped is not None:
                    self._swap_in(item)
                if id(item) not in seen and n > 0:
                    seen.add(id(item))
                    runs.append((item, n))
            if runs:
                self._run(runs)
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

    def _start_waiting(self) -> list[_Waiting]:
        """Queued requests the scheduler may admit (their futures now running); drops the ones
        whose future was cancelled before they started."""
        out = []
        with self._lock:
            for req in list(self._queue):
                if not req.started and (req.ready or req.future.cancelled()):
                    if not req.future.set_running_or_notify_cancel():  # cancelled while queued
                        self._queue.remove(req)
                        self._close(req)
                        continue
                    req.started = True
                if not req.ready:
                    continue
                out.append(_Waiting(req, self))
        return out

    def _drop_cancelled(self) -> None:
        """Everything of the jobs cancelled since the last step stops now; their blocks go back."""
        with self._lock:
            cancels, self._cancels = self._cancels, set()
            queued = [r for r in self._queue if r.cancelled or r.future in cancels]
            for r in queued:
                self._queue.remove(r)
        gone = {id(r): r for r in queued}
        for r in self._rows:
            if r.request.cancelled or r.request.future in cancels:
                gone[id(r.request)] = r.request
        for g in self._groups:
            for r in g.requests:
                if r.cancelled or r.future in cancels:
                    gone[id(r)] = r
        if not gone:
            return
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

    # --- admission -------------------------------------------------------------------------------
    def _joinable(self, req: _Request) -> _Group | None:
        """A prompt row still being prefilled that `req` can share (same adapter and prompt, and the
        prompt scores it wants are or will be computed)."""
        if not self.dedupe_prompts:
            return None
        for g in self._groups:
            if g.swapped is None and g.slot == req.slot and g.prompt == req.prompt and g.images == req.job.images and \
                    g.salt == self._salt(req) and (
                    g.computed == 0 or (not req.job.prompt_extras and (not req.wants_scores or (
                        g.score_k >= req.topk_prompt_logprobs and g.score_from <= req.job.score_from)))):
                return g
        return None

    def _fit(self, req: _Request, free_blocks: int, free_rows: int) -> Fit:
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

    # --- the prefix cache (kv.py) ----------------------------------------------------------------
    def _salt(self, req: _Request) -> str:
        """Whose cached blocks (and prompts being prefilled) a request may read: its owner's only."""
        return req.key if self.prefix_cache and self.salt_per_owner else ""

    def _prefix(self, req: _Request) -> tuple[bytes | None, list[bytes]]:
        """The root of its blocks' key chain (None: it neither reads nor fills the cache) and the keys
        of its prompt's full blocks. The root names the base (one per sampler), the adapter revision's
        content — a catalog revision by its content key, any other read-only adapter by its id (its
        weights never change); a trainable adapter's weights change with every step, so it caches
        nothing — and the salt."""
        if req.prefix is None:
            a, root = req.adapter, None
            if self.prefix_cache and req.job.images is None and (a is None or not a.trainable):
                content = "base" if a is None else (
                    a.source.key if a.source is not None and a.source.key.startswith(REVISION_KEY_PREFIX)
                    else "adapter:" + a.id)
                root = cache_root("mint-kv-1", content, self._salt(req))
            keys = [] if root is None else block_keys(root, req.prompt, self.block_size)
            req.prefix = (root, keys)
        return req.prefix

    def _usable_blocks(self, req: _Request) -> int:
        """How many leading full prompt blocks a new prompt row for `req` may take from the cache:
        the last prompt position is always computed (its logits draw the first token), and so is every
        position whose prompt logprob, targets or draws it asks for."""
        limit = len(req.prompt) - 1
        if req.job.prompt_extras:
            limit = 0
        elif req.wants_scores:
            limit = min(limit, max(0, req.job.score_from))
        return limit // self.block_size

    def _hit_tokens(self, req: _Request) -> int:
        """Prompt positions a new prompt row for `req` would take from the cache now."""
        if not self.prefix_cache:
            return 0
        _, keys = self._prefix(req)
        return len(self.pool.lookup(keys[: self._usable_blocks(req)])) * self.block_size

    def _register(self, item: _Row | _Group) -> None:
        """Keep the full blocks it has computed since the last call under their keys."""
        bs = self.block_size
        if isinstance(item, _Group):
            if item.root is None:
                return
            upto = min(item.computed // bs, len(item.keys))
            for k in range(item.registered, upto):
                self.pool.register(item.keys[k], item.blocks[k])
            item.registered = max(item.registered, upto)
        elif item.keys is not None and item.length % bs == 0 and item.length // bs == len(item.keys) + 1:
            k, n = len(item.keys), len(item.request.prompt)
            seq = item.request.prompt[k * bs :] + tuple(item.tokens[max(0, k * bs - n) :])
            item.keys += block_keys(item.keys[-1] if item.keys else item.root, seq[:bs], bs)
            self.pool.register(item.keys[k], item.blocks[k])

    def _admit(self, req: _Request, fit: Fit) -> _Group | None:
        """Reserve `fit`'s samples of `req` on a (new or shared) prompt row; None if none fit."""
        if fit.take == 0:
            return None
        bs, n = self.block_size, len(req.prompt)
        group = self._joinable(req)
        if group is None:
            root, keys = self._prefix(req)
            hit = self.pool.lookup(keys[: self._usable_blocks(req)])
            self.pool.share(hit)  # before the alloc, which may evict kept blocks
            blocks = hit + self.pool.alloc(blocks_for(n, bs) - len(hit))
            group = _Group(req.slot, req.prompt, blocks, images=req.job.images, prompt_blocks=len(blocks), pool=self.pool,
                           state_rows=self._state_rows(1), root=root, keys=keys, registered=len(hit),
                           cached=len(hit) * bs, computed=len(hit) * bs, salt=self._salt(req))
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
            group.members.append(_Member(req, 0, []))
            req.admitted = 1
        else:
            own = blocks_for(n + req.params.max_tokens, bs) - n // bs
            for _ in range(fit.take):
                first = 1 if n % bs and not group.has_sampler else 0
                group.members.append(_Member(req, req.admitted, self.pool.alloc(own - first)))
                req.admitted += 1
        if req.admitted >= req.num_samples or req.score_only:
            with self._lock:
                self._queue.remove(req)
        return group

    # --- preemption ------------------------------------------------------------------------------
    def _swap_out(self, item: _Row | _Group) -> None:
        """Preempt: its KV (a prompt: the part computed so far) to host memory, its blocks back."""
        handle = next(self._handles)
        if isinstance(item, _Row):
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

    def _swap_in(self, item: _Row | _Group) -> None:
        assert item.swapped is not None
        if self.states is not None:
            item.state = self.states.alloc()
        if isinstance(item, _Row):
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

    def _state_of(self, item: _Row | _Group) -> int | None:
        return None if self.states is None else item.state

    def _release_state(self, item: _Row | _Group) -> None:
        if self.states is not None:
            self.states.release(item.state)
            item.state = 0

    # --- the forward -----------------------------------------------------------------------------
    def _run(self, runs: list[tuple[_Row | _Group, int]]) -> None:
        t0 = time.perf_counter()
        batch = StepBatch([], [], [], [], [], [])
        decoding: list[_Row] = []
        finishing: list[_Group] = []  # prompts whose last chunk runs now
        # (group, first position, its asks' requests with their cells' slices) per scoring entry
        scored: list[tuple[_Group, int, list[tuple[_Request, int, int]]]] = []
        decode_tokens = prefill_tokens = 0
        for item, n in runs:
            seg = len(batch.lengths)
            if isinstance(item, _Row):
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
            if isinstance(item, _Group):
                item.computed += n
            else:
                item.length += 1
            if self.prefix_cache:
                self._register(item)
        # logits rows: decode rows first (in run order), then finishing prompts, as laid out above
        logits_of_seg = dict(zip(batch.logits_at, range(len(batch.logits_at)), strict=True))
        rows, index = list(decoding), [logits_of_seg[i] for i, (it, _) in enumerate(runs) if isinstance(it, _Row)]
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

    def _fork(self, g: _Group, copies: list[tuple[int, int]]) -> list[_Row]:
        """Turn the group's sampling members into rows over the prompt's blocks.

        Full prompt blocks are shared (reference-counted); the partly filled last one goes to the
        first sample and is copied for the others, whose own next tokens would otherwise collide in it.
        """
        bs, n = self.block_size, len(g.prompt)
        full, partial = g.blocks[: n // bs], g.blocks[n // bs :]
        rows: list[_Row] = []
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
            row = _Row(m.request, m.index, blocks, n, gen, pool=self.pool)
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
    def _advance(self, rows: list[_Row], logits: torch.Tensor) -> None:
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

    def _finish(self, row: _Row, reason: types.StopReason) -> None:
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

    def _respond(self, req: _Request) -> None:
        if req.score_only:
            assert req.scores is not None
            result: Any = [None if math.isnan(x) else x for x in req.scores.logprobs.tolist()]
        else:
            s = None if req.scores is None else req.scores.last(req.job.prompt_logprobs_last_n)
            job = req.job
            alt = None
            if req.alt_tokens is not None and req.alt_logprobs is not None:
                alt = types.PromptAltTokens(tokens=types.TensorData.from_numpy(req.alt_tokens),
                                            logprobs=types.TensorData.from_numpy(req.alt_logprobs))
            result = types.SampleResponse(
                sequences=list(req.results),  # type: ignore[arg-type]  # all filled by now
                prompt_logprobs_np=s.logprobs if s is not None and job.prompt_logprobs else None,
                topk_prompt_logprobs_np=s.topk(req.topk_prompt_logprobs) if s is not None and req.topk_prompt_logprobs else None,
                prompt_cache_hit_tokens=len(req.prompt) if req.cache_hit else req.cache_hit_tokens,
                target_prompt_logprobs=None if job.target_prompt_logprobs is None or req.cell_values is None
                else job.target_prompt_logprobs.response(req.cell_values),
                prompt_alt_tokens=alt,
            )
        self._close(req)
        req.future.set_result(result)

    def _close(self, req: _Request) -> None:
        """Drop the request's adapter pin and reference (once)."""
        if not req.closed:
            req.closed = True
            self.scheduler.note_end(req.key, time.perf_counter())
            if req.adapter is not None:
                if req.pinned:
                    self.residency.unpin(req.adapter)
                self.residency.unref(req.adapter)

    def _fail(self, req: _Request, exc: BaseException) -> None:
        self._close(req)
        if not req.future.done():
            req.future.set_exception(exc)

    def _fail_in_flight(self, exc: BaseException) -> None:
        failed = {r.request for r in self._rows}
        failed.update(req for g in self._groups for req in g.requests)
        with self._lock:
            self._queue = deque(r for r in self._queue if r not in failed)
        for req in failed:
            self._fail(req, exc)
        # Everything holding blocks was in flight, so the whole pool is free again.
        self.executor.drop_swapped([x.swapped for x in (*self._rows, *self._groups) if x.swapped is not None])
        self._rows, self._groups = [], []
        self._evictions_before += self.pool.evictions
        self.pool = BlockPool(self.cache.num_blocks)
        if self.states is not None:
            self.states = StateSlots(self.states.num_slots)


__all__ = ["Priority", "SampleCancelled", "SampleFuture", "Sampler", "SamplerStats"]
