"""Qwen3.5's hybrid layout read from an HF config: which layers are gated delta-net linear attention
(the rest full attention), the linear layers' dims, and the full attention's partial rotary and
gated shared expert (MoE). Torch-free, so the CLI's memory planner reads a config without a model.

A linear-attention layer (transformers' `Qwen3_5GatedDeltaNet`) projects each token to q, k
(`linear_num_key_heads` × `linear_key_head_dim`) and v (`linear_num_value_heads` ×
`linear_value_head_dim`) in one `in_proj_qkv`, runs them through a causal depthwise conv of
`linear_conv_kernel_dim` taps, and mixes tokens with the gated delta rule: a [k_dim, v_dim] state per
value head, decayed by exp(g) and corrected towards each new (k, v) by β. What a sequence carries
between steps is that state (fixed size, whatever its length) plus the conv's last kernel - 1 inputs.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from mint_server.model.errors import ModelError

LINEAR, FULL = "linear_attention", "full_attention"
STATE_BYTES = 4  # the recurrent state stays float32 (as transformers and FLA keep it), whatever the weights


@dataclass(frozen=True)
class HybridSpec:
    linear_layers: tuple[int, ...]  # layers whose token mixer is the gated delta net
    num_k_heads: int
    num_v_heads: int
    k_head_dim: int
    v_head_dim: int
    conv_kernel: int
    rotary_dim: int  # full attention rotates only the first rotary_dim dims of each head
    shared_expert_intermediate_size: int = 0  # MoE: the sigmoid-gated shared expert's width (0: none)

    @property
    def key_dim(self) -> int:
        return self.num_k_heads * self.k_head_dim

    @property
    def value_dim(self) -> int:
        return self.num_v_heads * self.v_head_dim

    @property
    def conv_dim(self) -> int:
        """Channels of the conv (and outputs of in_proj_qkv): q, k and v side by side."""
        return 2 * self.key_dim + self.value_dim

    def state_shapes(self) -> dict[str, tuple[int, ...]]:
        """What one sequence carries per linear layer: the conv's last inputs and the delta-rule state."""
        return {"conv": (self.conv_dim, self.conv_kernel - 1),
                "recurrent": (self.num_v_heads, self.k_head_dim, self.v_head_dim)}

    def state_bytes(self, conv_bytes: int) -> int:
        """Bytes of one sequence's state, all linear layers (conv state in the cache dtype, recurrent float32)."""
        s = self.state_shapes()
        conv = s["conv"][0] * s["conv"][1] * conv_bytes
        rec = s["recurrent"][0] * s["recurrent"][1] * s["recurrent"][2] * STATE_BYTES
        return len(self.linear_layers) * (conv + rec)


def parse_hybrid(hf: dict[str, Any], rope: dict[str, Any], num_layers: int, head_dim: int) -> HybridSpec:
    """The hybrid fields of an HF Qwen3.5 text config (KeyError names a missing one; ModelError a bad one)."""
    types = hf.get("layer_types")
    if not types:  # transformers' default: every `full_attention_interval`-th layer is full attention
        every = int(hf.get("full_attention_interval") or 4)
        types = [FULL if (i + 1) % every == 0 else LINEAR for i in range(num_layers)]
    if len(types) != num_layers or set(types) - {LINEAR, FULL}:
        raise ModelError(f"layer_types must list {num_layers} of {LINEAR!r} / {FULL!r}")
    factor = float(rope.get("partial_rotary_factor", hf.get("partial_rotary_factor", 0.25)))
    rotary = int(head_dim * factor)
    if rotary % 2 or not 0 < rotary <= head_dim:
        raise ModelError(f"partial_rotary_factor {factor} gives an odd or empty rotary dim of head_dim {head_dim}")
    spec = HybridSpec(
        linear_layers=tuple(i for i, t in enumerate(types) if t == LINEAR),
        num_k_heads=int(hf["linear_num_key_heads"]),
        num_v_heads=int(hf["linear_num_value_heads"]),
        k_head_dim=int(hf["linear_key_head_dim"]),
        v_head_dim=int(hf["linear_value_head_dim"]),
        conv_kernel=int(hf.get("linear_conv_kernel_dim") or 4),
        rotary_dim=rotary,
        shared_expert_intermediate_size=int(hf.get("shared_expert_intermediate_size") or 0),
    )
    if spec.num_v_heads % spec.num_k_heads:
        raise ModelError(f"linear_num_value_heads {spec.num_v_heads} is not a multiple of "
                         f"linear_num_key_heads {spec.num_k_heads}")
    if spec.conv_kernel < 2:
        raise ModelError(f"linear_conv_kernel_dim must be at least 2, got {spec.conv_kernel}")
    return spec
