"""FleetEngine: the Engine facade over the replicas, and its dispatch (see the package docstring)."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import hashlib
import itertools
import logging
import tempfile
import threading
import time
import uuid
from collections import Counter
from collections.abc import Callable, Sequence
from concurrent.futures import Future, InvalidStateError, ThreadPoolExecutor
from pathlib import Path
from typing import Any

import numpy as np
from tinker import types

from mint_server.engine.fleet.metrics import FleetCollector, add_cumulative
from mint_server.engine.fleet.replica import ReplicaActor, ray_module
from mint_server.engine.fleet.routing import Placement, ReplicaView, Router, TrackedRequest
from mint_server.engine.grammar import Grammars
from mint_server.engine.interface import (
    AdapterLost,
    EngineError,
    NotSupportedError,
)
from mint_server.engine.jobs import (
    AdapterRef,
    CustomJob,
    Job,
    JobParsing,
    OptimJob,
    Preparer,
    ReverseKLJob,
    SampleJob,
    TrainJob,
    image_processing,
    image_tokens,
)
from mint_server.engine.losses import LOSSES
from mint_server.engine.records import SamplingRecord, SamplingRecords
from mint_server.engine.sample_request import SampleFuture
from mint_server.engine.settings import EngineLimits, EngineSettings, FleetSettings
from mint_server.engine.values import AdapterSource, EngineReport
from mint_server.fsutil import write_content_dir
from mint_server.model.config import ModelConfig

log = logging.getLogger(__name__)
CANCEL_POLL_S = 0.02  # how often the router looks at a streamed request's cancel event


class FleetEngine(JobParsing):
    """The Engine protocol over Ray replicas (see the module docstring)."""

    def __init__(self, model_dir: str | Path, base_model: str, settings: EngineSettings | None = None,
                 fleet: FleetSettings | None = None, device: str | None = None, dtype: str | None = None) -> None:
        from transformers import AutoTokenizer

        ray = ray_module()
        self.settings = s = settings or EngineSettings()
        self.fleet = f = fleet or FleetSettings()
        s.check()
        f.check()
        self.model_dir, self.base_model = Path(model_dir), base_model
        cfg = ModelConfig.from_hf_dir(self.model_dir)
        self.limits = EngineLimits.of(s, base_model=base_model, arch=cfg.architecture, vocab_size=cfg.vocab_size,
                                      model_context=cfg.max_position_embeddings, loss_fns=frozenset(LOSSES),
                                      image_tokens=image_tokens(cfg))
        self.tokenizer = AutoTokenizer.from_pretrained(self.model_dir)
        # Sampling records live here, where results pass through, so training on any replica can
        # read the logprobs of a sequence sampled on another (stable_reinforce provenance).
        self.records = SamplingRecords(ttl_s=s.records_ttl_s)
        # Grammars here only check requests; each replica compiles them again for its own sampler.
        grammars = Grammars(self.tokenizer, cfg.vocab_size, cfg.eos_token_ids, self.limits.max_grammar_chars)
        self.prepare = Preparer(self.limits, cfg.eos_token_ids, self.tokenizer.decode, self.records, grammars,
                                images=image_processing(cfg, self.model_dir))

        self._started_ray = False
        if not ray.is_initialized():
            if f.ray_address:
                ray.init(address=f.ray_address, include_dashboard=False, log_to_driver=False)
            else:
                ray.init(include_dashboard=False, log_to_driver=False,
                         object_store_memory=f.local_object_store_mb * 1024 * 1024)
                self._started_ray = True
        actor_cls = ray.remote(ReplicaActor)
        self._replicas: list[ReplicaView] = []
        for i in range(f.replicas):
            replica_settings = s if s.store_dir is None else dataclasses.replace(
                s, store_dir=Path(s.store_dir) / f"replica-{i}")  # page dirs: one per replica
            if s.threads is None:  # as many torch threads as the CPUs Ray reserves it, not the node's cores
                replica_settings = dataclasses.replace(replica_settings, threads=int(max(1, f.cpus_per_replica)))
            handle = actor_cls.options(  # a tensor-parallel replica reserves its resources once per rank
                num_cpus=f.cpus_per_replica * s.tp, num_gpus=f.gpus_per_replica * s.tp, max_restarts=f.max_restarts,
                max_task_retries=0, max_concurrency=1000, name=None,
            ).remote(i, str(self.model_dir), base_model, replica_settings, device, dtype,
                     int(max(1, f.cpus_per_replica)), i if f.pin_cores else None)
            self._replicas.append(ReplicaView(i, handle))
        for r in self._replicas:
            r.incarnation, r.pid, r.capacity = ray.get(r.handle.hello.remote())
        self.router = Router(self._replicas, f.spill_inflight)
        self._lock = threading.Lock()
        self._adapters: dict[str, Placement] = {}
        self._ids = itertools.count(1)
        self._request_ids = itertools.count(1)  # sample requests (a cancel names one on its replica)
        self._tag = uuid.uuid4().hex[:6]
        self._materialized: dict[str, Path] = {}  # source key → its PEFT dir under the shared dir
        # Catalog revisions are written out here for the replicas: beside the page dirs, in the data
        # dir that every node mounts (docs/fleet.md); a private temp dir when there is no store dir.
        self._shared = (Path(s.store_dir).parent / "fleet-adapters" if s.store_dir is not None
                        else Path(tempfile.mkdtemp(prefix="mint-fleet-")))
        self._shared.mkdir(parents=True, exist_ok=True)
        self._pool = ThreadPoolExecutor(4, thread_name_prefix="mint-fleet")
        self._tracked: dict[Future, TrackedRequest] = {}  # sample futures in flight → their request
        # Read-only samples waiting for their replica's next batch: (request id, job, answer).
        self._outbox: dict[int, list[tuple[str, SampleJob, Callable[[Any, BaseException | None], None]]]] = {}
        # Streamed samples are consumed here (Ray streaming generators, awaited on one event loop).
        self._loop = asyncio.new_event_loop()
        self._watched: set[TrackedRequest] = set()  # streams whose cancel event the loop looks at
        self._watcher: asyncio.Future | None = None
        self._loop_thread = threading.Thread(target=self._loop.run_forever, daemon=True, name="mint-fleet-streams")
        self._loop_thread.start()
        self.routed: Counter[tuple[int, str]] = Counter()  # (replica, decision) → requests
        self._accepting = True

    # --- limits ---------------------------------------------------------------------------------
    @property
    def vocab_size(self) -> int:
        return self.limits.vocab_size

    @property
    def max_context(self) -> int:
        return self.limits.max_context

    @property
    def arch(self) -> str:
        return self.limits.arch

    @property
    def loss_fns(self) -> frozenset[str]:
        return self.limits.loss_fns

    @property
    def replicas(self) -> int:
        return len(self._replicas)

    def replica_views(self) -> list[ReplicaView]:
        """The router's record of each replica (up, in flight, last report): what metrics read."""
        return list(self._replicas)

    # --- placement of training adapters and portable sources -----------------------------------
    def _placement(self, fleet_id: str) -> Placement:
        with self._lock:
            p = self._adapters.get(fleet_id)
        if p is None:
            raise EngineError(f"unknown adapter {fleet_id!r}")
        r = self._replicas[p.replica]
        if p.incarnation != r.incarnation:
            raise AdapterLost(f"adapter {fleet_id!r}: replica {p.replica} died and was replaced; "
                              "its live state is gone (retry: the model resumes from its last saved state)")
        return p

    def _place(self, replica: int, local_id: str) -> str:
        fleet_id = f"fa-{self._tag}-{next(self._ids)}"
        with self._lock:
            self._adapters[fleet_id] = Placement(replica, local_id, self._replicas[replica].incarnation)
        return fleet_id

    def _portable(self, ref: AdapterRef) -> AdapterRef:
        """A source every replica can read. A catalog revision's `read` (verified blob reads; the
        closure holds this process's catalog and cannot travel) runs here, once per key, into a PEFT
        dir under the shared dir that every node mounts."""
        if not isinstance(ref, AdapterSource) or ref.read is None:
            return ref
        with self._lock:
            path = self._materialized.get(ref.key)
        if path is None:
            path = self._shared / hashlib.sha256(ref.key.encode()).hexdigest()[:32]
            if not (path / "adapter_config.json").exists():
                files = ref.read()

                def fill(d: Path) -> None:
                    for name, data in files.items():
                        (d / name).write_bytes(data)

                write_content_dir(path, fill)  # another thread or node may write the same content first
            with self._lock:
                self._materialized[ref.key] = path
        return AdapterSource(ref.key, peft_dir=path)

    def _needs_materialize(self, ref: AdapterRef) -> bool:
        return isinstance(ref, AdapterSource) and ref.read is not None and ref.key not in self._materialized

    # --- submit ---------------------------------------------------------------------------------
    def submit(self, job: Job) -> Future:
        if not self._accepting:
            raise EngineError("engine is shutting down")
        if isinstance(job, SampleJob):
            out: Future = Future() if job.score_only else SampleFuture(list(job.sequence_ids))
            tracked = TrackedRequest(f"{self._tag}-{next(self._request_ids)}", job.on_token, job.cancel)
            with self._lock:
                self._tracked[out] = tracked
            out.add_done_callback(self._untrack)
            if isinstance(job.adapter, str):  # sampling a training adapter: where it lives
                p = self._placement(job.adapter)
                self._dispatch(out, p.replica, "pinned", p.incarnation, job.on(p.local_id), None, tracked=tracked)
            elif self._needs_materialize(job.adapter):
                self._pool.submit(self._guard, out, lambda: self._sample(out, job, tracked, 0, None))
            else:
                self._sample(out, job, tracked, 0, None)
            return out
        if isinstance(job, TrainJob | OptimJob | CustomJob):
            p = self._placement(job.adapter_id or "")
            out = Future()
            self._dispatch(out, p.replica, "pinned", p.incarnation, job.on(p.local_id), None)
            return out
        if isinstance(job, ReverseKLJob):
            p = self._placement(job.adapter_id or "")
            reference = job.reference
            if isinstance(reference, str):
                ref_p = self._placement(reference)
                if ref_p.replica != p.replica:
                    raise NotSupportedError("reference: a training adapter on another replica cannot be the "
                                            "reference; save it and pass its checkpoint")
                reference = ref_p.local_id
            out = Future()

            def go() -> None:
                moved = dataclasses.replace(job, adapter_id=p.local_id, reference=self._portable(reference))
                self._dispatch(out, p.replica, "pinned", p.incarnation, moved, None)

            self._pool.submit(self._guard, out, go) if self._needs_materialize(reference) else go()
            return out
        raise TypeError(f"not a job: {type(job).__name__}")

    def _untrack(self, out: Future) -> None:
        with self._lock:
            self._tracked.pop(out, None)

    def _sample(self, out: Future, job: SampleJob, tracked: TrackedRequest, attempt: int, failed: int | None) -> None:
        if out.done():  # cancelled before it was dispatched
            return
        portable = job.on(self._portable(job.adapter))
        if isinstance(job.adapter, AdapterSource):
            replica, decision = self.router.route(job.adapter.key, exclude=failed)
        else:
            replica, decision = self.router.least_loaded(failed), "base" if failed is None else "retry"

        def retry(dead: int) -> bool:
            if attempt >= self.fleet.sample_retries or tracked.cancelled:
                return False
            self._pool.submit(self._guard, out, lambda: self._sample(out, job, tracked, attempt + 1, dead))
            return True

        self._dispatch(out, replica.index, decision, None, portable, retry, record=job if job.record else None,
                       tracked=tracked)

    def _dispatch(self, out: Future, index: int, decision: str, incarnation: str | None, job: Job,
                  retry: Callable[[int], bool] | None, record: SampleJob | None = None,
                  tracked: TrackedRequest | None = None) -> None:
        replica = self._replicas[index]
        with self._lock:
            self.routed[(index, decision)] += 1
            replica.inflight += 1
        if tracked is None:
            ref = replica.handle.run.remote(incarnation, job)
        else:
            tracked.replica = replica
            wire = _wire(job)  # type: ignore[arg-type]  # a SampleJob, as tracked says
            if tracked.streamed:
                stream = replica.handle.stream.remote(incarnation, tracked.request_id, wire)
                asyncio.run_coroutine_threadsafe(self._consume(out, replica, stream, tracked, retry, record),
                                                 self._loop)
                return
            if incarnation is None:  # a read-only sample: it goes in the replica's next batch
                self._enqueue(replica, tracked.request_id, wire,
                              lambda result, error: self._finish(out, replica, result, error, retry, record))
                return
            ref = replica.handle.run.remote(incarnation, wire, tracked.request_id)

        def done(f: Future) -> None:
            error = f.exception()
            self._finish(out, replica, None if error else f.result(), error, retry, record)

        ref.future().add_done_callback(done)

    def _enqueue(self, replica: ReplicaView, request_id: str, job: SampleJob,
                 answer: Callable[[Any, BaseException | None], None]) -> None:
        """Queue a sample for the replica's next batch; the first into an empty outbox schedules
        the send on the router's loop, so a burst of submits leaves as one Ray call."""
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
    async def _answer_batch(stream: Any, waiting: dict[str, Callable[[Any, BaseException | None], None]]) -> None:
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

    async def _consume(self, out: Future, replica: ReplicaView, stream: Any, tracked: TrackedRequest,
                       retry: Callable[[int], bool] | None, record: SampleJob | None) -> None:
        """Hand a replica's streamed tokens to the caller's on_token, then finish `out`. A retry on
        another replica replays the same tokens (same job, same seed): only unseen ones go on."""
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
        self._finish(out, replica, result, error, retry, record)

    async def _watch_cancels(self) -> None:
        """Streams' cancel events are threading.Events (no callback): one task on the router's loop
        looks at all of them every CANCEL_POLL_S and tells the replica of each one set."""
        while self._watched:
            await asyncio.sleep(CANCEL_POLL_S)
            for tracked in [t for t in self._watched if t.cancel is not None and t.cancel.is_set()]:
                self._watched.discard(tracked)
                self._cancel_remote(tracked)

    @staticmethod
    def _cancel_remote(tracked: TrackedRequest) -> None:
        if tracked.replica is not None:
            tracked.replica.handle.cancel.remote(tracked.request_id)  # fire and forget: gone is fine

    def _finish(self, out: Future, replica: ReplicaView, result: Any, error: BaseException | None,
                retry: Callable[[int], bool] | None, record: SampleJob | None) -> None:
        with self._lock:
            replica.inflight -= 1
        if error is not None:
            error = self._unwrap(error)
            if self._is_replica_death(error):
                self._replica_down(replica)
                if retry is not None and not out.done() and retry(replica.index):
                    return
                error = AdapterLost(f"replica {replica.index} died while running this request; retry it"
                                    + ("" if retry is not None else
                                       " (the model resumes from its last saved state)"))
            _settle(out, error=error)
            return
        if record is not None and isinstance(result, types.SampleResponse):
            self._keep_records(record, result)
        _settle(out, result=result)

    def _keep_records(self, job: SampleJob, response: types.SampleResponse) -> None:
        prompt = np.asarray(job.prompt, dtype=np.int32)
        key = job.adapter.key if isinstance(job.adapter, AdapterSource) else job.adapter
        for seq in response.sequences:
            if seq.sequence_id is not None and seq.logprobs is not None:
                self.records.put(seq.sequence_id, SamplingRecord(
                    prompt_tokens=prompt, tokens=np.asarray(seq.tokens, dtype=np.int32),
                    logprobs=np.asarray(seq.logprobs, dtype=np.float32), adapter_id=key))

    @staticmethod
    def _unwrap(e: BaseException) -> BaseException:
        ray = ray_module()
        if isinstance(e, ray.exceptions.RayTaskError) and e.cause is not None:
            return e.cause
        return e

    @staticmethod
    def _is_replica_death(e: BaseException) -> bool:
        ray = ray_module()
        return isinstance(e, ray.exceptions.RayActorError | ray.exceptions.ActorUnavailableError)

    def _replica_down(self, replica: ReplicaView) -> None:
        """Stop routing to it until Ray's replacement answers; then adopt its new incarnation."""
        with self._lock:
            if not replica.up:
                return
            replica.up = False
        log.warning("replica %d died; waiting for Ray to replace it", replica.index)
        threading.Thread(target=self._await_replacement, args=(replica,), daemon=True,
                         name=f"mint-fleet-probe-{replica.index}").start()

    def _await_replacement(self, replica: ReplicaView) -> None:
        ray = ray_module()
        delay = 0.1
        while self._accepting:
            try:
                incarnation, pid, _capacity = ray.get(replica.handle.hello.remote(), timeout=30)
            except Exception as e:  # noqa: BLE001 - still restarting, or gone for good
                if isinstance(e, ray.exceptions.ActorDiedError) and not getattr(e, "preempted", False) and \
                        self.fleet.max_restarts == 0:
                    return
                time.sleep(delay)
                delay = min(2.0, delay * 2)
                continue
            with self._lock:
                if incarnation != replica.incarnation:
                    replica.restarts += 1
                replica.incarnation, replica.pid, replica.up = incarnation, pid, True
            log.warning("replica %d is back (incarnation %s)", replica.index, incarnation)
            return

    @staticmethod
    def _guard(out: Future, fn: Callable[[], None]) -> None:
        try:
            fn()
        except BaseException as e:  # noqa: BLE001 - e.g. a catalog materialize that failed its check
            if not out.done():
                out.set_exception(e)

    # --- adapter ops ----------------------------------------------------------------------------
    def _call(self, index: int, incarnation: str | None, name: str, *args: Any,
              then: Callable[[Any], Any] = lambda x: x) -> Future:
        out: Future = Future()
        replica = self._replicas[index]
        with self._lock:
            replica.inflight += 1
        ref = replica.handle.call.remote(incarnation, name, *args)

        def finish(done: Future) -> None:
            with self._lock:
                replica.inflight -= 1
            try:
                result = then(done.result())
            except BaseException as e:  # noqa: BLE001
                error = self._unwrap(e)
                if self._is_replica_death(error):
                    self._replica_down(replica)
                    error = AdapterLost(f"replica {index} died during {name}; retry it")
                out.set_exception(error)
                return
            out.set_result(result)

        ref.future().add_done_callback(finish)
        return out

    def _new_home(self) -> ReplicaView:
        """Where a new training adapter goes: the up replica holding the fewest, then the least busy."""
        with self._lock:
            held = Counter(p.replica for p in self._adapters.values())
        return min(self.router.up(), key=lambda r: (held[r.index], r.inflight, r.index))

    def create_adapter(self, lora: types.LoraConfig, optimizer: str = "adamw") -> Future[str]:
        r = self._new_home()
        return self._call(r.index, None, "create_adapter", lora, optimizer,
                          then=lambda local: self._place(r.index, local))

    def release_adapter(self, adapter_id: str) -> Future[None]:
        with self._lock:
            p = self._adapters.pop(adapter_id, None)
        replica = None if p is None else self._replicas[p.replica]
        out: Future = Future()
        if p is None or replica is None or not replica.up or p.incarnation != replica.incarnation:
            out.set_result(None)  # already gone with its replica
            return out

        def finish(f: Future) -> None:
            error = f.exception()
            if error is None or isinstance(error, AdapterLost):  # died meanwhile: gone all the same
                out.set_result(None)
            else:
                out.set_exception(error)

        self._call(p.replica, p.incarnation, "release_adapter", p.local_id).add_done_callback(finish)
        return out

    def forget_source(self, key_prefix: str) -> Future[None]:
        with self._lock:
            for key in [k for k in self._materialized if k.startswith(key_prefix)]:
                del self._materialized[key]
        calls = [self._call(r.index, None, "forget_source", key_prefix) for r in self._replicas if r.up]
        return _all(calls)

    def save_state(self, adapter_id: str, dest: Path, include_optimizer: bool) -> Future[None]:
        p = self._placement(adapter_id)
        return self._call(p.replica, p.incarnation, "save_state", p.local_id, Path(dest), include_optimizer)

    def load_state(self, adapter_id: str | None, src: Path, include_optimizer: bool,
                   optimizer: str | None = None) -> Future[str]:
        if adapter_id is None:
            r = self._new_home()
            return self._call(r.index, None, "load_state", None, Path(src), include_optimizer, optimizer,
                              then=lambda local: self._place(r.index, local))
        p = self._placement(adapter_id)
        return self._call(p.replica, p.incarnation, "load_state", p.local_id, Path(src), include_optimizer,
                          then=lambda _local: adapter_id)

    def export_peft(self, adapter: AdapterRef, dest: Path) -> Future[None]:
        if isinstance(adapter, str):
            p = self._placement(adapter)
            return self._call(p.replica, p.incarnation, "export_peft", p.local_id, Path(dest))
        if isinstance(adapter, AdapterSource):
            home = self.router.route(adapter.key)[0].index
            return self._in_pool(lambda: self._call(home, None, "export_peft", self._portable(adapter), Path(dest)))
        raise EngineError("adapter: export needs an adapter, not the bare base")

    def interpolate(self, adapters: Sequence[AdapterRef], coefficients: list[float]) -> Future[str]:
        trained = [self._placement(a) for a in adapters if isinstance(a, str)]
        if len({p.replica for p in trained}) > 1:
            raise NotSupportedError("adapters: training adapters on different replicas cannot be interpolated; "
                                    "save them and interpolate their checkpoints")
        if trained:
            index, incarnation = trained[0].replica, trained[0].incarnation
        else:
            first = next((a for a in adapters if isinstance(a, AdapterSource)), None)
            index, incarnation = (self.router.route(first.key)[0].index if first else self.router.least_loaded().index), None

        def go() -> Future:
            local = [self._placement(a).local_id if isinstance(a, str) else self._portable(a) for a in adapters]
            return self._call(index, incarnation, "interpolate", local, list(coefficients),
                              then=lambda new: self._place(index, new))

        return self._in_pool(go)

    def _in_pool(self, make: Callable[[], Future]) -> Future:
        """Run `make` (which may check out catalog revisions: blocking) off the caller's thread."""
        out: Future = Future()

        def go() -> None:
            inner = make()
            inner.add_done_callback(lambda f: out.set_exception(e) if (e := f.exception()) else out.set_result(f.result()))

        self._pool.submit(self._guard, out, go)
        return out

    # --- figures --------------------------------------------------------------------------------
    def queue_depth(self) -> int:
        return sum(r.inflight for r in self._replicas)

    def cancel(self, future: Future) -> None:
        """The caller stops waiting, and the replica running the sample stops it (its KV is freed)."""
        with self._lock:
            tracked = self._tracked.get(future)
        future.cancel()
        if tracked is not None:
            tracked.cancel_requested = True
            self._cancel_remote(tracked)

    def queue_position(self, future: Future) -> tuple[int, int] | None:
        """Replicas keep their own queues: no per-request position crosses the router."""
        return None

    def report(self) -> EngineReport:
        """The replicas' figures summed, in LocalEngine.report's shape; per-replica ones kept for
        the fleet's own families. A replica that does not answer within 2 s keeps its last report.
        Cumulative counts (loads, evictions, sampler totals) carry over a replica's restart."""
        ray = ray_module()
        refs = [(r, r.handle.report.remote()) for r in self._replicas if r.up]
        for r, ref in refs:
            try:
                fresh = ray.get(ref, timeout=2)
            except Exception:  # noqa: BLE001 - a dying replica: its figures are stale, not fatal
                continue
            if r.report and r.report.get("incarnation") != fresh["incarnation"]:
                add_cumulative(r.retired, r.report)  # what the dead incarnation had counted
            r.report = fresh
            r.step_count += len(fresh["step_seconds"])
            r.step_sum += sum(fresh["step_seconds"])
        total: dict[str, Any] = {"resident": Counter(), "loads": Counter(), "evictions": Counter(),
                                 "load_seconds": [], "step_seconds": [], "waiting_for_adapter": 0,
                                 "kv_blocks_in_use": 0, "sampler": {}, "latencies": []}
        for r in self._replicas:
            rep = r.report
            add_cumulative(total, r.retired)
            if not rep:
                continue
            add_cumulative(total, rep)
            total["resident"].update(rep["resident"])
            if r.up:
                total["waiting_for_adapter"] += rep["waiting_for_adapter"]
                total["kv_blocks_in_use"] += rep["kv_blocks_in_use"]
            total["load_seconds"] += rep["load_seconds"]
            total["step_seconds"] += rep["step_seconds"]
            total["latencies"] += rep.get("latencies", [])
            rep["load_seconds"], rep["step_seconds"], rep["latencies"] = [], [], []  # handed over once
        total.setdefault("served", {})
        total.setdefault("step_tokens", {})
        total["calibration"] = next((dict(r.report.get("calibration", {})) for r in self._replicas if r.report), {})
        return {k: dict(v) if isinstance(v, Counter) else v for k, v in total.items()}  # type: ignore[return-value]

    def affinity(self) -> dict[str, float]:
        """Routing decisions so far: requests for a read-only adapter served by its home replica."""
        by = Counter()
        for (_i, decision), n in self.routed.items():
            by[decision] += n
        keyed = by["home"] + by["spill"]
        return {**by, "affinity_hit_rate": by["home"] / keyed if keyed else 1.0}

    def register_metrics(self, registry: Any) -> None:
        registry.register(FleetCollector(self))

    # --- test and operator hooks ----------------------------------------------------------------
    def home_of(self, key: str) -> int:
        return self.router.home_of(key)

    def replica_of(self, adapter_id: str) -> int:
        return self._placement(adapter_id).replica

    def kill_replica(self, index: int) -> None:
        """Kill a replica's actor as a crash would; Ray restarts it (max_restarts)."""
        ray_module().kill(self._replicas[index].handle, no_restart=False)

    def pause_replica(self, index: int, after_tokens: int | None = None) -> None:
        """Hold a replica's worker (LocalEngine.pause): its queued work waits; tests use it as a gate.
        `after_tokens`: only once that many tokens of streamed samples have been drawn there."""
        ray_module().get(self._replicas[index].handle.pause.remote(after_tokens))

    def ping_replica(self, index: int) -> float:
        """Seconds for an empty round trip to a replica's actor (Ray's own cost of a call)."""
        t0 = time.perf_counter()
        ray_module().get(self._replicas[index].handle.hello.remote(), timeout=60)
        return time.perf_counter() - t0

    def resume_replica(self, index: int) -> None:
        ray_module().get(self._replicas[index].handle.resume.remote())

    def replica_status(self, index: int) -> dict[str, Any]:
        """One replica's KV blocks in use, queue depth, cancels received and sampler totals, now."""
        return ray_module().get(self._replicas[index].handle.status.remote(), timeout=60)

    def replica_pids(self) -> list[int]:
        return [r.pid for r in self._replicas]

    def wait_up(self, timeout: float = 120.0) -> bool:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if all(r.up for r in self._replicas):
                return True
            time.sleep(0.05)
        return False

    def shutdown(self, drain: bool = True) -> None:
        ray = ray_module()
        self._accepting = False
        for r in self._replicas:
            with contextlib.suppress(Exception):  # a dead replica has nothing to drain
                ray.get(r.handle.shutdown.remote(drain), timeout=120)
            ray.kill(r.handle, no_restart=True)
        self._pool.shutdown(wait=False)
        self._loop.call_soon_threadsafe(self._loop.stop)
        if self._started_ray:
            ray.shutdown()


def _settle(out: Future, result: Any = None, error: BaseException | None = None) -> None:
    """Complete `out` unless the caller already cancelled it."""
    with contextlib.suppress(InvalidStateError):  # cancelled (or finished) meanwhile
        out.set_exception(error) if error is not None else out.set_result(result)


def _wire(job: SampleJob) -> SampleJob:
    """The job as it crosses to a replica: no callback, no event (they cannot leave this process),
    no decode function (the replica uses its own tokenizer's)."""
    job = job.streaming(None, None)
    if job.params.stop.decode is not None:
        stop = dataclasses.replace(job.params.stop, decode=None)
        job = dataclasses.replace(job, params=dataclasses.replace(job.params, stop=stop))
    return job


def _all(futures: list[Future]) -> Future:
    out: Future = Future()
    if not futures:
        out.set_result(None)
        return out
    left = [len(futures)]
    lock = threading.Lock()

    def one(f: Future) -> None:
        with lock:
            left[0] -= 1
            last = left[0] == 0
        if last and not out.done():
            errors = [x.exception() for x in futures if x.exception() is not None]
            out.set_exception(errors[0]) if errors else out.set_result(None)

    for f in futures:
        f.add_done_callback(one)
    return out


