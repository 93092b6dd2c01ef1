"""The model family registry: one entry per family saying, as data and small functions, what differs
between families, so the shared code asks a config's entry (`family_spec(cfg)`) instead of branching on
which spec (MLA, V4, hybrid, vision) the config carries.

As in vLLM's and SGLang's model registries, an entry names its model class by module and class
("module:Class") and the class is imported only when a model is built, so this module sits below the
model files (they import lora.py and kv_cache.py, which read this one). An entry holds:

- its model class;
- LoRA: its attention targets, the targets only some of its layers have, the (in, out) of the targets
  whose width differs from the standard blocks', its shared experts' width;
- the memory plan: its attention's parameters per layer, the parts only it has (linear attention,
  indexers, shared experts, the vision tower), or a count of its own;
- its KV cache: what a token holds per layer, the naive per-head K/V it replaces (latent caches), or
  pools held per block; the recurrent state a sequence carries;
- loading: its checkpoint-name map and the weights kept in float32;
- the PEFT names of its decoder and shared experts;
- what it refuses: tensor parallelism, packed training, the prefix cache, batch-invariant mode.

A family's config switches (which HF architecture, qk-norm, biases, MoE, ...) are config.FAMILIES'.
Adding a family: its switches there, its model file, and one FAMILY_SPECS entry here (docs/families.md).
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from mint_server.model.config import ModelConfig
from mint_server.model.hybrid_spec import HybridSpec
from mint_server.model.lora_targets import ATTN_TARGETS, LINEAR_TARGETS, V4_TARGETS
from mint_server.model.mla_spec import MLASpec, full_kv_elems_per_token, mla_token_shapes
from mint_server.model.mla_spec import keeps_float32 as mla_keeps_float32
from mint_server.model.v4_spec import (
    CSA,
    HCA,
    V4Spec,
    cache_bytes_per_block,
    cache_pool_shapes,
    checkpoint_name,
    floor_bytes_per_token,
)
from mint_server.model.v4_spec import keeps_float32 as v4_keeps_float32

Shape = tuple[int, ...]


# --- the standard blocks' rules (Llama, Qwen3, Qwen3-MoE, gpt-oss; the defaults) --------------------
def _standard_attention_targets(cfg: ModelConfig) -> tuple[str, ...]:
    return ATTN_TARGETS


def _no_targets(cfg: ModelConfig) -> dict:
    return {}


def _no_parts(cfg: ModelConfig) -> dict[str, int]:
    return {}


def _no_shared_expert(cfg: ModelConfig) -> int:
    return 0


def _standard_attention_params(cfg: ModelConfig) -> int:
    """q, k, v and o of one attention layer (biases, sinks: plan.count_params from the switches)."""
    h, H, D = cfg.hidden_size, cfg.num_heads, cfg.head_dim
    return h * (H + 2 * cfg.num_kv_heads) * D + H * D * h


def _kv_token_shapes(cfg: ModelConfig) -> dict[str, Shape]:
    return {"k": (cfg.num_kv_heads, cfg.head_dim), "v": (cfg.num_kv_heads, cfg.head_dim)}


def _no_state(cfg: ModelConfig, elem_bytes: int, tp: int) -> tuple[int, int]:
    return 0, 0


def _head_dim(cfg: ModelConfig) -> int:
    return cfg.head_dim


def _no_tp_refusal(cfg: ModelConfig, world: int) -> str | None:
    return None


def _never(name: str) -> bool:
    return False


def _compressor_prefix(cfg: ModelConfig, layer: int) -> str:
    return "compressor_"  # no such target: peft_io refuses it by name


@dataclass(frozen=True)
class BlockCache:
    """A cache whose pools are held per block rather than per token (DeepSeek-V4: v4_spec.py)."""

    pools: Callable[[ModelConfig, int, int], dict[str, tuple[Shape, bool]]]  # (cfg, blocks, block size)
    bytes_per_block: Callable[[ModelConfig, int, int], int]  # (cfg, block size, element bytes)
    floor_bytes_per_token: Callable[[ModelConfig, int], float]  # long context, out-of-window positions freed


@dataclass(frozen=True)
class FamilySpec:
    """What one family does its own way; every field's default is the standard blocks' behaviour."""

    model_class: str  # "module:Class", imported by `model_class_of`
    # LoRA (lora.py): attention targets, the targets of only some layers (target → layers), the (in, out)
    # of targets whose width is this family's own, and the width of a sparse layer's shared expert(s)
    attention_targets: Callable[[ModelConfig], tuple[str, ...]] = _standard_attention_targets
    layer_targets: Callable[[ModelConfig], dict[str, tuple[int, ...]]] = _no_targets
    target_io: Callable[[ModelConfig], dict[str, tuple[int, int]]] = _no_targets
    shared_expert_size: Callable[[ModelConfig], int] = _no_shared_expert
    # memory plan (plan.py): one attention layer's q/k/v/o parameters; the parts only it has
    # (linear_attn, indexer: totals; shared_experts: per sparse layer; vision_tower); or a whole count
    attention_params: Callable[[ModelConfig], int] = _standard_attention_params
    part_params: Callable[[ModelConfig], dict[str, int]] = _no_parts
    count_params: Callable[[ModelConfig], dict[str, int]] | None = None
    # KV cache (kv_cache.py): pool name → shape per token and attention layer; full_kv_elems: the naive
    # per-head K/V elements per token and layer a latent cache replaces (None: the cache is that K/V)
    kv_token_shapes: Callable[[ModelConfig], dict[str, Shape]] = _kv_token_shapes
    full_kv_elems: Callable[[ModelConfig], int] | None = None
    block_cache: BlockCache | None = None
    # a recurrent state per sequence (engine: a state slot each; no prefix cache); its bytes (total,
    # per GPU under tp) at `elem_bytes` per conv element
    recurrent_state: bool = False
    state_bytes: Callable[[ModelConfig, int, int], tuple[int, int]] = _no_state
    rotary_dim: Callable[[ModelConfig], int] = _head_dim  # RoPE's rotated dims per head
    # loading (loader.py): HF name → ours (None: the loader's prefix map); weights kept in float32
    weight_name: Callable[[str], str | None] | None = None
    keeps_float32: Callable[[str], bool] = _never
    # PEFT names (peft_io.py, merge.py)
    decoder_prefix: str = "model."
    shared_expert_module: str = "shared_experts"
    compressor_prefix: Callable[[ModelConfig, int], str] = _compressor_prefix
    # what it refuses (None / "": it does not)
    tp_refusal: Callable[[ModelConfig, int], str | None] = _no_tp_refusal  # (cfg, tp world)
    packing_refusal: str | None = None
    prefix_cache_refusal: str = ""
    batch_invariant: bool = False


# --- DeepSeek V3 / V3.2 / GLM-5: multi-head latent attention (mla_spec.py) -------------------------------
def _mla(cfg: ModelConfig) -> MLASpec:
    assert cfg.mla is not None, f"{cfg.architecture} has no MLA spec"
    return cfg.mla


def _mla_attention_targets(cfg: ModelConfig) -> tuple[str, ...]:
    q = ("q_proj",) if _mla(cfg).q_lora_rank is None else ("q_a_proj", "q_b_proj")
    return (*q, "kv_a_proj_with_mqa", "kv_b_proj", "o_proj")


def _mla_shared(cfg: ModelConfig) -> int:
    return _mla(cfg).n_shared_experts * cfg.moe_intermediate_size


def _mla_target_io(cfg: ModelConfig) -> dict[str, tuple[int, int]]:
    m, h, H, shared = _mla(cfg), cfg.hidden_size, cfg.num_heads, _mla_shared(cfg)
    return {
        "q_proj": (h, H * m.qk_head_dim), "q_a_proj": (h, m.q_lora_rank or 0),
        "q_b_proj": (m.q_lora_rank or 0, H * m.qk_head_dim),
        "kv_a_proj_with_mqa": (h, m.kv_lora_rank + m.qk_rope_head_dim),
        "kv_b_proj": (m.kv_lora_rank, H * (m.qk_nope_head_dim + m.v_head_dim)), "o_proj": (H * m.v_head_dim, h),
        "shared_gate_proj": (h, shared), "shared_up_proj": (h, shared), "shared_down_proj": (shared, h),
    }


def _mla_attention_params(cfg: ModelConfig) -> int:
    m, h, H = _mla(cfg), cfg.hidden_size, cfg.num_heads
    q = h * H * m.qk_head_dim if m.q_lora_rank is None else (
        h * m.q_lora_rank + m.q_lora_rank + m.q_lora_rank * H * m.qk_head_dim)
    return q + h * (m.kv_lora_rank + m.qk_rope_head_dim) + m.kv_lora_rank \
        + m.kv_lora_rank * H * (m.qk_nope_head_dim + m.v_head_dim) + H * m.v_head_dim * h


def _mla_part_params(cfg: ModelConfig) -> dict[str, int]:
    m, h = _mla(cfg), cfg.hidden_size
    indexer = 0 if not m.dsa else (
        (m.q_lora_rank or 0) * m.index_n_heads * m.index_head_dim + h * m.index_head_dim
        + 2 * m.index_head_dim + h * m.index_n_heads)
    indexers = sum(m.has_indexer(i) for i in range(cfg.num_layers))  # GLM-5's shared layers have none
    return {"indexer": indexers * indexer, "shared_experts": 3 * h * m.n_shared_experts * cfg.moe_intermediate_size}


def _mla_tp_refusal(cfg: ModelConfig, world: int) -> str | None:
    if _mla(cfg).attention_bias and world > 1:
        return (f"tensor parallelism is not supported for {cfg.architecture} with attention_bias "
                "(o_proj's bias would be added on every rank)")
    return None


_MLA = {
    "attention_targets": _mla_attention_targets, "target_io": _mla_target_io, "shared_expert_size": _mla_shared,
    "attention_params": _mla_attention_params, "part_params": _mla_part_params,
    "kv_token_shapes": lambda cfg: mla_token_shapes(_mla(cfg)),
    "full_kv_elems": lambda cfg: full_kv_elems_per_token(_mla(cfg), cfg.num_heads),
    "keeps_float32": mla_keeps_float32, "tp_refusal": _mla_tp_refusal,
    "packing_refusal": "MLA attention (DeepSeek): its latent attention has no per-datum packed form yet",
}


# --- DeepSeek-V4: compressed sparse / heavily compressed attention, hyper-connections (v4_spec.py) ---------
def _v4(cfg: ModelConfig) -> V4Spec:
    assert cfg.v4 is not None, f"{cfg.architecture} has no V4 spec"
    return cfg.v4


def _v4_layer_targets(cfg: ModelConfig) -> dict[str, tuple[int, ...]]:
    out: dict[str, tuple[int, ...]] = {}
    for kind, prefix in ((CSA, "csa_"), (HCA, "hca_")):
        if layers := _v4(cfg).layers_of(kind):
            out.update(dict.fromkeys((prefix + "kv_proj", prefix + "gate_proj"), layers))
    return out


def _v4_target_io(cfg: ModelConfig) -> dict[str, tuple[int, int]]:
    v, h, H, D, shared = _v4(cfg), cfg.hidden_size, cfg.num_heads, cfg.head_dim, cfg.moe_intermediate_size
    return {
        "q_a_proj": (h, v.q_lora_rank), "q_b_proj": (v.q_lora_rank, H * D), "kv_proj": (h, D),
        "o_b_proj": (v.o_groups * v.o_lora_rank, h),
        "csa_kv_proj": (h, 2 * D), "csa_gate_proj": (h, 2 * D), "hca_kv_proj": (h, D), "hca_gate_proj": (h, D),
        "shared_gate_proj": (h, shared), "shared_up_proj": (h, shared), "shared_down_proj": (shared, h),
    }


def _v4_count_params(cfg: ModelConfig) -> dict[str, int]:
    """DeepSeek-V4's parts: attention (with its compressors), the CSA indexers, the hyper-connections,
    (mhc) and every layer a MoE with one shared expert; the hash layers' token → experts table counts as router."""
    v, h, H, D, L = _v4(cfg), cfg.hidden_size, cfg.num_heads, cfg.head_dim, cfg.num_layers
    qr, Di, n, E, inter = v.q_lora_rank, v.index_head_dim, v.hc_mult, cfg.num_experts, cfg.moe_intermediate_size
    attn = h * qr + qr + qr * H * D + h * D + D + H * D * v.o_lora_rank + v.o_groups * v.o_lora_rank * h + H + 2 * h
    csa, hca = len(v.layers_of(CSA)), len(v.layers_of(HCA))
    compressor = csa * (4 * h * D + v.csa_rate * 2 * D + D) + hca * (2 * h * D + v.hca_rate * D + D)
    indexer = csa * (4 * h * Di + v.csa_rate * 2 * Di + Di + qr * v.index_n_heads * Di + h * v.index_n_heads)
    mix = (2 + n) * n
    hashed = len(v.hash_layers)
    return {
        "embedding": cfg.vocab_size * h,
        "lm_head": 0 if cfg.tie_word_embeddings else cfg.vocab_size * h,
        "attention": L * attn + compressor + h,  # + the final norm
        "indexer": indexer,
        "mhc": L * 2 * (mix * n * h + mix + 3) + n * n * h + n + 1,
        "routed_experts": L * E * 3 * h * inter,
        "shared_experts": L * 3 * h * inter,
        "router": L * E * h + (L - hashed) * E + hashed * cfg.vocab_size * cfg.num_experts_per_tok,
    }


