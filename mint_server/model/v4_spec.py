"""DeepSeek-V4 switches read from an HF config (torch-free, so `mint plan` reads a config without
loading a model). The modules live in deepseek_v4.py; docs/deepseek-v4.md describes the model.

Per layer the attention is one of three kinds (`layer_types`): `sliding_attention` (a sliding window
of `sliding_window` keys), `compressed_sparse_attention` (CSA: the window plus one compressed entry
per `csa_rate` tokens, of which a lightning indexer keeps `index_topk` per query) or
`heavily_compressed_attention` (HCA: the window plus one entry per `hca_rate` tokens, all visible).
The sliding layers rotate with the `main` rope, the compressed ones (and their compressors and the
indexer) with the `compress` rope. The residual is `hc_mult` parallel streams mixed by
manifold-constrained hyper-connections. Every MLP is a MoE; the first layers route by a frozen
token → experts table (`hash_layers`).
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any

from mint_server.model.errors import UnsupportedModelError

SLIDING, CSA, HCA = "sliding_attention", "compressed_sparse_attention", "heavily_compressed_attention"
LAYER_TYPES = (SLIDING, CSA, HCA)
_RATIO_TO_TYPE = {0: SLIDING, 4: CSA, 128: HCA}  # the legacy `compress_ratios` list (transformers' mapping)
SCORING_FUNCS = ("sqrtsoftplus", "sigmoid")  # what transformers runs (its ACT2FN has no softmax)
DEFAULT_BLOCK_SIZE = 16  # the sampler's KV block size (engine/kv.py): per-block state is amortised over it


@dataclass(frozen=True)
class V4Spec:
    q_lora_rank: int
    rope_dim: int  # the trailing rope part of each head (qk_rope_head_dim)
    layer_types: tuple[str, ...]
    csa_rate: int
    hca_rate: int
    sliding_window: int
    main_theta: float
    compress_theta: float
    compress_rope: dict[str, Any] | None  # yarn parameters of the compress rope (None: plain)
    o_groups: int
    o_lora_rank: int
    index_n_heads: int
    index_head_dim: int
    index_topk: int
    hc_mult: int
    hc_sinkhorn_iters: int
    hc_eps: float
    hash_layers: tuple[int, ...]
    scoring_func: str
    routed_scaling_factor: float
    swiglu_limit: float

    def rate(self, layer: int) -> int:
        """The layer's compression rate (0: sliding only)."""
        kind = self.layer_types[layer]
        return self.csa_rate if kind == CSA else self.hca_rate if kind == HCA else 0

    def layers_of(self, kind: str) -> tuple[int, ...]:
        return tuple(i for i, t in enumerate(self.layer_types) if t == kind)


