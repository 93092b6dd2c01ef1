"""Tensor parallelism inside one engine: the base and the LoRA bank split over N torch.distributed ranks.

Megatron's layout (gloo on CPU, NCCL on CUDA; every rank holds 1/N of each split weight):

    q/k/v, gate/up (dense and each expert's)   column-parallel: output features split, heads split
    o, down (dense and each expert's)          row-parallel: input features split, all-reduce after
    embedding                                  vocab-parallel: rows split, all-reduce of the lookups
    lm_head                                    vocab-parallel: rows split, logits all-gathered
    norms, router, rope                        replicated

Attention heads and KV heads are split alike (rank i has query heads i·H/N… and the KV heads they
read), so attention needs no communication; each rank's KV cache holds its own KV heads. MoE layers
split every expert's intermediate dimension (not the experts themselves): all ranks route the same
(replicated) tokens the same way and run every chosen expert on their slice, so the work is even
whatever the routing, and expert LoRA follows the dense MLP's rule.

LoRA (S-LoRA's scheme) follows the base layer's split. Column-parallel: A [r, in] is replicated and
B [out, r] split by output rows; the delta x·Aᵀ·B_iᵀ is exactly rank i's slice of the output.
Row-parallel: A [r, in] split by input columns and B [out, r] replicated; each rank adds
s·(x_i·A_iᵀ)·Bᵀ, a partial delta, to its partial base output, and the one all-reduce the base needs
anyway sums both (B·Σᵢ x_i·A_iᵀ = Σᵢ B·x_i·A_iᵀ by linearity): no extra collective in the forward,
and none at all when sampling. Reducing x·Aᵀ before B instead would add an all-reduce of
[tokens, r] to every row-parallel projection of every decode step.

Gradients: in backward the replicated factor's gradient is a sum of per-rank partials (column: the
ranks' output slices each contribute to dA; row: each rank's input slice to dB), so it is
all-reduced — a tensor of r·in (or out·r) per target and layer, independent of the token count.
The split factor's gradient is exact locally. The replicated factor and its optimizer state stay
bit-identical on every rank (same inputs, same arithmetic); the global gradient norm counts the
split factors' squares summed over ranks and the replicated ones once.

Adapter state (bank slots, host copies, gradients, AdamW moments, fp32 masters) is held in the
same split (`shard_pairs`, `shard_moments`); on disk it is always the ordinary unsharded layout
(`gather_pairs` on save/export, `shard_pairs` on load), so a state saved at TP = 2 loads at TP = 1.
"""

from __future__ import annotations

import dataclasses
import math
import os
import re
import socket
from collections.abc import Mapping
from datetime import timedelta

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import Tensor, nn

from mint_server.model.config import ModelConfig
from mint_server.model.families import family_spec
from mint_server.model.tp_group import (  # noqa: F401 - re-exported
    COLUMN_TARGETS,
    REPLICATED_TARGETS,
    ROW_TARGETS,
    TP,
    sync_replicated,
)

# Optimizer moments per family: which factor each moment is shaped like.
MOMENT_FACTORS = {"adamw": ("A", "A", "B", "B"), "dimuon": ("A", "B")}


class TPNotSupportedError(ValueError):
    """This model or feature cannot run tensor-parallel (the message says which part and why)."""


# --- process group ------------------------------------------------------------------------------
def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def init(rank: int, world: int, port: int, backend: str | None = None, addr: str = "127.0.0.1",
         timeout_s: float | None = None) -> TP:
    """Join the default process group (gloo on CPU, NCCL when CUDA is available) and return this rank's TP.

    `timeout_s` bounds how long a collective waits for its peers (torch's default otherwise)."""
    os.environ["MASTER_ADDR"], os.environ["MASTER_PORT"] = addr, str(port)
    backend = backend or ("nccl" if torch.cuda.is_available() else "gloo")
    device = torch.device("cpu")
    if backend == "nccl":
        device = torch.device("cuda", rank % torch.cuda.device_count())
        torch.cuda.set_device(device)
    timeout = {"timeout": timedelta(seconds=timeout_s)} if timeout_s is not None else {}
    dist.init_process_group(backend, rank=rank, world_size=world, **timeout)
    return TP(rank, world, device=device)


# --- which models can split ---------------------------------------------------------------------
def check_supported(cfg: ModelConfig, world: int) -> None:
    """TPNotSupportedError naming the first dimension that does not split over `world` ranks."""
    if world < 1:
        raise TPNotSupportedError(f"tp must be at least 1, got {world}")
    if cfg.family.tp_unsupported and world > 1:
        raise TPNotSupportedError(f"tensor parallelism is not supported for {cfg.architecture} "
                                  f"({cfg.family.tp_unsupported})")
    if (refusal := family_spec(cfg).tp_refusal(cfg, world)) is not None:
        raise TPNotSupportedError(refusal)
    dims = {"num_attention_heads": cfg.num_heads, "num_key_value_heads": cfg.num_kv_heads,
            "vocab_size": cfg.vocab_size}
    if cfg.dense_layers:
        dims["intermediate_size"] = cfg.intermediate_size
    if cfg.sparse_layers:
        dims["moe_intermediate_size"] = cfg.moe_intermediate_size
    for name, value in dims.items():
        if value % world:
            raise TPNotSupportedError(f"tp={world} does not divide the model's {name} ({value})")


