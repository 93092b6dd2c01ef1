"""The oracle for DeepSeek-V4 LoRA: transformers' DeepseekV4ForCausalLM with the LoRA merged into its weights."""

from __future__ import annotations

import torch
from torch import Tensor

from mint_server.model.config import ModelConfig
from mint_server.model.lora import (
    COMPRESSOR_TARGETS,
    EXPERT_PREFIX,
    SHARED_PREFIX,
    UNEMBED_TARGET,
    target_layers,
)
from mint_server.model.peft_io import LoraWeights


def hf_name(target: str, layer: int) -> str:
    """The HF parameter a (non-expert) target adapts."""
    if target == UNEMBED_TARGET:
        return "lm_head.weight"
    if target.startswith(SHARED_PREFIX):
        return f"model.layers.{layer}.mlp.shared_experts.{target[len(SHARED_PREFIX):]}.weight"
    if target in COMPRESSOR_TARGETS:
        return f"model.layers.{layer}.self_attn.compressor.{target[4:]}.weight"
    return f"model.layers.{layer}.self_attn.{target}.weight"


def merged_params(hf, cfg: ModelConfig, adapter: LoraWeights) -> dict[str, Tensor]:
    """HF parameter name → base weight + scale·B·A (a function of the adapter's tensors: autograd through
    it gives the reference gradients). Experts: transformers' fused gate_up_proj / down_proj."""
    base = dict(hf.named_parameters())
    scale = adapter.alpha / adapter.rank
    inter = cfg.moe_intermediate_size
    out: dict[str, Tensor] = {}
    for t, (A, B) in adapter.weights.items():
        for i, layer in enumerate(target_layers(cfg)[t]):
            delta = scale * (B[i] @ A[i])
            if not t.startswith(EXPERT_PREFIX):
                name = hf_name(t, layer)
                out[name] = out.get(name, base[name]) + delta
                continue
            proj = t[len(EXPERT_PREFIX):]
            if proj == "down_proj":
                name = f"model.layers.{layer}.mlp.experts.down_proj"
                out[name] = out.get(name, base[name]) + delta
            else:
                name = f"model.layers.{layer}.mlp.experts.gate_up_proj"
                w = out.get(name, base[name])
                lo, hi = (0, inter) if proj == "gate_proj" else (inter, 2 * inter)
                out[name] = torch.cat([w[:, :lo], w[:, lo:hi] + delta, w[:, hi:]], dim=1)
    return out


def merged_logits(hf, cfg: ModelConfig, adapter: LoraWeights | None, tokens: Tensor) -> Tensor:
    params = {} if adapter is None else merged_params(hf, cfg, adapter)
    return torch.func.functional_call(hf, params, (tokens,), strict=False).logits


def merge_in_place(hf, cfg: ModelConfig, adapter: LoraWeights):
    with torch.no_grad():
        merged = merged_params(hf, cfg, adapter)
        for name, p in hf.named_parameters():
            if name in merged:
                p.copy_(merged[name])
    return hf
