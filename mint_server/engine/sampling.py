"""Continuous-batching sampler: many requests, many LoRA adapters, one ragged forward per step.

The engine worker hands it parsed `SampleJob`s (`submit`, see `preparer.Preparer`) and calls `step`
whenever `has_ready_work()`. Each step
  1. drops cancelled work — every cancel that arrived since the last step, at once — and frees its KV;
  2. asks the `Scheduler` (pure policy) for a step plan over everything it holds: running decode rows
     (one token each), prompts being prefilled (a chunk each), preempted rows and queued requests
     waiting for KV. The plan fills the step's token budget by priority class and fair share across
     keys, admits what fits and names the rows to preempt;
  3. swaps the preempted rows' KV out to host memory (they resume later from exactly that KV),
     admits — reserves KV for prompt + max_tokens of each admitted sample, so an admitted sequence
     never waits for memory — and swaps resumed rows back in;
  4. runs the plan as one forward over a ragged batch: decode rows and prefill chunks together, each
     row on its own adapter, and draws their tokens.
Steps 3 and 4, and everything holding KV, are the `Batcher`'s (batcher.py, where prompt sharing, the
prefix cache and preemption are told); the `Sampler` adds the requests' intake: the queue, cancels
from any thread, and what the engine and /metrics ask of it. The scheduler's cost model is measured
by step_costs.py.

Requests whose adapter is still loading wait without holding anyone up (cold loads are the
residency manager's scheduled work, `waiting_adapters` its wants). A request holds a reference on its
adapter from submit until it finishes (the adapter is not dropped, even if released meanwhile).
"""

from __future__ import annotations

import itertools
import threading
import time
from collections import deque
from concurrent.futures import Future
from typing import Any

from mint_server.engine.batcher import Batcher
from mint_server.engine.jobs import SampleJob
from mint_server.engine.residency import Adapter
from mint_server.engine.sample_request import (
    PromptGroup,
    SampleFuture,
    SampleRequest,
    SampleRow,
    WaitingRequest,
)


class Sampler(Batcher):
    def __init__(self, *args: Any, **kwargs: Any) -> None:
        """Batcher's arguments (batcher.Batcher.__init__)."""
        super().__init__(*args, **kwargs)
        self._queue: deque[SampleRequest] = deque()
        self._lock = threading.Lock()  # guards _queue, _cancels: has_work/queued/cancel come from other threads
        self._last_adapter: dict[str, Adapter | None] = {}  # key → its latest request's adapter
        self._cancels: set[Future] = set()
        self._arrivals = itertools.count()

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
        req = SampleRequest(future=future, adapter=adapter, job=job, arrival=next(self._arrivals),
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
            runs: list[tuple[SampleRow | PromptGroup, int]] = []
            seen: set[int] = set()
            for item, n in plan.run:
                if isinstance(item, WaitingRequest):
                    req = item.request
                    group = self._admit(req, plan.admit[id(item)])
                    if group is not None and (req.admitted >= req.num_samples or req.score_only):
                        with self._lock:
                            self._queue.remove(req)
                    if group is None or id(group) in seen:
                        continue
                    item, n = group, min(n, group.pending)
                elif isinstance(item, SampleRow | PromptGroup) and item.swapped is not None:
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

    def _start_waiting(self) -> list[WaitingRequest]:
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
                out.append(WaitingRequest(req, self))
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
        if gone:
            self._drop(gone)

    def _fail_in_flight(self, exc: BaseException) -> None:
        """Fail what holds KV (Batcher._fail_in_flight), also where it is still queued for more samples."""
        failed = self._in_flight()
        with self._lock:
            self._queue = deque(r for r in self._queue if r not in failed)
        super()._fail_in_flight(exc)
