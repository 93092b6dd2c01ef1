"""Recorded sampling info (Tinker's `record_stability_info`), looked up later by sequence id.

A sampling client created with `record_stability_info=True` asks the server to remember, for every
sequence it samples, what the sampler saw: the prompt, the sampled tokens and their logprobs. A
later `stable_reinforce` training request names those sequences (`SampledSequence.sequence_id`, via
the datum's provenance spans) and reads the sampling logprobs back from here, so the client never
has to send them. The SDK documents the records as expiring after inactivity: each record lives
`ttl_s` past its last write or read, and the store is bounded in records and in tokens held, oldest
use evicted first.

Thread-safe: the sampler writes from the engine worker, readers may be anywhere.
"""

from __future__ import annotations

import threading
import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True)
class SamplingRecord:
    prompt_tokens: np.ndarray  # int32 [P]; shared between the samples of one request
    tokens: np.ndarray  # int32 [N], the sampled tokens
    logprobs: np.ndarray  # float32 [N], the sampler's logprobs of `tokens` (raw log_softmax, T = 1)
    adapter_id: str | None  # None = base model

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_tokens) + len(self.tokens)


class SamplingRecords:
    def __init__(
        self,
        ttl_s: float = 3600.0,
        max_records: int = 1_000_000,
        max_tokens: int = 200_000_000,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.ttl_s, self.max_records, self.max_tokens = ttl_s, max_records, max_tokens
        self._clock = clock
        # sequence id → (record, expiry); ordered by last use, so expired and evicted ones sit first.
        self._items: OrderedDict[str, tuple[SamplingRecord, float]] = OrderedDict()
        self._tokens = 0
        self._lock = threading.Lock()

    def put(self, sequence_id: str, record: SamplingRecord) -> None:
        with self._lock:
            old = self._items.pop(sequence_id, None)
            if old is not None:
                self._tokens -= old[0].num_tokens
            self._items[sequence_id] = (record, self._clock() + self.ttl_s)
            self._tokens += record.num_tokens
            self._evict()

    def get_record(self, sequence_id: str) -> SamplingRecord | None:
        """The record, or None when unknown or expired; a hit extends its life by ttl_s."""
        with self._lock:
            self._evict()
            item = self._items.get(sequence_id)
            if item is None:
                return None
            self._items[sequence_id] = (item[0], self._clock() + self.ttl_s)
            self._items.move_to_end(sequence_id)
            return item[0]

    def get(self, sequence_id: str) -> list[float] | None:
        """The sampling logprobs of the sequence's sampled tokens, or None when unknown or expired."""
        record = self.get_record(sequence_id)
        return None if record is None else record.logprobs.tolist()

    def __len__(self) -> int:
        with self._lock:
            self._evict()
            return len(self._items)

    def _evict(self) -> None:
        now = self._clock()
        while self._items:
            sid, (record, expiry) = next(iter(self._items.items()))
            over = len(self._items) > self.max_records or self._tokens > self.max_tokens
            if expiry > now and not over:
                return
            del self._items[sid]
            self._tokens -= record.num_tokens
