"""Load an HF checkpoint dir (config.json + safetensors, sharded or not) into our Transformer.

MoE experts come in either of two layouts and are stacked into our [E, out, in] parameters:
per-expert tensors (`mlp.experts.{e}.gate_proj.weight`, as the Hub ships them) or transformers'
fused layout (`mlp.experts.gate_up_proj` [E, 2·I, H], gate rows first, and `mlp.experts.down_proj`
[E, H, I]). Qwen3-VL-MoE checkpoints on the Hub hold the fused tensors transposed ([E, H, 2·I],
[E, I, H]); like transformers, a fused tensor whose shape is the transpose of ours is transposed
(when H = 2·I the two cannot be told apart and ours is assumed, as transformers assumes).

Pre-quantized checkpoints (fp8 block-scaled, MXFP4: `ModelConfig.prequantized`) are dequantized as
their tensors are read (prequant.DequantizingReader), on every device, to the engine's dtype.
"""

from __future__ import annotations

import json
import re
from functools import partial
from pathlib import Path

import torch
from safetensors import safe_open

from mint_server.model.config import ModelConfig, ModelError
from mint_server.model.families import family_spec, model_class_of
from mint_server.model.prequant import DequantizingReader
from mint_server.model.tp import TP, checkpoint_split_dim, shard_model, shard_of
from mint_server.model.transformer import Transformer

# HF weight-name prefix → ours. Our module tree mirrors HF's below the `model.` prefix (a
# vision-language model's decoder below `model.language_model.`, its tower below `model.visual.`).
NAME_PREFIXES = (("model.language_model.", ""), ("model.visual.", "visual."), ("model.", ""), ("lm_head.", "lm_head."))
_PER_EXPERT = re.compile(r"^(layers\.\d+\.mlp\.experts)\.(\d+)\.(gate_proj|up_proj|down_proj)\.weight$")
_FUSED_GATE_UP = re.compile(r"^(layers\.\d+\.mlp\.experts)\.gate_up_proj$")


def default_device() -> torch.device:
    return torch.device("cuda" if torch.cuda.is_available() else "cpu")


def default_dtype(device: torch.device) -> torch.dtype:
    # bf16 matmul is very slow on CPUs; fp32 there, bf16 on accelerators.
    return torch.float32 if device.type == "cpu" else torch.bfloat16


def weight_files(model_dir: Path) -> list[Path]:
    """The safetensors files of a checkpoint; a clear error naming whatever is missing."""
    index = model_dir / "model.safetensors.index.json"
    if index.is_file():
        shards = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        files = [model_dir / s for s in shards]
    elif (model_dir / "model.safetensors").is_file():
        files = [model_dir / "model.safetensors"]
    else:
        raise ModelError(f"{str(model_dir)!r} has no model.safetensors (nor model.safetensors.index.json)")
    for f in files:
        if not f.is_file():
            raise ModelError(f"weight file {f.name!r} listed in the index is missing from {str(model_dir)!r}")
    return files


def our_name(hf_name: str) -> str | None:
    for prefix, repl in NAME_PREFIXES:
        if hf_name.startswith(prefix):
            return repl + hf_name[len(prefix) :]
    return None


def _ours_layout(t: torch.Tensor, ours: str, shapes: dict[str, tuple[int, ...]]) -> torch.Tensor:
    """A fused expert tensor stored transposed (the Hub's Qwen3-VL-MoE down_proj [E, I, H]) in our layout."""
    want = shapes[ours]
    if ours.endswith("mlp.experts.down_proj") and tuple(t.shape) != want and t.dim() == 3 \
            and (t.shape[0], t.shape[2], t.shape[1]) == want:
        return t.transpose(1, 2)
    return t


