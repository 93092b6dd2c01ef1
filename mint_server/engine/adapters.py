"""The engine's working set of adapters: id → slot in the LoRA bank, plus per-adapter training state.

Training and sampling share these slots: an optimizer step updates the slot in place, and a new
revision for the sampler is a fresh slot filled from adapter weights (never a merged checkpoint).
Sampling requests hold a reference on the slot they started with, so a slot that is released or
superseded while requests run is only cleared when the last of them finishes.
"""

from __future__ import annotations

import itertools
import threading
import uuid
from collections import OrderedDict
from dataclasses import dataclass, field

import torch
from torch import Tensor

from mint_server.engine.interface import EngineError
from mint_server.model.config import ModelConfig
from mint_server.model.lora import LoraBank, init_lora_weights, select_targets
from mint_server.model.peft_io import DEFAULT_LORA_ALPHA, LoraWeights


@dataclass
class AdamState:
    step: int = 0
    # target → (m_A, v_A, m_B, v_B), each at the adapter's own rank, float32
    moments: dict[str, tuple[Tensor, Tensor, Tensor, Tensor]] = field(default_factory=dict)


@dataclass
class Adapter:
    id: str
    slot: int
    rank: int
    alpha: float
    targets: tuple[str, ...]
    trainable: bool
    grads: dict[str, tuple[Tensor, Tensor]] = field(default_factory=dict)  # accumulated since last step
    optim: AdamState = field(default_factory=AdamState)
    refcount: int = 0  # in-flight sampling requests pinned to this slot
    released: bool = False
    source: str | None = None  # for sampler adapters loaded from disk: the dir they came from

    @property
    def scale(self) -> float:
        return self.alpha / self.rank


class AdapterRegistry:
    """Owns the LoraBank. Not thread-safe by itself except acquire/unpin; the engine worker drives it."""

    def __init__(
        self, cfg: ModelConfig, num_slots: int, max_rank: int, device: torch.device | str, dtype: torch.dtype
    ) -> None:
        self.cfg = cfg
        self.bank = LoraBank(cfg, num_slots, max_rank, device, dtype)
        self.device, self.dtype = torch.device(device), dtype
        self._adapters: dict[str, Adapter] = {}
        self._free = list(range(num_slots))
        self._lru: OrderedDict[str, None] = OrderedDict()  # unreferenced sampler adapters, oldest first
        self._lock = threading.Lock()
        self._ids = itertools.count()

    # --- lookup ---------------------------------------------------------------------------------
    def get(self, adapter_id: str) -> Adapter:
        a = self._adapters.get(adapter_id)
        if a is None or a.released:
            raise EngineError(f"unknown adapter id {adapter_id!r}")
        return a

    def find_source(self, source: str) -> Adapter | None:
        for a in self._adapters.values():
            if a.source == source and not a.released:
                return a
        return None

    def __len__(self) -> int:
        return sum(not a.released for a in self._adapters.values())

    # --- create / install / release -------------------------------------------------------------
    def create(
        self,
        rank: int,
        seed: int | None,
        train_attn: bool = True,
        train_mlp: bool = True,
        train_unembed: bool = True,
        alpha: float = DEFAULT_LORA_ALPHA,
    ) -> Adapter:
        targets = select_targets(train_attn, train_mlp, train_unembed)
        if not targets:
            raise EngineError("lora_config: at least one of train_attn, train_mlp, train_unembed must be true")
        self._check_rank(rank)
        seed = seed if seed is not None else int(torch.randint(0, 2**31 - 1, ()).item())
        weights = init_lora_weights(self.bank.shapes, targets, rank, seed, self.dtype)
        return self._install(LoraWeights(weights, rank, alpha), trainable=True, source=None)

    def install(self, weights: LoraWeights, trainable: bool, source: str | None = None) -> Adapter:
        self._check_rank(weights.rank)
        return self._install(weights, trainable, source)

    def _check_rank(self, rank: int) -> None:
        if not 1 <= rank <= self.bank.max_rank:
            raise EngineError(f"rank must be in 1..{self.bank.max_rank} (the engine's max LoRA rank), got {rank}")

    def _install(self, weights: LoraWeights, trainable: bool, source: str | None) -> Adapter:
        slot = self._take_slot()
        self.bank.write(slot, {t: (a.to(self.device), b.to(self.device)) for t, (a, b) in weights.weights.items()},
                        weights.rank, weights.alpha)
        adapter = Adapter(
            id=f"a{next(self._ids)}-{uuid.uuid4().hex[:8]}", slot=slot, rank=weights.rank, alpha=weights.alpha,
            targets=tuple(sorted(weights.weights)), trainable=trainable, source=source,
        )
        self._adapters[adapter.id] = adapter
        if not trainable:
            self._lru[adapter.id] = None
        return adapter

    def _take_slot(self) -> int:
        if self._free:
            return self._free.pop(0)
        with self._lock:  # evict the least recently used sampler adapter that nobody is using
            victim = next((i for i in self._lru if self._adapters[i].refcount == 0), None)
        if victim is None:
            raise EngineError(f"all {self.bank.num_slots} adapter slots are in use; release an adapter first")
        self.release(victim)
        return self._free.pop(0)

    def release(self, adapter_id: str) -> None:
        a = self.get(adapter_id)
        a.released = True
        a.grads.clear()
        a.optim = AdamState()
        self._maybe_free(a)

    def _maybe_free(self, a: Adapter) -> None:
        with self._lock:
            if not (a.released and a.refcount == 0):
                return
            self._lru.pop(a.id, None)
            if self._adapters.pop(a.id, None) is None:
                return
        self.bank.clear(a.slot)
        self._free.append(a.slot)

    # --- sampling pins --------------------------------------------------------------------------
    def pin(self, adapter_id: str) -> Adapter:
        a = self.get(adapter_id)
        with self._lock:
            a.refcount += 1
            if a.id in self._lru:
                self._lru.move_to_end(a.id)
        return a

    def unpin(self, a: Adapter) -> None:
        with self._lock:
            a.refcount -= 1
        self._maybe_free(a)

    # --- weights --------------------------------------------------------------------------------
    def weights(self, adapter_id: str) -> LoraWeights:
        a = self.get(adapter_id)
        return LoraWeights(self.bank.read(a.slot), a.rank, a.alpha)

    def set_weights(self, adapter_id: str, weights: LoraWeights) -> None:
        a = self.get(adapter_id)
        if weights.rank != a.rank or set(weights.weights) != set(a.targets):
            raise EngineError(
                f"weights of rank {weights.rank} on {sorted(weights.weights)} do not fit adapter {adapter_id!r} "
                f"(rank {a.rank} on {list(a.targets)})"
            )
        self.bank.write(a.slot, {t: (x.to(self.device), y.to(self.device)) for t, (x, y) in weights.weights.items()},
                        weights.rank, weights.alpha)
        a.alpha = weights.alpha
