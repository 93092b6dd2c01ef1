"""GLM-5 (`GlmMoeDsaForCausalLM`) on the DeepSeek blocks, with multi-LoRA built in.

transformers' GLM-5 is DeepSeek-V3.2 (MLA, DeepSeek MoE with shared experts, DSA) with two
differences, both switches of `mla_spec.MLASpec`:
- the DSA indexer rotates its RoPE dims in interleaved pairs (V3.2: rotate-half):
  `index_rope_interleave`;
- `indexer_types`: a "shared" layer has no indexer and attends to the keys the previous "full"
  layer's indexer chose for the same query (cross-layer top-k sharing). So the blocks hand the
  selection down the stack: `GlmMoeDsaBlock` returns it beside the hidden states and
  `GlmMoeDsaTransformer.run_layers` passes it to the next block (also when blocks are recomputed
  for activation checkpointing: the selection is an input of the block, not state kept aside).

Everything else — the MLA projections, the absorbed latent decode, the latent KV cache, the
DeepSeek router, expert / shared-expert LoRA — is deepseek.py's, unchanged. The indexers stay
frozen (docs/mla.md). A shared layer caches no indexer key (its slot in the `index_k` pool is
left unused).
"""

from __future__ import annotations

import torch
from torch import Tensor

from mint_server.model.config import ModelConfig
from mint_server.model.deepseek import DeepseekBlock, DeepseekTransformer
from mint_server.model.kv_cache import CacheView
from mint_server.model.lora import LoraBatch


class GlmMoeDsaBlock(DeepseekBlock):
    def forward(self, x: Tensor, cos: Tensor, sin: Tensor, lora: LoraBatch | None, cache: CacheView | None,
                selection: Tensor | None = None) -> tuple[Tensor, Tensor | None]:
        """The block's output and the DSA selection its attention used (for the shared layers after it)."""
        y, selection = self.self_attn.attend(self.input_layernorm(x), cos, sin, lora, cache, selection)
        x = x + y
        return x + self.mlp(self.post_attention_layernorm(x), lora), selection


class GlmMoeDsaTransformer(DeepseekTransformer):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__(cfg, block=GlmMoeDsaBlock)

    def run_layers(self, x: Tensor, cos: Tensor, sin: Tensor, lora: LoraBatch | None, cache: CacheView | None,
                   recomputed_blocks: int, vision: object = None) -> Tensor:
        assert vision is None  # a text-only family
        selection = None  # the last full indexer layer's keys per query
        for i, block in enumerate(self.layers):
            if i < recomputed_blocks:
                x, selection = torch.utils.checkpoint.checkpoint(block, x, cos, sin, lora, cache, selection,
                                                                 use_reentrant=False)
            else:
                x, selection = block(x, cos, sin, lora, cache, selection)
        return x
