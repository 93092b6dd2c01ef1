"""The oracle for LoRA on Qwen3-VL: transformers' model with the adapter merged into its weights (a
function of the adapter's tensors, so autograd through it gives the reference gradients). PEFT cannot
target the MoE's fused expert parameters, so this is how expert LoRA is checked."""

from __future__ import annotations

import torch
from torch import Tensor

from mint_server.model.config import ModelConfig
from mint_server.model.lora import ATTN_TARGETS, EXPERT_PREFIX, MLP_TARGETS, UNEMBED_TARGET, target_layers
from mint_server.model.peft_io import LoraWeights

DECODER = "model.language_model.layers"


def merged_params(hf, cfg: ModelConfig, adapter: LoraWeights) -> dict[str, Tensor]:
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
                name = f"{DECODER}.{layer}.self_attn.{t}.weight"
            elif t in MLP_TARGETS:
                name = f"{DECODER}.{layer}.mlp.{t}.weight"
            elif t == EXPERT_PREFIX + "down_proj":
                name = f"{DECODER}.{layer}.mlp.experts.down_proj"
            else:
                name = f"{DECODER}.{layer}.mlp.experts.gate_up_proj"
                w = out.get(name, base[name])
                lo, hi = (0, inter) if t == EXPERT_PREFIX + "gate_proj" else (inter, 2 * inter)
                out[name] = torch.cat([w[:, :lo], w[:, lo:hi] + delta, w[:, hi:]], dim=1)
                continue
            out[name] = out.get(name, base[name]) + delta
    return out


def merged_logits(hf, cfg: ModelConfig, adapter: LoraWeights | None, inputs: dict) -> Tensor:
    params = {} if adapter is None else merged_params(hf, cfg, adapter)
    return torch.func.functional_call(hf, params, (), inputs, strict=False).logits
