"""The contract between the service layer and an engine.

The service never touches tensors: it parses each request once into a typed job
(`engine.prepare_*`) and queues it (`engine.submit`), getting a `concurrent.futures.Future`
completed by the engine's own worker. Work queued by several
clients is fused by the engine's scheduler, so a call may wait for others before it runs. Wire types
come from the `tinker` package.

Adapter ids are opaque strings chosen by the engine. `None` as an adapter means the bare base.
"""

from __future__ import annotations

from collections.abc import Sequence
from concurrent.futures import Future
from pathlib import Path
from typing import Any, Protocol

from tinker import types

# The api's one door into the engine: the value types, jobs and parse helpers it needs are
# re-exported from here, so no api module imports another engine module.
from mint_server.engine.custom_loss import CompiledLoss, compile_loss  # noqa: F401
from mint_server.engine.jobs import (  # noqa: F401
    AdapterRef,
    CustomJob,
    Job,
    OptimJob,
    Prompt,
    ReverseKLJob,
    SampleJob,
    TrainJob,
)
from mint_server.engine.losses import ReverseKLDatum  # noqa: F401
from mint_server.engine.residency import check_lora_config  # noqa: F401
from mint_server.engine.settings import EngineLimits, EngineSettings, advertised_settings  # noqa: F401
from mint_server.engine.values import (  # noqa: F401
    AdapterLost,
    AdapterSource,
    EngineError,
    EngineFailed,
    EngineReport,
    NotSupportedError,
    Priority,
    SampleCancelled,
    TokenCallback,
    TopLogprobs,
)


class Engine(Protocol):
    """Parse with `prepare_*` (pure, thread-safe, EngineError naming the field), then `submit`.

    Adapters are named by id (training adapters, from `create_adapter` / `load_state`) or by an
    `AdapterSource` (read-only adapters: checkpoints, catalog revisions), which the engine's
    residency manager opens, loads, caches and evicts on its own; `None` is the bare base.
    """

    base_model: str  # user-facing name, e.g. "HuggingFaceTB/SmolLM2-135M-Instruct"
    model_dir: Path  # HF checkpoint dir: config.json, tokenizer files
    tokenizer: Any  # the base's tokenizer, loaded once by the engine: the faces use this one, never their own
    limits: EngineLimits
    settings: EngineSettings

    # --- parse ----------------------------------------------------------------------------------
    def prepare_prompt(self, prompt: types.ModelInput | Sequence[int]) -> Prompt:
        """A prompt parsed once (image chunks read and counted in tokens), for `prepare_sample`."""
        ...
    def prepare_train(self, datums: Sequence[types.Datum], loss_fn: str, loss_fn_config: dict[str, Any] | None,
                      backward: bool = True, key: str = "") -> TrainJob: ...
    def prepare_reverse_kl(self, datums: Sequence[Any], temperature: float, reference: AdapterRef = None) -> ReverseKLJob: ...
    def prepare_optim(self, params: Any, family: str | None = None) -> OptimJob:
        """With `family` ("adamw" | "dimuon", the adapter's), params of the other family are refused."""
        ...
    def prepare_sample(self, adapter: AdapterRef, prompt_tokens: Sequence[int] | types.ModelInput | Prompt,
                       num_samples: int,
                       params: types.SamplingParams, prompt_logprobs: bool = False, topk_prompt_logprobs: int = 0,
                       *, record: bool = False, key: str = "", stop_at_eos: bool = False, top_logprobs: int = 0,
                       frequency_penalty: float = 0.0, presence_penalty: float = 0.0,
                       priority: Priority = Priority.ROLLOUT, repetition_penalty: float = 1.0,
                       min_p: float = 0.0, logit_bias: Any = None, response_format: Any = None,
                       stop_token_ids: Any = None) -> SampleJob:
        """`stop_at_eos` keeps EOS as a stop next to stop strings (OpenAI's `stop`; Tinker's explicit
        stop list replaces EOS); `stop_token_ids` are stops next to both. `top_logprobs` (≤
        limits.max_top_logprobs) reports that many alternatives per sampled token
        (`SampledSequence.topk_logprobs_np`, and to `on_token`); logit_bias ({token id: bias}), the
        penalties (OpenAI's frequency/presence, vLLM's repetition), min_p and `response_format` (a
        JSON schema, regex or Lark grammar the text must follow: engine/grammar.py) shape the draw
        only (reported logprobs stay the raw model's).
        Streaming: `job.streaming(on_token, cancel)` (see SampleJob)."""
        ...
    def prepare_score(self, adapter: AdapterRef, tokens: Sequence[int] | types.ModelInput | Prompt, *, key: str = "",
                      priority: Priority = Priority.ROLLOUT) -> SampleJob: ...
    def prepare_custom(self, datums: Sequence[types.Datum], loss: CompiledLoss) -> CustomJob:
        """A forward_backward with a loss compiled by `engine.custom_loss.compile_loss`."""
        ...

    # --- run ------------------------------------------------------------------------------------
    def submit(self, job: Job) -> Future: ...
    def create_adapter(self, lora: types.LoraConfig, optimizer: str = "adamw") -> Future[str]:
        """A trainable adapter; `optimizer` ("adamw" | "dimuon") is its family for life."""
        ...
    def release_adapter(self, adapter_id: str) -> Future[None]: ...
    def forget_source(self, key_prefix: str) -> Future[None]: ...
    def save_state(self, adapter_id: str, dest: Path, include_optimizer: bool) -> Future[None]: ...
    def load_state(self, adapter_id: str | None, src: Path, include_optimizer: bool,
                   optimizer: str | None = None) -> Future[str]: ...
    def export_peft(self, adapter: AdapterRef, dest: Path) -> Future[None]: ...
    def interpolate(self, adapters: Sequence[AdapterRef], coefficients: list[float]) -> Future[str]: ...
    def queue_depth(self) -> int: ...
    def report(self) -> EngineReport:
        """Figures for /metrics (drains the per-step lists it hands over)."""
        ...
    def register_metrics(self, registry: Any) -> None:
        """Add the engine's own metric families to the server's Prometheus registry (or none)."""
        ...
    def cancel(self, future: Future) -> None:
        """Stop a submitted sample (its KV blocks are freed); a finished one is left as is."""
        ...
    def queue_position(self, future: Future) -> tuple[int, int] | None:
        """(requests ahead, requests waiting) while the work behind `future` waits; None once it runs."""
        ...
    def shutdown(self, drain: bool = True) -> None: ...
