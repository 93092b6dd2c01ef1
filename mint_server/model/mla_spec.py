"""DeepSeek-family switches read from an HF config: Multi-head Latent Attention (MLA), DeepSeek's
MoE routing, and DeepSeek Sparse Attention's lightning indexer (V3.2). Torch-free, so the CLI's
memory planner can read a config without loading a model.

Dims (per token, per layer): the query is `q_a_proj` (hidden → q_lora_rank) → RMSNorm → `q_b_proj`
(→ heads · (nope + rope)), or one `q_proj` when q_lora_rank is null. Keys and values come from one
shared compressed latent: `kv_a_proj_with_mqa` (hidden → kv_lora_rank + rope) splits into the latent
(RMSNorm'd) and a single RoPE key shared by all heads; `kv_b_proj` (kv_lora_rank → heads · (nope +
v)) expands the latent into per-head no-RoPE keys and values. The latent cache stores only
kv_lora_rank + rope numbers per token and layer.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from mint_server.model.errors import ModelError


@dataclass(frozen=True)
class MLASpec:
    q_lora_rank: int | None  # None: one q_proj (no query compression)
    kv_lora_rank: int
    qk_nope_head_dim: int
    qk_rope_head_dim: int
    v_head_dim: int
    rope_interleave: bool  # DeepSeek's checkpoints rotate (x0, x1), (x2, x3) … pairs
    attention_bias: bool  # on q_a_proj, kv_a_proj_with_mqa, o_proj
    softmax_scale: float  # (nope + rope)^-½, times yarn's mscale² when the rope is scaled
    # DeepSeek MoE: sigmoid scores, group-limited top-k, a bias that steers only the choice.
    n_shared_experts: int
    routed_scaling_factor: float
    n_group: int
    topk_group: int
    # DeepSeek Sparse Attention (V3.2); zero without an indexer.
    index_n_heads: int = 0
    index_head_dim: int = 0
    index_topk: int = 0
    index_rope_interleave: bool = False  # GLM-5 rotates the indexer's rope dims in pairs (V3.2: rotate-half)
    # GLM-5: per layer "full" (runs its indexer) or "shared" (no indexer: reuses the selection of the
    # previous full layer); empty = every layer full.
    indexer_types: tuple[str, ...] = ()

    @property
    def qk_head_dim(self) -> int:
        return self.qk_nope_head_dim + self.qk_rope_head_dim

    def has_indexer(self, layer: int) -> bool:
        return self.dsa and (not self.indexer_types or self.indexer_types[layer] == "full")

    @property
    def dsa(self) -> bool:
        return self.index_topk > 0


def yarn_mscale(factor: float, mscale: float = 1.0) -> float:
    return 1.0 if factor <= 1 else 0.1 * mscale * math.log(factor) + 1.0


def rope_attention_factor(rope: dict[str, Any] | None) -> float:
    """The factor yarn multiplies cos/sin by (1 for other rope types)."""
    if not rope or rope.get("rope_type", rope.get("type")) != "yarn":
        return 1.0
    if rope.get("attention_factor") is not None:
        return float(rope["attention_factor"])
    factor, mscale, mscale_all = rope["factor"], rope.get("mscale"), rope.get("mscale_all_dim")
    if mscale and mscale_all:
        return yarn_mscale(factor, mscale) / yarn_mscale(factor, mscale_all)
    return yarn_mscale(factor)


def parse_mla(hf: dict[str, Any], rope: dict[str, Any], dsa: bool, index_rope_interleave: bool = False) -> MLASpec:
    """The MLA / DeepSeek-MoE / indexer fields of an HF DeepSeek config (KeyError names a missing one)."""
    nope, rope_dim = int(hf["qk_nope_head_dim"]), int(hf["qk_rope_head_dim"])
    scale = (nope + rope_dim) ** -0.5
    if rope.get("rope_type", rope.get("type", "default")) != "default" and rope.get("mscale_all_dim"):
        m = yarn_mscale(float(rope["factor"]), float(rope["mscale_all_dim"]))
        scale *= m * m
    q_rank = hf.get("q_lora_rank")
    return MLASpec(
        q_lora_rank=None if q_rank is None else int(q_rank),
        kv_lora_rank=int(hf["kv_lora_rank"]),
        qk_nope_head_dim=nope,
        qk_rope_head_dim=rope_dim,
        v_head_dim=int(hf["v_head_dim"]),
        # V3.2 always interleaves (its config has no switch).
        rope_interleave=True if dsa else bool(hf.get("rope_interleave", True)),
        attention_bias=bool(hf.get("attention_bias", False)),
        softmax_scale=scale,
        n_shared_experts=int(hf.get("n_shared_experts") or 0),
        routed_scaling_factor=float(hf.get("routed_scaling_factor", 1.0)),
        n_group=int(hf.get("n_group") or 1),
        topk_group=int(hf.get("topk_group") or 1),
        index_n_heads=int(hf["index_n_heads"]) if dsa else 0,
        index_head_dim=int(hf["index_head_dim"]) if dsa else 0,
        index_topk=int(hf["index_topk"]) if dsa else 0,
        index_rope_interleave=index_rope_interleave,
        indexer_types=indexer_types_of(hf) if dsa else (),
    )


def indexer_types_of(hf: dict[str, Any]) -> tuple[str, ...]:
    """Per-layer "full" / "shared" indexers as transformers derives them: `indexer_types`, else the
    `index_topk_pattern` string (F / S), else every `index_topk_freq`-th layer from
    `index_skip_topk_offset` on runs its own (the defaults, 1 and 2, make every layer full)."""
    layers = int(hf["num_hidden_layers"])
    types = hf.get("indexer_types")
    if types is None and (pattern := hf.get("index_topk_pattern")) is not None:
        types = [{"F": "full", "S": "shared"}.get(c, c) for c in pattern]
    if types is None:
        freq, offset = max(int(hf.get("index_topk_freq") or 1), 1), int(hf.get("index_skip_topk_offset", 2))
        types = ["full" if max(i - offset + 1, 0) % freq == 0 else "shared" for i in range(layers)]
    types = tuple(types)
    if len(types) != layers or not set(types) <= {"full", "shared"} or (types and types[0] != "full"):
        raise ModelError(f"indexer_types must be full / shared for each of {layers} layers, the first full: {types}")
    return types


def dense_layers_of(hf: dict[str, Any], num_layers: int) -> tuple[int, ...]:
    """DeepSeek's dense-MLP layers: `mlp_layer_types` when given (V3.2), else the first
    `first_k_dense_replace` layers."""
    types = hf.get("mlp_layer_types")
    if types:
        return tuple(i for i, t in enumerate(types) if t == "dense")
    return tuple(range(min(int(hf.get("first_k_dense_replace") or 0), num_layers)))


def mla_token_shapes(spec: MLASpec) -> dict[str, tuple[int, ...]]:
    """The latent KV cache per token and layer: the normed latent, the (roped) shared key, and for
    V3.2 the indexer's key (kept for every layer; GLM-5's shared-indexer layers leave theirs unused)."""
    shapes = {"latent": (spec.kv_lora_rank,), "k_rope": (spec.qk_rope_head_dim,)}
    if spec.dsa:
        shapes["index_k"] = (spec.index_head_dim,)
    return shapes


def full_kv_elems_per_token(spec: MLASpec, num_heads: int) -> int:
    """What a naive cache of the expanded per-head keys and values would hold per token and layer."""
    return num_heads * (spec.qk_head_dim + spec.v_head_dim)


# DeepSeek's router (weights and choice bias) stays float32 like HF: bf16 would flip expert choices.
FLOAT32_WEIGHTS = ("mlp.gate.weight", "mlp.gate.e_score_correction_bias")


def keeps_float32(name: str) -> bool:
    """Whether the loader keeps this weight (our name) in float32 whatever the model's dtype."""
    return name.endswith(FLOAT32_WEIGHTS)
