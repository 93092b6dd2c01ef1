"""Where every adapter lives — the engine's one adapter cache, with three tiers.

1. device: a slot of the LoRA bank, what a forward can read;
2. host:   decoded weights in host memory (for a training adapter also its fp32 masters, AdamW
           moments and pending gradients), within a byte budget;
3. store:  durable — a sampler adapter's source (a PEFT dir, a catalog revision's verified blobs, a
           training state) is re-read from there; a training adapter, or any adapter with no
           source, is written to the engine's page dir first (atomically), so paging never loses
           work and is bit-exact: the same tensors come back.

The engine worker is the only caller (not thread-safe), except `AdapterSource.read`, which runs on
loader threads. The worker asks `schedule(needed)` between steps: adapters already in a slot stay,
host-tier ones are copied into free or evicted slots (bounded bytes per step), store-tier ones are
handed to the loader pool (prefetch). Eviction takes the least recently used adapter that no
running sequence reads (`pins`) and that was not just brought in for the step about to run.
"""

from __future__ import annotations

import contextlib
import itertools
import logging
import os
import shutil
import sys
import tempfile
import threading
import time
import uuid
from collections.abc import Callable, Iterable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from mint_server.engine.runner import Runner
from mint_server.engine.settings import EngineSettings
from mint_server.engine.values import AdamState, AdapterSource, EngineError
from mint_server.model.config import ModelConfig, ModelError
from mint_server.model.lora import LoraBank, init_lora_weights, select_targets
from mint_server.model.peft_io import DEFAULT_LORA_ALPHA, LoraWeights, load_peft, load_peft_files
from mint_server.model.tp import TP, local_target_shapes

log = logging.getLogger(__name__)
Pairs = dict[str, tuple[Tensor, Tensor]]  # target → (A [L, r, in], B [L, out, r])


def check_lora_config(rank: Any, train_attn: bool, train_mlp: bool, train_unembed: bool, max_rank: int) -> None:
    """The one rule for a new trainable adapter's LoraConfig: the api refuses a bad one at once with it
    (api/tinker/validate.py), before anything is queued; `Residency.create` holds to it too."""
    if isinstance(rank, bool) or not isinstance(rank, int) or not 1 <= rank <= max_rank:
        raise EngineError(f"must be between 1 and {max_rank} (this server's max LoRA rank), got {rank!r}",
                          field="lora_config.rank")
    if not (train_attn or train_mlp or train_unembed):
        raise EngineError("at least one of train_mlp, train_attn, train_unembed must be true", field="lora_config")


@dataclass(eq=False)
class Adapter:
    id: str
    trainable: bool
    rank: int = 0  # 0 until a source adapter is first read
    alpha: float = DEFAULT_LORA_ALPHA
    targets: tuple[str, ...] = ()
    source: AdapterSource | None = None
    slot: int | None = None  # device tier when set
    host: Pairs | None = None  # host tier: the weights (fp32 masters when the bank is not fp32)
    # `host`, `grads` and the moments off the device are this rank's share (each tensor-parallel
    # rank holds its own; at world size 1 the whole) rather than fresh from the store or a client
    host_split: bool = False
    paged: Path | None = None  # store tier for adapters without a source: the page dir
    grads: dict[str, tuple[Tensor, Tensor]] = field(default_factory=dict)  # accumulated since last step
    optim: AdamState = field(default_factory=AdamState)
    master: Pairs | None = None  # fp32 masters of a trainable adapter on a low-precision bank
    refs: int = 0  # queued or running requests that will read it: it is not dropped meanwhile
    pins: int = 0  # running sequences reading its slot: it is not evicted meanwhile
    released: bool = False
    last_used: int = 0
    host_bytes: int = 0  # what this adapter counts against the host budget
    loading: Future | None = None
    load_error: BaseException | None = None

    @property
    def scale(self) -> float:
        return self.alpha / self.rank

    @property
    def tier(self) -> str:
        return "device" if self.slot is not None else "host" if self.host is not None else "store"


