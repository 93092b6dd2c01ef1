"""Memory plan for serving and LoRA-training a base on N accelerators (`mint plan`), from its config alone.

Counts, not measurements: base parameters by part, their bytes per GPU under tensor parallelism for
attention / dense MLPs / the vocabulary and expert parallelism for the routed experts, the KV cache
per token (MLA's latent cache vs expanded per-head K/V; hybrid bases: only their attention layers, plus
a fixed recurrent state per sequence for their linear-attention layers), LoRA bytes per unit of rank,
and how many adapters fit in each residency tier. See docs/scale-up.md.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass

from mint_server.model.config import ModelConfig
from mint_server.model.lora import lora_shapes, select_targets, target_experts, target_shapes
from mint_server.model.mla_spec import full_kv_elems_per_token, mla_token_shapes
from mint_server.model.tp import TPNotSupportedError, check_supported
from mint_server.model.v4_spec import (
    CSA,
    DEFAULT_BLOCK_SIZE,
    HCA,
    cache_bytes_per_block,
    floor_bytes_per_token,
)

GIB = 2**30


@dataclass
class Plan:
    architecture: str
    gpus: int
    tp: int
    ep: int
    params: dict[str, int]  # part → parameters
    base_bytes_per_gpu: int
    kv_bytes_per_token_latent: int | None  # all layers; None for non-MLA bases
    kv_bytes_per_token_full: int
    kv_bytes_per_token_per_gpu: int  # what one GPU holds per token with this base's cache under tp
    # DeepSeek-V4: what its cache would cost per token at long context with positions past every
    # layer's window freed (only the compressed entries grow); None for other bases
    kv_bytes_per_token_floor: float | None
    lora_params_per_rank: int
    adapter_bytes: int  # one serving adapter at `rank` (bank dtype), whole model
    adapter_bytes_per_gpu: int
    train_adapter_bytes_per_gpu: int  # + gradients and fp32 AdamW moments and master
    kv_budget_bytes_per_gpu: int
    kv_tokens: int  # positions the KV budget holds
    sequences_at_context: int
    device_adapters_per_gpu: int  # serving adapters in the memory left on a GPU
    device_training_adapters_per_gpu: int
    host_adapters: int
    fits: bool
    sliding_layers: int = 0  # layers that attend to only the last `sliding_window` positions (gpt-oss)
    sliding_window: int = 0
    # hybrid bases (Qwen3.5): each sequence's conv + delta-rule state over all linear-attention layers,
    # whatever its length (0 for other bases); per GPU under tp (linear-attention heads split)
    state_bytes_per_sequence: int = 0
    state_bytes_per_sequence_per_gpu: int = 0
    tp_note: str | None = None  # why the engine cannot run this base tensor-parallel yet (None: it can)


def count_params(cfg: ModelConfig) -> dict[str, int]:
    """Base parameters by part (norms included in their part; MTP layers not counted)."""
    h, H, L = cfg.hidden_size, cfg.num_heads, cfg.num_layers
    if cfg.v4 is not None:
        return _count_v4(cfg)
    m = cfg.mla
    if m is not None:
        q = h * H * m.qk_head_dim if m.q_lora_rank is None else (
            h * m.q_lora_rank + m.q_lora_rank + m.q_lora_rank * H * m.qk_head_dim)
        attn = q + h * (m.kv_lora_rank + m.qk_rope_head_dim) + m.kv_lora_rank \
            + m.kv_lora_rank * H * (m.qk_nope_head_dim + m.v_head_dim) + H * m.v_head_dim * h
        indexer = 0 if not m.dsa else (
            (m.q_lora_rank or 0) * m.index_n_heads * m.index_head_dim + h * m.index_head_dim
            + 2 * m.index_head_dim + h * m.index_n_heads)
        indexers = sum(m.has_indexer(i) for i in range(L))  # GLM-5's shared layers have none
        shared = 3 * h * m.n_shared_experts * cfg.moe_intermediate_size
    else:
        attn = h * (H + 2 * cfg.num_kv_heads) * cfg.head_dim + H * cfg.head_dim * h
        indexer, indexers, shared = 0, 0, 0
    f = cfg.family
    if f.attention_bias:  # q/k/v biases (gpt-oss: o_proj's too, and a sink logit per head)
        attn += (H + 2 * cfg.num_kv_heads) * cfg.head_dim + (h if f.o_bias else 0) + (H if f.sinks else 0)
    expert = 3 * h * cfg.moe_intermediate_size + (2 * cfg.moe_intermediate_size + h if f.sinks else 0)  # + biases
    linear = 0
    if (hy := cfg.hybrid) is not None:  # Qwen3.5: q_proj also yields the gate; q/k norms; gated shared expert
        attn += h * H * cfg.head_dim + 2 * cfg.head_dim
        linear = len(hy.linear_layers) * (h * (hy.conv_dim + hy.value_dim + 2 * hy.num_v_heads) + hy.value_dim * h
                                          + hy.conv_dim * hy.conv_kernel + 2 * hy.num_v_heads + hy.v_head_dim)
        shared = 3 * h * hy.shared_expert_intermediate_size + h if hy.shared_expert_intermediate_size else 0
    sparse, dense = len(cfg.sparse_layers), len(cfg.dense_layers)
    return {
        "embedding": cfg.vocab_size * h,
        "lm_head": 0 if cfg.tie_word_embeddings else cfg.vocab_size * h,
        "attention": len(cfg.attention_layers) * attn + L * 2 * h,
        "linear_attn": linear,
        "indexer": indexers * indexer,
        "dense_mlp": dense * 3 * h * cfg.intermediate_size,
        "routed_experts": sparse * cfg.num_experts * expert,
        "shared_experts": sparse * shared,
        "router": sparse * cfg.num_experts * (h + 1),
        "vision_tower": cfg.vision.num_params() if cfg.vision is not None else 0,  # replicated on every GPU
    }


def _count_v4(cfg: ModelConfig) -> dict[str, int]:
    """DeepSeek-V4's parts: attention (with its compressors), the CSA indexers, the hyper-connections,
    (mhc) and every layer a MoE with one shared expert; the hash layers' token → experts table counts as router."""
    v, h, H, D, L = cfg.v4, cfg.hidden_size, cfg.num_heads, cfg.head_dim, cfg.num_layers
    assert v is not None
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


