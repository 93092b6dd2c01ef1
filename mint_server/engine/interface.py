"""The contract between the service layer and an engine.

The service never touches tensors: it parses each request once into a typed job
(`engine.prepare_*`) and queues it (`engine.submit`), getting a `concurrent.futures.Future`
completed by the engine's own worker. Work queued by several
clients is fused by the engine's scheduler, so a call may wait for others before it runs. Wire types
come from the `tinker` package.

Adapter ids are opaque strings chosen by the engine. `None` as an adapter means the bare base.
"""

from __future__ import annotations

import enum
from collections.abc import Callable, Sequence
from concurrent.futures import Future
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

from tinker import types

if TYPE_CHECKING:  # the jobs module imports this one for EngineError
    from mint_server.engine.custom_loss import CompiledLoss
    from mint_server.engine.jobs import (
        AdapterRef,
        CustomJob,
        Job,
        OptimJob,
        ReverseKLJob,
        SampleJob,
        TrainJob,
    )
    from mint_server.engine.settings import EngineLimits, EngineSettings


class Priority(enum.IntEnum):
    """Scheduling class of sample work (lower runs first): interactive serving (the OpenAI face) ahead
    of RL rollouts (the Tinker sampler) ahead of sweeps and evals. A request may lower its own."""

    INTERACTIVE = 0
    ROLLOUT = 1
    BATCH = 2

    @classmethod
    def lowered(cls, name: str | None, default: Priority) -> Priority:
        """`name` ("interactive" | "rollout" | "batch"), never above `default`; EngineError names the
        field for anything else or for a raise."""
        if name is None:
            return default
        try:
            wanted = cls[str(name).upper()]
        except KeyError:
            raise EngineError(f"priority: must be one of interactive, rollout, batch; got {name!r}") from None
        if wanted < default:
            raise EngineError(f"priority: this request may lower its priority below {default.name.lower()} "
                              f"but not raise it; got {name!r}")
        return wanted


# Streaming: (sample index, token id, raw logprob, top) called on the engine's worker thread as each
# token is drawn; `top` is the job's `top_logprobs` most likely (token id, logprob) pairs, best
# first, or None when it asked for none. It must be quick and must not raise: hand the token to
# another thread and return.
TopLogprobs = list[tuple[int, float]]
TokenCallback = Callable[[int, int, float, TopLogprobs | None], None]


class EngineError(ValueError):
    """A request the engine refuses (bad input); the message names the field. Maps to HTTP 400."""


class NotSupportedError(EngineError):
    """A feature the engine does not implement; maps to HTTP 400 with a clear message."""


class EngineFailed(RuntimeError):
    """Part of the engine died (a tensor-parallel rank): the work it held fails with this, and so
    does any later work, at once, until the server is restarted (HTTP 503)."""


class AdapterLost(RuntimeError):
    """A training adapter's engine replica died and took the adapter's live state with it.

    Retryable: the service resumes the model from its last saved state on the next call (HTTP 503
    when raised at submit time; a `server` error on a future)."""


class Engine(Protocol):
    """Parse with `prepare_*` (pure, thread-safe, EngineError naming the field), then `submit`.

    Adapters are named by id (training adapters, from `create_adapter` / `load_state`) or by an
    `AdapterSource` (read-only adapters: checkpoints, catalog revisions), which the engine's
    residency manager opens, loads, caches and evicts on its own; `None` is the bare base.
    """

    base_model: str  # user-facing name, e.g. "HuggingFaceTB/SmolLM2-135M-Instruct"
    model_dir: Path  # HF checkpoint dir: config.json, tokenizer files
    limits: EngineLimits
    settings: EngineSettings

    # --- parse ----------------------------------------------------------------------------------
    def prepare_train(self, datums: Sequence[types.Datum], loss_fn: str, loss_fn_config: dict[str, Any] | None,
                      backward: bool = True) -> TrainJob: ...
    def prepare_reverse_kl(self, datums: Sequence[Any], temperature: float, reference: AdapterRef = None) -> ReverseKLJob: ...
    def prepare_optim(self, params: Any) -> OptimJob: ...
    def prepare_sample(self, adapter: AdapterRef, prompt_tokens: Sequence[int], num_samples: int,
                       params: types.SamplingParams, prompt_logprobs: bool = False, topk_prompt_logprobs: int = 0,
                       *, record: bool = False, key: str = "", stop_at_eos: bool = False, top_logprobs: int = 0,
                       frequency_penalty: float = 0.0, presence_penalty: float = 0.0,
                       priority: Priority = Priority.ROLLOUT) -> SampleJob:
        """`stop_at_eos` keeps EOS as a stop next to stop strings (OpenAI's `stop`; Tinker's explicit
        stop list replaces EOS). `top_logprobs` (≤ limits.max_top_logprobs) reports that many
        alternatives per sampled token (`SampledSequence.topk_logprobs_np`, and to `on_token`);
        the penalties are OpenAI's, shaping the draw only (reported logprobs stay the raw model's).
        Streaming: `job.streaming(on_token, cancel)` (see SampleJob)."""
        ...
    def prepare_score(self, adapter: AdapterRef, tokens: Sequence[int], *, key: str = "",
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
    def cancel(self, future: Future) -> None:
        """Stop a submitted sample (its KV blocks are freed); a finished one is left as is."""
        ...
    def queue_position(self, future: Future) -> tuple[int, int] | None:
        """(requests ahead, requests waiting) while the work behind `future` waits; None once it runs."""
        ...
    def shutdown(self, drain: bool = True) -> None: ...
