"""The model runner: every piece of tensor work on adapter or model state is an op run on each rank.

One engine runs on N ranks (tensor parallel, vLLM v1's split); a single process is the same thing at
world size 1, a shard of one. The engine worker (queue, fusing, residency bookkeeping, sampler
admission and token choice, losses) runs only on rank 0. Wherever it needs tensor work — a forward,
a backward, an optimizer step, filling or reading a bank slot — it calls `Runner.call(op, **inputs)`:
every rank runs the same op function on its own `Shard` (its share of the model, the LoRA bank, the
KV cache and the adapters' device-side training state). At world 1 that is a plain call; at N > 1
rank 0 first broadcasts the op's name and inputs to the followers (engine/tp_runner.py starts them),
so every collective inside an op meets its peers. The split itself is model/tp.py's; at world 1 its
splits and gathers are the identity and its collectives return their input.

Each op body exists once: the slot and optimizer ops here, the training pass's in training.py, the
reverse-KL pass's in reverse_kl.py, the sampler's in executor.py (they register with `op`).

What crosses ranks: full adapter state arriving from a client or the store (install, load, a store
read) goes to every rank, which keeps its share (`promote`, `set_weights`, `set_optim`); an adapter
leaving its slot keeps each rank's share in that rank's host memory (`demote`, `promote_split`);
whatever leaves the engine — a save, an export, a page written to the store — is all-gathered
(`weights`, `gather_optim`, `gather_host`), so every file holds the ordinary unsplit layout.

A rank-0 op that fails before its collectives leaves the followers waiting for the next op, which
is fine; the ops check nothing that could differ between ranks (rank 0 validates requests before).
A follower that fails inside an op (out of memory) leaves rank 0 waiting in that op's collective:
there is no recovery yet. One tp > 1 engine per process (it owns the default process group).
"""

from __future__ import annotations

import pickle
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor

from mint_server.engine.masters import masters_for, publish, step_params
from mint_server.engine.optim import STEP_OF, Pairs, family_of, step_or_rollback
from mint_server.engine.values import AdamState, EngineFailed
from mint_server.model import tp as tpmod
from mint_server.model.kv_cache import KVCache
from mint_server.model.lora import LoraBank
from mint_server.model.qwen3_vl import FeatureCache
from mint_server.model.recurrent_state import StateCache

OPS: dict[str, Callable[..., Any]] = {}


def op(fn: Callable[..., Any]) -> Callable[..., Any]:
    """Register `fn(shard, **inputs)` as an op every rank can run."""
    OPS[fn.__name__] = fn
    return fn


@dataclass(eq=False)
class Record:
    """A follower's device-side state of one adapter (on rank 0 it is the residency's Adapter)."""

    id: str
    grads: dict[str, tuple[Tensor, Tensor]] = field(default_factory=dict)
    optim: AdamState = field(default_factory=AdamState)
    master: Pairs | None = None
    host: Pairs | None = None  # this rank's share while the adapter is in the host tier


class Shard:
    """One rank's share: model, bank, KV cache, adapters' device-side state, an in-flight pass."""

    def __init__(self, tp: tpmod.TP, model: Any, bank: LoraBank, device: torch.device, dtype: torch.dtype,
                 resolve: Callable[[str], Any] | None = None) -> None:
        self.tp, self.model, self.bank, self.device, self.dtype = tp, model, bank, device, dtype
        self.cache: KVCache | None = None
        self.states: Any = None  # hybrid bases' recurrent states (world 1 only: hybrid bases refuse tp > 1)
        self.features: Any = None  # encoded images by digest (vision bases, world 1 only)
        self._resolve = resolve  # rank 0: adapter id → the residency's Adapter
        self._records: dict[str, Record] = {}
        self.pass_state: tuple[Tensor, Any] | None = None  # (logprobs, leaves) between forward and backward
        self.pending: dict[str, Pairs] = {}  # gradients of the current pass, committed at its end
        self.swapped: dict[int, dict[str, Tensor]] = {}  # preempted sequences' KV (executor.swap_out)

    def record(self, aid: str) -> Any:
        if self._resolve is not None:
            return self._resolve(aid)
        return self._records.setdefault(aid, Record(aid))

    def forget(self, aid: str) -> None:
        if self._resolve is None:
            self._records.pop(aid, None)


def send_op(message: Any, group: Any, timeout: timedelta) -> None:
    """Rank 0: broadcast one pickled op. A rank that is stopped never takes it, so each send waits at
    most `timeout` (RuntimeError past it) instead of the control group's unbounded wait."""
    data = torch.frombuffer(bytearray(pickle.dumps(message, protocol=pickle.HIGHEST_PROTOCOL)), dtype=torch.uint8)
    for part in (torch.tensor([data.numel()], dtype=torch.int64), data):
        dist.broadcast(part, src=0, group=group, async_op=True).wait(timeout=timeout)


