"""Drive the trainer and sampler the way the engine worker does, for unit tests: requests are
parsed by a `Preparer` (the engine's one parser) and adapters come from a `Residency`."""

from __future__ import annotations

from concurrent.futures import Future
from dataclasses import dataclass
from typing import Any

import torch

from mint_server.engine.adapter_state import AdapterState
from mint_server.engine.interface import EngineError
from mint_server.engine.jobs import TrainJob
from mint_server.engine.losses import LOSSES
from mint_server.engine.preparer import Preparer
from mint_server.engine.residency import Residency
from mint_server.engine.reverse_kl import ReverseKL
from mint_server.engine.sampling import Sampler
from mint_server.engine.settings import EngineLimits, EngineSettings
from mint_server.engine.training import Trainer
from mint_server.model.config import ModelConfig


def make_residency(cfg: ModelConfig, num_slots: int, max_rank: int, device: str = "cpu",
                   dtype: torch.dtype = torch.float32, **settings: Any) -> Residency:
    return Residency(cfg, EngineSettings(device_slots=num_slots, max_rank=max_rank, **settings), device, dtype)


def limits_for(cfg: ModelConfig, max_context: int | None = None, max_rank: int = 64,
               max_num_samples: int = 1024) -> EngineLimits:
    return EngineLimits(base_model="tiny", arch=cfg.architecture, vocab_size=cfg.vocab_size,
                        max_context=max_context or cfg.max_position_embeddings, max_rank=max_rank,
                        max_num_samples=max_num_samples, max_top_k=cfg.vocab_size, loss_fns=frozenset(LOSSES))


def preparer(cfg: ModelConfig, records: Any = None, tokenizer: Any = None, grammars: Any = None,
             **limits: Any) -> Preparer:
    return Preparer(limits_for(cfg, **limits), cfg.eos_token_ids, tokenizer.decode if tokenizer else None, records,
                    grammars)


def train_job(trainer: Any, adapter_id: str | None, datums: list, loss_fn: str = "cross_entropy",
              loss_fn_config: dict | None = None, backward: bool = True, records: Any = None) -> TrainJob:
    """A parsed forward(_backward) for `trainer`'s model."""
    prep = preparer(trainer.model.config, records=records)
    return prep.train(datums, loss_fn, loss_fn_config, backward).on(adapter_id)


class SamplerHarness:
    """A Sampler with the old one-call submit: parse, reference the adapter, queue."""

    def __init__(self, model: Any, residency: Residency, *, kv_slots: int = 8, max_seq_len: int = 96,
                 records: Any = None, tokenizer: Any = None, decode: Any = None, max_num_samples: int = 1024,
                 max_step_tokens: int = 16384, grammars: Any = None, **sampler_kw: Any) -> None:
        self.residency = residency
        self.prep = preparer(model.config, records=records, tokenizer=tokenizer, max_context=max_seq_len,
                             max_num_samples=max_num_samples, max_rank=residency.bank.max_rank, grammars=grammars)
        if decode is not None:
            self.prep.decode = decode
        if "eos_token_ids" in sampler_kw:
            from mint_server.engine.sampler_ops import StopCondition

            self.prep.eos = StopCondition(token_ids=frozenset(sampler_kw.pop("eos_token_ids")))
        self.sampler = Sampler(model, residency, kv_budget_tokens=kv_slots * max_seq_len, max_seq_len=max_seq_len,
                               records=records, max_step_tokens=max_step_tokens, grammars=grammars, **sampler_kw)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.sampler, name)

    def submit(self, adapter_id: str | None, prompt: list[int], n: int, params: Any, prompt_logprobs: bool = False,
               topk_prompt_logprobs: int = 0, *, record_stability_info: bool = False, key: str = "",
               **options: Any) -> Future:
        """`options`: Preparer.sample's keyword options (top_logprobs, penalties)."""
        job = self.prep.sample(adapter_id, prompt, n, params, prompt_logprobs, topk_prompt_logprobs,
                               record=record_stability_info, key=key, **options)
        return self._queue_job(job, adapter_id)

    def compute_logprobs(self, adapter_id: str | None, tokens: list[int]) -> Future:
        return self._queue_job(self.prep.score(adapter_id, tokens), adapter_id)

    def _queue_job(self, job: Any, adapter_id: str | None) -> Future:
        adapter = self.residency.get(adapter_id) if adapter_id is not None else None
        if adapter is not None:
            self.residency.ref(adapter)
        return self.sampler.submit(job, adapter)


@dataclass
class TrainRequest:
    """A raw forward(_backward) request, as a client would send it (parsed by `Harness.run`)."""

    adapter_id: str | None
    datums: list
    loss_fn: str
    loss_fn_config: dict | None = None
    backward: bool = True


def AdapterRegistry(cfg: ModelConfig, num_slots: int, max_rank: int, device: str = "cpu",  # noqa: N802
                    dtype: torch.dtype = torch.float32) -> Residency:
    return make_residency(cfg, num_slots, max_rank, device, dtype)


class TrainerHarness(Trainer):
    """A Trainer whose calls take raw requests and parse them first, as the engine's callers do."""

    def __init__(self, model: Any, residency: Residency, base_model: str, records: Any = None, **kw: Any) -> None:
        super().__init__(model, residency, base_model, **kw)
        self.prep = preparer(model.config, records=records, max_rank=residency.bank.max_rank)
        self.state = AdapterState(residency, base_model, model.config)
        self.save_state, self.load_state = self.state.save_state, self.state.load_state
        self.export_peft, self.interpolate = self.state.export_peft, self.state.interpolate

    def validate(self, req: TrainRequest) -> TrainJob:
        return self.prep.train(req.datums, req.loss_fn, req.loss_fn_config, req.backward).on(req.adapter_id)

    def run(self, reqs: list) -> list:  # type: ignore[override]
        out: list = []
        jobs = []
        for r in reqs:
            try:
                jobs.append(self.validate(r) if isinstance(r, TrainRequest) else r)
                out.append(None)
            except EngineError as e:
                out.append(e)
        results = iter(super().run(jobs))
        return [e if e is not None else next(results) for e in out]

    def reverse_kl(self, adapter_id: str, reference_id: str | None, datums: list,
                   temperature: float = 1.0) -> Any:
        return ReverseKL(self).run(self.prep.reverse_kl(datums, temperature).on(adapter_id), reference_id)

    def optim_step(self, adapter_id: str, params: Any) -> Any:
        return self.state.optim_step(self.prep.optim(params).on(adapter_id))

    def create_adapter(self, lora: Any) -> str:
        return self.residency.create(lora.rank, lora.seed, lora.train_attn, lora.train_mlp, lora.train_unembed).id