def _v4_compressor_prefix(cfg: ModelConfig, layer: int) -> str:
    """A compressor projection's target prefix: its layer's kind (csa_ / hca_)."""
    types = _v4(cfg).layer_types
    return {CSA: "csa_", HCA: "hca_"}.get(types[layer] if layer < len(types) else None, "compressor_")


_V4 = {
    "attention_targets": lambda cfg: ("q_a_proj", "q_b_proj", *V4_TARGETS), "layer_targets": _v4_layer_targets,
    "target_io": _v4_target_io, "shared_expert_size": lambda cfg: cfg.moe_intermediate_size,
    "count_params": _v4_count_params,
    "block_cache": BlockCache(
        pools=lambda cfg, blocks, size: cache_pool_shapes(_v4(cfg), cfg.head_dim, cfg.num_layers, blocks, size),
        bytes_per_block=lambda cfg, size, elem: cache_bytes_per_block(_v4(cfg), cfg.head_dim, cfg.num_layers, size,
                                                                      elem),
        floor_bytes_per_token=lambda cfg, elem: floor_bytes_per_token(_v4(cfg), cfg.head_dim, elem)),
    "weight_name": checkpoint_name, "keeps_float32": v4_keeps_float32, "compressor_prefix": _v4_compressor_prefix,
    "tp_refusal": lambda cfg, world: (
        f"tensor parallelism is not supported for {cfg.architecture} (compressed attention, grouped output "
        "projection, hyper-connection streams) yet"),
    "packing_refusal": "DeepSeek-V4: its compressors read each row's positions",
}


