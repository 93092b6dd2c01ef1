"""Model configuration: one dataclass for every supported family, read from an HF config.json.

A family is declarative: an entry in FAMILIES says which HF architecture it is and which switches
(qk-norm, attention bias, mixture-of-experts MLPs) it turns on. Adding a family is one entry here
plus, if its weight names differ, a name map in loader.py.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from mint_server.model.mla_spec import MLASpec, dense_layers_of, parse_mla
from mint_server.model.v4_spec import V4Spec, parse_v4


class ModelError(ValueError):
    """A model directory or config that we cannot load; the message names the problem."""


class UnsupportedModelError(ModelError):
    """The checkpoint's architecture is not one we implement."""


@dataclass(frozen=True)
class Family:
    name: str
    qk_norm: bool
    attention_bias: bool
    moe: bool = False  # some layers' MLP is a routed set of experts (Qwen3-MoE style)
    mla: bool = False  # DeepSeek: latent attention, sigmoid-routed MoE with shared experts (mla_spec.py)
    dsa: bool = False  # DeepSeek-V3.2: plus the sparse-attention indexer
    compressed: bool = False  # DeepSeek-V4: compressed sparse / heavily compressed attention, mHC (v4_spec.py)


# HF `architectures[0]` → family switches.
FAMILIES: dict[str, Family] = {
    "LlamaForCausalLM": Family("llama", qk_norm=False, attention_bias=False),
    "Qwen3ForCausalLM": Family("qwen3", qk_norm=True, attention_bias=False),
    "Qwen3MoeForCausalLM": Family("qwen3_moe", qk_norm=True, attention_bias=False, moe=True),
    "DeepseekV3ForCausalLM": Family("deepseek_v3", qk_norm=False, attention_bias=False, moe=True, mla=True),
    "DeepseekV32ForCausalLM": Family("deepseek_v32", qk_norm=False, attention_bias=False, moe=True, mla=True,
                                     dsa=True),
    "DeepseekV4ForCausalLM": Family("deepseek_v4", qk_norm=False, attention_bias=False, moe=True, compressed=True),
}
MODEL_TYPES = {"llama": "LlamaForCausalLM", "qwen3": "Qwen3ForCausalLM", "qwen3_moe": "Qwen3MoeForCausalLM",
               "deepseek_v3": "DeepseekV3ForCausalLM", "deepseek_v32": "DeepseekV32ForCausalLM",
               "deepseek_v4": "DeepseekV4ForCausalLM"}


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
    # DeepSeek-V4 (family.compressed): head_dim is the one shared K=V head's, num_kv_heads 1, every
    # layer's MLP a MoE (intermediate_size = moe_intermediate_size: the shared expert's width).
    v4: V4Spec | None = None

    @property
    def family(self) -> Family:
        return FAMILIES[self.architecture]

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

    @classmethod
    def from_hf_dict(cls, hf: dict[str, Any]) -> ModelConfig:
        archs = hf.get("architectures") or [MODEL_TYPES.get(hf.get("model_type", ""), "")]
        arch = archs[0] if archs else ""
        if arch not in FAMILIES:
            raise UnsupportedModelError(
                f"unsupported architecture {arch or hf.get('model_type')!r}; supported: {sorted(FAMILIES)}"
            )
        try:
            num_heads = int(hf["num_attention_heads"])
            hidden = int(hf["hidden_size"])
            rope = hf.get("rope_parameters") or hf.get("rope_scaling") or {}
            rope_theta = float(hf.get("rope_theta") or rope.get("rope_theta") or 10000.0)
            rope_type = rope.get("rope_type") or rope.get("type") or "default"
            family = FAMILIES[arch]
            v4 = None
            if family.compressed:  # its two ropes (main, compress) are V4Spec's
                try:
                    v4 = parse_v4(hf, int(hf["num_hidden_layers"]))
                except ValueError as e:
                    raise UnsupportedModelError(str(e)) from None
                rope_type, rope, rope_theta = "default", {}, v4.main_theta
                hf = {**hf, "num_key_value_heads": 1, "intermediate_size": hf["moe_intermediate_size"]}
            if rope_type not in ("default", "llama3") and not (family.mla and rope_type == "yarn"):
                raise UnsupportedModelError(f"unsupported rope_scaling type {rope_type!r}")
            eos = hf.get("eos_token_id")
            eos_ids = tuple(eos) if isinstance(eos, list) else (() if eos is None else (int(eos),))
            moe = _moe_fields(hf) if family.moe else {}
            if family.mla:
                layers = int(hf["num_hidden_layers"])
                mla = parse_mla(hf, rope, family.dsa)
                moe.update(mla=mla, mlp_only_layers=dense_layers_of(hf, layers), decoder_sparse_step=1)
                hf = {**hf, "num_key_value_heads": num_heads, "head_dim": mla.qk_rope_head_dim}
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
                rope_scaling=dict(rope) if rope_type in ("llama3", "yarn") else None,
                bos_token_id=hf.get("bos_token_id"),
                eos_token_ids=eos_ids,
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
