"""The tensor-parallel model runner: one engine on N ranks; scheduling on rank 0, tensor work on all.

vLLM v1's split. The engine worker (queue, fusing, residency bookkeeping, sampler admission and
token choice, losses) runs only on rank 0, in the server process. Wherever it needs tensor work on
split state — a forward, a backward, an optimizer step, filling or reading a bank slot — it calls
`Runner.call(op, **inputs)`: rank 0 broadcasts the op's name and inputs (metadata, token tensors,
and full adapter weights when a slot is filled), then every rank runs the same op function on its
own `Shard` (its share of the model, the LoRA bank, the KV cache and the adapters' device-side
training state). Followers (ranks 1..N-1, spawned processes) only receive and run ops, in order,
so every collective inside an op meets its peers. The split itself is model/tp.py's.

What crosses the boundary: full adapter state arriving from a client or the store (install, load,
a store read) goes to every rank, which keeps its share (`promote`, `set_weights`, `set_optim`); an
adapter leaving its slot keeps each rank's share in that rank's host memory (`demote`,
`promote_split`); whatever leaves the engine — a save, an export, a page written to the store — is
all-gathered (`weights`, `gather_optim`, `gather_host`), so every file holds the ordinary unsplit
layout.

A rank-0 op that fails before its collectives leaves the followers waiting for the next op, which
is fine; the ops check nothing that could differ between ranks (rank 0 validates requests before).
A follower that fails inside an op (out of memory) leaves rank 0 waiting in that op's collective:
there is no recovery yet. One tp > 1 engine per process (it owns the default process group).
"""

from __future__ import annotations

import logging
import multiprocessing as mp
import pickle
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor

from mint_server.engine import executor
from mint_server.engine.host_memory import keep_freed_memory
from mint_server.engine.masters import masters_for, publish, step_params
from mint_server.engine.optim import STEP_OF, Pairs, family_of, step_or_rollback
from mint_server.engine.training import target_logprobs
from mint_server.engine.training_lora import LoraRef, accumulate, leaf_grads, training_lora
from mint_server.engine.values import AdamState, EngineError, EngineFailed
from mint_server.model import tp as tpmod
from mint_server.model.kv_cache import KVCache
from mint_server.model.lora import LoraBank

log = logging.getLogger(__name__)
OPS: dict[str, Callable[..., Any]] = {}


def op(fn: Callable[..., Any]) -> Callable[..., Any]:
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


# Idle followers wait for rank 0's next op in a gloo group of its own, whose timeout is this long
# (in effect none); rank 0 bounds its side of each dispatch, and the collectives inside ops use the
# default group, by tp_timeout_s.
CONTROL_TIMEOUT = timedelta(days=365)


def control_group() -> Any:
    """The group ops are dispatched over; every rank creates it right after joining."""
    return dist.new_group(backend="gloo", timeout=CONTROL_TIMEOUT)


def send_op(message: Any, group: Any, timeout: timedelta) -> None:
    """Rank 0: broadcast one pickled op. A rank that is stopped never takes it, so each send waits at
    most `timeout` (RuntimeError past it) instead of the control group's unbounded wait."""
    data = torch.frombuffer(bytearray(pickle.dumps(message, protocol=pickle.HIGHEST_PROTOCOL)), dtype=torch.uint8)
    for part in (torch.tensor([data.numel()], dtype=torch.int64), data):
        dist.broadcast(part, src=0, group=group, async_op=True).wait(timeout=timeout)


def receive_op(group: Any) -> Any:
    """A follower: wait (without a limit) for rank 0's next op."""
    size = torch.zeros(1, dtype=torch.int64)
    dist.broadcast(size, src=0, group=group)
    data = torch.empty(int(size.item()), dtype=torch.uint8)
    dist.broadcast(data, src=0, group=group)
    return pickle.loads(data.numpy().tobytes())