# --- Qwen3.5: gated delta-net linear attention between gated full attention (hybrid_spec.py) -------------
def _hybrid(cfg: ModelConfig) -> HybridSpec:
    assert cfg.hybrid is not None, f"{cfg.architecture} has no hybrid spec"
    return cfg.hybrid


def _hybrid_target_io(cfg: ModelConfig) -> dict[str, tuple[int, int]]:
    """q_proj also yields the output gate; the gated delta net's projections; the shared expert."""
    hy, h, s = _hybrid(cfg), cfg.hidden_size, _hybrid(cfg).shared_expert_intermediate_size
    return {"q_proj": (h, 2 * cfg.num_heads * cfg.head_dim), "in_proj_qkv": (h, hy.conv_dim),
            "in_proj_z": (h, hy.value_dim), "in_proj_b": (h, hy.num_v_heads), "in_proj_a": (h, hy.num_v_heads),
            "out_proj": (hy.value_dim, h),
            "shared_gate_proj": (h, s), "shared_up_proj": (h, s), "shared_down_proj": (s, h)}


def _hybrid_part_params(cfg: ModelConfig) -> dict[str, int]:
    """The linear-attention layers and the gated shared expert."""
    hy, h = _hybrid(cfg), cfg.hidden_size
    linear = len(hy.linear_layers) * (h * (hy.conv_dim + hy.value_dim + 2 * hy.num_v_heads) + hy.value_dim * h
                                      + hy.conv_dim * hy.conv_kernel + 2 * hy.num_v_heads + hy.v_head_dim)
    s = hy.shared_expert_intermediate_size
    return {"linear_attn": linear, "shared_experts": 3 * h * s + h if s else 0}