class Runner:
    """Rank 0's handle: `call` runs an op on every rank and returns rank 0's result."""

    def __init__(self, shard: Shard, followers: list[Any] | None = None, control: Any = None,
                 timeout_s: float = 0.0) -> None:
        self.shard, self.tp, self.followers, self.control = shard, shard.tp, followers or [], control
        self.timeout = timedelta(seconds=timeout_s)
        self.failed: str | None = None  # why the group is broken, once a rank has died or hung

    @classmethod
    def single(cls, bank: LoraBank, device: torch.device, dtype: torch.dtype, model: Any = None,
               resolve: Callable[[str], Any] | None = None) -> Runner:
        """A shard of one: world size 1, no followers, no process group."""
        return cls(Shard(tpmod.TP(0, 1), model, bank, device, dtype, resolve))

    def call(self, name: str, **inputs: Any) -> Any:
        """A dead follower fails this op and every later one at once with EngineFailed (gloo sees
        the closed connection within milliseconds); a hung one fails it after tp_timeout_s. Either
        way no op is sent into the broken group again."""
        if not self.followers:  # a shard of one: nothing to broadcast
            return OPS[name](self.shard, **inputs)
        self._check_followers()
        try:
            send_op((name, inputs), self.control, self.timeout)
            return OPS[name](self.shard, **inputs)
        except RuntimeError as e:  # torch.distributed's error for a peer that went away or timed out
            self._check_followers()
            # Alive but not answering: the ranks no longer agree on where they are in the op stream.
            self.failed = (f"tensor-parallel op {name!r} did not complete on every rank ({e}); this engine "
                           "cannot run work until the server is restarted")
            raise EngineFailed(self.failed) from e

    def _check_followers(self) -> None:
        if self.failed is None:
            dead = [(rank, p.exitcode) for rank, p in enumerate(self.followers, start=1) if not p.is_alive()]
            if dead:
                rank, code = dead[0]
                self.failed = (f"tensor-parallel rank {rank} died (exit code {code}); this engine cannot run "
                               "work until the server is restarted")
        if self.failed is not None:
            raise EngineFailed(self.failed)

    def close(self) -> None:
        """Stop the followers (once; a shard of one has none)."""
        if not self.followers:
            return
        followers, self.followers = self.followers, []
        try:
            if self.failed is None:
                send_op(("stop", {}), self.control, self.timeout)
        finally:
            for p in followers:
                p.join(timeout=60)
            dist.destroy_process_group()


# --- helpers ----------------------------------------------------------------------------------------
def _to(pairs: Any, device: torch.device, dtype: torch.dtype | None = None) -> dict:
    return {t: tuple(x.to(device=device, dtype=dtype or x.dtype) for x in xs) for t, xs in pairs.items()}


def _views(sh: Shard, slot: int, rank: int, targets: tuple[str, ...]) -> Pairs:
    return {t: (sh.bank.A[t][slot][..., :rank, :], sh.bank.B[t][slot][..., :rank]) for t in targets}


def _current(sh: Shard, aid: str, slot: int, rank: int, targets: tuple[str, ...]) -> Pairs:
    """This rank's share of the adapter's weights: fp32 masters where kept, else its bank slot."""
    rec = sh.record(aid)
    return rec.master if rec.master is not None else _views(sh, slot, rank, targets)


def _cpu_full(pairs: Any, sh: Shard) -> dict:
    return {t: tuple(x.detach().float().cpu() for x in xs) for t, xs in tpmod.gather_pairs(pairs, sh.tp).items()}


def _local_optim(sh: Shard, optim: AdamState) -> AdamState:
    """This rank's share of a full optimizer state, on the device."""
    moments = _to(tpmod.shard_moments(optim.moments, optim.family, sh.tp), sh.device)
    return AdamState(optim.step, moments, optim.family, optim.betas)


# --- residency: filling and reading slots ---------------------------------------------------------
@op
def promote(sh: Shard, aid: str, slot: int, weights: Pairs, rank: int, alpha: float, trainable: bool,
            grads: Pairs, optim: AdamState) -> None:
    """host → device: every rank writes its share of the (full) weights and training state."""
    rec = sh.record(aid)
    local = _to(tpmod.shard_pairs(weights, sh.tp), sh.device)
    sh.bank.write(slot, local, rank, alpha)
    rec.master = masters_for(local, trainable, sh.dtype)
    rec.grads = _to(tpmod.shard_pairs(grads, sh.tp), sh.device)
    rec.optim = _local_optim(sh, optim)


@op
def promote_split(sh: Shard, aid: str, slot: int, rank: int, alpha: float, trainable: bool) -> None:
    """host → device for an adapter whose host copy is split: every rank moves its own share."""
    rec = sh.record(aid)
    local = _to(rec.host, sh.device)
    sh.bank.write(slot, local, rank, alpha)
    rec.master = masters_for(local, trainable, sh.dtype)
    rec.grads = _to(rec.grads, sh.device)
    rec.optim.moments = _to(rec.optim.moments, sh.device)
    rec.host = None