class Runner:
    """Rank 0's handle: `call` runs an op on every rank and returns rank 0's result."""

    def __init__(self, shard: Shard, followers: list[Any], control: Any, timeout_s: float) -> None:
        self.shard, self.tp, self.followers, self.control = shard, shard.tp, followers, control
        self.timeout = timedelta(seconds=timeout_s)
        self.failed: str | None = None  # why the group is broken, once a rank has died or hung

    def call(self, name: str, **inputs: Any) -> Any:
        """A dead follower fails this op and every later one at once with EngineFailed (gloo sees
        the closed connection within milliseconds); a hung one fails it after tp_timeout_s. Either
        way no op is sent into the broken group again."""
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
        try:
            if self.failed is None:
                send_op(("stop", {}), self.control, self.timeout)
        finally:
            for p in self.followers:
                p.join(timeout=60)
            dist.destroy_process_group()


# --- starting ranks -------------------------------------------------------------------------------
def start_followers(world: int, model_dir: Path, settings: Any, device: torch.device,
                    dtype: torch.dtype) -> tuple[tpmod.TP, list[Any], Any]:
    """Spawn ranks 1..world-1 and join the group as rank 0 (returns once every rank has joined)."""
    port = tpmod.free_port()
    ctx = mp.get_context("spawn")
    procs = []
    for rank in range(1, world):
        p = ctx.Process(target=follower_main, args=(rank, world, port, str(model_dir), settings, str(device), dtype),
                        name=f"mint-tp-{rank}", daemon=True)
        p.start()
        procs.append(p)
    try:
        tp = tpmod.init(0, world, port, backend="nccl" if device.type == "cuda" else "gloo",
                        timeout_s=settings.tp_timeout_s)
        control = control_group()
    except Exception:
        for p in procs:
            p.kill()
        raise
    return tp, procs, control


def follower_main(rank: int, world: int, port: int, model_dir: str, settings: Any, device: str,
                  dtype: torch.dtype) -> None:
    """A follower rank: load and split the model, then run rank 0's ops until told to stop."""
    from mint_server.model.loader import load_model

    torch.set_num_threads(settings.intra_op_threads())
    dev = torch.device(device)
    if dev.type == "cuda":
        dev = torch.device("cuda", rank % torch.cuda.device_count())
    elif settings.keep_freed_memory:
        keep_freed_memory()
    tp = tpmod.init(rank, world, port, backend="nccl" if dev.type == "cuda" else "gloo",
                    timeout_s=settings.tp_timeout_s)
    control = control_group()
    model = load_model(Path(model_dir), dev, dtype, tp=tp)  # reads only this rank's slices
    cfg = model.config
    bank = LoraBank(cfg, settings.device_slots, settings.max_rank, dev, dtype,
                    shapes=tpmod.local_target_shapes(cfg, world))
    shard = Shard(tp, model, bank, dev, dtype)
    while True:
        name, inputs = receive_op(control)
        if name == "stop":
            break
        try:
            OPS[name](shard, **inputs)
        except EngineError:  # rank 0 raised the same and answers the request
            pass
        except Exception:  # noqa: BLE001 - a follower keeps serving; rank 0 sees its own error
            log.exception("tp rank %d: op %s failed", rank, name)
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


# --- residency: filling and reading slots ---------------------------------------------------------
@op
def promote(sh: Shard, aid: str, slot: int, weights: Pairs, rank: int, alpha: float, trainable: bool,
            grads: Pairs, moments: dict, step: int, family: str) -> None:
    """host → device: every rank writes its share of the (full) weights and training state."""
    rec = sh.record(aid)
    local = _to(tpmod.shard_pairs(weights, sh.tp), sh.device)
    sh.bank.write(slot, local, rank, alpha)
    rec.master = masters_for(local, trainable, sh.dtype)
    rec.grads = _to(tpmod.shard_pairs(grads, sh.tp), sh.device)
    rec.optim = AdamState(step, _to(tpmod.shard_moments(moments, family, sh.tp), sh.device), family)


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
    """device → host: every rank keeps its share (weights or fp32 masters, gradients, moments) in its
    own host memory; nothing crosses ranks."""
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
def set_optim(sh: Shard, aid: str, step: int, moments: dict, family: str) -> None:
    """Loaded optimizer state (full) → every rank's share; pending gradients dropped."""
    rec = sh.record(aid)
    rec.grads = {}
    rec.optim = AdamState(step, _to(tpmod.shard_moments(moments, family, sh.tp), sh.device), family)


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
    norm = tpmod.grad_norm(rec.grads, sh.tp)
    rec.optim.family = family = family_of(params)  # rank 0 checked it against the adapter's
    extra = {"tp": sh.tp} if family == "dimuon" else {}  # Dimuon orthogonalizes over the full factor
    metrics = step_or_rollback(STEP_OF[family], params_, rec.grads, rec.optim, params, sh.tp.all_true,
                               norm=norm, **extra)
    publish(views, params_)
    rec.grads = {}
    return metrics


