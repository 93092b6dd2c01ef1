"""The oracle for expert LoRA: transformers' Qwen3MoeForCausalLM with the LoRA merged into its weights."""

from __future__ import annotations

import torch
from torch import Tensor
from transformers import AutoModelForCausalLM

from mint_server.model.config import ModelConfig
from mint_server.model.lora import ATTN_TARGETS, EXPERT_PREFIX, MLP_TARGETS, UNEMBED_TARGET, target_layers
from mint_server.model.peft_io import LoraWeights


def load_hf(model_dir):
    return AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()


def merged_params(hf, cfg: ModelConfig, adapter: LoraWeights) -> dict[str, Tensor]:
    """HF parameter name → base weight + scale·B·A for every weight the adapter touches; a function
    of the adapter's tensors, so autograd through it gives the reference LoRA gradients."""
    base = dict(hf.named_parameters())
    scale = adapter.alpha / adapter.rank
    inter = cfg.moe_intermediate_size
    out: dict[str, Tensor] = {}
    for t, (A, B) in adapter.weights.items():
        for i, layer in enumerate(target_layers(cfg)[t]):
            delta = scale * (B[i] @ A[i])  # [out, in], or [E, out, in] for experts
            if t == UNEMBED_TARGET:
                name = "lm_head.weight"
            elif t in ATTN_TARGETS:
                name = f"model.layers.{layer}.self_attn.{t}.weight"
            elif t in MLP_TARGETS:
                name = f"model.layers.{layer}.mlp.{t}.weight"
            else:
                proj = t[len(EXPERT_PREFIX):]
                if proj == "down_proj":
                    name = f"model.layers.{layer}.mlp.experts.down_proj"
                else:
                    name = f"model.layers.{layer}.mlp.experts.gate_up_proj"
                    w = out.get(name, base[name])
                    lo, hi = (0, inter) if proj == "gate_proj" else (inter, 2 * inter)
                    out[name] = torch.cat([w[:, :lo], w[:, lo:hi] + delta, w[:, hi:]], dim=1)
                    continue
            out[name] = out.get(name, base[name]) + delta
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
