"""The service's own input checks: what is not an engine job (LoRA configs at creation, token
ids in MinT's extension payloads). Training, sampling and optimizer requests are parsed by the
engine's `prepare_*` instead, against the engine's one set of limits (`EngineLimits`).
"""

from __future__ import annotations

from tinker import types

from mint_server.engine.interface import EngineError, EngineLimits, check_lora_config


class InvalidInput(EngineError):
    """Bad input found by the service itself (HTTP 400), same meaning as the engine's EngineError."""


def check_lora(lora: types.LoraConfig, limits: EngineLimits) -> None:
    """The engine's rule (its one home), applied before creation is queued: a bad config is a 400 now."""
    check_lora_config(lora.rank, lora.train_attn, lora.train_mlp, lora.train_unembed, limits.max_rank)