# --- training pass --------------------------------------------------------------------------------
@op
def train_forward(sh: Shard, tokens: Tensor, targets: Tensor, row_slots: list[int] | None,
                  adapters: list[LoraRef] | None, row_adapter: list[int] | None, backward: bool,
                  recomputed_blocks: int, logits_chunk: int) -> Tensor:
    """Target logprobs [rows, T, K] (replicated); with backward, the graph waits for `train_backward`."""
    leaves = None
    lora = None
    if backward:
        lora, leaves = training_lora(sh.bank, adapters, row_adapter, sh.device, sh.dtype)  # type: ignore[arg-type]
    elif row_slots is not None:
        lora = sh.bank.batch(row_slots, sh.device)
    with torch.set_grad_enabled(backward):
        h = sh.model.hidden_states(tokens.to(sh.device), lora=lora, recomputed_blocks=recomputed_blocks)
        lp = target_logprobs(sh.model, h, lora, targets.to(sh.device), logits_chunk)
    sh.pass_state = (lp, leaves) if backward else None
    return lp


@op
def train_backward(sh: Shard, grad: Tensor) -> None:
    """Backpropagate rank 0's d(loss)/d(logprobs) through every rank's share; gradients stay pending."""
    assert sh.pass_state is not None
    lp, leaves = sh.pass_state
    sh.pass_state = None
    lp.backward(grad.to(lp.device))
    accumulate(sh.pending, leaf_grads(leaves))


@op
def train_commit(sh: Shard, keep: bool) -> list[str]:
    """End of a pass: add the pending gradients to the adapters (ids whose gradients are non-finite on
    any rank are refused and returned), or drop them (`keep` False: the pass failed)."""
    pending, sh.pending, sh.pass_state = sh.pending, {}, None
    failed: list[str] = []
    if not keep:
        return failed
    for aid in sorted(pending):
        grads = pending[aid]
        finite = all(bool(torch.isfinite(g).all()) for pair in grads.values() for g in pair)
        if not sh.tp.all_true(finite):
            failed.append(aid)
            continue
        accumulate(sh.record(aid).grads, grads)
    return failed


@op
def reverse_kl_pass(sh: Shard, rows: list[Any], student: LoraRef, reference_slot: int | None, temperature: float,
                    recomputed_blocks: int) -> Any:
    """One reverse-KL micro-batch on every rank's share (the KL over the gathered logits is the same on
    every rank); the student's gradients stay pending until `train_commit`."""
    from mint_server.engine.reverse_kl import kl_micro_batch

    el, leaves = kl_micro_batch(sh.model, sh.bank, rows, student, reference_slot, temperature, sh.device, sh.dtype,
                                recomputed_blocks)
    accumulate(sh.pending, leaf_grads(leaves))
    return el


# --- sampling -------------------------------------------------------------------------------------
@op
def make_cache(sh: Shard, num_blocks: int, block_size: int) -> None:
    cfg = tpmod.local_config(sh.model.config, sh.tp.world)
    sh.cache = KVCache(cfg, num_blocks, block_size, sh.device, sh.dtype)


# the sampler's step, block copies and swaps: the executor's ops, the same functions on every rank
OPS.update(executor.OPS)
