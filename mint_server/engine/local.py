"""LocalEngine: one resident base model on this process's device, driven through a work queue.

Callers (the service, the CLI) get futures. A single worker thread owns the model, the adapter bank
and the KV cache, so nothing in them needs locks. Each turn of the worker:
  1. fuses every queued forward / forward_backward that may run now (no earlier queued op on the
     same adapter) into one batched pass — several policies train in one forward/backward;
  2. runs the next other op (optim_step, save, load, …) in arrival order;
  3. advances the continuous sampling batch by one step, so sampling never stalls behind training.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from tinker import types

from mint_server.engine.adapters import AdapterRegistry
from mint_server.engine.interface import EngineError
from mint_server.engine.losses import LOSSES
from mint_server.engine.records import SamplingRecords
from mint_server.engine.sampling import Sampler
from mint_server.engine.training import Trainer, TrainRequest
from mint_server.model.loader import default_device, default_dtype, load_model
from mint_server.model.peft_io import load_peft

log = logging.getLogger(__name__)


@dataclass
class EngineSettings:
    adapter_slots: int = 32  # device slots of the LoRA bank (the working set)
    max_rank: int = 64
    kv_slots: int = 64  # concurrent sequences the KV cache holds
    max_seq_len: int | None = None  # per sequence; default min(model context, 2048)
    max_fused_tokens: int = 32768  # bound on one fused training pass
    records_ttl_s: float = 3600.0


@dataclass
class _Work:
    future: Future
    adapters: tuple[str, ...]  # adapters this op reads or writes (for ordering)
    train: TrainRequest | None = None  # fusable forward / forward_backward
    op: Callable[[], Any] | None = None  # anything else
    tokens: int = 0
    enqueued: float = field(default_factory=time.monotonic)


class LocalEngine:
    def __init__(
        self,
        model_dir: str | Path,
        base_model: str,
        device: torch.device | str | None = None,
        dtype: torch.dtype | None = None,
        settings: EngineSettings | None = None,
    ) -> None:
        from transformers import AutoTokenizer

        self.settings = s = settings or EngineSettings()
        self.model_dir, self.base_model = Path(model_dir), base_model
        self.device = torch.device(device) if device is not None else default_device()
        self.dtype = dtype or default_dtype(self.device)
        self.model = load_model(self.model_dir, self.device, self.dtype)
        cfg = self.model.config
        self.vocab_size = cfg.vocab_size
        self.max_context = min(cfg.max_position_embeddings, s.max_seq_len or 2048)
        self.tokenizer = AutoTokenizer.from_pretrained(self.model_dir)
        self.registry = AdapterRegistry(cfg, s.adapter_slots, s.max_rank, self.device, self.dtype)
        self.records = SamplingRecords(ttl_s=s.records_ttl_s)
        self.trainer = Trainer(self.model, self.registry, base_model, records=self.records)
        self.sampler = Sampler(
            self.model, self.registry, kv_slots=s.kv_slots, max_seq_len=self.max_context,
            records=self.records, tokenizer=self.tokenizer,
        )
        self._queue: deque[_Work] = deque()
        self._cv = threading.Condition()
        self._accepting, self._running, self._abort = True, True, False
        self.stats = {"train_passes": 0, "fused_requests": 0, "ops": 0, "sample_steps": 0}
        self._worker = threading.Thread(target=self._loop, name="mint-engine", daemon=True)
        self._worker.start()

    # --- queue ----------------------------------------------------------------------------------
    def _submit(self, work: _Work) -> Future:
        with self._cv:
            if not self._accepting:
                raise EngineError("engine is shutting down")
            self._queue.append(work)
            self._cv.notify()
        return work.future

    def _op(self, fn: Callable[[], Any], *adapters: str | None) -> Future:
        return self._submit(_Work(Future(), tuple(a for a in adapters if a), op=fn))

    def queue_depth(self) -> int:
        return len(self._queue)

    def _take(self) -> tuple[list[_Work], _Work | None]:
        """Under the lock: the fusable training work that may run now, else the next other op."""
        fused: list[_Work] = []
        blocked: set[str] = set()
        tokens = 0
        for w in list(self._queue):
            if w.train is not None and not blocked.intersection(w.adapters):
                if fused and tokens + w.tokens > self.settings.max_fused_tokens:
                    break
                fused.append(w)
                tokens += w.tokens
            else:
                blocked.update(w.adapters)
                if w.train is None and not w.adapters:
                    blocked.add("*")
        if fused:
            for w in fused:
                self._queue.remove(w)
            return fused, None
        return [], (self._queue.popleft() if self._queue else None)

    def _loop(self) -> None:
        while True:
            with self._cv:
                while self._running and not self._queue and not self.sampler.has_work():
                    self._cv.wait(timeout=0.5)
                if self._abort:  # shutdown without draining: running samples fail, on this thread
                    self.sampler.fail_all(EngineError("engine shut down"))
                    return
                if not self._running and not self._queue and not self.sampler.has_work():
                    return
                fused, op = self._take()
            if fused:
                self._run_fused(fused)
            elif op is not None:
                self._run_op(op)
            if self.sampler.has_work():
                try:
                    self.sampler.step()
                    self.stats["sample_steps"] += 1
                except Exception:  # a bug in a step must not kill the worker; requests see it
                    log.exception("sampler step failed")

    def _run_fused(self, work: list[_Work]) -> None:
        for w in work:
            w.future.set_running_or_notify_cancel()
        try:
            results = self.trainer.run([w.train for w in work])
        except Exception as e:  # noqa: BLE001 - the whole pass failed: every caller sees why
            log.exception("fused training pass failed")
            results = [e] * len(work)
        self.stats["train_passes"] += 1
        self.stats["fused_requests"] += len(work)
        for w, r in zip(work, results, strict=True):
            if isinstance(r, BaseException):
                w.future.set_exception(r)
            else:
                w.future.set_result(r)

    def _run_op(self, w: _Work) -> None:
        if not w.future.set_running_or_notify_cancel():
            return
        try:
            w.future.set_result(w.op())
        except Exception as e:  # noqa: BLE001 - delivered to the caller
            if not isinstance(e, EngineError):
                log.exception("engine op failed")
            w.future.set_exception(e)
        self.stats["ops"] += 1

    # --- Engine protocol ------------------------------------------------------------------------
    def create_adapter(self, lora: types.LoraConfig) -> Future[str]:
        def create() -> str:
            return self.registry.create(
                lora.rank, lora.seed, lora.train_attn, lora.train_mlp, lora.train_unembed
            ).id

        return self._op(create)

    def release_adapter(self, adapter_id: str) -> Future[None]:
        return self._op(lambda: self.registry.release(adapter_id), adapter_id)

    def load_peft(self, peft_dir: Path) -> Future[str]:
        """A sampler adapter from a PEFT dir; the same dir loaded twice shares one slot."""
        source = str(Path(peft_dir).resolve())

        def install() -> str:
            existing = self.registry.find_source(source)
            if existing is not None:
                return existing.id
            weights = load_peft(source, self.model.config.num_layers)
            return self.registry.install(weights, trainable=False, source=source).id

        return self._op(install)

    @property
    def loss_fns(self) -> frozenset[str]:
        return frozenset(LOSSES)

    @property
    def arch(self) -> str:
        return self.model.config.architecture

    def validate_train(
        self, adapter_id: str | None, datums: list[types.Datum], loss_fn: str,
        loss_fn_config: dict[str, Any] | None, backward: bool = True,
    ) -> None:
        """Raise EngineError naming the field if this forward(_backward) cannot run; no side effects."""
        self.trainer.validate(TrainRequest(adapter_id, list(datums), loss_fn, loss_fn_config, backward))

    def _train(self, adapter_id: str | None, datums, loss_fn, loss_fn_config, backward: bool) -> Future:
        req = TrainRequest(adapter_id, list(datums), loss_fn, loss_fn_config, backward)
        self.trainer.validate(req)  # bad input fails the caller now, before it can join a fused pass
        tokens = sum(d.model_input.length for d in req.datums)
        return self._submit(_Work(Future(), (adapter_id,) if adapter_id else (), train=req, tokens=tokens))

    def forward(self, adapter_id, datums, loss_fn, loss_fn_config=None) -> Future[types.ForwardBackwardOutput]:
        return self._train(adapter_id, datums, loss_fn, loss_fn_config, backward=False)

    def forward_backward(self, adapter_id, datums, loss_fn, loss_fn_config=None) -> Future[types.ForwardBackwardOutput]:
        return self._train(adapter_id, datums, loss_fn, loss_fn_config, backward=True)

    def forward_backward_reverse_kl(self, adapter_id, reference_adapter_id, datums, temperature=1.0) -> Future:
        return self._op(
            lambda: self.trainer.reverse_kl(adapter_id, reference_adapter_id, list(datums), temperature),
            adapter_id, reference_adapter_id,
        )

    def optim_step(self, adapter_id: str, params: types.AdamParams) -> Future[types.OptimStepResponse]:
        return self._op(lambda: self.trainer.optim_step(adapter_id, params), adapter_id)

    def save_state(self, adapter_id: str, dest: Path, include_optimizer: bool) -> Future[None]:
        return self._op(lambda: self.trainer.save_state(adapter_id, Path(dest), include_optimizer), adapter_id)

    def load_state(self, adapter_id: str, src: Path, include_optimizer: bool) -> Future[None]:
        return self._op(lambda: self.trainer.load_state(adapter_id, Path(src), include_optimizer), adapter_id)

    def export_peft(self, adapter_id: str, dest: Path) -> Future[None]:
        return self._op(lambda: self.trainer.export_peft(adapter_id, Path(dest)), adapter_id)

    def interpolate(self, adapter_ids: list[str], coefficients: list[float]) -> Future[str]:
        return self._op(lambda: self.trainer.interpolate(list(adapter_ids), list(coefficients)), *adapter_ids)

    def sample(
        self,
        adapter_id: str | None,
        prompt_tokens: list[int],
        num_samples: int,
        params: types.SamplingParams,
        prompt_logprobs: bool = False,
        topk_prompt_logprobs: int = 0,
    ) -> Future[types.SampleResponse]:
        # The sampler validates and queues thread-safely; pinning the adapter happens inside submit,
        # so it must not race the worker's registry edits: route it through the worker.
        outer: Future[types.SampleResponse] = Future()

        def submit() -> None:
            inner = self.sampler.submit(adapter_id, list(prompt_tokens), num_samples, params,
                                        prompt_logprobs, topk_prompt_logprobs)
            _chain(inner, outer)

        def submitted(f: Future) -> None:
            if outer.done():
                return
            if f.cancelled():  # shut down before the submit ran
                outer.set_exception(EngineError("engine shut down before the request started"))
            elif f.exception() is not None:
                outer.set_exception(f.exception())

        self._op(submit, adapter_id).add_done_callback(submitted)
        return outer

    def shutdown(self, drain: bool = True) -> None:
        with self._cv:
            self._accepting = False
            if not drain:
                while self._queue:
                    self._queue.popleft().future.cancel()
                self._abort = True
            self._running = False
            self._cv.notify_all()
        self._worker.join()


def _chain(inner: Future, outer: Future) -> None:
    def done(f: Future) -> None:
        if outer.done():
            return
        if f.exception() is not None:
            outer.set_exception(f.exception())
        else:
            outer.set_result(f.result())

    inner.add_done_callback(done)