def parse_v4(hf: dict[str, Any], num_layers: int) -> V4Spec:
    """The V4 fields of an HF config, with transformers' defaults and legacy spellings (compress_ratios,
    num_hash_layers, qk_rope_head_dim, a flat rope_scaling); KeyError names a missing field."""
    head_dim = int(hf["head_dim"])
    rates = {CSA: 4, HCA: 128, **(hf.get("compress_rates") or {})}
    if hf.get("compress_rate_csa") is not None:
        rates[CSA] = int(hf["compress_rate_csa"])
    if hf.get("compress_rate_hca") is not None:
        rates[HCA] = int(hf["compress_rate_hca"])
    types = hf.get("layer_types")
    if types is None and hf.get("compress_ratios") is not None:
        unknown = sorted({int(r) for r in hf["compress_ratios"]} - set(_RATIO_TO_TYPE))
        if unknown:
            raise UnsupportedModelError(f"compress_ratios holds {unknown}; DeepSeek-V4 knows {sorted(_RATIO_TO_TYPE)}")
        types = [_RATIO_TO_TYPE[int(r)] for r in hf["compress_ratios"]]
    if types is None:  # transformers' default: two HCA layers, then CSA / HCA alternating
        types = [HCA] * min(num_layers, 2) + [CSA if i % 2 else HCA for i in range(max(num_layers - 2, 0))]
    types = tuple(types[:num_layers])  # the legacy list carries one more entry, for the MTP layer
    if len(types) != num_layers or any(t not in LAYER_TYPES for t in types):
        raise UnsupportedModelError(f"layer_types must list one of {list(LAYER_TYPES)} per layer ({num_layers}), got {list(types)}")
    mlp_types = hf.get("mlp_layer_types")
    if mlp_types is None:
        n_hash = int(hf.get("num_hash_layers", 3))
        mlp_types = ["hash_moe"] * min(num_layers, n_hash) + ["moe"] * max(0, num_layers - n_hash)
    partial = hf.get("partial_rotary_factor")
    if partial is None:
        partial = int(hf["qk_rope_head_dim"]) / head_dim if hf.get("qk_rope_head_dim") else 64 / 512
    rope = hf.get("rope_parameters") or hf.get("rope_scaling") or {}
    compress = rope.get("compress") if isinstance(rope.get("compress"), dict) else {
        k: v for k, v in rope.items() if k not in ("main", "compress")}
    compress_type = compress.get("rope_type", compress.get("type", "default"))
    if compress_type not in ("default", "yarn"):
        raise UnsupportedModelError(f"unsupported compress rope type {compress_type!r} (default or yarn)")
    main = rope.get("main") if isinstance(rope.get("main"), dict) else {}
    scoring = hf.get("scoring_func", "sqrtsoftplus")
    if scoring not in SCORING_FUNCS:
        raise UnsupportedModelError(f"unsupported scoring_func {scoring!r}; DeepSeek-V4 knows {list(SCORING_FUNCS)}")
    yarn = None
    if compress_type == "yarn":  # transformers forces attention_factor 1 (the reference never scales cos/sin)
        yarn = {**compress, "rope_type": "yarn", "attention_factor": compress.get("attention_factor", 1.0)}
    return V4Spec(
        q_lora_rank=int(hf["q_lora_rank"]),
        rope_dim=int(head_dim * partial),
        layer_types=types,
        csa_rate=int(rates[CSA]),
        hca_rate=int(rates[HCA]),
        sliding_window=int(hf.get("sliding_window", 128)),
        main_theta=float(main.get("rope_theta", hf.get("rope_theta", 10000.0))),
        compress_theta=float(compress.get("rope_theta") if isinstance(rope.get("compress"), dict)
                             else hf.get("compress_rope_theta", 160000.0)),
        compress_rope=yarn,
        o_groups=int(hf.get("o_groups", 8)),
        o_lora_rank=int(hf.get("o_lora_rank", 1024)),
        index_n_heads=int(hf.get("index_n_heads", 64)),
        index_head_dim=int(hf.get("index_head_dim", 128)),
        index_topk=int(hf.get("index_topk", 512)),
        hc_mult=int(hf.get("hc_mult", 4)),
        hc_sinkhorn_iters=int(hf.get("hc_sinkhorn_iters", 20)),
        hc_eps=float(hf.get("hc_eps", 1e-6)),
        hash_layers=tuple(i for i, t in enumerate(mlp_types[:num_layers]) if t == "hash_moe"),
        scoring_func=scoring,
        routed_scaling_factor=float(hf.get("routed_scaling_factor", 1.5)),
        swiglu_limit=float(hf.get("swiglu_limit", 10.0)),
    )