@op
def demote(sh: Shard, aid: str, slot: int, rank: int, targets: tuple[str, ...]) -> None:
    """device → host: every rank keeps an exact copy of its share (weights or fp32 masters, gradients,
    moments) in its own host memory; nothing crosses ranks."""
    rec = sh.record(aid)
    rec.host = {t: (x.detach().float().cpu().clone(), y.detach().float().cpu().clone())
                for t, (x, y) in _current(sh, aid, slot, rank, targets).items()}
    rec.master = None
    rec.grads = _to(rec.grads, torch.device("cpu"))
    rec.optim.moments = _to(rec.optim.moments, torch.device("cpu"))


@op
def gather_host(sh: Shard, aid: str) -> tuple[Pairs, Pairs, dict]:
    """host → store for a split host copy: the full weights, gradients and moments (every rank
    drops its share)."""
    rec = sh.record(aid)
    host = _cpu_full(rec.host, sh)
    grads = _cpu_full(rec.grads, sh)
    moments = {t: tuple(m.cpu() for m in ms)
               for t, ms in tpmod.gather_moments(rec.optim.moments, rec.optim.family, sh.tp).items()}
    sh.forget(aid)
    return host, grads, moments


@op
def host_weights(sh: Shard, aid: str) -> Pairs:
    return _cpu_full(sh.record(aid).host, sh)


@op
def forget(sh: Shard, aid: str) -> None:
    sh.forget(aid)


@op
def weights(sh: Shard, aid: str, slot: int, rank: int, targets: tuple[str, ...]) -> Pairs:
    """The full weights (fp32 masters where kept), on the host."""
    return _cpu_full(_current(sh, aid, slot, rank, targets), sh)


@op
def clear(sh: Shard, aid: str, slot: int) -> None:
    sh.bank.clear(slot)
    sh.forget(aid)


@op
def set_weights(sh: Shard, aid: str, slot: int, weights: Pairs, rank: int, alpha: float, trainable: bool) -> None:
    rec = sh.record(aid)
    local = _to(tpmod.shard_pairs(weights, sh.tp), sh.device)
    sh.bank.write(slot, local, rank, alpha)
    rec.master = masters_for(local, trainable, sh.dtype)


@op
def set_optim(sh: Shard, aid: str, optim: AdamState) -> None:
    """Loaded optimizer state (full) → every rank's share; pending gradients dropped."""
    rec = sh.record(aid)
    rec.grads = {}
    rec.optim = _local_optim(sh, optim)


@op
def gather_optim(sh: Shard, aid: str) -> AdamState:
    rec = sh.record(aid)
    moments = {t: tuple(m.cpu() for m in ms)
               for t, ms in tpmod.gather_moments(rec.optim.moments, rec.optim.family, sh.tp).items()}
    return AdamState(rec.optim.step, moments, rec.optim.family, rec.optim.betas)


# --- optimizer --------------------------------------------------------------------------------------
@op
def optim_step(sh: Shard, aid: str, slot: int, rank: int, targets: tuple[str, ...], params: Any) -> dict[str, float]:
    """AdamW or Dimuon on every rank's share with the global gradient norm; all or nothing across ranks."""
    rec = sh.record(aid)
    views = _views(sh, slot, rank, targets)
    params_ = step_params(views, rec.master, sh.dtype)
    if params_ is not views:
        rec.master = params_
    rec.optim.family = family = family_of(params)  # rank 0 checked it against the adapter's
    # One rank holds whole factors: the step's own norm and orthogonalization (optim.grad_norm's float32
    # sum, bit for bit as ever). A share: the global norm; Dimuon orthogonalizes over the full factor.
    across_ranks: dict[str, Any] = {}
    if sh.tp.world > 1:
        across_ranks = {"norm": tpmod.grad_norm(rec.grads, sh.tp), **({"tp": sh.tp} if family == "dimuon" else {})}
    metrics = step_or_rollback(STEP_OF[family], params_, rec.grads, rec.optim, params, sh.tp.all_true,
                               **across_ranks)
    publish(views, params_)
    rec.grads = {}
    return metrics


# --- the sampler's KV cache -------------------------------------------------------------------------
@op
def make_cache(sh: Shard, num_blocks: int, block_size: int, dtype: torch.dtype, state_slots: int = 0) -> None:
    """The sampler's KV cache (this rank's KV heads) and, for hybrid bases, recurrent-state slots."""
    cfg = sh.model.config
    sh.cache = KVCache(tpmod.local_config(cfg, sh.tp.world), num_blocks, block_size, sh.device, dtype)
    sh.states = StateCache.for_model(cfg, state_slots, sh.device, dtype)
    sh.features = FeatureCache()
