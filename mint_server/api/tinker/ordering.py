"""Per-model ordering: a training model's operations run one at a time, in seq_id order.

The SDK numbers a TrainingClient's requests 1, 2, 3… but may deliver them out of order (the chunks
of one forward_backward are POSTed concurrently). An operation waits here until every lower seq_id
has run. Operations without a seq_id (mindlab-toolkit's reverse-KL call, unload) run after whatever
is ready when they arrive. One operation at a time per model keeps each client's view of its
adapter exactly sequential; different models still run concurrently in the engine.
"""

from __future__ import annotations

import asyncio
from collections import OrderedDict, deque
from collections.abc import Awaitable, Callable
from typing import Any

Thunk = Callable[[], Awaitable[Any]]
# A client may run ahead of a missing request by a bounded amount; more is a bug or an attack.
MAX_SEQ_AHEAD = 100_000
# Refusals remembered per model, so that a resubmission of a refused request (the SDK retries
# some statuses with the same seq_id) is answered with the same error, not "already used".
MAX_REFUSALS_KEPT = 256


class SeqError(ValueError):
    """A seq_id that can never run (already used, or absurdly far ahead)."""


class Sequencer:
    def __init__(self, next_seq: int = 1) -> None:
        self.next_seq = next_seq
        self._by_seq: dict[int, tuple[Thunk, asyncio.Future[Any]]] = {}
        self._unordered: deque[tuple[Thunk, asyncio.Future[Any]]] = deque()
        self._skipped: set[int] = set()
        self._refused: OrderedDict[int, BaseException] = OrderedDict()
        self._worker: asyncio.Task[None] | None = None
        self._closed: str | None = None

    def depth(self) -> int:
        return len(self._by_seq) + len(self._unordered)

    def check(self, seq_id: int) -> None:
        if seq_id < self.next_seq or seq_id in self._by_seq or seq_id in self._skipped:
            raise SeqError(f"seq_id {seq_id} was already used for this model")
        if seq_id > self.next_seq + MAX_SEQ_AHEAD:
            raise SeqError(f"seq_id {seq_id} is too far ahead of the next expected ({self.next_seq})")

    def submit(self, seq_id: int | None, thunk: Thunk) -> asyncio.Future[Any]:
        future: asyncio.Future[Any] = asyncio.get_running_loop().create_future()
        if self._closed is not None:
            future.set_exception(RuntimeError(self._closed))
            return future
        if seq_id is None:
            self._unordered.append((thunk, future))
        else:
            self.check(seq_id)
            self._by_seq[seq_id] = (thunk, future)
        self._kick()
        return future

    def skip(self, seq_id: int) -> None:
        """A request with this seq_id was rejected: later ones must not wait for it."""
        if seq_id >= self.next_seq and seq_id not in self._by_seq:
            self._skipped.add(seq_id)
            self._kick()

    def refuse(self, seq_id: int, error: BaseException) -> None:
        """The request with this seq_id was refused with `error` before it was queued: later ones
        must not wait for it (`skip`), and a resubmission of it gets `error` again (`refusal`)."""
        self.skip(seq_id)
        self._refused[seq_id] = error
        self._refused.move_to_end(seq_id)
        while len(self._refused) > MAX_REFUSALS_KEPT:
            self._refused.popitem(last=False)

    def refusal(self, seq_id: int) -> BaseException | None:
        """The error a request with this seq_id was refused with, if it was (and still remembered)."""
        return self._refused.get(seq_id)

    def drop_unreachable(self, reason: str) -> None:
        """Shutdown: fail ops waiting behind a seq_id that never arrived; ready ones still run."""
        seq = self.next_seq
        while seq in self._by_seq or seq in self._skipped:
            seq += 1
        for s in [s for s in self._by_seq if s > seq]:
            _thunk, fut = self._by_seq.pop(s)
            if not fut.done():
                fut.set_exception(RuntimeError(reason))

    def close(self, reason: str) -> None:
        """Fail everything not yet started (the session ended); the running one finishes."""
        self._closed = reason
        for _thunk, fut in [*self._by_seq.values(), *self._unordered]:
            if not fut.done():
                fut.set_exception(RuntimeError(reason))
        self._by_seq.clear()
        self._unordered.clear()

    async def drained(self) -> None:
        """Wait until the operation running now (if any) has finished."""
        if self._worker is not None and not self._worker.done():
            await asyncio.wait({self._worker})

    def _kick(self) -> None:
        if self._worker is None or self._worker.done():
            self._worker = asyncio.get_running_loop().create_task(self._run())

    def _next_ready(self) -> tuple[Thunk, asyncio.Future[Any]] | None:
        while self.next_seq in self._skipped:
            self._skipped.discard(self.next_seq)
            self.next_seq += 1
        if self.next_seq in self._by_seq:
            item = self._by_seq.pop(self.next_seq)
            self.next_seq += 1
            return item
        if self._unordered:
            return self._unordered.popleft()
        return None

    async def _run(self) -> None:
        while (item := self._next_ready()) is not None:
            thunk, future = item
            if future.done():
                continue
            try:
                result = await thunk()
            except asyncio.CancelledError:
                future.cancel()
                raise
            except Exception as e:  # the op failed; the client sees it via retrieve_future
                if not future.done():
                    future.set_exception(e)
            else:
                if not future.done():
                    future.set_result(result)
