"""FleetEngine: the Engine facade over the replicas, and its dispatch (see the package docstring)."""

from __future__ import annotations

import contextlib
import dataclasses
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
from mint_server.engine.fleet.placement import Placements
from mint_server.engine.fleet.replica import ReplicaActor, ray_module
from mint_server.engine.fleet.routing import ReplicaView, Router, TrackedRequest
from mint_server.engine.fleet.transport import SampleTransport, cancel_remote
from mint_server.engine.front import EngineFront
from mint_server.engine.interface import (
    AdapterLost,
    EngineError,
    NotSupportedError,
)
from mint_server.engine.jobs import (
    AdapterRef,
    CustomJob,
    Job,
    OptimJob,
    ReverseKLJob,
    SampleJob,
    TrainJob,
)
from mint_server.engine.records import SamplingRecord
from mint_server.engine.settings import EngineSettings, FleetSettings
from mint_server.engine.values import AdapterSource, EngineReport
from mint_server.model.config import ModelConfig

log = logging.getLogger(__name__)


class FleetEngine(EngineFront):
    """The Engine protocol over Ray replicas (see the module docstring)."""

    def __init__(self, model_dir: str | Path, base_model: str, settings: EngineSettings | None = None,
                 fleet: FleetSettings | None = None, device: str | None = None, dtype: str | None = None) -> None:
        ray = ray_module()
        self.settings = s = settings or EngineSettings()
        self.fleet = f = fleet or FleetSettings()
        s.check()
        f.check()
        self.model_dir, self.base_model = Path(model_dir), base_model
        # The records live here, where results pass through, so training on any replica can read the
        # logprobs of a sequence sampled on another (stable_reinforce provenance). The grammars here
        # only check requests; each replica compiles them again for its own sampler.
        self._open_front(self.model_dir, base_model, ModelConfig.from_hf_dir(self.model_dir))

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
        self._request_ids = itertools.count(1)  # sample requests (a cancel names one on its replica)
        self._tag = uuid.uuid4().hex[:6]
        # Catalog revisions are written out here for the replicas: beside the page dirs, in the data
        # dir that every node mounts (docs/fleet.md); a private temp dir when there is no store dir.
        shared = (Path(s.store_dir).parent / "fleet-adapters" if s.store_dir is not None
                  else Path(tempfile.mkdtemp(prefix="mint-fleet-")))
        shared.mkdir(parents=True, exist_ok=True)
        self.placements = Placements(self._replicas, self._tag, shared)
        self._pool = ThreadPoolExecutor(4, thread_name_prefix="mint-fleet")
        self._tracked: dict[Future, TrackedRequest] = {}  # sample futures in flight → their request
        self.transport = SampleTransport()
        self.routed: Counter[tuple[int, str]] = Counter()  # (replica, decision) → requests
        self._accepting = True

    @property
    def replicas(self) -> int:
        return len(self._replicas)

    def replica_views(self) -> list[ReplicaView]:
        """The router's record of each replica (up, in flight, last report): what metrics read."""
        return list(self._replicas)

    # --- submit ---------------------------------------------------------------------------------
    def submit(self, job: Job) -> Future:
        if not self._accepting:
            raise EngineError("engine is shutting down")
        if isinstance(job, SampleJob):
            out = self._sample_future(job)
            tracked = TrackedRequest(f"{self._tag}-{next(self._request_ids)}", job.on_token, job.cancel)
            with self._lock:
                self._tracked[out] = tracked
            out.add_done_callback(self._untrack)
            if isinstance(job.adapter, str):  # sampling a training adapter: where it lives
                p = self.placements.of(job.adapter)
                self._dispatch(out, p.replica, "pinned", p.incarnation, job.on(p.local_id), None, tracked=tracked)
            elif self.placements.needs_materialize(job.adapter):
                self._pool.submit(self._guard, out, lambda: self._sample(out, job, tracked, 0, None))
            else:
                self._sample(out, job, tracked, 0, None)
            return out
        if isinstance(job, TrainJob | OptimJob | CustomJob):
            p = self.placements.of(job.adapter_id or "")
            out = Future()
            self._dispatch(out, p.replica, "pinned", p.incarnation, job.on(p.local_id), None)
            return out
        if isinstance(job, ReverseKLJob):
            p = self.placements.of(job.adapter_id or "")
            reference = job.reference
            if isinstance(reference, str):
                ref_p = self.placements.of(reference)
                if ref_p.replica != p.replica:
                    raise NotSupportedError("reference: a training adapter on another replica cannot be the "
                                            "reference; save it and pass its checkpoint")
                reference = ref_p.local_id
            out = Future()

            def go() -> None:
                moved = dataclasses.replace(job, adapter_id=p.local_id, reference=self.placements.portable(reference))
                self._dispatch(out, p.replica, "pinned", p.incarnation, moved, None)

            self._pool.submit(self._guard, out, go) if self.placements.needs_materialize(reference) else go()
            return out
        raise TypeError(f"not a job: {type(job).__name__}")

    def _untrack(self, out: Future) -> None:
        with self._lock:
            self._tracked.pop(out, None)

    def _sample(self, out: Future, job: SampleJob, tracked: TrackedRequest, attempt: int, failed: int | None) -> None:
        if out.done():  # cancelled before it was dispatched
            return
        portable = job.on(self.placements.portable(job.adapter))
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
                self.transport.stream(stream, tracked,
                                      lambda result, error: self._finish(out, replica, result, error, retry, record))
                return
            if incarnation is None:  # a read-only sample: it goes in the replica's next batch
                self.transport.enqueue(replica, tracked.request_id, wire,
                                       lambda result, error: self._finish(out, replica, result, error, retry, record))
                return
            ref = replica.handle.run.remote(incarnation, wire, tracked.request_id)

        def done(f: Future) -> None:
            error = f.exception()
            self._finish(out, replica, None if error else f.result(), error, retry, record)

        ref.future().add_done_callback(done)

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
        held = self.placements.held()
        return min(self.router.up(), key=lambda r: (held[r.index], r.inflight, r.index))

    def create_adapter(self, lora: types.LoraConfig, optimizer: str = "adamw") -> Future[str]:
        r = self._new_home()
        return self._call(r.index, None, "create_adapter", lora, optimizer,
                          then=lambda local: self.placements.place(r.index, local))

    def release_adapter(self, adapter_id: str) -> Future[None]:
        p = self.placements.pop(adapter_id)
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
        self.placements.forget(key_prefix)
        calls = [self._call(r.index, None, "forget_source", key_prefix) for r in self._replicas if r.up]
        return _all(calls)

    def save_state(self, adapter_id: str, dest: Path, include_optimizer: bool) -> Future[None]:
        p = self.placements.of(adapter_id)
        return self._call(p.replica, p.incarnation, "save_state", p.local_id, Path(dest), include_optimizer)

    def load_state(self, adapter_id: str | None, src: Path, include_optimizer: bool,
                   optimizer: str | None = None) -> Future[str]:
        if adapter_id is None:
            r = self._new_home()
            return self._call(r.index, None, "load_state", None, Path(src), include_optimizer, optimizer,
                              then=lambda local: self.placements.place(r.index, local))
        p = self.placements.of(adapter_id)
        return self._call(p.replica, p.incarnation, "load_state", p.local_id, Path(src), include_optimizer,
                          then=lambda _local: adapter_id)

    def export_peft(self, adapter: AdapterRef, dest: Path) -> Future[None]:
        if isinstance(adapter, str):
            p = self.placements.of(adapter)
            return self._call(p.replica, p.incarnation, "export_peft", p.local_id, Path(dest))
        if isinstance(adapter, AdapterSource):
            home = self.router.route(adapter.key)[0].index
            return self._in_pool(lambda: self._call(home, None, "export_peft", self.placements.portable(adapter), Path(dest)))
        raise EngineError("adapter: export needs an adapter, not the bare base")

    def interpolate(self, adapters: Sequence[AdapterRef], coefficients: list[float]) -> Future[str]:
        trained = [self.placements.of(a) for a in adapters if isinstance(a, str)]
        if len({p.replica for p in trained}) > 1:
            raise NotSupportedError("adapters: training adapters on different replicas cannot be interpolated; "
                                    "save them and interpolate their checkpoints")
        if trained:
            index, incarnation = trained[0].replica, trained[0].incarnation
        else:
            first = next((a for a in adapters if isinstance(a, AdapterSource)), None)
            index, incarnation = (self.router.route(first.key)[0].index if first else self.router.least_loaded().index), None

        def go() -> Future:
            local = [self.placements.of(a).local_id if isinstance(a, str) else self.placements.portable(a) for a in adapters]
            return self._call(index, incarnation, "interpolate", local, list(coefficients),
                              then=lambda new: self.placements.place(index, new))

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
            cancel_remote(tracked)

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
        return self.placements.of(adapter_id).replica

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
        self.transport.stop()
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


