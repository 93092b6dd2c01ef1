"""The checks of the catalog's free-form fields (texts, JSON objects, a policy's LoRA config): each
refuses a bad value with InvalidArgument naming the field."""

from __future__ import annotations

import json
from typing import Any

from mint_server.catalog.errors import InvalidArgument


def check_text(value: str | None, field: str, max_len: int, *, required: bool = False) -> str | None:
    if value is None or value == "":
        if required:
            raise InvalidArgument(f"{field} is required", field=field)
        return None
    if not isinstance(value, str) or len(value) > max_len:
        raise InvalidArgument(f"{field} must be a string of at most {max_len} characters", field=field)
    try:
        value.encode("utf-8")  # a lone surrogate would be stored, then break every read of it
    except UnicodeEncodeError:
        raise InvalidArgument(f"{field} is not valid Unicode text", field=field) from None
    return value


def check_json_object(value: dict[str, Any] | None, field: str) -> dict[str, Any]:
    if value is None:
        return {}
    if not isinstance(value, dict):
        raise InvalidArgument(f"{field} must be a JSON object", field=field)
    try:
        # ensure_ascii=False + encode: a lone surrogate fails here, not in every later read.
        json.dumps(value, allow_nan=False, ensure_ascii=False).encode("utf-8")
    except (TypeError, ValueError) as e:
        raise InvalidArgument(f"{field} is not JSON-serializable: {e}", field=field) from None
    return value


# What a policy's LoRA config may hold: the fields training records (rank, train_*) and those a PEFT
# import implies (rank, alpha, target_modules, dropout), each typed and in range.
MAX_LORA_RANK = 65536
MAX_LORA_ALPHA = 1e6
MAX_TARGET_PATTERN = 1024  # characters of a PEFT target_modules regex
MAX_TARGET_MODULES = 256  # names in a target_modules list
MAX_MODULE_NAME = 128  # characters of one of them


def check_lora_config(value: dict[str, Any] | None) -> dict[str, Any]:
    config = check_json_object(value, "lora_config")
    for key, v in config.items():
        field = f"lora_config.{key}"
        number = isinstance(v, int | float) and not isinstance(v, bool)
        if key == "rank":
            ok = isinstance(v, int) and not isinstance(v, bool) and 1 <= v <= MAX_LORA_RANK
            expected = f"an integer between 1 and {MAX_LORA_RANK}"
        elif key == "alpha":
            ok, expected = number and 0 < v <= MAX_LORA_ALPHA, f"a number in (0, {MAX_LORA_ALPHA:g}]"
        elif key == "dropout":
            ok, expected = number and 0 <= v < 1, "a number in [0, 1)"
        elif key == "target_modules":
            ok = (isinstance(v, str) and 0 < len(v) <= MAX_TARGET_PATTERN) or (
                isinstance(v, list)
                and len(v) <= MAX_TARGET_MODULES
                and all(isinstance(m, str) and 0 < len(m) <= MAX_MODULE_NAME for m in v)
            )
            expected = "a list of module names (or a PEFT regex string)"
        elif key in ("train_mlp", "train_attn", "train_unembed"):
            ok, expected = isinstance(v, bool), "true or false"
        else:
            raise InvalidArgument(
                f"{field}: unknown field (known: rank, alpha, dropout, target_modules, train_mlp, train_attn, "
                "train_unembed)",
                field=field,
            )
        if not ok:
            raise InvalidArgument(f"{field} must be {expected}, got {v!r}", field=field)
    return config
