"""Which expert-LoRA layout a PEFT adapter file uses, read from its safetensors header alone.

Kept free of torch so the catalog CLI can ask cheaply; the conversion itself is
`peft_io.convert_peft_dir`. Layouts: see peft_io and docs/moe.md.
"""

from __future__ import annotations

import json
import re
import struct
from pathlib import Path

MOE_LAYOUTS = ("packed", "per-expert")
MOE_LAYOUT_KEY = "mint_moe_layout"  # in adapter_config.json, for adapters with expert LoRA
PACKED_KEY = re.compile(r"^(.*\.mlp\.experts)\.(\w+\.lora_[AB]\.weight)$")
PER_EXPERT_KEY = re.compile(r"^(.*\.mlp\.experts)\.(\d+)\.(\w+\.lora_[AB]\.weight)$")


def layout_of_keys(keys: list[str]) -> str | None:
    """packed | per-expert for tensor names holding expert LoRA, else None."""
    for key in keys:
        if PER_EXPERT_KEY.match(key):
            return "per-expert"
        if PACKED_KEY.match(key):
            return "packed"
    return None


def moe_layout_of(peft_dir: str | Path) -> str | None:
    """The expert-LoRA layout of a PEFT dir's adapter_model.safetensors (None: no expert LoRA)."""
    with open(Path(peft_dir) / "adapter_model.safetensors", "rb") as f:
        (n,) = struct.unpack("<Q", f.read(8))
        header = json.loads(f.read(n))
    return layout_of_keys([k for k in header if k != "__metadata__"])