def load_model(
    model_dir: str | Path, device: torch.device | str | None = None, dtype: torch.dtype | None = None,
    tp: TP | None = None,
) -> Transformer:
    """tp: build this tensor-parallel rank's share only, reading just its slices of the split weights."""
    model_dir = Path(model_dir)
    cfg = ModelConfig.from_hf_dir(model_dir)
    device = torch.device(device) if device is not None else default_device()
    dtype = dtype or default_dtype(device)
    files = weight_files(model_dir)
    with torch.device("meta"):
        model: Transformer = model_class_of(cfg)(cfg)
        if tp is not None:
            shard_model(model, tp)  # parameters take their per-rank shapes (still meta)

    def read(sf: object, name: str, ours: str) -> torch.Tensor:
        dim = checkpoint_split_dim(ours) if tp is not None and tp.world > 1 else None
        if dim is None:
            return sf.get_tensor(name)  # type: ignore[attr-defined]
        part = sf.get_slice(name)  # type: ignore[attr-defined]
        return part[shard_of(part.get_shape(), dim, tp)]  # type: ignore[arg-type]

    expected = set(model.state_dict())
    shapes = {k: tuple(v.shape) for k, v in model.state_dict().items()}
    if cfg.tie_word_embeddings:
        expected.discard("lm_head.weight")
    state: dict[str, torch.Tensor] = {}
    per_expert: dict[str, dict[int, torch.Tensor]] = {}  # our stacked name → expert → [out, in]
    convert = getattr(model, "convert_checkpoint", None)  # a family's own checkpoint layout (gpt-oss experts)
    family = family_spec(cfg)  # its checkpoint-name map and the weights it keeps in float32
    rename = family.weight_name or our_name
    for f in files:
        with safe_open(str(f), framework="pt", device="cpu") as handle:
            sf = DequantizingReader(handle, cfg.prequantized, files, dtype)  # pre-quantized weights read as floats
            for name in sf.keys():
                ours = rename(name)
                if ours is None:
                    continue
                if convert is not None and (parts := convert(ours, partial(sf.get_tensor, name))) is not None:
                    state.update({k: v.to(device=device, dtype=dtype) for k, v in parts.items()})
                elif ours in expected:
                    keep = torch.float32 if family.keeps_float32(ours) else dtype
                    tensor = _ours_layout(read(sf, name, ours), ours, shapes)
                    state[ours] = tensor.to(device=device, dtype=keep if tensor.is_floating_point() else None)
                elif m := _PER_EXPERT.match(ours):
                    per_expert.setdefault(f"{m.group(1)}.{m.group(3)}", {})[int(m.group(2))] = read(sf, name, ours)
                elif m := _FUSED_GATE_UP.match(ours):
                    fused = sf.get_tensor(name)
                    if fused.shape[1] != 2 * cfg.moe_intermediate_size and fused.shape[2] == 2 * cfg.moe_intermediate_size:
                        fused = fused.transpose(1, 2)  # the Hub's Qwen3-VL-MoE layout [E, H, 2·I]
                    gate, up = fused.to(device=device, dtype=dtype).chunk(2, dim=1)
                    if tp is not None and tp.world > 1:  # gate and up are each split along their rows
                        gate = gate[shard_of(gate.shape, 1, tp)].contiguous()
                        up = up[shard_of(up.shape, 1, tp)].contiguous()
                    state[f"{m.group(1)}.gate_proj"], state[f"{m.group(1)}.up_proj"] = gate, up
    for ours, experts in per_expert.items():
        if ours in expected and ours not in state:
            if sorted(experts) != list(range(cfg.num_experts)):
                raise ModelError(f"checkpoint {str(model_dir)!r} has experts {sorted(experts)[:5]}... for "
                                 f"{ours}, expected 0..{cfg.num_experts - 1}")
            state[ours] = torch.stack([experts[e] for e in range(cfg.num_experts)]).to(device=device, dtype=dtype)
    missing = expected - set(state)
    if missing:
        raise ModelError(f"checkpoint {str(model_dir)!r} lacks weights: {sorted(missing)[:5]}")
    model.load_state_dict(state, strict=False, assign=True)
    if cfg.tie_word_embeddings:
        model.lm_head.weight = model.embed_tokens.weight
    model.reset_buffers(device)  # rope frequencies (and a vision tower's) were never built on meta
    model.requires_grad_(False)  # the base is frozen; only adapters ever train
    return model.eval()
