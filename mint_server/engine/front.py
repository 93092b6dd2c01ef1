"""What every engine restates in front of its work (local.LocalEngine, fleet.FleetEngine): its
limits from the settings and the base's config, the pure `prepare_*` half of the Engine protocol
(one `Preparer`: the same parsing and checks whatever runs the jobs), the records of sampled
sequences, and the future a sample job answers with."""

from __future__ import annotations

from collections.abc import Sequence
from concurrent.futures import Future
from pathlib import Path
from typing import Any

from tinker import types

from mint_server.engine.custom_loss import CompiledLoss
from mint_server.engine.grammar import Grammars
from mint_server.engine.jobs import (
    AdapterRef,
    CustomJob,
    OptimJob,
    Prompt,
    ReverseKLJob,
    SampleJob,
    TrainJob,
)
from mint_server.engine.losses import LOSSES
from mint_server.engine.preparer import Preparer, image_processing, image_tokens
from mint_server.engine.records import SamplingRecords
from mint_server.engine.sample_request import SampleFuture
from mint_server.engine.settings import EngineLimits, EngineSettings
from mint_server.engine.values import Priority
from mint_server.model.config import ModelConfig


class EngineFront:
    """Limits, parsing and sampling records of an engine over one base model (`_open_front`)."""

    settings: EngineSettings
    limits: EngineLimits
    records: SamplingRecords
    grammars: Grammars
    prepare: Preparer

    def _open_front(self, model_dir: Path, base_model: str, cfg: ModelConfig) -> None:
        """The limits of `self.settings` on this base, its tokenizer, the sampling records (kept where
        results pass through, so training can read the logprobs of any sampled sequence), its grammars
        and the parser that checks every request against all of them."""
        from transformers import AutoTokenizer

        s = self.settings
        self.limits = EngineLimits.of(s, base_model=base_model, arch=cfg.architecture, vocab_size=cfg.vocab_size,
                                      model_context=cfg.max_position_embeddings, loss_fns=frozenset(LOSSES),
                                      image_tokens=image_tokens(cfg))
        self.tokenizer = AutoTokenizer.from_pretrained(model_dir)
        self.records = SamplingRecords(ttl_s=s.records_ttl_s)
        self.grammars = Grammars(self.tokenizer, cfg.vocab_size, cfg.eos_token_ids, self.limits.max_grammar_chars)
        self.prepare = Preparer(self.limits, cfg.eos_token_ids, self.tokenizer.decode, self.records, self.grammars,
                                images=image_processing(cfg, model_dir))

    # --- limits (read by the service) -----------------------------------------------------------
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

    @staticmethod
    def _sample_future(job: SampleJob) -> Future:
        """What `submit(job)` answers with: a SampleFuture knows its sequence ids from the start (Tinker
        returns them before any token is sampled); a score-only job has none."""
        return Future() if job.score_only else SampleFuture(list(job.sequence_ids))

    # --- parsing (pure, any thread) -------------------------------------------------------------
    def prepare_train(self, datums: Sequence[types.Datum], loss_fn: str, loss_fn_config: dict[str, Any] | None,
                      backward: bool = True, key: str = "") -> TrainJob:
        return self.prepare.train(datums, loss_fn, loss_fn_config, backward, key=key)

    def prepare_reverse_kl(self, datums: Sequence[Any], temperature: float, reference: AdapterRef = None) -> ReverseKLJob:
        return self.prepare.reverse_kl(datums, temperature, reference)

    def prepare_optim(self, params: Any, family: str | None = None) -> OptimJob:
        return self.prepare.optim(params, family=family)

    def prepare_prompt(self, prompt: types.ModelInput | Sequence[int]) -> Prompt:
        return self.prepare.prompt(prompt)

    def prepare_sample(self, adapter: AdapterRef, prompt_tokens: Sequence[int] | types.ModelInput | Prompt,
                       num_samples: int,
                       params: types.SamplingParams, prompt_logprobs: bool = False, topk_prompt_logprobs: int = 0,
                       *, record: bool = False, key: str = "", stop_at_eos: bool = False, top_logprobs: int = 0,
                       frequency_penalty: float = 0.0, presence_penalty: float = 0.0,
                       repetition_penalty: float = 1.0, min_p: float = 0.0, logit_bias: Any = None,
                       response_format: Any = None, stop_token_ids: Any = None,
                       priority: Priority = Priority.ROLLOUT, **prompt_and_logprobs: Any) -> SampleJob:
        """`prompt_and_logprobs`: Preparer.sample's target_prompt_logprobs, prompt_alt_tokens_k,
        prompt_logprobs_last_n and logprobs_mode."""
        return self.prepare.sample(adapter, prompt_tokens, num_samples, params, prompt_logprobs,
                                   topk_prompt_logprobs, record=record, key=key, stop_at_eos=stop_at_eos,
                                   top_logprobs=top_logprobs, frequency_penalty=frequency_penalty,
                                   presence_penalty=presence_penalty, priority=priority,
                                   repetition_penalty=repetition_penalty, min_p=min_p, logit_bias=logit_bias,
                                   response_format=response_format, stop_token_ids=stop_token_ids,
                                   **prompt_and_logprobs)

    def prepare_score(self, adapter: AdapterRef, tokens: Sequence[int] | types.ModelInput | Prompt, *, key: str = "",
                      priority: Priority = Priority.ROLLOUT) -> SampleJob:
        return self.prepare.score(adapter, tokens, key=key, priority=priority)

    def prepare_custom(self, datums: Sequence[types.Datum], loss: CompiledLoss) -> CustomJob:
        return self.prepare.custom(datums, loss)