@dataclass
class ResidencyStats:
    loads: dict[str, int] = field(default_factory=lambda: {"host": 0, "store": 0})  # by source tier
    evictions: dict[str, int] = field(default_factory=lambda: {"device": 0, "host": 0})
    load_seconds: list[float] = field(default_factory=list)  # store → host reads, drained by metrics


class Residency:
    def __init__(
        self, cfg: ModelConfig, settings: EngineSettings, device: torch.device | str, dtype: torch.dtype,
        on_loaded: Callable[[], None] | None = None, tp: TP | None = None,
    ) -> None:
        """`runner` fills and reads every rank's share of a slot: a shard of one by default; tp: this
        process is rank 0 of a tensor-parallel engine, whose bank holds its share and whose runner
        (set by the engine) reaches every rank."""
        self.cfg, self.settings = cfg, settings
        self.bank = LoraBank(cfg, settings.device_slots, settings.max_rank, device, dtype,
                             shapes=local_target_shapes(cfg, tp.world) if tp is not None else None)
        self.device, self.dtype = torch.device(device), dtype
        self.runner = Runner.single(self.bank, self.device, dtype, resolve=self.record)
        self.host_budget = int(settings.host_cache_mb * 1024 * 1024)
        if settings.store_dir is not None:
            # Pages belong to this process's live adapters only (durable state is in checkpoints):
            # whatever an earlier process left there is stale.
            self.page_root = Path(settings.store_dir)
            shutil.rmtree(self.page_root, ignore_errors=True)
        else:
            self.page_root = Path(tempfile.mkdtemp(prefix="mint-pages-"))
        self.page_root.mkdir(parents=True, exist_ok=True)
        self._adapters: dict[str, Adapter] = {}
        self._by_key: dict[str, Adapter] = {}
        self._slots: list[Adapter | None] = [None] * settings.device_slots
        self._host_bytes = 0
        self._clock = itertools.count(1)
        self._ids = itertools.count()
        self._tag = uuid.uuid4().hex[:8]  # per engine: ids from two engines never collide
        self._pool = ThreadPoolExecutor(settings.loader_threads, thread_name_prefix="mint-loader",
                                        initializer=_start_loader_thread, initargs=(settings.loader_nice,))
        self._on_loaded = on_loaded or (lambda: None)
        self._fresh: set[str] = set()  # brought into a slot for the step about to run
        self._loading: set[Adapter] = set()  # store → host reads queued or in flight
        # reads not yet taken by a loader thread: adapter → (urgency rank, source, paged dir)
        self._queued: dict[Adapter, tuple[int, AdapterSource | None, Path | None]] = {}
        self._queued_lock = threading.Lock()
        self.failed: set[Adapter] = set()  # loads that failed, until the work waiting on them is told
        self.stats = ResidencyStats()

    # --- lookup ---------------------------------------------------------------------------------
    def get(self, adapter_id: str) -> Adapter:
        a = self._adapters.get(adapter_id)
        if a is None or a.released:
            raise EngineError(f"unknown adapter id {adapter_id!r}")
        return a

    def record(self, adapter_id: str) -> Adapter:
        """The adapter, released or not (the runner's view of rank 0's state)."""
        return self._adapters[adapter_id]

    def on_device(self, adapter_id: str) -> Adapter:
        """The adapter, which the worker made device-resident before running an op on it."""
        a = self.get(adapter_id)
        if a.slot is None:
            raise RuntimeError(f"adapter {adapter_id!r} is not in a device slot")
        return a

    def __len__(self) -> int:
        return sum(not a.released for a in self._adapters.values())

    def counts(self) -> dict[str, int]:
        out = {"device": 0, "host": 0, "store": 0}
        for a in list(self._adapters.values()):  # read from the metrics thread too
            if not a.released:
                out[a.tier] += 1
        return out

    @property
    def host_bytes(self) -> int:
        return self._host_bytes

    # --- create / install / open / release ------------------------------------------------------
    def create(
        self, rank: int, seed: int | None, train_attn: bool = True, train_mlp: bool = True,
        train_unembed: bool = True, alpha: float = DEFAULT_LORA_ALPHA,
    ) -> Adapter:
        check_lora_config(rank, train_attn, train_mlp, train_unembed, self.bank.max_rank)
        targets = select_targets(train_attn, train_mlp, train_unembed)
        seed = seed if seed is not None else int(torch.randint(0, 2**31 - 1, ()).item())
        weights = init_lora_weights(self.bank.full_shapes, targets, rank, seed, torch.float32, self.bank.experts)
        return self.install(LoraWeights(weights, rank, alpha), trainable=True)

    def install(self, weights: LoraWeights, trainable: bool, optim: AdamState | None = None) -> Adapter:
        """A new adapter from weights (and optimizer state): into a free slot if there is one, else
        the host tier. Complete before anything can page it out."""
        self.check_rank(weights.rank, "rank")
        a = Adapter(id=f"a{next(self._ids)}-{self._tag}", trainable=trainable, rank=weights.rank,
                    alpha=weights.alpha, targets=tuple(sorted(weights.weights)), last_used=next(self._clock))
        if optim is not None:
            a.optim = AdamState(optim.step, {t: tuple(m.cpu() for m in ms)
                                             for t, ms in optim.moments.items()}, optim.family, optim.betas)
        self._adapters[a.id] = a
        self._set_host(a, {t: (x.detach().float().cpu().clone(), y.detach().float().cpu().clone())
                           for t, (x, y) in weights.weights.items()})
        slot = self._free_slot()
        if slot is not None:
            self._promote(a, slot)
        self._fit_host()
        return a

    def open(self, source: AdapterSource) -> Adapter:
        """The read-only adapter for a source (one per key); read from the store when first needed."""
        a = self._by_key.get(source.key)
        if a is None or a.released:
            a = Adapter(id=f"s{next(self._ids)}-{self._tag}", trainable=False, source=source)
            self._adapters[a.id] = a
            self._by_key[source.key] = a
        return a

    def check_rank(self, rank: int, where: str) -> None:
        if not 1 <= rank <= self.bank.max_rank:
            raise EngineError(f"{where}: must be in 1..{self.bank.max_rank} (the engine's max LoRA rank), got {rank}")

    def release(self, adapter_id: str) -> None:
        a = self.get(adapter_id)
        a.released = True
        a.grads, a.optim, a.master = {}, AdamState(), None
        self._maybe_drop(a)

    def forget(self, key: str) -> None:
        """The source is gone (checkpoint deleted, session over): drop its adapter once unused."""
        a = self._by_key.pop(key, None)
        if a is not None and not a.released:
            a.released = True
            self._maybe_drop(a)

    def forget_prefix(self, prefix: str) -> None:
        for key in [k for k in self._by_key if k.startswith(prefix)]:
            self.forget(key)

    def _maybe_drop(self, a: Adapter) -> None:
        if not a.released or a.refs > 0:
            return
        if self._adapters.pop(a.id, None) is None:
            return
        if a.source is not None and self._by_key.get(a.source.key) is a:
            del self._by_key[a.source.key]
        if a.slot is not None:
            self._slots[a.slot] = None
            self.runner.call("clear", aid=a.id, slot=a.slot)
            a.slot = None
        elif a.host_split:
            self.runner.call("forget", aid=a.id)
        a.host_split = False
        self._set_host(a, None)
        if a.paged is not None:
            shutil.rmtree(a.paged, ignore_errors=True)
            a.paged = None

    # --- references -----------------------------------------------------------------------------
    def ref(self, a: Adapter) -> None:
        a.refs += 1

    def unref(self, a: Adapter) -> None:
        a.refs -= 1
        self._maybe_drop(a)

    def pin(self, a: Adapter) -> None:
        assert a.slot is not None
        a.pins += 1
        a.last_used = next(self._clock)

    def unpin(self, a: Adapter) -> None:
        a.pins -= 1

    def touch(self, a: Adapter) -> None:
        a.last_used = next(self._clock)

    # --- scheduling (between steps) -------------------------------------------------------------
    def schedule(self, needed: Sequence[Adapter]) -> set[str]:
        """Bring `needed` (most urgent first) towards the device; return the ids now in a slot.

        Finished loads land in the host tier; host-tier adapters are copied into free slots, or into
        slots evicted from adapters not needed, then from needed ones further down the list; store
        adapters start loading in that order (prefetch, bounded by a window of wants and the host
        budget).
        """
        self._fresh = set()
        self._collect_loads()
        # Only the most urgent few matter this step: promotions need slots, prefetch a bounded window.
        window = 4 * len(self._slots)
        with self._queued_lock:  # loads not started yet fall behind this call's wants (re-ranked below)
            for a, (rank, source, paged) in self._queued.items():
                self._queued[a] = (rank + window, source, paged)
        wanted: list[Adapter] = []
        seen: set[str] = set()
        for a in needed:
            if a.id not in seen and (not a.released or a.refs > 0):
                seen.add(a.id)
                wanted.append(a)
                if len(wanted) >= window:
                    break
        rank_of = {a.id: i for i, a in enumerate(wanted)}
        budget = self.settings.load_bytes_per_step
        copied = 0
        for a in wanted:
            if a.slot is not None:
                continue
            if a.host is None:
                self._start_load(a, rank_of[a.id])
                continue
            if copied and copied + _nbytes(a.host) > budget:
                continue
            slot = self._free_slot()
            if slot is None:
                slot = self._evict_for(a, rank_of)
            if slot is None:
                break
            self._promote(a, slot)
            self._fresh.add(a.id)
            copied += _nbytes(a.host) if a.host is not None else 0
        self._fit_host(keep={a.id for a in wanted[: 2 * len(self._slots)]})
        return {a.id for a in wanted if a.slot is not None}

    def take_load_error(self, a: Adapter) -> BaseException | None:
        err, a.load_error = a.load_error, None
        self.failed.discard(a)
        return err

    def _free_slot(self) -> int | None:
        for i, holder in enumerate(self._slots):
            if holder is None:
                return i
        return None

    def _evict_for(self, a: Adapter, rank_of: dict[str, int]) -> int | None:
        """A slot for `a`: from the least urgent, least recently used adapter nobody is reading."""
        mine = rank_of.get(a.id, len(rank_of))
        victims = [
            v for v in self._slots
            if v is not None and v.pins == 0 and v.id not in self._fresh and rank_of.get(v.id, 1 << 60) > mine
        ]
        if not victims:
            return None
        victim = min(victims, key=lambda v: (-rank_of.get(v.id, 1 << 60), v.last_used))
        slot = victim.slot
        assert slot is not None
        self._demote(victim)
        return slot

    def _promote(self, a: Adapter, slot: int) -> None:
        """host → device: write the slot; a training adapter's state follows it to the device."""
        assert a.host is not None
        if a.host_split:  # every rank moves its own host share into the slot
            self.runner.call("promote_split", aid=a.id, slot=slot, rank=a.rank, alpha=a.alpha, trainable=a.trainable)
            a.host_split = False
        else:  # every rank takes its share of the full host copy
            self.runner.call("promote", aid=a.id, slot=slot, weights=a.host, rank=a.rank, alpha=a.alpha,
                             trainable=a.trainable, grads=a.grads, optim=a.optim)
        self._slots[slot] = a
        a.slot = slot
        self.stats.loads["host"] += 1
        self._set_host(a, None)
        a.last_used = next(self._clock)

    def _demote(self, a: Adapter) -> None:
        """device → host: an exact copy of what the slot (or the fp32 masters) held; every rank keeps
        its share in its own host memory (runner.demote)."""
        assert a.slot is not None
        slot = a.slot
        self.runner.call("demote", aid=a.id, slot=slot, rank=a.rank, targets=a.targets)
        a.host_split = True
        host = a.host
        self._slots[slot] = None
        a.slot = None
        self.stats.evictions["device"] += 1
        self._set_host(a, host)

    def _set_host(self, a: Adapter, host: Pairs | None) -> None:
        self._host_bytes -= a.host_bytes
        a.host = host
        a.host_bytes = _nbytes(host) + _state_bytes(a) if host is not None else 0
        self._host_bytes += a.host_bytes

    def _fit_host(self, keep: Iterable[str] = ()) -> None:
        """Move the least recently used host-tier adapters to the store until the budget holds."""
        if self._host_bytes <= self.host_budget:
            return
        keep = set(keep)
        candidates = sorted((a for a in self._adapters.values() if a.host is not None and a.slot is None),
                            key=lambda a: (a.id in keep, a.last_used))
        for a in candidates:
            if self._host_bytes <= self.host_budget:
                break
            self._to_store(a)

    def _to_store(self, a: Adapter) -> None:
        """host → store. A sourced read-only adapter just drops its copy; anything else is written to
        its page dir first (atomically), then dropped."""
        if a.host_split and (a.source is None or a.trainable):
            # pages hold the full layout: gather every rank's share (they drop theirs)
            a.host, a.grads, a.optim.moments = self.runner.call("gather_host", aid=a.id)
        elif a.host_split:  # re-read from its source when needed: every rank just drops its share
            self.runner.call("forget", aid=a.id)
        a.host_split = False
        if a.source is None or a.trainable:
            from mint_server.engine import state_io  # state_io imports this module

            dest = self.page_root / a.id
            state_io.save_paged(dest, state_io.PagedState(LoraWeights(a.host or {}, a.rank, a.alpha), a.optim,
                                                          a.grads))
            a.paged = dest
            self._set_host(a, None)
            a.grads, a.optim = {}, AdamState(a.optim.step, family=a.optim.family, betas=a.optim.betas)
        else:
            self._set_host(a, None)
        self.stats.evictions["host"] += 1

    def _start_load(self, a: Adapter, rank: int) -> None:
        """Queue a's store read at urgency `rank` (lower first). The pool runs tasks in the order it
        was handed them, so each task reads whichever queued load is most urgent when a loader thread
        takes it: a quiet request's cold load does not wait behind a sweep's long prefetch."""
        if a.load_error is not None:
            return
        if a.loading is not None:
            with self._queued_lock:
                if a in self._queued:  # not started yet: it moves to this call's rank
                    self._queued[a] = (rank, *self._queued[a][1:])
            return
        if a.source is None and a.paged is None:
            raise RuntimeError(f"adapter {a.id!r} has no tier to load from")
        a.loading = Future()
        with self._queued_lock:
            self._queued[a] = (rank, a.source, a.paged)
        self._loading.add(a)
        a.loading.add_done_callback(lambda _f: self._on_loaded())
        self._pool.submit(self._load_most_urgent)

    def _load_most_urgent(self) -> None:
        """On a loader thread: take the most urgent queued load and run it."""
        with self._queued_lock:
            if not self._queued:
                return
            a = min(self._queued, key=lambda q: self._queued[q][0])
            _, source, paged = self._queued.pop(a)
        future = a.loading
        if future is None or not future.set_running_or_notify_cancel():
            return
        try:
            future.set_result(self._read(source, paged))
        except BaseException as e:  # noqa: BLE001 - delivered to the requests waiting on it
            future.set_exception(e)

    def _read(self, source: AdapterSource | None, paged: Path | None) -> tuple[object, float]:
        """On a loader thread: read and decode from the store (verified where the store verifies)."""
        from mint_server.engine import state_io

        t0 = time.perf_counter()
        if paged is not None:
            out: object = state_io.load_paged(paged)
        else:
            assert source is not None
            try:
                if source.state_dir is not None:
                    out = state_io.load_state(source.state_dir, include_optimizer=False).weights
                elif source.read is not None:
                    out = load_peft_files(source.read(), self.cfg)
                else:
                    out = load_peft(source.peft_dir, self.cfg)  # type: ignore[arg-type]
            except ModelError as e:
                raise EngineError(f"adapter {source.key!r}: {e}") from None
            state_io.check_shapes(out, self.bank, f"adapter {source.key!r}")  # type: ignore[arg-type]
        return out, time.perf_counter() - t0

    def _collect_loads(self) -> None:
        from mint_server.engine import state_io

        for a in [a for a in self._loading if a.loading is not None and a.loading.done()]:
            f = a.loading
            assert f is not None
            a.loading = None
            self._loading.discard(a)
            try:
                out, seconds = f.result()
            except BaseException as e:  # noqa: BLE001 - delivered to the requests waiting on it
                a.load_error = e
                self.failed.add(a)
                continue
            self.stats.loads["store"] += 1
            self.stats.load_seconds.append(seconds)
            if isinstance(out, state_io.PagedState):
                w = out.weights
                a.grads, a.optim = out.grads, AdamState(out.optim.step, out.optim.moments, out.optim.family,
                                                      out.optim.betas)
                shutil.rmtree(a.paged, ignore_errors=True)  # type: ignore[arg-type]
                a.paged = None
            else:
                w = out  # type: ignore[assignment]
                a.rank, a.alpha, a.targets = w.rank, w.alpha, tuple(sorted(w.weights))
            self._set_host(a, {t: (x.float(), y.float()) for t, (x, y) in w.weights.items()})
            if a.released and a.refs == 0:
                self._maybe_drop(a)

    # --- weights --------------------------------------------------------------------------------
    def weights(self, adapter_id: str) -> LoraWeights:
        """The adapter's weights (fp32 masters where kept), wherever it lives on device or host."""
        a = self.get(adapter_id)
        if a.slot is not None:
            pairs = self.runner.call("weights", aid=a.id, slot=a.slot, rank=a.rank, targets=a.targets)
        elif a.host is not None and a.host_split:
            pairs = self.runner.call("host_weights", aid=a.id)
        elif a.host is not None:
            pairs = a.host
        else:
            raise RuntimeError(f"adapter {adapter_id!r} is in the store; schedule it first")
        return LoraWeights({t: (x.detach().float().clone(), y.detach().float().clone()) for t, (x, y) in pairs.items()},
                           a.rank, a.alpha)

    def set_weights(self, adapter_id: str, weights: LoraWeights) -> None:
        """Overwrite a device-resident adapter's weights (same rank and targets)."""
        a = self.on_device(adapter_id)
        if weights.rank != a.rank or set(weights.weights) != set(a.targets):
            raise EngineError(
                f"weights of rank {weights.rank} on {sorted(weights.weights)} do not fit adapter {adapter_id!r} "
                f"(rank {a.rank} on {list(a.targets)})"
            )
        a.alpha = weights.alpha
        self.runner.call("set_weights", aid=a.id, slot=a.slot, weights=weights.weights, rank=weights.rank,
                         alpha=weights.alpha, trainable=a.trainable)

    def close(self) -> None:
        """Pages belong to this process's adapters: they go with it."""
        self._pool.shutdown(wait=True, cancel_futures=True)
        with self._queued_lock:  # reads no thread took: nobody waits on them any more
            for a in self._queued:
                if a.loading is not None:
                    a.loading.cancel()
            self._queued.clear()
        shutil.rmtree(self.page_root, ignore_errors=True)


def _start_loader_thread(nice: int) -> None:
    """Single-threaded math (no OpenMP team beside the engine worker's: see LocalEngine.__init__),
    at a lower priority than the steps (EngineSettings.loader_nice)."""
    torch.set_num_threads(1)
    if nice and sys.platform == "linux":  # Linux's setpriority takes a thread id; elsewhere it is a pid
        tid = threading.get_native_id()
        # a sandbox that refuses it: loads still work, at the engine's priority
        with contextlib.suppress(OSError):
            os.setpriority(os.PRIO_PROCESS, tid, min(19, os.getpriority(os.PRIO_PROCESS, tid) + nice))


def _nbytes(pairs: Pairs | None) -> int:
    if not pairs:
        return 0
    return sum(x.numel() * x.element_size() + y.numel() * y.element_size() for x, y in pairs.values())


def _state_bytes(a: Adapter) -> int:
    grads = _nbytes(a.grads)
    moments = sum(m.numel() * m.element_size() for ms in a.optim.moments.values() for m in ms)
    return grads + moments
