"""The engine's typed jobs: what a parsed request is (preparer.Preparer parses every request into
one, once).

Two phases: `Preparer.train / reverse_kl / sample / optim` are pure and thread-safe — they parse
and check a request against the engine's limits and raise EngineError naming the field — and
`Engine.submit(job)` queues the result. Nothing downstream (worker, trainer, sampler) parses or
validates again; it only checks state that can change meanwhile (does the adapter still exist).

A training job's adapter is usually named only when it runs (the client's model is created by an
earlier op in its sequence), so jobs carry `adapter_id=None` until `job.on(adapter_id)`.
"""

from __future__ import annotations

import dataclasses
import threading
from dataclasses import dataclass
from typing import Any

from tinker import types

from mint_server.engine.custom_loss import CompiledLoss
from mint_server.engine.grammar import Grammar
from mint_server.engine.losses import (
    KLRow,
    LossSpec,
    ParsedDatum,
)
from mint_server.engine.sampler_ops import PromptTargets, StopCondition
from mint_server.engine.values import AdapterSource, Priority, TokenCallback
from mint_server.model.images import PromptImages

AdapterRef = str | AdapterSource | None  # an adapter id, a source to open, or None for the bare base


@dataclass(frozen=True)
class TrainJob:
    """forward (backward=False) or forward_backward over parsed datums."""

    datums: tuple[ParsedDatum, ...]
    spec: LossSpec
    config: dict[str, float]
    backward: bool
    adapter_id: str | None = None
    key: str = ""  # the API key's owner: its training tokens count in its fair share of the engine

    @property
    def tokens(self) -> int:
        return sum(len(d.tokens) for d in self.datums)

    def on(self, adapter_id: str | None) -> TrainJob:
        return dataclasses.replace(self, adapter_id=adapter_id)


@dataclass(frozen=True)
class ReverseKLJob:
    rows: tuple[KLRow, ...]
    temperature: float
    reference: AdapterRef = None  # None: the bare base
    adapter_id: str | None = None

    def on(self, adapter_id: str) -> ReverseKLJob:
        return dataclasses.replace(self, adapter_id=adapter_id)


@dataclass(frozen=True)
class OptimJob:
    params: types.AdamParams | types.DimuonParams
    adapter_id: str | None = None

    def on(self, adapter_id: str) -> OptimJob:
        return dataclasses.replace(self, adapter_id=adapter_id)


@dataclass(frozen=True)
class SampleParams:
    max_tokens: int
    temperature: float  # 0 = greedy
    top_k: int  # 0 = no limit
    top_p: float
    seed: int
    stop: StopCondition
    # OpenAI's penalties, over the tokens this sample generated so far: the draw sees
    # logit[t] - frequency_penalty * count[t] - presence_penalty * (count[t] > 0).
    frequency_penalty: float = 0.0
    presence_penalty: float = 0.0
    # vLLM's and transformers' repetition penalty, over the prompt and the tokens generated so far:
    # a seen token's logit is divided by it when positive, multiplied when negative (1 = off).
    repetition_penalty: float = 1.0
    # min-p filtering: tokens whose probability (after temperature, top-k, top-p) is below
    # min_p × the most likely token's are not drawn (0 = off).
    min_p: float = 0.0
    # OpenAI's logit_bias: (token id, bias) pairs added to those logits before anything else shapes them.
    logit_bias: tuple[tuple[int, float], ...] = ()
    # Structured output: the sample's text stays inside this grammar (engine/grammar.py).
    grammar: Grammar | None = None
    # Reported logprobs (sampled tokens and their top alternatives): the raw model's (False, the
    # default: what training computes) or, opted in, those of the distribution the draw used after
    # every control above (vLLM's logprobs_mode="processed_logprobs"; sampler_ops.processed_logprobs).
    processed_logprobs: bool = False


@dataclass(frozen=True)
class Prompt:
    """A parsed prompt (`Preparer.prompt`): token ids, each image standing as its run of image tokens,
    and the images themselves (vision-language bases)."""

    tokens: tuple[int, ...]
    images: PromptImages | None = None


@dataclass(frozen=True)
class SampleJob:
    """Sampling (or, with score_only, SamplingClient.compute_logprobs) of one prompt."""

    adapter: AdapterRef
    prompt: tuple[int, ...]  # an image stands as its run of image tokens (`images` holds the pixels)
    num_samples: int
    params: SampleParams
    sequence_ids: tuple[str, ...]  # the ids clients see, one per sample
    prompt_logprobs: bool = False
    topk_prompt_logprobs: int = 0
    top_logprobs: int = 0  # the k most likely tokens reported at each sampled position
    record: bool = False  # keep sampling logprobs by sequence id (record_stability_info)
    score_only: bool = False
    key: str = ""  # whose work this is: admission is fair across keys
    priority: Priority = Priority.ROLLOUT
    # Streaming: on_token sees each token as it is drawn (on the worker thread); setting `cancel`
    # stops the job at the sampler's next step, frees its KV and fails its future (SampleCancelled).
    on_token: TokenCallback | None = dataclasses.field(default=None, compare=False)
    cancel: threading.Event | None = dataclasses.field(default=None, compare=False)
    images: PromptImages | None = None  # the prompt's images (vision-language bases)
    # tinker 0.38: logprobs of chosen ids at prompt positions, draws at every prompt position, and
    # prompt (top-k) logprobs of only the last n prompt tokens.
    target_prompt_logprobs: PromptTargets | None = dataclasses.field(default=None, compare=False)
    prompt_alt_tokens_k: int = 0
    prompt_logprobs_last_n: int | None = None

    @property
    def prompt_extras(self) -> bool:
        """Whether it wants prompt work a shared prefill does not do for everyone (targets, draws)."""
        return self.target_prompt_logprobs is not None or self.prompt_alt_tokens_k > 0

    @property
    def score_from(self) -> int:
        """The first prompt position whose next-token logprob it wants (0 unless prompt_logprobs_last_n)."""
        n = self.prompt_logprobs_last_n
        return 0 if n is None else len(self.prompt) - 1 - n

    def on(self, adapter: AdapterRef) -> SampleJob:
        return dataclasses.replace(self, adapter=adapter)

    def streaming(self, on_token: TokenCallback | None, cancel: threading.Event | None) -> SampleJob:
        return dataclasses.replace(self, on_token=on_token, cancel=cancel)


@dataclass(frozen=True)
class CustomJob:
    """forward_backward with an uploaded custom loss (engine.custom_loss): a forward-only
    cross-entropy job yields the target logprobs, then the loss runs per datum with autograd."""

    forward: TrainJob
    inputs: tuple[tuple[Any, ...], ...]  # per datum, the loss's loss_fn_inputs as tensors
    loss: CompiledLoss
    adapter_id: str | None = None

    def on(self, adapter_id: str) -> CustomJob:
        return dataclasses.replace(self, forward=self.forward.on(adapter_id), adapter_id=adapter_id)


Job = TrainJob | ReverseKLJob | OptimJob | SampleJob | CustomJob
