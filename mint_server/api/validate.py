"""Input checks done before anything reaches the engine, so that a bad request is refused with a
message naming the field and leaves no trace (no seq slot held, no adapter touched). The engine
checks again; these catch what a client can get wrong without knowing the model's internals.
Training data (losses, their inputs and config) is checked by the engine's own
`validate_train` at submission time instead, so those rules live in one place.
"""

from __future__ import annotations

import math
from collections.abc import Iterable

import numpy as np
from tinker import types

from mint_server.engine.interface import EngineError

MAX_LORA_RANK = 1024
MAX_SAMPLES = 128


class InvalidInput(EngineError):
    """Bad input found by the service itself (HTTP 400), same meaning as the engine's EngineError."""


def _tokens(model_input: types.ModelInput, where: str) -> list[int]:
    try:
        return model_input.to_ints()
    except ValueError:
        raise InvalidInput(f"{where}: only token chunks are supported") from None


def check_tokens(tokens: Iterable[int], vocab_size: int, where: str) -> None:
    arr = np.asarray(list(tokens), dtype=np.int64)
    if arr.size and (arr.min() < 0 or arr.max() >= vocab_size):
        bad = int(arr[(arr < 0) | (arr >= vocab_size)][0])
        raise InvalidInput(f"{where}: token id {bad} is outside the vocabulary [0, {vocab_size})")


def check_adam(params: types.AdamParams) -> None:
    fields = params.model_dump()
    for k, v in fields.items():
        if not math.isfinite(v):
            raise InvalidInput(f"adam_params.{k} must be finite")
    if params.learning_rate < 0:
        raise InvalidInput("adam_params.learning_rate must be >= 0")
    if not (0 <= params.beta1 < 1 and 0 <= params.beta2 < 1):
        raise InvalidInput("adam_params.beta1 and beta2 must be in [0, 1)")
    if params.eps <= 0:
        raise InvalidInput("adam_params.eps must be > 0")
    if params.weight_decay < 0 or params.grad_clip_norm < 0:
        raise InvalidInput("adam_params.weight_decay and grad_clip_norm must be >= 0")


def check_lora(lora: types.LoraConfig) -> None:
    if not 1 <= lora.rank <= MAX_LORA_RANK:
        raise InvalidInput(f"lora_config.rank must be between 1 and {MAX_LORA_RANK}, got {lora.rank}")
    if not (lora.train_mlp or lora.train_attn or lora.train_unembed):
        raise InvalidInput("lora_config: at least one of train_mlp, train_attn, train_unembed must be true")


def check_sampling(
    prompt: types.ModelInput, num_samples: int, params: types.SamplingParams, vocab_size: int, max_context: int
) -> list[int]:
    tokens = _tokens(prompt, "prompt")
    if not tokens:
        raise InvalidInput("prompt is empty")
    check_tokens(tokens, vocab_size, "prompt")
    if not 1 <= num_samples <= MAX_SAMPLES:
        raise InvalidInput(f"num_samples must be between 1 and {MAX_SAMPLES}, got {num_samples}")
    max_tokens = params.max_tokens
    if max_tokens is None or max_tokens < 1:
        raise InvalidInput("sampling_params.max_tokens must be set to 1 or more")
    if len(tokens) + max_tokens > max_context:
        raise InvalidInput(
            f"prompt ({len(tokens)} tokens) + sampling_params.max_tokens ({max_tokens}) exceeds "
            f"the model's context ({max_context})"
        )
    if not (math.isfinite(params.temperature) and params.temperature >= 0):
        raise InvalidInput("sampling_params.temperature must be finite and >= 0")
    if not (math.isfinite(params.top_p) and 0 < params.top_p <= 1):
        raise InvalidInput("sampling_params.top_p must be in (0, 1]")
    if params.top_k < -1 or params.top_k == 0:
        raise InvalidInput("sampling_params.top_k must be -1 (no limit) or >= 1")
    stop = params.stop
    if isinstance(stop, list | tuple) and stop and all(isinstance(s, int) for s in stop):
        check_tokens(stop, vocab_size, "sampling_params.stop")  # type: ignore[arg-type]
    return tokens
