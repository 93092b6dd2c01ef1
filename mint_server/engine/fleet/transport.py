"""How sample requests and their tokens cross between the router and the replicas, on an event loop
of their own: read-only samples queued for a replica's next batch leave as one Ray call, streamed
samples' tokens reach the caller's on_token as they arrive, and their cancel events are watched and
told to the replica."""

from __future__ import annotations

import asyncio
import logging
import threading
from collections import Counter
from collections.abc import Callable
from typing import Any

from mint_server.engine.fleet.routing import ReplicaView, TrackedRequest
from mint_server.engine.interface import EngineError
from mint_server.engine.jobs import SampleJob

log = logging.getLogger(__name__)
CANCEL_POLL_S = 0.02  # how often the loop looks at a streamed request's cancel event
Answer = Callable[[Any, BaseException | None], None]  # (result, error): how a request is answered


def cancel_remote(tracked: TrackedRequest) -> None:
    """Tell the replica running it to stop it."""
    if tracked.replica is not None:
        tracked.replica.handle.cancel.remote(tracked.request_id)  # fire and forget: gone is fine


class SampleTransport:
    def __init__(self) -> None:
        self._lock = threading.Lock()
        # Read-only samples waiting for their replica's next batch: (request id, job, answer).
        self._outbox: dict[int, list[tuple[str, SampleJob, Answer]]] = {}
        # Streamed samples are consumed here (Ray streaming generators, awaited on one event loop).
        self._loop = asyncio.new_event_loop()
        self._watched: set[TrackedRequest] = set()  # streams whose cancel event the loop looks at
        self._watcher: asyncio.Future | None = None
        self._loop_thread = threading.Thread(target=self._loop.run_forever, daemon=True, name="mint-fleet-streams")
        self._loop_thread.start()

    def stop(self) -> None:
        self._loop.call_soon_threadsafe(self._loop.stop)

    def enqueue(self, replica: ReplicaView, request_id: str, job: SampleJob, answer: Answer) -> None:
        """Queue a sample for the replica's next batch; the first into an empty outbox schedules
        the send on the loop, so a burst of submits leaves as one Ray call."""
        with self._lock:
            box = self._outbox.setdefault(replica.index, [])
            box.append((request_id, job, answer))
            first = len(box) == 1
        if first:
            self._loop.call_soon_threadsafe(self._send_batch, replica)

    def _send_batch(self, replica: ReplicaView) -> None:
        with self._lock:
            batch = self._outbox.pop(replica.index, [])
        if len(batch) == 1:  # alone: a plain task answers sooner than a streaming generator
            (request_id, job, answer), = batch
            ref = replica.handle.run.remote(None, job, request_id)
            ref.future().add_done_callback(
                lambda f: answer(None, f.exception()) if f.exception() is not None else answer(f.result(), None))
        elif batch:
            stream = replica.handle.run_batch.remote([(rid, job) for rid, job, _ in batch])
            asyncio.ensure_future(self._answer_batch(stream, {rid: answer for rid, _, answer in batch}))

    @staticmethod
    async def _answer_batch(stream: Any, waiting: dict[str, Answer]) -> None:
        try:
            async for ref in stream:
                for request_id, error, result in await ref:
                    waiting.pop(request_id)(result, error)
        except BaseException as e:  # noqa: BLE001 - the replica died: every unanswered request sees it
            for answer in waiting.values():
                answer(None, e)
            return
        for answer in waiting.values():  # not expected: the replica answers every request it got
            answer(None, EngineError("the replica ended a batch without answering this request"))

    def stream(self, stream: Any, tracked: TrackedRequest, answer: Answer) -> None:
        """Consume a replica's streamed sample (a Ray streaming generator) on the loop."""
        asyncio.run_coroutine_threadsafe(self._consume(stream, tracked, answer), self._loop)

    async def _consume(self, stream: Any, tracked: TrackedRequest, answer: Answer) -> None:
        """Hand a replica's streamed tokens to the caller's on_token, then answer. A retry on another
        replica replays the same tokens (same job, same seed): only unseen ones go on."""
        seen: Counter[int] = Counter()
        if tracked.cancel is not None:
            self._watched.add(tracked)
            if self._watcher is None or self._watcher.done():
                self._watcher = asyncio.ensure_future(self._watch_cancels())
        result: Any = None
        error: BaseException | None = None
        try:
            async for ref in stream:
                kind, value = await ref
                if kind == "result":
                    result = value
                    continue
                for index, token, logprob, top in value:
                    seen[index] += 1
                    if seen[index] <= tracked.delivered[index]:
                        continue
                    tracked.delivered[index] += 1
                    if tracked.on_token is not None:
                        try:
                            tracked.on_token(index, token, logprob, top)
                        except Exception:  # a listener's bug must not fail the request (as LocalEngine)
                            log.exception("token callback failed")
        except BaseException as e:  # noqa: BLE001 - delivered to the caller, or retried
            error = e
        finally:
            self._watched.discard(tracked)
        answer(result, error)

    async def _watch_cancels(self) -> None:
        """Streams' cancel events are threading.Events (no callback): one task on the loop looks at
        all of them every CANCEL_POLL_S and tells the replica of each one set."""
        while self._watched:
            await asyncio.sleep(CANCEL_POLL_S)
            for tracked in [t for t in self._watched if t.cancel is not None and t.cancel.is_set()]:
                self._watched.discard(tracked)
                cancel_remote(tracked)