def lora_params_per_rank(cfg: ModelConfig) -> int:
    """Σ (in + out) over every LoRA target of the base (experts: each its own pair), all layers."""
    shapes, experts = target_shapes(cfg), target_experts(cfg)
    total = 0
    for t in select_targets():
        if t in shapes:
            a, b = lora_shapes(shapes[t], experts.get(t, 0), 1)
            total += math.prod(a) + math.prod(b)
    return total


def kv_elems_per_token(cfg: ModelConfig) -> tuple[int | None, int]:
    """(latent, full) cache elements per token per layer; latent None for a non-MLA base."""
    if cfg.mla is None:
        return None, 2 * cfg.num_kv_heads * cfg.head_dim
    latent = sum(math.prod(s) for s in mla_token_shapes(cfg.mla).values())
    return latent, full_kv_elems_per_token(cfg.mla, cfg.num_heads)


def plan(cfg: ModelConfig, *, gpus: int, gpu_mem_gib: float, rank: int, tp: int | None = None,
         ep: int | None = None, weight_bytes: float = 2.0, kv_bytes: int = 2, lora_bytes: int = 2,
         kv_fraction: float = 0.5, context: int = 8192, host_mem_gib: float = 512.0,
         mem_util: float = 0.9) -> Plan:
    """weight_bytes per base parameter (2: bf16, 1: fp8); kv_fraction of the memory left after the
    base goes to the KV cache, the rest to adapter slots."""
    tp, ep = tp or gpus, ep or gpus
    params = count_params(cfg)
    experts, tower = params["routed_experts"], params.get("vision_tower", 0)
    rest = sum(params.values()) - experts - tower
    base_gpu = int((rest / tp + experts / ep + tower) * weight_bytes)
    latent, full = kv_elems_per_token(cfg)
    L = len(cfg.attention_layers)
    # Under tensor-parallel attention per-head K/V shard by head (a KV head is replicated on the ranks
    # that share it when tp > KV heads); MLA's latent is shared by all heads, so each rank keeps all of
    # it (data-parallel attention would split sequences instead).
    kv_split = min(tp, cfg.num_kv_heads)
    kv_tok_gpu = (latent * L * kv_bytes) if latent is not None else -(-full * L * kv_bytes // kv_split)
    floor = None
    if cfg.v4 is not None:  # its paged cache (window K=V, entries, state), one K=V head: replicated too
        v4_paged = cache_bytes_per_block(cfg.v4, cfg.head_dim, L, DEFAULT_BLOCK_SIZE, kv_bytes) / DEFAULT_BLOCK_SIZE
        kv_tok_gpu = full_bytes = math.ceil(v4_paged)
        floor = floor_bytes_per_token(cfg.v4, cfg.head_dim, kv_bytes)
    else:
        full_bytes = full * L * kv_bytes
    try:
        check_supported(cfg, tp)
        tp_note = None
    except TPNotSupportedError as e:
        tp_note = str(e)
    per_rank = lora_params_per_rank(cfg)
    adapter = per_rank * rank * lora_bytes
    adapter_gpu = -(-adapter // gpus)
    train_gpu = -(-per_rank * rank * (2 * lora_bytes + 12) // gpus)  # weights+grads; fp32 master, m, v
    free = int(gpu_mem_gib * GIB * mem_util) - base_gpu
    kv_budget = max(0, int(free * kv_fraction))
    kv_tokens = kv_budget // kv_tok_gpu if kv_tok_gpu else 0
    state = cfg.hybrid.state_bytes(kv_bytes) if cfg.hybrid is not None else 0
    state_gpu = -(-state // min(tp, cfg.hybrid.num_k_heads)) if cfg.hybrid is not None else 0
    sequences = kv_budget // (context * kv_tok_gpu + state_gpu) if kv_tok_gpu or state_gpu else 0
    slots_mem = max(0, free - kv_budget)
    return Plan(
        architecture=cfg.architecture, gpus=gpus, tp=tp, ep=ep, params=params, base_bytes_per_gpu=base_gpu,
        kv_bytes_per_token_latent=None if latent is None else latent * L * kv_bytes,
        kv_bytes_per_token_full=full_bytes, kv_bytes_per_token_per_gpu=kv_tok_gpu, kv_bytes_per_token_floor=floor,
        lora_params_per_rank=per_rank, adapter_bytes=adapter, adapter_bytes_per_gpu=adapter_gpu,
        train_adapter_bytes_per_gpu=train_gpu, kv_budget_bytes_per_gpu=kv_budget, kv_tokens=kv_tokens,
        sequences_at_context=sequences, device_adapters_per_gpu=slots_mem // max(adapter_gpu, 1),
        device_training_adapters_per_gpu=slots_mem // max(train_gpu, 1),
        host_adapters=int(host_mem_gib * GIB) // max(adapter, 1), fits=free > 0, tp_note=tp_note,
        sliding_layers=sum(1 for i in range(cfg.num_layers) if cfg.window(i)), sliding_window=cfg.sliding_window,
        state_bytes_per_sequence=state, state_bytes_per_sequence_per_gpu=state_gpu,
    )


def render(p: Plan, rank: int, context: int) -> str:
    def gib(b: float) -> str:
        return f"{b / GIB:,.2f} GiB"

    total = sum(p.params.values())
    lines = [f"{p.architecture}: {total / 1e9:,.1f} B parameters on {p.gpus} GPUs (tp={p.tp}, ep={p.ep})"]
    lines += [f"  {k:<15} {v / 1e9:>9.2f} B" for k, v in p.params.items() if v]
    lines.append(f"base weights per GPU      {gib(p.base_bytes_per_gpu)}" + ("" if p.fits else "  (DOES NOT FIT)"))
    if p.kv_bytes_per_token_floor is not None:
        lines.append(f"KV per token (all layers) {p.kv_bytes_per_token_full:,} B as paged (window K=V kept for every "
                     f"position, compressed entries, per-block state); {p.kv_bytes_per_token_floor:,.0f} B at long "
                     "context with out-of-window positions freed")
    elif p.kv_bytes_per_token_latent is not None:
        ratio = p.kv_bytes_per_token_full / p.kv_bytes_per_token_latent
        lines.append(f"KV per token (all layers) latent {p.kv_bytes_per_token_latent:,} B vs full K/V "
                     f"{p.kv_bytes_per_token_full:,} B ({ratio:.1f}x smaller)")
    else:
        lines.append(f"KV per token (all layers) {p.kv_bytes_per_token_full:,} B")
    if p.sliding_layers:
        lines.append(f"  ({p.sliding_layers} sliding-window layers attend to the last {p.sliding_window:,} positions only; "
                     "MinT still caches every position of every layer)")
    if p.state_bytes_per_sequence:
        lines.append(f"recurrent state per sequence {p.state_bytes_per_sequence:,} B (linear-attention layers, any "
                     f"length; {p.state_bytes_per_sequence_per_gpu:,} B per GPU)")
    lines.append(f"KV per token per GPU      {p.kv_bytes_per_token_per_gpu:,} B; budget {gib(p.kv_budget_bytes_per_gpu)}"
                 f" = {p.kv_tokens:,} positions = {p.sequences_at_context:,} sequences of {context:,}")
    lines.append(f"LoRA params per rank      {p.lora_params_per_rank:,}; rank {rank} adapter {gib(p.adapter_bytes)}"
                 f" ({gib(p.adapter_bytes_per_gpu)} per GPU; training {gib(p.train_adapter_bytes_per_gpu)} per GPU)")
    lines.append(f"adapters per tier         device {p.device_adapters_per_gpu:,} serving / "
                 f"{p.device_training_adapters_per_gpu:,} training; host {p.host_adapters:,}; store unbounded")
    if p.tp_note:
        lines.append(f"note: {p.tp_note}")
    return "\n".join(lines)


def plan_dict(p: Plan) -> dict:
    return asdict(p)
