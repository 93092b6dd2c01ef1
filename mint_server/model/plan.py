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
from mint_server.model.families import family_spec
from mint_server.model.lora import lora_shapes, select_targets, target_experts, target_shapes
from mint_server.model.tp import TPNotSupportedError, check_supported
from mint_server.model.v4_spec import DEFAULT_BLOCK_SIZE

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
    family = family_spec(cfg)
    if family.count_params is not None:  # a family counted its own way (DeepSeek-V4)
        return family.count_params(cfg)
    h, H, L = cfg.hidden_size, cfg.num_heads, cfg.num_layers
    attn, parts = family.attention_params(cfg), family.part_params(cfg)
    f = cfg.family
    if f.attention_bias:  # q/k/v biases (gpt-oss: o_proj's too, and a sink logit per head)
        attn += (H + 2 * cfg.num_kv_heads) * cfg.head_dim + (h if f.o_bias else 0) + (H if f.sinks else 0)
    expert = 3 * h * cfg.moe_intermediate_size + (2 * cfg.moe_intermediate_size + h if f.sinks else 0)  # + biases
    sparse, dense = len(cfg.sparse_layers), len(cfg.dense_layers)
    return {
        "embedding": cfg.vocab_size * h,
        "lm_head": 0 if cfg.tie_word_embeddings else cfg.vocab_size * h,
        "attention": len(cfg.attention_layers) * attn + L * 2 * h,
        "linear_attn": parts.get("linear_attn", 0),
        "indexer": parts.get("indexer", 0),
        "dense_mlp": dense * 3 * h * cfg.intermediate_size,
        "routed_experts": sparse * cfg.num_experts * expert,
        "shared_experts": sparse * parts.get("shared_experts", 0),
        "router": sparse * cfg.num_experts * (h + 1),
        "vision_tower": parts.get("vision_tower", 0),  # replicated on every GPU
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
    """(latent, full) cache elements per token per layer; latent None for a cache of per-head K/V."""
    family = family_spec(cfg)
    if family.full_kv_elems is None:
        return None, 2 * cfg.num_kv_heads * cfg.head_dim
    return sum(math.prod(s) for s in family.kv_token_shapes(cfg).values()), family.full_kv_elems(cfg)


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
    if (paged := family_spec(cfg).block_cache) is not None:  # DeepSeek-V4's (window K=V, entries, state), one
        # K=V head: replicated too
        kv_tok_gpu = full_bytes = math.ceil(paged.bytes_per_block(cfg, DEFAULT_BLOCK_SIZE, kv_bytes) / DEFAULT_BLOCK_SIZE)
        floor = paged.floor_bytes_per_token(cfg, kv_bytes)
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
    state, state_gpu = family_spec(cfg).state_bytes(cfg, kv_bytes, tp)
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
