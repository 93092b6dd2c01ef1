"""gpt-oss (`GptOssForCausalLM`) on the shared blocks, with multi-LoRA built in.

Attention is the shared `transformer.Attention` with this family's switches (config.py): biases on
q/k/v/o; a learned logit per head (`sinks`) that joins every softmax as a key with no value; and on
the `sliding_attention` layers (every other one) a window of the last `sliding_window` positions,
the query's own included — in training, prefill and the paged decode alike (`kv_cache.attend`,
`kv_cache.visible`). RoPE is YaRN, rotate-half.

Every layer's MLP is routed experts (`GptOssMoE`, on `moe.SparseMoE`'s pair grouping and expert
LoRA): the router is a linear with a bias; a token keeps its top-k router logits and softmaxes only
those. Each expert has biases and a clamped SwiGLU: g = min(gate, limit), u = clamp(up, ±limit),
out = down((u + 1) · g · σ(alpha · g)). The router and the sinks are frozen (never LoRA targets, no
gradient); the experts' gate / up / down get one LoRA pair per expert, like Qwen3-MoE's.

Checkpoint layout: transformers keeps an expert stack as `gate_up_proj` [E, H, 2I] (input features
first, gate and up interleaved column by column), `gate_up_proj_bias` [E, 2I] (interleaved alike),
`down_proj` [E, I, H] and `down_proj_bias` [E, H]; `GptOssTransformer.convert_checkpoint` turns them
into our [E, out, in] gate / up / down stacks and their biases. MXFP4-quantized checkpoints (as the
Hub ships gpt-oss: `*_blocks` / `*_scales`) are dequantized to that layout as they are read (prequant.py).
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import Tensor, nn

from mint_server.model.config import ModelConfig
from mint_server.model.lora import ExpertGroups, LoraBatch
from mint_server.model.moe import Experts, SparseMoE
from mint_server.model.transformer import Block, Transformer


class GptOssExperts(Experts):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__(cfg)
        E, h, i = cfg.num_experts, cfg.hidden_size, cfg.moe_intermediate_size
        self.gate_proj_bias = nn.Parameter(torch.zeros(E, i))
        self.up_proj_bias = nn.Parameter(torch.zeros(E, i))
        self.down_proj_bias = nn.Parameter(torch.zeros(E, h))


class GptOssMoE(SparseMoE):
    def __init__(self, cfg: ModelConfig, index: int) -> None:
        super().__init__(cfg, index)
        del self.gate
        self.router = nn.Linear(cfg.hidden_size, cfg.num_experts, bias=True)  # never trained
        self.experts = GptOssExperts(cfg)
        self.alpha, self.limit = cfg.swiglu_alpha, cfg.swiglu_limit

    def route(self, x: Tensor) -> tuple[Tensor, Tensor]:
        """Softmax over each token's top-k router logits only (in the logits' dtype, as transformers)."""
        top, chosen = torch.topk(self.router(x), self.top_k, dim=-1)
        return torch.softmax(top, dim=-1).to(x.dtype), chosen

    def act(self, g: Tensor, u: Tensor) -> Tensor:
        g = g.clamp(max=self.limit)
        u = u.clamp(-self.limit, self.limit)
        return (u + 1) * (g * torch.sigmoid(g * self.alpha))

    def _project(self, name: str, x: Tensor, groups: ExpertGroups, lora: LoraBatch | None) -> Tensor:
        y = super()._project(name, x, groups, lora)
        return y + getattr(self.experts, f"{name}_bias")[groups.expert]


class GptOssBlock(Block):
    def __init__(self, cfg: ModelConfig, layer: int) -> None:
        super().__init__(cfg, layer)
        self.mlp = GptOssMoE(cfg, cfg.sparse_layers.index(layer))  # every gpt-oss layer is sparse


class GptOssTransformer(Transformer):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__(cfg, block=GptOssBlock)

    @staticmethod
    def convert_checkpoint(name: str, read: Callable[[], Tensor]) -> dict[str, Tensor] | None:
        """Our tensors for one of transformers' expert tensors (`name` in our naming, `read` loads it);
        None: the tensor is ours as it is."""
        prefix, _, leaf = name.rpartition(".")
        if not prefix.endswith("mlp.experts"):
            return None
        if leaf == "gate_up_proj":  # [E, H, 2I] → gate, up [E, I, H]
            w = read()
            return {f"{prefix}.gate_proj": w[..., 0::2].transpose(1, 2).contiguous(),
                    f"{prefix}.up_proj": w[..., 1::2].transpose(1, 2).contiguous()}
        if leaf == "gate_up_proj_bias":  # [E, 2I] → [E, I] each
            b = read()
            return {f"{prefix}.gate_proj_bias": b[:, 0::2].contiguous(), f"{prefix}.up_proj_bias": b[:, 1::2].contiguous()}
        if leaf == "down_proj":  # [E, I, H] → [E, H, I]
            return {f"{prefix}.down_proj": read().transpose(1, 2).contiguous()}
        return None
