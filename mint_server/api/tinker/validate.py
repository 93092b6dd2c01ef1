"""The service's own input checks: what is not an engine job (LoRA configs at creation, token
ids in MinT's extension payloads). Training, sampling and optimizer requests are parsed by the
engine's `prepare_*` instead, against the engine's one set of limits (`EngineLimits`).
"""

from __future__ import annotations

from tinker import types

from mint_server.engine.interface import EngineError, EngineLimits


class InvalidInput(EngineError):
    """Bad input found by the service itself (HTTP 400), same meaning as the engine's EngineError."""


def check_lora(lora: types.LoraConfig, limits: EngineLimits) -> None:
    if isinstance(lora.rank, bool) or not isinstance(lora.rank, int) or not 1 <= lora.rank <= limits.max_rank:
        raise InvalidInput(f"lora_config.rank: must be between 1 and {limits.max_rank} (this server's max LoRA "
                           f"rank), got {lora.rank!r}")
    if not (lora.train_mlp or lora.train_attn or lora.train_unembed):
        raise InvalidInput("lora_config: at least one of train_mlp, train_attn, train_unembed must be true")
