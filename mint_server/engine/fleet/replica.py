"""One replica of the fleet: a LocalEngine inside a Ray actor, and how this process reaches Ray."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import os
import threading
import uuid
from collections.abc import AsyncIterator
from concurrent.futures import Future
from typing import Any

from mint_server.engine.interface import (
    AdapterLost,
    NotSupportedError,
    TopLogprobs,
)
from mint_server.engine.jobs import (
    Job,
    SampleJob,
)
from mint_server.engine.settings import EngineSettings
from mint_server.engine.values import SampleCancelled


def ray_module() -> Any:
    try:
        import ray
    except ImportError:  # pragma: no cover - depends on the install
        raise NotSupportedError("the fleet needs Ray: pip install 'mint-server[fleet]'") from None
    return ray


class ReplicaActor:
    """One LocalEngine in a Ray actor. `incarnation` changes when Ray restarts it: adapters created by
    an earlier incarnation are gone, and calls naming one fail with AdapterLost."""

    def __init__(self, index: int, model_dir: str, base_model: str, settings: EngineSettings,
                 device: str | None, dtype: str | None, threads: int, core: int | None) -> None:
        import torch

        from mint_server.engine.local import LocalEngine

        if core is not None and hasattr(os, "sched_setaffinity"):
            pin_process({core % (os.cpu_count() or 1)})
        torch.set_num_threads(max(1, threads))
        self.index, self.incarnation = index, uuid.uuid4().hex[:12]
        self._running: dict[str, tuple[Future, threading.Event | None]] = {}  # request id → its sample
        self.cancels = 0  # cancels that reached a sample running here
        self._pause_after: int | None = None  # pause(after_tokens): streamed tokens left before the pause
        self.engine = LocalEngine(model_dir, base_model=base_model, device=device,
                                  dtype=getattr(torch, dtype) if dtype else None, settings=settings)

    def hello(self) -> tuple[str, int, int]:
        """Its incarnation, process id and capacity (adapter slots on its device)."""
        return self.incarnation, os.getpid(), self.engine.settings.device_slots

    def _check(self, incarnation: str | None) -> None:
        if incarnation is not None and incarnation != self.incarnation:
            raise AdapterLost(f"replica {self.index} restarted; the training adapter's live state is gone")

    def _localize(self, job: Job) -> Job:
        """What the router could not send: the tokenizer's decode for stop strings."""
        if isinstance(job, SampleJob) and job.params.stop.strings and job.params.stop.decode is None:
            stop = dataclasses.replace(job.params.stop, decode=self.engine.tokenizer.decode)
            job = dataclasses.replace(job, params=dataclasses.replace(job.params, stop=stop))
        return job

    async def run(self, incarnation: str | None, job: Job, request_id: str | None = None) -> Any:
        self._check(incarnation)
        local = self.engine.submit(self._localize(job))
        if request_id is not None:
            self._running[request_id] = (local, None)
        try:
            return await asyncio.wrap_future(local)
        finally:
            if request_id is not None:
                self._running.pop(request_id, None)

    async def run_batch(self, batch: list[tuple[str, SampleJob]]) -> AsyncIterator[list[tuple[str, Any, Any]]]:
        """Many samples in one Ray call (the router's batch for this replica), answered as a Ray
        streaming generator: lists of (request id, error or None, result), each list what finished
        since the last yield. One call and a few yields instead of a task per request: Ray's
        per-task work (driver, raylet, this worker) no longer grows with the request count."""
        loop = asyncio.get_running_loop()
        finished: asyncio.Queue[tuple[str, Future | BaseException]] = asyncio.Queue()
        for request_id, job in batch:
            try:
                local = self.engine.submit(self._localize(job))
            except Exception as e:  # noqa: BLE001 - e.g. shutting down: that request's answer
                finished.put_nowait((request_id, e))
                continue
            self._running[request_id] = (local, None)
            local.add_done_callback(
                lambda f, rid=request_id: loop.call_soon_threadsafe(finished.put_nowait, (rid, f)))
        left = len(batch)
        while left:
            items = [await finished.get()]
            while not finished.empty():
                items.append(finished.get_nowait())
            answers = []
            for request_id, outcome in items:
                self._running.pop(request_id, None)
                if isinstance(outcome, BaseException):
                    answers.append((request_id, outcome, None))
                elif outcome.cancelled():
                    answers.append((request_id, SampleCancelled(), None))
                elif (error := outcome.exception()) is not None:
                    answers.append((request_id, error, None))
                else:
                    answers.append((request_id, None, outcome.result()))
            left -= len(answers)
            yield answers

    async def stream(self, incarnation: str | None, request_id: str, job: SampleJob) -> AsyncIterator[Any]:
        """A sample as a Ray streaming generator: ("tokens", [(index, token, logprob, top), ...]) batches as
        the sampler draws them (what arrived since the last yield), then ("result", response). Closing
        the generator early (ray.cancel) or `cancel(request_id)` sets the job's cancel event: the
        sampler drops its rows and frees their KV at its next step."""
        self._check(incarnation)
        loop = asyncio.get_running_loop()
        drawn: asyncio.Queue[tuple[int, int, float, TopLogprobs | None] | None] = asyncio.Queue()
        cancel = threading.Event()

        def on_token(index: int, token: int, logprob: float, top: TopLogprobs | None) -> None:  # worker thread
            loop.call_soon_threadsafe(drawn.put_nowait, (index, token, logprob, top))
            if self._pause_after is not None:
                self._pause_after -= 1
                if self._pause_after <= 0:
                    self._pause_after = None
                    self.engine.pause()  # after this step: see pause()

        local = self.engine.submit(self._localize(job).streaming(on_token, cancel))
        self._running[request_id] = (local, cancel)
        # Scheduled from the worker thread after its last on_token, so it arrives after every token.
        local.add_done_callback(lambda _f: loop.call_soon_threadsafe(drawn.put_nowait, None))
        try:
            finished = False
            while not finished:
                batch = [await drawn.get()]
                while not drawn.empty():
                    batch.append(drawn.get_nowait())
                if batch[-1] is None:
                    finished = True
                    batch.pop()
                if batch:
                    yield ("tokens", batch)
            yield ("result", local.result())
        finally:
            self._running.pop(request_id, None)
            if not local.done():
                cancel.set()

    def cancel(self, request_id: str) -> bool:
        """Stop a sample started by `run` or `stream` (its KV is freed); False if it is not running here."""
        local, cancel = self._running.get(request_id, (None, None))
        if local is None:
            return False
        self.cancels += 1
        if cancel is not None:
            cancel.set()
        else:
            self.engine.cancel(local)
        return True

    async def call(self, incarnation: str | None, name: str, *args: Any) -> Any:
        self._check(incarnation)
        return await asyncio.wrap_future(getattr(self.engine, name)(*args))

    def report(self) -> dict[str, Any]:
        r = self.engine.report()
        r["queue_depth"] = self.engine.queue_depth()
        r["incarnation"] = self.incarnation
        r["cancels"] = self.cancels
        return r

    def status(self) -> dict[str, Any]:
        """What report() tells without draining anything: for tests and operators."""
        import torch

        return {"kv_blocks_in_use": self.engine.sampler.kv_blocks_in_use, "queue_depth": self.engine.queue_depth(),
                "cancels": self.cancels, "incarnation": self.incarnation, "sampler": self.engine.sampler.totals(),
                "torch_threads": torch.get_num_threads(),
                "tp_ranks": self.engine.runner.tp.world}

    def pause(self, after_tokens: int | None = None) -> None:
        """Hold the engine's worker before its next turn, or, with `after_tokens`, once that many
        tokens of streamed samples have been drawn here (a gate that lands mid-stream)."""
        if after_tokens is None:
            self.engine.pause()
        else:
            self._pause_after = after_tokens

    def resume(self) -> None:
        self._pause_after = None
        self.engine.resume()

    def shutdown(self, drain: bool) -> None:
        self.engine.shutdown(drain)


def pin_process(cores: set[int]) -> None:
    """Pin every thread of this process (Ray's own ones too: sched_setaffinity(0) pins only the
    calling thread); threads started later inherit it."""
    for tid in os.listdir("/proc/self/task") if os.path.isdir("/proc/self/task") else ["0"]:
        with contextlib.suppress(OSError):  # the thread ended meanwhile
            os.sched_setaffinity(int(tid), cores)