def local_config(cfg: ModelConfig, world: int) -> ModelConfig:
    """What one rank's KV cache holds: the config with its share of the KV heads."""
    return dataclasses.replace(cfg, num_kv_heads=cfg.num_kv_heads // world)


def local_target_shapes(cfg: ModelConfig, world: int) -> dict[str, tuple[int, int, int]]:
    """lora.target_shapes as one rank holds them (layers, in, out): column targets' out and row
    targets' in divided by `world`."""
    from mint_server.model.lora import target_shapes

    out = {}
    for t, (layers, fi, fo) in target_shapes(cfg).items():
        if t in REPLICATED_TARGETS:
            out[t] = (layers, fi, fo)
        elif t in ROW_TARGETS:
            out[t] = (layers, fi // world, fo)
        elif t in COLUMN_TARGETS:
            out[t] = (layers, fi, fo // world)
        else:
            raise TPNotSupportedError(f"LoRA target {t!r} has no tensor-parallel split")
    return out


# --- splitting the base ---------------------------------------------------------------------------
def _slice(w: Tensor, dim: int, tp: TP) -> Tensor:
    n = w.shape[dim] // tp.world
    return w.narrow(dim, tp.rank * n, n).contiguous()


def _split_linear(linear: nn.Linear, dim: int, tp: TP) -> None:
    linear.weight = nn.Parameter(_slice(linear.weight.data, dim, tp), requires_grad=False)
    if linear.bias is not None:  # column-parallel bias splits with the outputs; row-parallel has none here
        linear.bias = nn.Parameter(_slice(linear.bias.data, 0, tp), requires_grad=False)
    linear.in_features, linear.out_features = linear.weight.shape[1], linear.weight.shape[0]


def shard_model(model: nn.Module, tp: TP) -> nn.Module:
    """Split a loaded (full) model in place to this rank's share; its forward then runs the collectives.
    On a model built on the meta device (loader.load_model(tp=…)) this only shapes the parameters, and
    the loader fills them with the slices it read."""
    from mint_server.model.moe import SparseMoE

    cfg: ModelConfig = model.config  # type: ignore[assignment]
    check_supported(cfg, tp.world)
    if tp.world == 1:
        return model
    model.tp = tp
    emb = model.embed_tokens
    emb.weight = nn.Parameter(_slice(emb.weight.data, 0, tp), requires_grad=False)
    emb.num_embeddings = emb.weight.shape[0]
    model.vocab_start = tp.rank * emb.weight.shape[0]
    if cfg.tie_word_embeddings:
        model.lm_head.weight = emb.weight
    else:
        _split_linear(model.lm_head, 0, tp)
    for block in model.layers:
        attn = block.self_attn
        attn.tp = tp
        attn.n_heads //= tp.world
        if hasattr(attn, "n_kv"):
            attn.n_kv //= tp.world
        # heads split: the per-head projections column-parallel (MLA: the query up-projection and
        # kv_b_proj; its q_a / kv_a down-projections and latent stay whole), the output row-parallel
        for name in ("q_proj", "k_proj", "v_proj", "q_b_proj", "kv_b_proj"):
            if hasattr(attn, name):
                _split_linear(getattr(attn, name), 0, tp)
        _split_linear(attn.o_proj, 1, tp)
        mlp = block.mlp
        mlp.tp = tp
        if isinstance(mlp, SparseMoE):
            ex = mlp.experts  # [E, out, in]
            ex.gate_proj = nn.Parameter(_slice(ex.gate_proj.data, 1, tp), requires_grad=False)
            ex.up_proj = nn.Parameter(_slice(ex.up_proj.data, 1, tp), requires_grad=False)
            ex.down_proj = nn.Parameter(_slice(ex.down_proj.data, 2, tp), requires_grad=False)
            mlp = getattr(mlp, "shared_experts", None)  # DeepSeek's shared experts split like a dense MLP
            if mlp is None:
                continue
            mlp.tp = tp
        _split_linear(mlp.gate_proj, 0, tp)
        _split_linear(mlp.up_proj, 0, tp)
        _split_linear(mlp.down_proj, 1, tp)
    return model


_COLUMN_WEIGHT = re.compile(r"\.(self_attn\.[qkv]_proj\.(weight|bias)|self_attn\.(q_b|kv_b)_proj\.weight|"
                            r"mlp\.(shared_experts\.)?(gate|up)_proj\.weight|mlp\.experts\.\d+\.(gate|up)_proj\.weight)$")
_ROW_WEIGHT = re.compile(r"\.(self_attn\.o_proj|mlp\.(shared_experts\.)?down_proj|mlp\.experts\.\d+\.down_proj)\.weight$")
_STACKED = {"mlp.experts.gate_proj": 1, "mlp.experts.up_proj": 1, "mlp.experts.down_proj": 2}


def checkpoint_split_dim(name: str) -> int | None:
    """The dim of a checkpoint tensor (our name, see loader.our_name) that tensor parallelism splits;
    None: every rank reads all of it. Lets each rank read only its slice from the safetensors files."""
    if name in ("embed_tokens.weight", "lm_head.weight"):
        return 0
    if _COLUMN_WEIGHT.search(name):
        return 0
    if _ROW_WEIGHT.search(name):
        return 1
    for suffix, dim in _STACKED.items():
        if name.endswith(suffix):
            return dim
    return None


def shard_of(shape: tuple[int, ...] | list[int], dim: int, tp: TP) -> tuple[slice, ...]:
    """The index of this rank's slice of a tensor split along `dim`."""
    n = shape[dim] // tp.world
    index = [slice(None)] * len(shape)
    index[dim] = slice(tp.rank * n, (tp.rank + 1) * n)
    return tuple(index)


def embed(model: nn.Module, tokens: Tensor) -> Tensor:
    """Vocab-parallel lookup: each rank fills the tokens in its rows, zeros elsewhere; summed."""
    tp: TP = model.tp
    w = model.embed_tokens.weight
    local = tokens - model.vocab_start
    inside = (local >= 0) & (local < w.shape[0])
    x = F.embedding(local.clamp(0, w.shape[0] - 1), w) * inside[..., None].to(w.dtype)
    return tp.reduce(x)


# --- splitting and gathering adapter state --------------------------------------------------------
def split_dim(target: str, factor: str) -> int | None:
    """The dim of a [layers, (E,) r, in] / [layers, (E,) out, r] factor that is split; None: replicated."""
    if target in REPLICATED_TARGETS:
        return None
    if target in ROW_TARGETS:
        return -1 if factor == "A" else None
    if target in COLUMN_TARGETS:
        return None if factor == "A" else -2
    raise TPNotSupportedError(f"LoRA target {target!r} has no tensor-parallel split")


def shard_tensor(x: Tensor, target: str, factor: str, tp: TP) -> Tensor:
    """This rank's share of a full factor (a copy); at world 1 the tensor itself (nothing to split)."""
    if tp.world == 1:
        return x
    dim = split_dim(target, factor)
    if dim is None:
        return x.clone()
    return _slice(x, dim % x.dim(), tp)


def gather_tensor(x: Tensor, target: str, factor: str, tp: TP) -> Tensor:
    """The full factor from every rank's share (a copy); at world 1 the tensor itself."""
    if tp.world == 1:
        return x
    dim = split_dim(target, factor)
    if dim is None:
        return x.clone()
    return tp.all_gather_dim(x, dim % x.dim())


def shard_pairs(pairs: Mapping[str, tuple[Tensor, Tensor]], tp: TP) -> dict[str, tuple[Tensor, Tensor]]:
    """Full (A, B) per target (weights, gradients) → this rank's share."""
    return {t: (shard_tensor(a, t, "A", tp), shard_tensor(b, t, "B", tp)) for t, (a, b) in pairs.items()}


def gather_pairs(pairs: Mapping[str, tuple[Tensor, Tensor]], tp: TP) -> dict[str, tuple[Tensor, Tensor]]:
    """Every rank's share → the full (A, B) per target, on every rank (a collective: all ranks call it,
    targets in the same order)."""
    return {t: (gather_tensor(a, t, "A", tp), gather_tensor(b, t, "B", tp)) for t, (a, b) in sorted(pairs.items())}


def shard_moments(moments: Mapping[str, tuple[Tensor, ...]], family: str, tp: TP) -> dict[str, tuple[Tensor, ...]]:
    factors = MOMENT_FACTORS[family]
    return {t: tuple(shard_tensor(m, t, f, tp) for m, f in zip(ms, factors, strict=True)) for t, ms in moments.items()}


def gather_moments(moments: Mapping[str, tuple[Tensor, ...]], family: str, tp: TP) -> dict[str, tuple[Tensor, ...]]:
    factors = MOMENT_FACTORS[family]
    return {t: tuple(gather_tensor(m, t, f, tp) for m, f in zip(ms, factors, strict=True))
            for t, ms in sorted(moments.items())}


def grad_norm(grads: Mapping[str, tuple[Tensor, Tensor]], tp: TP) -> float:
    """The global L2 norm of a split adapter's gradient: split factors summed over ranks, replicated
    ones (equal on every rank) counted once."""
    split, replicated = 0.0, 0.0
    for t, pair in sorted(grads.items()):
        for factor, g in zip("AB", pair, strict=True):
            sq = float(g.float().pow(2).sum(dtype=torch.float64))
            if split_dim(t, factor) is None:
                replicated += sq
            else:
                split += sq
    return math.sqrt(tp.sum(split) + replicated)
