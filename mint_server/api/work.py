"""Work: the operations' handle on the engine. Each accepted request runs as a future registered here
(with metrics, answered by request id, holding its admission ticket until it ends); the engine
future it waits on is noted, for queue-state answers and cancels.

Engine work happens in the engine's own threads and comes back through `asyncio.wrap_future`."""

from __future__ import annotations

import asyncio
import time
from concurrent.futures import Future
from contextvars import ContextVar
from typing import Any, TypeVar

from tinker import types

from mint_server.api.admission import Ticket
from mint_server.api.http.metrics import Metrics
from mint_server.api.state.futures import FutureStore
from mint_server.engine.interface import Engine, EngineError

T = TypeVar("T")
# The engine future the current operation waits on, for queue-state answers (see Work.queue_position).
_ENGINE_WAIT: ContextVar[list[Future[Any] | None] | None] = ContextVar("mint_engine_wait", default=None)


def waits_on_engine(holder: list[Future[Any] | None]) -> None:
    """Called at the start of an operation's coroutine: its engine calls are noted in `holder`."""
    _ENGINE_WAIT.set(holder)


class Work:
    def __init__(self, engine: Engine, futures: FutureStore, dedupe: dict[tuple[str, int], types.UntypedAPIFuture],
                 metrics: Metrics) -> None:  # fmt: skip
        self.engine = engine
        self.futures = futures
        self.dedupe = dedupe  # Stores.dedupe: a registered answer is what a resubmission gets
        self.metrics = metrics
        self.engine_waits: dict[str, list[Future[Any] | None]] = {}  # request id → its engine future

    def register(
        self,
        ticket: Ticket,
        op: str,
        future: asyncio.Future[Any],
        *,
        scope: str | None = None,
        seq_id: int | None = None,
        sample_sequence_ids: list[str] | None = None,
        engine_wait: list[Future[Any] | None] | None = None,
    ) -> types.UntypedAPIFuture:
        """Track `future`, the work of the request admitted with `ticket`, under a new request id, with
        metrics, and answer the submit call. The ticket is held until the future is done.

        `engine_wait` is the holder the operation's coroutine passed to `waits_on_engine`."""
        request_id = self.futures.add(ticket.owner, op, future)
        ticket.hold(future)
        if engine_wait is not None:
            self.engine_waits[request_id] = engine_wait
        start = time.monotonic()
        queue = "sampling" if op == "sample" else "training"
        self.metrics.queue_depth.labels(queue).inc()

        def finished(f: asyncio.Future[Any]) -> None:
            self.engine_waits.pop(request_id, None)
            self.metrics.queue_depth.labels(queue).dec()
            elapsed = time.monotonic() - start
            (self.metrics.sample_latency if op == "sample" else self.metrics.op_latency.labels(op)).observe(elapsed)
            error = None if f.cancelled() else f.exception()
            if f.cancelled() or error is not None:
                category = "user" if isinstance(error, EngineError) else "server"
                self.metrics.requests_failed.labels(op, category).inc()

        future.add_done_callback(finished)
        answer = types.UntypedAPIFuture(
            request_id=request_id,
            model_id=scope if scope and op != "sample" else None,
            sample_sequence_ids=sample_sequence_ids,
        )
        if scope is not None and seq_id is not None:
            self.dedupe[(scope, seq_id)] = answer
        return answer

    def spawn(self, coro: Any) -> asyncio.Future[Any]:
        """Run an operation that needs no ordering; the returned task is owned by the FutureStore."""
        return asyncio.ensure_future(coro)

    @staticmethod
    async def call(future: Future[T]) -> T:
        holder = _ENGINE_WAIT.get()
        if holder is not None:
            holder[0] = future
        return await asyncio.wrap_future(future)

    def engine_future(self, request_id: str) -> Future[Any] | None:
        holder = self.engine_waits.get(request_id)
        return holder[0] if holder else None

    def cancel_sample(self, request_id: str, owner: str) -> None:
        """Stop a pending sample of `owner`: dropped if still queued in the engine, else its rows
        end and free their KV (a finished one is left as is)."""
        engine_future = self.engine_future(request_id)  # before the cancel's callbacks forget it
        self.futures.cancel(request_id, owner)  # checks owner and kind
        if engine_future is not None:
            self.engine.cancel(engine_future)

    def queue_position(self, request_id: str) -> tuple[int, int] | None:
        """(position, depth) while the request's engine work waits behind others; None otherwise."""
        future = self.engine_future(request_id)
        if future is None or future.done():
            return None
        return self.engine.queue_position(future)
