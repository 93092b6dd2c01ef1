"""LocalEngine: one resident base model on this process's device, driven through a work queue.

Callers (the service, the CLI) parse requests with `prepare_*` (pure, any thread) and queue the
resulting jobs with `submit` (or the adapter ops below), getting futures. A single worker thread
owns the model, the residency manager (adapter tiers) and the KV cache, so nothing in them needs
locks. Each turn of the worker:
  1. hands new sample jobs to the sampler;
  2. asks the residency manager to bring the adapters that queued work needs towards the device
     (cold loads run on loader threads; only host → slot copies happen here, between steps);
  3. fuses every queued forward / forward_backward whose adapters are in slots and that has no
     earlier queued op on the same adapter into one batched pass, else runs the next ready op;
  4. advances the continuous sampling batch by one step, so sampling never stalls behind training
     and a cold load never stalls a running decode.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from collections.abc import Callable, Sequence
from concurrent.futures import Future
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from tinker import types

from mint_server.engine.adapter_state import AdapterState
from mint_server.engine.front import EngineFront
from mint_server.engine.host_memory import keep_freed_memory
from mint_server.engine.jobs import (
    AdapterRef,
    CustomJob,
    Job,
    OptimJob,
    ReverseKLJob,
    SampleJob,
    TrainJob,
)
from mint_server.engine.optim import family_named
from mint_server.engine.residency import Adapter, Residency
from mint_server.engine.reverse_kl import ReverseKL
from mint_server.engine.runner import Runner, Shard
from mint_server.engine.sampling import Sampler
from mint_server.engine.settings import EngineSettings
from mint_server.engine.step_costs import measure_chunk_tokens, measure_step_cost
from mint_server.engine.training import Trainer
from mint_server.engine.values import AdamState, AdapterSource, EngineError, EngineReport, NotSupportedError
from mint_server.model import invariant, kernels
from mint_server.model.invariant import enable_for_model as enable_invariant
from mint_server.model.kv_cache import kv_bytes_per_token
from mint_server.model.loader import default_device, default_dtype, load_model
from mint_server.model.quantize import quantize_model
from mint_server.model.tp import TP, TPNotSupportedError, check_supported, local_config

log = logging.getLogger(__name__)


@dataclass(eq=False)
class _Work:
    future: Future
    refs: tuple[AdapterRef, ...]  # adapters it reads or writes: ordering, and residency
    train: TrainJob | None = None  # fusable forward / forward_backward
    sample: SampleJob | None = None  # handed to the sampler once no earlier op on its adapter waits
    op: Callable[[list[Adapter | None]], Any] | None = None  # anything else; gets the resolved refs
    on_device: bool = True  # its adapters must be in slots when it runs
    resolved: list[Adapter | None] | None = None
    enqueued: float = field(default_factory=time.perf_counter)  # when it reached the engine

    @property
    def ids(self) -> set[str]:
        return {a.id for a in self.resolved or () if a is not None}


class LocalEngine(EngineFront):
    def __init__(
        self,
        model_dir: str | Path,
        base_model: str,
        device: torch.device | str | None = None,
        dtype: torch.dtype | None = None,
        settings: EngineSettings | None = None,
    ) -> None:
        self.settings = s = settings or EngineSettings()
        s.check()
        # Tensor math runs on the worker thread, with its own OpenMP team of intra_op_threads (set
        # there): a second team on the constructing thread makes libgomp throttle its spin-waits
        # once it counts more threads than cores, and every op of a step then waits for a futex
        # wake-up (measured: one decode step 32 → 57 ms on 2 cores). So this thread — and the
        # loaders — compute single-threaded.
        torch.set_num_threads(1)
        self.model_dir, self.base_model = Path(model_dir), base_model
        self.device = torch.device(device) if device is not None else default_device()
        self.dtype = dtype or default_dtype(self.device)
        if s.keep_freed_memory and self.device.type == "cpu":
            keep_freed_memory()
        tp, followers, control = self._start_tp() if s.tp > 1 else (None, [], None)
        try:
            # tp: this process is rank 0; it loads only its share and schedules for every rank
            self.model = load_model(self.model_dir, self.device, self.dtype, tp=tp)
            if s.quantize != "none":  # QLoRA: the frozen base quantized in place (model/quantize.py)
                try:
                    quantize_model(self.model, s.quantize)
                except ValueError as e:
                    raise NotSupportedError.from_error(e) from None
        except BaseException:
            for p in followers:  # they would wait for rank 0's ops forever
                p.kill()
            raise
        cfg = self.model.config
        self._invariant = s.batch_invariant
        if s.batch_invariant:
            enable_invariant(cfg, s.max_rank, self.device, self.dtype)
        self._open_front(self.model_dir, base_model, cfg)
        self._cv = threading.Condition()
        self._landed = False  # a cold load finished since the worker last looked (LocalEngine._loop)
        self.residency = Residency(cfg, s, self.device, self.dtype, on_loaded=self._wake, tp=tp)
        if tp is not None:  # every rank's share (else the residency's own: a shard of one)
            self.residency.runner = Runner(Shard(tp, self.model, self.residency.bank, self.device, self.dtype,
                                                 self.residency.record), followers, control, s.tp_timeout_s)
        self.runner = self.residency.runner
        self.trainer = Trainer(self.model, self.residency, base_model, max_tokens_per_pass=s.max_fused_tokens,
                               checkpoint_from_tokens=s.checkpoint_from_tokens or None,
                               logits_chunk=s.logits_chunk_elements(), compile=s.compile, compile_now=False)
        self.state = AdapterState(self.residency, base_model, cfg)
        self.reverse_kl = ReverseKL(self.trainer)
        self.sampler = Sampler(
            self.model, self.residency,
            kv_budget_tokens=max(s.kv_tokens(kv_bytes_per_token(local_config(cfg, s.tp), self.dtype)),
                                 self.limits.max_context),
            max_seq_len=self.limits.max_context, records=self.records, max_batch_rows=s.max_batch_rows,
            max_step_tokens=s.step_tokens(s.step_overhead_tokens or 0), max_slowdown=s.max_slowdown,
            step_overhead_tokens=s.step_overhead_tokens or 0, linger_s=s.linger_s, grammars=self.grammars,
            compile=s.compile, compile_cache_dir=s.compile_cache_dir, prefix_cache=s.prefix_cache,
        )
        self._queue: deque[_Work] = deque()
        self._accepting, self._running, self._abort = True, True, False
        self._paused = False
        self.stats = {"train_passes": 0, "fused_requests": 0, "ops": 0, "sample_steps": 0, "train_tokens": 0}
        self.step_seconds: list[float] = []  # drained by the service's metrics
        self._worker = threading.Thread(target=self._loop, name="mint-engine", daemon=True)
        self._calibrated = threading.Event()
        self._worker.start()
        # The worker measures this machine first (_calibrate); nothing else may compute meanwhile, or
        # the figures are another thread's contention (a server building its app beside it measured
        # a one-token step at 3x its cost), so the constructor returns once they are taken.
        self._calibrated.wait()

    def _start_tp(self) -> tuple[TP, list[Any], Any]:
        """Spawn the follower ranks (each loads and splits the model) and join them as rank 0."""
        from mint_server.engine.tp_runner import start_followers
        from mint_server.model.config import ModelConfig

        try:
            check_supported(ModelConfig.from_hf_dir(self.model_dir), self.settings.tp)
        except TPNotSupportedError as e:
            raise NotSupportedError(f"tp: {e}") from None
        if self.device.type == "cuda":
            self.device = torch.device("cuda", 0)
        return start_followers(self.settings.tp, self.model_dir, self.settings, self.device, self.dtype)

    # --- submit ---------------------------------------------------------------------------------
    def submit(self, job: Job) -> Future:
        """Queue a prepared job. Sample jobs answer with a SampleFuture (its sequence ids are known)."""
        if isinstance(job, TrainJob):
            return self._submit(_Work(Future(), (job.adapter_id,) if job.adapter_id else (), train=job))
        if isinstance(job, SampleJob):
            return self._submit(_Work(self._sample_future(job), (job.adapter,) if job.adapter is not None else (), sample=job,
                                      on_device=False))
        if isinstance(job, OptimJob):
            return self._op(lambda _a: self.state.optim_step(job), job.adapter_id)
        if isinstance(job, CustomJob):
            return self._op(lambda _a: self.trainer.forward_backward_custom(job), job.adapter_id)
        if isinstance(job, ReverseKLJob):
            def run(adapters: list[Adapter | None]) -> Any:
                reference = adapters[1] if len(adapters) > 1 else None
                return self.reverse_kl.run(job, None if reference is None else reference.id)

            return self._op(run, job.adapter_id, job.reference)
        raise TypeError(f"not a job: {type(job).__name__}")

    # --- adapter ops ----------------------------------------------------------------------------
    def create_adapter(self, lora: types.LoraConfig, optimizer: str = "adamw") -> Future[str]:
        """A trainable adapter whose optimizer family ("adamw" or "dimuon") is fixed for its life."""
        def create(_a: list[Adapter | None]) -> str:
            a = self.residency.create(lora.rank, lora.seed, lora.train_attn, lora.train_mlp, lora.train_unembed)
            a.optim = AdamState(family=family_named(optimizer))
            return a.id

        return self._op(create, on_device=False)

    def release_adapter(self, adapter_id: str) -> Future[None]:
        return self._op(lambda _a: self.residency.release(adapter_id), adapter_id, on_device=False)

    def forget_source(self, key_prefix: str) -> Future[None]:
        """Sources under this key prefix are gone (checkpoint deleted, session over)."""
        return self._op(lambda _a: self.residency.forget_prefix(key_prefix), on_device=False)

    def save_state(self, adapter_id: str, dest: Path, include_optimizer: bool) -> Future[None]:
        return self._op(lambda _a: self.state.save_state(adapter_id, Path(dest), include_optimizer), adapter_id)

    def load_state(self, adapter_id: str | None, src: Path, include_optimizer: bool,
                   optimizer: str | None = None) -> Future[str]:
        """Into an existing adapter, or (None) into a new trainable one (optimizer family: the saved
        one, or `optimizer`); returns its id."""
        if adapter_id is None:
            return self._op(lambda _a: self.state.load_state(None, Path(src), include_optimizer, optimizer),
                            on_device=False)
        return self._op(lambda _a: self.state.load_state(adapter_id, Path(src), include_optimizer), adapter_id)

    def export_peft(self, adapter: AdapterRef, dest: Path) -> Future[None]:
        return self._op(lambda a: self.state.export_peft(a[0].id, Path(dest)), adapter)  # type: ignore[union-attr]

    def interpolate(self, adapters: Sequence[AdapterRef], coefficients: list[float]) -> Future[str]:
        return self._op(lambda a: self.state.interpolate([x.id for x in a], list(coefficients)),  # type: ignore[union-attr]
                        *adapters)

    def pause(self) -> None:
        """Hold the worker before its next turn (an operator's gate; tests use it to hold work)."""
        with self._cv:
            self._paused = True

    def resume(self) -> None:
        with self._cv:
            self._paused = False
            self._cv.notify_all()

    def queue_depth(self) -> int:
        return len(self._queue)

    def cancel(self, future: Future) -> None:
        """Stop a submitted sample: dropped if still queued, else its rows end and free their KV."""
        if future.cancel():  # not yet handed to the sampler: the worker drops it
            return
        self.sampler.cancel(future)  # applied at the sampler's next step, with every other cancel
        self._wake()

    def queue_position(self, future: Future) -> tuple[int, int] | None:
        """(requests ahead of it, requests waiting in all) while `future`'s work still waits for the
        worker or, for a sample, for admission by the sampler; None once it runs (or if unknown)."""
        with self._cv:
            queue = [w.future for w in self._queue]
        index, admitting = self.sampler.queue_index(future)
        waiting = len(queue) + admitting
        if future in queue:
            return queue.index(future), waiting
        if index is not None:
            return len(queue) + index, waiting
        return None

    def register_metrics(self, registry: Any) -> None:
        """One engine has no families of its own: report() carries everything."""

    def report(self) -> EngineReport:
        """Figures for /metrics; step and load times are handed over once (drained)."""
        with self._cv:
            steps, self.step_seconds = self.step_seconds, []
            waiting_work = sum(1 for w in self._queue for a in w.resolved or () if a is not None and a.slot is None)
            stats = self.residency.stats
            loads, stats.load_seconds = stats.load_seconds, []
            counts = self.residency.counts()
        waiting = waiting_work + sum(1 for a in self.sampler.waiting_adapters() if a.slot is None)
        return {"resident": counts, "loads": dict(stats.loads), "evictions": dict(stats.evictions),
                "load_seconds": loads, "step_seconds": steps, "waiting_for_adapter": waiting,
                "kv_blocks_in_use": self.sampler.kv_blocks_in_use, "sampler": self.sampler.totals(),
                "latencies": self.sampler.drain_latencies(), "served": self.sampler.scheduler.shares(),
                "step_tokens": {"decode": float(self.sampler.stats.decode_tokens),
                                "prefill": float(self.sampler.stats.prefill_tokens),
                                "training": float(self.stats["train_tokens"])},
                "calibration": self.calibration(), "compile": self.sampler.executor.compile_stats.totals(),
                "training": {k: float(v) for k, v in self.trainer.stats.items()}}

    def calibration(self) -> dict[str, float]:
        """What start-up measured on this machine (the skinny-product rule, the scheduler's cost model)."""
        sc = self.sampler.scheduler
        cost = sc.cost
        assert cost is not None
        out = {"skinny_rows": float(kernels.skinny_rows()), "max_step_tokens": float(sc.max_step_tokens),
               "max_chunk_tokens": float(sc.step_budget),
               "max_slowdown": float(sc.max_slowdown)}
        if cost.unit_s > 0:
            out.update(one_token_step_seconds=cost.at(1) * cost.unit_s,
                       full_step_seconds=cost(sc.max_step_tokens, 0) * cost.unit_s,
                       prefill_chunk_seconds=cost.chunk * cost.unit_s,
                       adapter_seconds=cost.adapter_first * cost.unit_s,
                       second_adapter_seconds=cost.adapter_each * cost.unit_s)
        return out

    # --- queue ----------------------------------------------------------------------------------
    def _submit(self, work: _Work) -> Future:
        with self._cv:
            if not self._accepting:
                raise EngineError("engine is shutting down")
            self._queue.append(work)
            self._cv.notify()
        return work.future

    def _op(self, fn: Callable[[list[Adapter | None]], Any], *refs: AdapterRef, on_device: bool = True) -> Future:
        distinct = {r if isinstance(r, str) else r.key for r in refs if r is not None}
        if on_device and len(distinct) > self.settings.device_slots:
            # They must all be in device slots at once: it would wait for ever for room.
            raise EngineError(f"adapters: this needs {len(distinct)} adapters in device slots at once; the engine "
                              f"has {self.settings.device_slots} (--device-slots)")
        return self._submit(_Work(Future(), tuple(r for r in refs if r is not None), op=fn, on_device=on_device))

    def _wake(self) -> None:
        with self._cv:
            self._landed = True
            self._cv.notify()

    def _resolve(self, work: _Work) -> bool:
        """On the worker: turn the work's refs into adapters (opening sources) and reference them."""
        if work.resolved is not None:
            return True
        try:
            adapters = [self.residency.open(r) if isinstance(r, AdapterSource) else self.residency.get(r)
                        for r in work.refs]
        except EngineError as e:
            work.future.set_exception(e)
            return False
        for a in adapters:
            self.residency.ref(a)
        work.resolved = list(adapters)
        return True

    def _done(self, work: _Work) -> None:
        for a in work.resolved or ():
            if a is not None:
                self.residency.unref(a)

    def _take(self, ready: set[str]) -> tuple[list[_Work], _Work | None]:
        """Under the lock: the fusable training work that may run now, else the first ready op.
        Work on one adapter keeps its order; work waiting for a cold adapter holds up only that adapter."""
        fused: list[_Work] = []
        blocked: set[str] = set()
        tokens = 0
        first_op: _Work | None = None
        for w in self._queue:
            if w.resolved is None:  # arrived during this turn: next turn
                continue
            ids = w.ids
            runnable = not blocked.intersection(ids) and (not w.on_device or ids <= ready)
            if w.train is not None and runnable:
                if fused and tokens + w.train.tokens > self.settings.max_fused_tokens:
                    break
                fused.append(w)
                tokens += w.train.tokens
            elif w.train is None and runnable and first_op is None:
                first_op = w
            blocked.update(ids)
        if fused:
            for w in fused:
                self._queue.remove(w)
            return fused, None
        if first_op is not None:
            self._queue.remove(first_op)
        return [], first_op

    def _calibrate(self) -> None:
        """The skinny-product rule and the scheduler's cost model are this machine's: measured on the
        worker (its thread team), before any step; the cost model measures steps as they then run."""
        s = self.settings
        if not self._invariant:
            kernels.calibrate_skinny_once([m.weight for m in self.model.modules()
                                           if isinstance(m, torch.nn.Linear) and m.weight.dim() == 2])
        sc = self.sampler.scheduler
        if s.step_overhead_tokens is None:
            cost = measure_step_cost(self.sampler)
            sc.cost = cost
            sc.max_step_tokens = s.step_tokens_for(cost)
        sc.max_chunk_tokens = s.max_chunk_tokens or (
            measure_chunk_tokens(self.sampler, sc.max_step_tokens) if s.step_overhead_tokens is None else 0)
        log.info("calibrated: %s", {k: round(v, 4) for k, v in self.calibration().items()})

    def _compile(self) -> None:
        """compile "auto": the serving step's and the training blocks' graphs, before the engine
        serves. Not in a background thread: its tracing holds the GIL between the eager steps' ops,
        and requests run meanwhile took 11-116x their time (benchmarks/first_request.py); with the
        data dir's compile cache warm a restart mostly traces. A failure leaves the step eager."""
        if self.settings.compile == "off":
            return
        t0 = time.perf_counter()
        log.info("compiling the serving step and the training blocks (compile auto; cached in the data "
                    "dir for the next start)")
        self.sampler.executor.compile()
        self.trainer.compile()
        log.info("compiled in %.1f s", time.perf_counter() - t0)

    def _loop(self) -> None:
        torch.set_num_threads(self.settings.intra_op_threads())  # this thread's OpenMP team (see __init__)
        try:
            try:
                self._calibrate()
            except Exception:  # noqa: BLE001 - the defaults stand; serving goes on
                log.exception("measuring the step costs failed")
            self._compile()  # after the measurements: it would be their contention
        finally:
            self._calibrated.set()
        while True:
            with self._cv:
                while self._running and (self._paused or not self._has_work()):
                    self._cv.wait(timeout=0.5)
                if self._abort:  # shutdown without draining: running samples fail, on this thread
                    self.sampler.fail_all(EngineError("engine shut down"))
                    return
                if not self._running and not self._queue and not self.sampler.has_work():
                    return
                if not self._queue and (hold := self.sampler.hold()) > 0:  # a quiet key's next request
                    self._cv.wait(timeout=hold)
                queued = list(self._queue)
                self._landed = False  # loads landing from here on are news to this turn's wait
            t0 = time.perf_counter()
            try:
                ran = self._turn(queued)
            except Exception:  # a bug in a turn must not kill the worker; requests see their own errors
                log.exception("engine turn failed")
                ran = True
            if ran:
                with self._cv:
                    self.step_seconds.append(time.perf_counter() - t0)
                    del self.step_seconds[:-10000]
            else:  # everything waits for cold loads: sleep until a loader finishes
                with self._cv:
                    # one that finished during the turn already notified (nobody was waiting then)
                    if self._running and not self._abort and not self._landed:
                        self._cv.wait(timeout=0.05)

    def _has_work(self) -> bool:
        return bool(self._queue) or self.sampler.has_work()

    def _turn(self, queued: list[_Work]) -> bool:
        """One turn; False when nothing could run (all of it waits for adapters)."""
        blocked: set[str] = set()
        for w in queued:
            if not self._resolve(w):
                with self._cv:
                    self._queue.remove(w)
                continue
            if w.sample is not None and not blocked.intersection(w.ids):
                with self._cv:
                    self._queue.remove(w)
                if w.future.cancelled():
                    self._done(w)
                else:  # the request owns the adapter reference from here on
                    self.sampler.submit(w.sample, (w.resolved or [None])[0], w.future, w.enqueued)
                continue
            blocked.update(w.ids)
        with self._cv:
            queued = list(self._queue)
        needed = [a for w in queued for a in w.resolved or () if a is not None and w.on_device]
        needed += self.sampler.waiting_adapters(limit=4 * self.settings.device_slots)
        ready = self.residency.schedule(needed)
        self._fail_unloadable(queued)
        with self._cv:
            fused, op = self._take(ready)
        ran = False
        if fused:
            self._run_fused(fused)
            ran = True
        elif op is not None:
            self._run_op(op)
            ran = True
        if self.sampler.has_ready_work():
            try:
                self.sampler.step()
                self.stats["sample_steps"] += 1
            except Exception:  # a bug in a step must not kill the worker; requests see it
                log.exception("sampler step failed")
            ran = True
        return ran

    def _fail_unloadable(self, queued: list[_Work]) -> None:
        """Adapters whose load failed (corrupt or missing store data): fail the work waiting for them."""
        if not self.residency.failed:
            return
        failed: dict[str, BaseException] = {}
        for a in list(self.residency.failed):
            if a.load_error is not None:
                failed[a.id] = a.load_error
                self.sampler.fail_waiting(a, a.load_error)
        with self._cv:
            doomed = [w for w in self._queue if w.ids & failed.keys()]
            for w in doomed:
                self._queue.remove(w)
        for w in doomed:
            self._done(w)
            w.future.set_exception(failed[next(iter(w.ids & failed.keys()))])
        for a in list(self.residency.failed):
            self.residency.take_load_error(a)

    def _run_fused(self, work: list[_Work]) -> None:
        for w in work:
            w.future.set_running_or_notify_cancel()
        try:
            between = self._sample_between if self.sampler.has_ready_work() else None
            results = self.trainer.run([w.train for w in work], between,  # type: ignore[misc]
                                       slice_tokens=self.settings.train_slice_tokens)
        except Exception as e:  # noqa: BLE001 - the whole pass failed: every caller sees why
            log.exception("fused training pass failed")
            results = [e] * len(work)
        self.stats["train_passes"] += 1
        self.stats["fused_requests"] += len(work)
        self.stats["train_tokens"] += sum(w.train.tokens for w in work)  # type: ignore[union-attr]
        for w in work:  # training counts in the key's fair share: its samples then yield to lighter keys'
            job = w.train
            assert job is not None
            self.sampler.scheduler.charge(job.key, job.adapter_id or "", job.tokens)
        for w, r in zip(work, results, strict=True):
            for a in w.resolved or ():
                if a is not None:
                    self.residency.touch(a)
            self._done(w)
            if isinstance(r, BaseException):
                w.future.set_exception(r)
            else:
                w.future.set_result(r)

    def _sample_between(self) -> None:
        """Between a training pass's micro-batches: a few sampler steps, so decoding streams keep
        going while another key trains (the pass's adapters stay in their slots meanwhile)."""
        for _ in range(self.settings.sample_steps_per_slice):
            if not self.sampler.has_ready_work():
                return
            try:
                self.sampler.step()
                self.stats["sample_steps"] += 1
            except Exception:  # a bug in a step must not fail the training pass; requests see it
                log.exception("sampler step failed")

    def _run_op(self, w: _Work) -> None:
        if w.op is None or not w.future.set_running_or_notify_cancel():
            self._done(w)
            return
        try:
            result = w.op(w.resolved or [])
        except Exception as e:  # noqa: BLE001 - delivered to the caller
            if not isinstance(e, EngineError):
                log.exception("engine op failed")
            self._done(w)
            w.future.set_exception(e)
            return
        self.stats["ops"] += 1
        self._done(w)
        w.future.set_result(result)

    def shutdown(self, drain: bool = True) -> None:
        with self._cv:
            self._accepting = False
            self._paused = False
            if not drain:
                while self._queue:
                    w = self._queue.popleft()
                    if not w.future.done():
                        w.future.set_exception(EngineError("engine shut down before the request started"))
                self._abort = True
            self._running = False
            self._cv.notify_all()
        self._worker.join()
        if self._invariant:
            invariant.set_enabled(False)
        self.residency.close()
        self.runner.close()