def cache_pool_shapes(spec: V4Spec, head_dim: int, num_layers: int, num_blocks: int,
                      block_size: int) -> dict[str, tuple[tuple[int, ...], bool]]:
    """The paged cache's pools: name → (full shape, float32?). Every pool is [layers of its kind,
    blocks, …], so swapping, copying and sharing blocks handle them all alike.

    kv          [L, blocks, block_size, D]     each position's K (= V) for the sliding window
    {csa,hca}_entry [Lk, blocks, e, D]         the compressed entries of the windows ending in the
                                               block (e = ⌈block_size / rate⌉ slots)
    {csa,hca}_state [Lk, blocks, s, D] fp32    the compressor's running softmax state (acc, lse;
                                               CSA: also the overlap series) after the block's last
                                               written position; read by the next token
    csa_ientry / csa_istate                    the same for the lightning indexer's keys (index_head_dim)
    """
    pools: dict[str, tuple[tuple[int, ...], bool]] = {"kv": ((num_layers, num_blocks, block_size, head_dim), False)}
    for kind, name, rate, states in ((CSA, "csa", spec.csa_rate, 4), (HCA, "hca", spec.hca_rate, 2)):
        n = len(spec.layers_of(kind))
        if not n:
            continue
        slots = -(-block_size // rate)
        pools[f"{name}_entry"] = ((n, num_blocks, slots, head_dim), False)
        pools[f"{name}_state"] = ((n, num_blocks, states, head_dim), True)
        if kind == CSA:
            pools["csa_ientry"] = ((n, num_blocks, slots, spec.index_head_dim), False)
            pools["csa_istate"] = ((n, num_blocks, states, spec.index_head_dim), True)
    return pools


def cache_bytes_per_block(spec: V4Spec, head_dim: int, num_layers: int, block_size: int, elem_bytes: int) -> int:
    """What one block of `block_size` positions costs in every pool (fp32 state pools: 4 B)."""
    total = 0
    for shape, fp32 in cache_pool_shapes(spec, head_dim, num_layers, 1, block_size).values():
        n = 1
        for s in shape:
            n *= s
        total += n * (4 if fp32 else elem_bytes)
    return total


def floor_bytes_per_token(spec: V4Spec, head_dim: int, elem_bytes: int) -> float:
    """The cache's long-context cost per token if positions past every layer's window were freed:
    only the compressed entries grow (D / rate per compressed layer, plus the indexer's keys)."""
    csa, hca = len(spec.layers_of(CSA)), len(spec.layers_of(HCA))
    return elem_bytes * (csa * (head_dim + spec.index_head_dim) / spec.csa_rate + hca * head_dim / spec.hca_rate)


# --- checkpoint names (DeepSeek's own, as the Hub ships them, or transformers' module names) ------
_RENAMES = tuple((re.compile(a), b) for a, b in (
    (r"\.attn\.", ".self_attn."), (r"\.ffn\.", ".mlp."), (r"\.indexer\.compressor\.", ".compressor.indexer."),
    (r"^embed\.weight$", "embed_tokens.weight"), (r"^head\.weight$", "lm_head.weight"),
    (r"^hc_head_fn$", "hc_head.hc_fn"), (r"^hc_head_base$", "hc_head.hc_base"), (r"^hc_head_scale$", "hc_head.hc_scale"),
    (r"\.attn_norm\.", ".input_layernorm."), (r"\.ffn_norm\.", ".post_attention_layernorm."),
    (r"\.hc_(attn|ffn)_(fn|base|scale)$", r".\1_hc.\2"), (r"\.attn_sink$", ".sinks"),
    (r"\.indexer\.weights_proj\.", ".compressor.indexer.scorer.weights_proj."),
    (r"\.indexer\.wq_b\.", ".compressor.indexer.q_b_proj."), (r"\.norm\.", ".kv_norm."), (r"\.ape$", ".position_bias"),
    (r"\.wq_a\.", ".q_a_proj."), (r"\.wq_b\.", ".q_b_proj."), (r"\.wkv\.", ".kv_proj."), (r"\.wgate\.", ".gate_proj."),
    (r"\.wo_a\.", ".o_a_proj."), (r"\.wo_b\.", ".o_b_proj."), (r"\.q_norm\.", ".q_a_norm."),
    (r"\.gate\.bias$", ".gate.e_score_correction_bias"),
    (r"\.w1\.weight$", ".gate_proj.weight"), (r"\.w2\.weight$", ".down_proj.weight"), (r"\.w3\.weight$", ".up_proj.weight"),
))
# transformers keeps these in float32 whatever the dtype (and we keep the router there too).
_FLOAT32 = re.compile(r"(_hc\.|^hc_head\.|\.sinks$|\.position_bias$|\.e_score_correction_bias$|_norm\.weight$|"
                      r"_layernorm\.weight$|^norm\.weight$|\.mlp\.gate\.weight$)")


def checkpoint_name(name: str) -> str | None:
    """Our parameter name for a V4 checkpoint tensor (None: not ours, e.g. the MTP layers')."""
    if name.startswith("model."):
        name = name[len("model."):]
    elif name.startswith("mtp.") or ".mtp." in name:
        return None
    for pattern, repl in _RENAMES:
        name = pattern.sub(repl, name)
    return name


def keeps_float32(name: str) -> bool:
    return _FLOAT32.search(name) is not None
