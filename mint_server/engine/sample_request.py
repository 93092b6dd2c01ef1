"""A sample request as the sampler holds it, and the pieces of work it becomes.

`SampleRequest` is one submitted `SampleJob` with its adapter, its progress and what its answer
collects; its samples are admitted into a `PromptGroup` (one prompt being prefilled, shared by every
sample and identical request that joins it) and fork off it into `SampleRow`s (one running sample
each). `PromptGroup`, `SampleRow` and `WaitingRequest` (a queued request) are the scheduler's
`Work` items (scheduler.py): what they hold, what they still run and what admitting them takes.
The batcher (batcher.py) moves them through the KV pool.
"""

from __future__ import annotations

import math
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any, Protocol

import numpy as np
import torch
from tinker import types

from mint_server.engine.jobs import SampleJob
from mint_server.engine.kv import BlockPool
from mint_server.engine.residency import Adapter
from mint_server.engine.sampler_ops import PromptAsk, PromptScores
from mint_server.engine.scheduler import NO_FIT, Fit
from mint_server.engine.values import TopLogprobs
from mint_server.model.images import PromptImages


class SampleFuture(Future):
    """A Future for a SampleResponse that knows its sequence ids from the start.

    Tinker returns the ids in the submit response, before any token is sampled.
    """

    def __init__(self, sequence_ids: list[str]) -> None:
        super().__init__()
        self.sequence_ids = sequence_ids


@dataclass(eq=False)
class SampleRequest:
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
    prefix: tuple[bytes | None, list[bytes]] | None = None  # (root, full prompt blocks' keys): PrefixKeys.prefix
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

    def response(self) -> Any:
        """Its answer, once every sample finished (a score-only job: once its prompt ran): a
        SampleResponse, or for a score-only job the prompt's logprobs."""
        if self.score_only:
            assert self.scores is not None
            return [None if math.isnan(x) else x for x in self.scores.logprobs.tolist()]
        s = None if self.scores is None else self.scores.last(self.job.prompt_logprobs_last_n)
        job = self.job
        alt = None
        if self.alt_tokens is not None and self.alt_logprobs is not None:
            alt = types.PromptAltTokens(tokens=types.TensorData.from_numpy(self.alt_tokens),
                                        logprobs=types.TensorData.from_numpy(self.alt_logprobs))
        return types.SampleResponse(
            sequences=list(self.results),  # type: ignore[arg-type]  # all filled by now
            prompt_logprobs_np=s.logprobs if s is not None and job.prompt_logprobs else None,
            topk_prompt_logprobs_np=s.topk(self.topk_prompt_logprobs) if s is not None and self.topk_prompt_logprobs else None,
            prompt_cache_hit_tokens=len(self.prompt) if self.cache_hit else self.cache_hit_tokens,
            target_prompt_logprobs=None if job.target_prompt_logprobs is None or self.cell_values is None
            else job.target_prompt_logprobs.response(self.cell_values),
            prompt_alt_tokens=alt,
        )


@dataclass(eq=False)
class SampleRow:
    """One running sample: its blocks, how many positions of them are filled, what it drew so far.
    Preempted, its KV waits in host memory under `swapped` and `blocks` is empty."""

    request: SampleRequest
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
class PromptMember:
    request: SampleRequest
    index: int
    own_blocks: list[int]  # reserved at admission, past the shared prompt blocks
    own_count: int = 0  # how many (they are given back while its prompt is preempted)

    def __post_init__(self) -> None:
        self.own_count = len(self.own_blocks)


@dataclass(eq=False)
class PromptGroup:
    """One prompt being prefilled (in chunks), serving every admitted sample with this adapter and
    prompt; its samples fork off it when its last chunk has run."""

    slot: int
    prompt: tuple[int, ...]
    blocks: list[int]  # the prompt's blocks (the last one partly filled unless the prompt fills it)
    members: list[PromptMember] = field(default_factory=list)
    requests: list[SampleRequest] = field(default_factory=list)
    computed: int = 0  # prompt positions already in the cache
    score_k: int = -1  # top-k of the prompt scores its chunks compute (-1: none wanted)
    score_from: int = 1 << 62  # the first position whose next-token logprob they compute (last_n: later)
    asks: list[SampleRequest] = field(default_factory=list)  # requests with target cells or draws (PromptAsk)
    scores: PromptScores | None = None
    swapped: int | None = None  # preempted: the host copy of its computed KV; blocks given back
    prompt_blocks: int = 0  # blocks its prompt takes (taken back when resumed)
    pool: BlockPool | None = None  # for held_blocks
    images: PromptImages | None = None  # part of the prompt's identity: other images, another prompt
    state: int = 0  # hybrid bases: the prompt's recurrent-state slot (state_cache.py; 0: none)
    state_rows: int = 0  # hybrid bases: 1, the batch row its state counts as (Batcher._state_rows)
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


class Admission(Protocol):
    """What a waiting request asks of the batcher that would admit it (batcher.Batcher)."""

    def hit_tokens(self, req: SampleRequest) -> int: ...

    def admission_fit(self, req: SampleRequest, free_blocks: int, free_rows: int) -> Fit: ...


@dataclass(eq=False)
class WaitingRequest:
    """A queued request as the scheduler sees it: no KV yet; `fit` asks the batcher what admitting
    more of its samples would take."""

    request: SampleRequest
    admission: Admission
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
        return len(self.request.prompt) - self.admission.hit_tokens(self.request)

    def fit(self, free_blocks: int, free_rows: int) -> Fit:
        return self.admission.admission_fit(self.request, free_blocks, free_rows)
