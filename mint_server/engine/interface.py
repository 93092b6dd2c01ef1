"""The contract between the service layer and an engine.

The service never touches tensors: it turns HTTP requests into calls on an `Engine`, each of which
returns a `concurrent.futures.Future` completed by the engine's own worker. Work queued by several
clients is fused by the engine's scheduler, so a call may wait for others before it runs. Wire types
come from the `tinker` package.

Adapter ids are opaque strings chosen by the engine. `None` as an adapter id means the bare base.
"""

from __future__ import annotations

from concurrent.futures import Future
from pathlib import Path
from typing import Any, Protocol

from tinker import types


class EngineError(ValueError):
    """A request the engine refuses (bad input); the message names the field. Maps to HTTP 400."""


class NotSupportedError(EngineError):
    """A feature the engine does not implement; maps to HTTP 400 with a clear message."""


class Engine(Protocol):
    base_model: str  # user-facing name, e.g. "HuggingFaceTB/SmolLM2-135M-Instruct"
    model_dir: Path  # HF checkpoint dir: config.json, tokenizer files
    vocab_size: int
    max_context: int
    arch: str  # HF architecture of the base, e.g. "LlamaForCausalLM"
    loss_fns: frozenset[str]

    def validate_train(
        self,
        adapter_id: str | None,
        datums: list[types.Datum],
        loss_fn: str,
        loss_fn_config: dict[str, Any] | None,
        backward: bool = True,
    ) -> None:
        """Raise EngineError naming the field if this call cannot run; no side effects, thread-safe."""
        ...

    # --- adapters -------------------------------------------------------------------------------
    def create_adapter(self, lora: types.LoraConfig) -> Future[str]: ...
    def release_adapter(self, adapter_id: str) -> Future[None]: ...
    def load_peft(self, peft_dir: Path) -> Future[str]:
        """A sampler-only adapter from a PEFT dir (exported weights)."""
        ...

    # --- training -------------------------------------------------------------------------------
    def forward(
        self, adapter_id: str | None, datums: list[types.Datum], loss_fn: str, loss_fn_config: dict[str, Any] | None
    ) -> Future[types.ForwardBackwardOutput]: ...
    def forward_backward(
        self, adapter_id: str, datums: list[types.Datum], loss_fn: str, loss_fn_config: dict[str, Any] | None
    ) -> Future[types.ForwardBackwardOutput]: ...
    def forward_backward_reverse_kl(
        self,
        adapter_id: str,
        reference_adapter_id: str | None,
        datums: list[types.Datum],
        temperature: float = 1.0,
    ) -> Future[types.ForwardBackwardOutput]: ...
    def optim_step(self, adapter_id: str, params: types.AdamParams) -> Future[types.OptimStepResponse]: ...
    def save_state(self, adapter_id: str, dest: Path, include_optimizer: bool) -> Future[None]: ...
    def load_state(self, adapter_id: str, src: Path, include_optimizer: bool) -> Future[None]: ...
    def export_peft(self, adapter_id: str, dest: Path) -> Future[None]: ...
    def interpolate(self, adapter_ids: list[str], coefficients: list[float]) -> Future[str]: ...

    # --- sampling -------------------------------------------------------------------------------
    def sample(
        self,
        adapter_id: str | None,
        prompt_tokens: list[int],
        num_samples: int,
        params: types.SamplingParams,
        prompt_logprobs: bool = False,
        topk_prompt_logprobs: int = 0,
    ) -> Future[types.SampleResponse]: ...

    def shutdown(self, drain: bool = True) -> None: ...
