"""Oracles for the family tests: transformers with the LoRA merged into its weights (a function of the
adapter's tensors, so autograd through it gives the reference gradients)."""

from __future__ import annotations

import torch
from torch import Tensor

from mint_server.model.config import ModelConfig
from mint_server.model.lora import EXPERT_PREFIX, target_layers
from mint_server.model.peft_io import LoraWeights
from tests.mla import helpers as mla_helpers


def gpt_oss_merged_params(hf, cfg: ModelConfig, adapter: LoraWeights) -> dict[str, Tensor]:
    """gpt-oss keeps experts input-first: gate_up_proj [E, H, 2I] with gate / up in alternate columns,
    down_proj [E, I, H]; our deltas are [E, out, in]."""
    base = dict(hf.named_parameters())
    scale = adapter.alpha / adapter.rank
    out: dict[str, Tensor] = {}
    for t, (A, B) in adapter.weights.items():
        for i, layer in enumerate(target_layers(cfg)[t]):
            delta = scale * (B[i] @ A[i])
            if not t.startswith(EXPERT_PREFIX):
                name = mla_helpers.hf_name(t, layer)
                out[name] = out.get(name, base[name]) + delta
                continue
            proj = t[len(EXPERT_PREFIX):]
            if proj == "down_proj":
                name = f"model.layers.{layer}.mlp.experts.down_proj"
                out[name] = out.get(name, base[name]) + delta.transpose(1, 2)
                continue
            name = f"model.layers.{layer}.mlp.experts.gate_up_proj"
            w = out.get(name, base[name])
            col = 0 if proj == "gate_proj" else 1
            parts = [w[..., 0::2], w[..., 1::2]]
            parts[col] = parts[col] + delta.transpose(1, 2)
            out[name] = torch.stack(parts, dim=-1).flatten(-2)  # re-interleave the columns
    return out


def merged_params(hf, cfg: ModelConfig, adapter: LoraWeights) -> dict[str, Tensor]:
    if cfg.family.name == "gpt_oss":
        return gpt_oss_merged_params(hf, cfg, adapter)
    return mla_helpers.merged_params(hf, cfg, adapter)  # GLM-5's experts are DeepSeek's layout


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
