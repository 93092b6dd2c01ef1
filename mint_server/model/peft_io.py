"""LoRA adapters on disk in PEFT layout: adapter_config.json + adapter_model.safetensors."""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from mint_server.fsutil import atomic_write_dir
from mint_server.model.config import ModelError
from mint_server.model.lora import ALL_TARGETS, ATTN_TARGETS, UNEMBED_TARGET
from mint_server.model.peft_archive import (  # archives' name, read as lm_head
    LM_HEAD_PREFIX,
    TINKER_UNEMBED_PREFIX,
)

DEFAULT_LORA_ALPHA = 32.0  # Tinker's default; PEFT scaling is lora_alpha / r

_KEY = re.compile(r"^base_model\.model\.(?:model\.layers\.(\d+)\.(?:self_attn|mlp)\.)?(\w+)\.lora_([AB])\.weight$")


@dataclass
class LoraWeights:
    """One adapter: weights[target] = (A [layers, r, in], B [layers, out, r]) on CPU or device."""

    weights: dict[str, tuple[torch.Tensor, torch.Tensor]]
    rank: int
    alpha: float = DEFAULT_LORA_ALPHA


def peft_key(target: str, layer: int, which: str) -> str:
    if target == UNEMBED_TARGET:
        return f"base_model.model.lm_head.lora_{which}.weight"
    block = "self_attn" if target in ATTN_TARGETS else "mlp"
    return f"base_model.model.model.layers.{layer}.{block}.{target}.lora_{which}.weight"


def save_peft(adapter: LoraWeights, dest: str | Path, base_model: str) -> None:
    """Write a PEFT adapter dir atomically (fp32 tensors on disk, whatever the compute dtype)."""
    tensors = {}
    for t, (a, b) in adapter.weights.items():
        for layer in range(a.shape[0]):
            tensors[peft_key(t, layer, "A")] = a[layer].detach().to("cpu", torch.float32).contiguous()
            tensors[peft_key(t, layer, "B")] = b[layer].detach().to("cpu", torch.float32).contiguous()
    config = {
        "peft_type": "LORA",
        "task_type": "CAUSAL_LM",
        "base_model_name_or_path": base_model,
        "r": adapter.rank,
        "lora_alpha": adapter.alpha,
        "lora_dropout": 0.0,
        "bias": "none",
        "target_modules": sorted(adapter.weights),
        "fan_in_fan_out": False,
        "use_rslora": False,
        "use_dora": False,
        "init_lora_weights": True,
        "inference_mode": True,
        "modules_to_save": None,
    }

    def fill(tmp: Path) -> None:
        save_file(tensors, str(tmp / "adapter_model.safetensors"), metadata={"format": "pt"})
        (tmp / "adapter_config.json").write_text(json.dumps(config, indent=2))

    atomic_write_dir(dest, fill)


def load_peft(src: str | Path, num_layers: int) -> LoraWeights:
    """Read a PEFT LoRA dir; clear errors for anything we cannot represent exactly."""
    src = Path(src)
    cfg_file, weights_file = src / "adapter_config.json", src / "adapter_model.safetensors"
    for f in (cfg_file, weights_file):
        if not f.is_file():
            raise ModelError(f"PEFT adapter dir {str(src)!r} lacks {f.name}")
    cfg = json.loads(cfg_file.read_text())
    if cfg.get("peft_type", "LORA") != "LORA":
        raise ModelError(f"adapter peft_type {cfg.get('peft_type')!r} is not supported (only LORA)")
    for flag in ("use_dora", "use_rslora", "fan_in_fan_out"):
        if cfg.get(flag):
            raise ModelError(f"adapter_config {flag}=true is not supported")
    rank = int(cfg["r"])
    alpha = float(cfg.get("lora_alpha", rank))
    if cfg.get("rank_pattern") or cfg.get("alpha_pattern"):
        raise ModelError("adapter_config rank_pattern/alpha_pattern are not supported")
    found: dict[str, dict[int, dict[str, torch.Tensor]]] = {}
    for key, tensor in load_file(str(weights_file)).items():
        m = _KEY.match(key.replace(TINKER_UNEMBED_PREFIX, LM_HEAD_PREFIX))
        if m is None or m.group(2) not in ALL_TARGETS:
            raise ModelError(f"unsupported tensor {key!r} in {weights_file.name}")
        layer = int(m.group(1) or 0)
        found.setdefault(m.group(2), {}).setdefault(layer, {})[m.group(3)] = tensor.float()
    weights = {}
    for t, layers in found.items():
        n = num_layers if t != UNEMBED_TARGET else 1
        if sorted(layers) != list(range(n)) or any(len(ab) != 2 for ab in layers.values()):
            raise ModelError(f"adapter target {t!r} does not cover layers 0..{n - 1} with both lora_A and lora_B")
        weights[t] = (torch.stack([layers[i]["A"] for i in range(n)]), torch.stack([layers[i]["B"] for i in range(n)]))
    return LoraWeights(weights=weights, rank=rank, alpha=alpha)
