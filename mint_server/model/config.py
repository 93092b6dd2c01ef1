"""Model configuration: one dataclass for every supported family, read from an HF config.json.

A family is declarative: an entry in FAMILIES says which HF architecture it is and which switches
(qk-norm, attention bias, mixture-of-experts MLPs, MLA, sinks, ...) it turns on. Adding a family is one
entry here, one in the family registry (families.FAMILY_SPECS: its model class and what it does its own
way) and, where its blocks differ, a model file on the shared blocks (docs/families.md).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from mint_server.model.errors import ModelError, UnsupportedModelError
from mint_server.model.hybrid_spec import HybridSpec, parse_hybrid
from mint_server.model.mla_spec import MLASpec, dense_layers_of, parse_mla
from mint_server.model.prequant_spec import Prequantized, parse_quantization
from mint_server.model.v4_spec import V4Spec, parse_v4
from mint_server.model.vision_spec import VisionSpec, flatten_text_config, mrope_section, parse_vision


@dataclass(frozen=True)
class Family:
    name: str
    qk_norm: bool
    attention_bias: bool
    moe: bool = False  # some layers' MLP is a routed set of experts (Qwen3-MoE style)
    mla: bool = False  # DeepSeek: latent attention, sigmoid-routed MoE with shared experts (mla_spec.py)
    dsa: bool = False  # DeepSeek-V3.2: plus the sparse-attention indexer
    vision: bool = False  # Qwen3-VL: an image tower, multimodal RoPE and deepstack (vision_spec.py)
    sinks: bool = False  # gpt-oss: a learned per-head sink logit joins every attention softmax
    o_bias: bool = False  # o_proj has a bias too (gpt-oss; attention_bias covers q/k/v)
    index_rope_interleave: bool = False  # GLM-5: the DSA indexer's rope rotates pairs (mla_spec.MLASpec)
    tp_unsupported: str = ""  # why tensor parallelism refuses this family ("" = it splits)
    hybrid: bool = False  # Qwen3.5: gated delta-net linear-attention layers between gated full attention (hybrid_spec.py)
    compressed: bool = False  # DeepSeek-V4: compressed sparse / heavily compressed attention, mHC (v4_spec.py)


# rope_scaling types we implement (transformer.rope_inv_freq), for every family but multimodal RoPE's.
ROPE_TYPES = frozenset({"default", "linear", "llama3", "yarn"})

# HF `architectures[0]` → family switches.
FAMILIES: dict[str, Family] = {
    "LlamaForCausalLM": Family("llama", qk_norm=False, attention_bias=False),
    "Qwen3ForCausalLM": Family("qwen3", qk_norm=True, attention_bias=False),
    "Qwen3MoeForCausalLM": Family("qwen3_moe", qk_norm=True, attention_bias=False, moe=True),
    "DeepseekV3ForCausalLM": Family("deepseek_v3", qk_norm=False, attention_bias=False, moe=True, mla=True),
    "DeepseekV32ForCausalLM": Family("deepseek_v32", qk_norm=False, attention_bias=False, moe=True, mla=True,
                                     dsa=True),
    "Qwen3VLForConditionalGeneration": Family("qwen3_vl", qk_norm=True, attention_bias=False, vision=True),
    "Qwen3VLMoeForConditionalGeneration": Family("qwen3_vl_moe", qk_norm=True, attention_bias=False, moe=True,
                                                 vision=True),
    "GptOssForCausalLM": Family("gpt_oss", qk_norm=False, attention_bias=True, moe=True, sinks=True, o_bias=True,
                                tp_unsupported="attention sinks and biased experts do not split yet"),
    "GlmMoeDsaForCausalLM": Family("glm_moe_dsa", qk_norm=False, attention_bias=False, moe=True, mla=True, dsa=True,
                                   index_rope_interleave=True, tp_unsupported="shared DSA indexer layers do not split yet"),
    "Qwen3_5ForCausalLM": Family("qwen3_5", qk_norm=True, attention_bias=False, hybrid=True),
    "Qwen3_5MoeForCausalLM": Family("qwen3_5_moe", qk_norm=True, attention_bias=False, moe=True, hybrid=True),
    "DeepseekV4ForCausalLM": Family("deepseek_v4", qk_norm=False, attention_bias=False, moe=True, compressed=True),
}
MODEL_TYPES = {"llama": "LlamaForCausalLM", "qwen3": "Qwen3ForCausalLM", "qwen3_moe": "Qwen3MoeForCausalLM",
               "deepseek_v3": "DeepseekV3ForCausalLM", "deepseek_v32": "DeepseekV32ForCausalLM",
               "qwen3_vl": "Qwen3VLForConditionalGeneration", "qwen3_vl_moe": "Qwen3VLMoeForConditionalGeneration",
               "gpt_oss": "GptOssForCausalLM", "glm_moe_dsa": "GlmMoeDsaForCausalLM",
               "qwen3_5_text": "Qwen3_5ForCausalLM", "qwen3_5_moe_text": "Qwen3_5MoeForCausalLM",
               "qwen3_5": "Qwen3_5ForConditionalGeneration", "qwen3_5_moe": "Qwen3_5MoeForConditionalGeneration",
               "deepseek_v4": "DeepseekV4ForCausalLM"}
# Vision-language wrappers whose text model is a family: their `text_config` and language-model weights
# load as that family (the vision tower is not loaded). Qwen3.5's Hub checkpoints are these.
TEXT_MODEL_OF = {"Qwen3_5ForConditionalGeneration": "Qwen3_5ForCausalLM",
                 "Qwen3_5MoeForConditionalGeneration": "Qwen3_5MoeForCausalLM"}


@dataclass(frozen=True)
class ModelConfig:
    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    max_position_embeddings: int
    tie_word_embeddings: bool
    rope_scaling: dict[str, Any] | None = None
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()
    # Mixture of experts (families with moe=True; zero / empty otherwise). A layer's MLP is sparse
    # when it is not in mlp_only_layers and (layer + 1) is a multiple of decoder_sparse_step;
    # the other layers keep a dense MLP of intermediate_size.
    num_experts: int = 0
    num_experts_per_tok: int = 0
    moe_intermediate_size: int = 0
    norm_topk_prob: bool = False
    decoder_sparse_step: int = 1
    mlp_only_layers: tuple[int, ...] = ()
    # DeepSeek families (family.mla): MLA dims, DeepSeek routing, the V3.2 indexer. Their head_dim
    # is the RoPE part (qk_rope_head_dim) and num_kv_heads == num_heads (neither is a K/V shape).
    mla: MLASpec | None = None
    # Vision-language families (family.vision): the image tower, and the frequencies per axis
    # (t, h, w) of the language model's multimodal RoPE.
    vision: VisionSpec | None = None
    mrope_section: tuple[int, int, int] | None = None
    # gpt-oss: `layer_types[i]` "sliding_attention" layers see only the last `sliding_window` positions
    # (their own included); experts use a clamped SwiGLU, (clamp(u, ±limit) + 1) · g·σ(alpha·g) with
    # g = clamp(gate, max=limit) (limit 0: plain SiLU · up).
    sliding_window: int = 0
    layer_types: tuple[str, ...] = ()
    swiglu_alpha: float = 0.0
    swiglu_limit: float = 0.0
    # Qwen3.5 (family.hybrid): which layers are linear attention, their dims, partial rotary, shared expert.
    hybrid: HybridSpec | None = None
    # DeepSeek-V4 (family.compressed): head_dim is the one shared K=V head's, num_kv_heads 1, every
    # layer's MLP a MoE (intermediate_size = moe_intermediate_size: the shared expert's width).
    v4: V4Spec | None = None
    # A pre-quantized checkpoint (`quantization_config`: fp8 block-scaled, MXFP4): how its weights are
    # stored; the loader dequantizes them (prequant.py). None: plain float weights.
    prequantized: Prequantized | None = None

    @property
    def family(self) -> Family:
        return FAMILIES[self.architecture]

    def window(self, layer: int) -> int:
        """How many positions (its own included) a query of `layer` attends to; 0: all earlier ones."""
        sliding = bool(self.layer_types) and self.layer_types[layer] == "sliding_attention"
        return self.sliding_window if sliding else 0

    def is_sparse(self, layer: int) -> bool:
        """Whether `layer`'s MLP is the routed experts (else a dense MLP)."""
        return (
            self.num_experts > 0
            and layer not in self.mlp_only_layers
            and (layer + 1) % self.decoder_sparse_step == 0
        )

    @property
    def sparse_layers(self) -> tuple[int, ...]:
        return tuple(i for i in range(self.num_layers) if self.is_sparse(i))

    @property
    def dense_layers(self) -> tuple[int, ...]:
        return tuple(i for i in range(self.num_layers) if not self.is_sparse(i))

    @property
    def attention_layers(self) -> tuple[int, ...]:
        """Layers with softmax attention, the ones the KV cache holds (all but hybrid linear-attention layers)."""
        linear = self.hybrid.linear_layers if self.hybrid is not None else ()
        return tuple(i for i in range(self.num_layers) if i not in linear)

    @classmethod
    def from_hf_dict(cls, hf: dict[str, Any]) -> ModelConfig:
        archs = hf.get("architectures") or [MODEL_TYPES.get(hf.get("model_type", ""), "")]
        arch = archs[0] if archs else ""
        text_cfg = hf.get("text_config")
        quantization = hf.get("quantization_config") or (
            text_cfg.get("quantization_config") if isinstance(text_cfg, dict) else None)
        if arch in TEXT_MODEL_OF and isinstance(text := hf.get("text_config"), dict):
            tie = hf.get("tie_word_embeddings", text.get("tie_word_embeddings", False))
            arch = TEXT_MODEL_OF[arch]
            hf = {**text, "architectures": [arch], "tie_word_embeddings": tie}
        if arch not in FAMILIES:
            raise UnsupportedModelError(
                f"unsupported architecture {arch or hf.get('model_type')!r}; supported: {sorted(FAMILIES)}"
            )
        family = FAMILIES[arch]
        prequantized = parse_quantization(quantization, family.name)
        top = hf
        try:
            if family.vision:
                hf = flatten_text_config(hf)
            num_heads = int(hf["num_attention_heads"])
            hidden = int(hf["hidden_size"])
            rope = hf.get("rope_parameters") or hf.get("rope_scaling") or {}
            rope_theta = float(hf.get("rope_theta") or rope.get("rope_theta") or 10000.0)
            rope_type = rope.get("rope_type") or rope.get("type") or "default"
            v4 = None
            if family.compressed:  # its two ropes (main, compress) are V4Spec's
                v4 = parse_v4(hf, int(hf["num_hidden_layers"]))
                rope_type, rope, rope_theta = "default", {}, v4.main_theta
                hf = {**hf, "num_key_value_heads": 1, "intermediate_size": hf["moe_intermediate_size"]}
            # dynamic NTK is refused: transformers derives its frequencies from each forward's length, so
            # a position's keys would depend on the chunk that computed them (no cache can honour it).
            if rope_type not in ROPE_TYPES:
                raise UnsupportedModelError(f"unsupported rope_scaling type {rope_type!r}; supported: {sorted(ROPE_TYPES)}")
            if family.vision and rope_type != "default":
                raise UnsupportedModelError(f"rope type {rope_type!r} with multimodal RoPE is not supported")
            eos = hf.get("eos_token_id")
            eos_ids = tuple(eos) if isinstance(eos, list) else (() if eos is None else (int(eos),))
            moe = (_gpt_oss_fields(hf) if family.sinks else _moe_fields(hf)) if family.moe else {}
            if family.moe and family.vision:  # Qwen3-VL-MoE's router always renormalises its top-k
                moe["norm_topk_prob"] = True
            if family.mla:
                layers = int(hf["num_hidden_layers"])
                mla = parse_mla(hf, rope, family.dsa, family.index_rope_interleave)
                moe.update(mla=mla, mlp_only_layers=dense_layers_of(hf, layers), decoder_sparse_step=1)
                hf = {**hf, "num_key_value_heads": num_heads, "head_dim": mla.qk_rope_head_dim}
            if family.vision:
                head_dim = int(hf.get("head_dim") or hidden // num_heads)
                moe.update(vision=parse_vision(top, hidden), mrope_section=mrope_section(rope, head_dim))
            if family.hybrid:
                moe.update(_hybrid_fields(hf, rope, num_heads, hidden, family.moe))
                if family.moe:  # every layer sparse; the shared expert is the dense part
                    hf = {**hf, "intermediate_size": moe["hybrid"].shared_expert_intermediate_size}
            if v4 is not None:  # every layer's MLP is routed
                moe.update(v4=v4, mlp_only_layers=(), decoder_sparse_step=1)
            return cls(
                architecture=arch,
                vocab_size=int(hf["vocab_size"]),
                hidden_size=hidden,
                intermediate_size=int(hf["intermediate_size"]),
                num_layers=int(hf["num_hidden_layers"]),
                num_heads=num_heads,
                num_kv_heads=int(hf.get("num_key_value_heads") or num_heads),
                head_dim=int(hf.get("head_dim") or hidden // num_heads),
                rms_norm_eps=float(hf.get("rms_norm_eps", 1e-6)),
                rope_theta=rope_theta,
                max_position_embeddings=int(hf.get("max_position_embeddings", 2048)),
                tie_word_embeddings=bool(hf.get("tie_word_embeddings", False)),
                rope_scaling=_rope_scaling(hf, rope, rope_type),
                bos_token_id=hf.get("bos_token_id"),
                eos_token_ids=eos_ids,
                prequantized=prequantized,
                **moe,
            )
        except KeyError as e:
            raise ModelError(f"config.json is missing field {e.args[0]!r}") from None

    @classmethod
    def from_hf_dir(cls, path: str | Path) -> ModelConfig:
        path = Path(path)
        if not path.is_dir():
            raise ModelError(f"model directory {str(path)!r} does not exist")
        cfg_file = path / "config.json"
        if not cfg_file.is_file():
            raise ModelError(f"{str(path)!r} has no config.json")
        try:
            hf = json.loads(cfg_file.read_text())
        except json.JSONDecodeError as e:
            raise ModelError(f"{cfg_file} is not valid JSON: {e}") from None
        return cls.from_hf_dict(hf)


def _rope_scaling(hf: dict[str, Any], rope: dict[str, Any], rope_type: str) -> dict[str, Any] | None:
    """The rope scaling parameters, None for plain RoPE. As transformers reads them: llama3 and yarn's
    original context defaults to a top-level `original_max_position_embeddings`, else to
    max_position_embeddings."""
    if rope_type == "default":
        return None
    out = dict(rope)
    if rope_type in ("llama3", "yarn"):
        if hf.get("original_max_position_embeddings"):
            out["original_max_position_embeddings"] = int(hf["original_max_position_embeddings"])
        out.setdefault("original_max_position_embeddings", int(hf["max_position_embeddings"]))
    return out


def _hybrid_fields(hf: dict[str, Any], rope: dict[str, Any], num_heads: int, hidden: int, moe: bool) -> dict[str, Any]:
    """Qwen3.5's switches: the hybrid spec; MoE layers always renormalise their top-k and have no
    dense layers. Refuses what its modules do not implement, by name."""
    if hf.get("attention_bias"):
        raise UnsupportedModelError("attention_bias=true is not supported for Qwen3.5")
    if hf.get("hidden_act", "silu") != "silu":
        raise UnsupportedModelError(f"unsupported hidden_act {hf.get('hidden_act')!r} (only silu)")
    layers = int(hf["num_hidden_layers"])
    spec = parse_hybrid(hf, rope, layers, int(hf.get("head_dim") or hidden // num_heads))
    out: dict[str, Any] = {"hybrid": spec}
    if moe:
        out.update(norm_topk_prob=True, decoder_sparse_step=1, mlp_only_layers=())
    return out


def _moe_fields(hf: dict[str, Any]) -> dict[str, Any]:
    """The MoE switches of an HF config (transformers writes the expert count as num_local_experts)."""
    experts = hf.get("num_experts", hf.get("num_local_experts", hf.get("n_routed_experts")))
    if experts is None:
        raise KeyError("num_experts")
    top_k = int(hf["num_experts_per_tok"])
    if not 0 < top_k <= int(experts):
        raise ModelError(f"num_experts_per_tok {top_k} is outside 1..num_experts ({experts})")
    step = int(hf.get("decoder_sparse_step") or 1)
    if hf.get("hidden_act", "silu") != "silu":
        raise UnsupportedModelError(f"unsupported hidden_act {hf.get('hidden_act')!r} (only silu)")
    return {
        "num_experts": int(experts),
        "num_experts_per_tok": top_k,
        "moe_intermediate_size": int(hf["moe_intermediate_size"]),
        "norm_topk_prob": bool(hf.get("norm_topk_prob", False)),
        "decoder_sparse_step": step,
        "mlp_only_layers": tuple(int(i) for i in hf.get("mlp_only_layers") or ()),
    }


def _gpt_oss_fields(hf: dict[str, Any]) -> dict[str, Any]:
    """gpt-oss: every layer's MLP is routed experts of `intermediate_size`; sliding / full layers."""
    layers = int(hf["num_hidden_layers"])
    types = tuple(hf.get("layer_types") or ("sliding_attention" if i % 2 == 0 else "full_attention"
                                            for i in range(layers)))
    if len(types) != layers or not set(types) <= {"sliding_attention", "full_attention"}:
        raise ModelError(f"layer_types must list sliding_attention / full_attention for each of {layers} layers")
    window = int(hf.get("sliding_window") or 0)
    if "sliding_attention" in types and window < 1:
        raise ModelError("sliding_window must be at least 1 when a layer is sliding_attention")
    experts, top_k = int(hf.get("num_local_experts", hf.get("num_experts", 0))), int(hf["num_experts_per_tok"])
    if not 0 < top_k <= experts:
        raise ModelError(f"num_experts_per_tok {top_k} is outside 1..num_local_experts ({experts})")
    return {
        "num_experts": experts, "num_experts_per_tok": top_k, "moe_intermediate_size": int(hf["intermediate_size"]),
        "sliding_window": window, "layer_types": types,
        "swiglu_alpha": float(hf.get("swiglu_alpha", 1.702)), "swiglu_limit": float(hf.get("swiglu_limit", 7.0)),
    }