def _hybrid_state_bytes(cfg: ModelConfig, elem_bytes: int, tp: int) -> tuple[int, int]:
    """One sequence's conv + delta-rule state over all linear layers; per GPU its linear heads split."""
    state = _hybrid(cfg).state_bytes(elem_bytes)
    return state, -(-state // min(tp, _hybrid(cfg).num_k_heads))


def _hybrid_tp_refusal(cfg: ModelConfig, world: int) -> str | None:
    return None if world <= 1 else (f"tensor parallelism is not supported for {cfg.architecture} "
                                    "(linear-attention layers and their recurrent state) yet")


_HYBRID = {
    "layer_targets": lambda cfg: dict.fromkeys(LINEAR_TARGETS, _hybrid(cfg).linear_layers),
    "target_io": _hybrid_target_io, "shared_expert_size": lambda cfg: _hybrid(cfg).shared_expert_intermediate_size,
    # q_proj also yields the gate; the q / k norms
    "attention_params": lambda cfg: _standard_attention_params(cfg) + cfg.hidden_size * cfg.num_heads * cfg.head_dim
    + 2 * cfg.head_dim,
    "part_params": _hybrid_part_params, "recurrent_state": True, "state_bytes": _hybrid_state_bytes,
    "rotary_dim": lambda cfg: _hybrid(cfg).rotary_dim,  # partial rotary
    "shared_expert_module": "shared_expert", "tp_refusal": _hybrid_tp_refusal,
    "packing_refusal": "Qwen3.5 hybrid: its linear-attention layers carry a recurrent state along each row",
    "prefix_cache_refusal": "a hybrid base: its recurrent state is not in the KV blocks",
}


# --- Qwen3-VL: an image tower, multimodal RoPE, DeepStack (vision_spec.py) ------------------------------
def _vision_tp_refusal(cfg: ModelConfig, world: int) -> str | None:
    return None if world <= 1 else f"tensor parallelism is not supported for {cfg.architecture} (image input) yet"


def _vision_part_params(cfg: ModelConfig) -> dict[str, int]:
    assert cfg.vision is not None, f"{cfg.architecture} has no vision spec"
    return {"vision_tower": cfg.vision.num_params()}  # replicated on every GPU


_VISION = {
    "part_params": _vision_part_params, "decoder_prefix": "model.language_model.", "tp_refusal": _vision_tp_refusal,
    "packing_refusal": "vision-language base (image features and M-RoPE positions are laid out per padded row)",
}

_MODEL = "mint_server.model."
# config.Family.name → its entry (config.FAMILIES maps each HF architecture to its Family).
FAMILY_SPECS: dict[str, FamilySpec] = {
    "llama": FamilySpec(_MODEL + "transformer:Transformer", batch_invariant=True),
    "qwen3": FamilySpec(_MODEL + "transformer:Transformer", batch_invariant=True),
    "qwen3_moe": FamilySpec(_MODEL + "transformer:Transformer"),
    "gpt_oss": FamilySpec(_MODEL + "gpt_oss:GptOssTransformer"),
    "deepseek_v3": FamilySpec(_MODEL + "deepseek:DeepseekTransformer", **_MLA),
    "deepseek_v32": FamilySpec(_MODEL + "deepseek:DeepseekTransformer", **_MLA),
    "glm_moe_dsa": FamilySpec(_MODEL + "glm_moe_dsa:GlmMoeDsaTransformer", **_MLA),
    "deepseek_v4": FamilySpec(_MODEL + "deepseek_v4:DeepseekV4Transformer", **_V4),
    "qwen3_5": FamilySpec(_MODEL + "qwen35:HybridTransformer", **_HYBRID),
    "qwen3_5_moe": FamilySpec(_MODEL + "qwen35:HybridTransformer", **_HYBRID),
    "qwen3_vl": FamilySpec(_MODEL + "qwen3_vl:VisionLanguageModel", **_VISION),
    "qwen3_vl_moe": FamilySpec(_MODEL + "qwen3_vl:VisionLanguageModel", **_VISION),
}


def family_spec(cfg: ModelConfig) -> FamilySpec:
    """This config's family entry."""
    return FAMILY_SPECS[cfg.family.name]


def model_class_of(cfg: ModelConfig) -> type[Any]:
    """The model class (a transformer.Transformer) of this config's family, its module imported now."""
    module, _, name = family_spec(cfg).model_class.partition(":")
    return getattr(importlib.import_module(module), name)

