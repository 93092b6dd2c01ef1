"""The names of the projections a LoRA adapter can target, per kind of block (a leaf: lora.py, the
family registry and the PEFT code all read them)."""

from __future__ import annotations

ATTN_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj")
MLP_TARGETS = ("gate_proj", "up_proj", "down_proj")
EXPERT_TARGETS = ("expert_gate_proj", "expert_up_proj", "expert_down_proj")
UNEMBED_TARGET = "lm_head"
# DeepSeek (MLA) attention projections (q_proj / o_proj shared with ATTN_TARGETS) and the shared
# experts beside the routed ones (a dense SwiGLU in every sparse layer); see docs/mla.md.
MLA_TARGETS = ("q_a_proj", "q_b_proj", "kv_a_proj_with_mqa", "kv_b_proj")
SHARED_TARGETS = ("shared_gate_proj", "shared_up_proj", "shared_down_proj")
SHARED_PREFIX = "shared_"  # shared-expert target = SHARED_PREFIX + the projection name
# Qwen3.5's gated delta-net (linear-attention) projections, in its linear layers; see docs/qwen35.md.
LINEAR_TARGETS = ("in_proj_qkv", "in_proj_z", "in_proj_b", "in_proj_a", "out_proj")
# DeepSeek-V4 attention (q_a_proj / q_b_proj shared with MLA_TARGETS; o_a_proj, the grouped output
# projection, has no PEFT LoRA form and is not a target) and its compressors' projections, CSA's and
# HCA's apart (their widths differ); see docs/deepseek-v4.md.
V4_TARGETS = ("kv_proj", "o_b_proj")
COMPRESSOR_TARGETS = ("csa_kv_proj", "csa_gate_proj", "hca_kv_proj", "hca_gate_proj")
ALL_TARGETS = (ATTN_TARGETS + MLA_TARGETS + LINEAR_TARGETS + V4_TARGETS + COMPRESSOR_TARGETS + MLP_TARGETS
               + EXPERT_TARGETS + SHARED_TARGETS + (UNEMBED_TARGET,))
EXPERT_PREFIX = "expert_"  # expert target = EXPERT_PREFIX + the expert's projection name
