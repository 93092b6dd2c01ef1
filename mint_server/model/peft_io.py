"""LoRA adapters on disk in PEFT layout: adapter_config.json + adapter_model.safetensors.

Expert LoRA (MoE bases) has two layouts, told apart by the keys (and named in adapter_config.json
as "mint_moe_layout"); see docs/moe.md:

- packed (what MinT writes and the catalog stores): one tensor pair per projection per layer,
  `...layers.{l}.mlp.experts.{proj}.lora_A.weight` [E, r, in] and `...lora_B.weight` [E, out, r];
- per-expert (PEFT's module layout): `...layers.{l}.mlp.experts.{e}.{proj}.lora_A.weight` [r, in]
  and `...lora_B.weight` [out, r] for every expert e.

Both load; either can be written, and `convert_moe_layout` turns one into the other bit-exactly.
"""

from __future__ import annotations

import json
import re
import shutil
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from mint_server.fsutil import atomic_write_dir
from mint_server.model import kernels
from mint_server.model.config import ModelConfig, ModelError
from mint_server.model.families import family_spec
from mint_server.model.lora import (
    ALL_TARGETS,
    ATTN_TARGETS,
    COMPRESSOR_TARGETS,
    EXPERT_PREFIX,
    LINEAR_TARGETS,
    MLA_TARGETS,
    SHARED_PREFIX,
    UNEMBED_TARGET,
    V4_TARGETS,
    target_layers,
)
from mint_server.model.moe_layout import (
    MOE_LAYOUT_KEY,
    MOE_LAYOUTS,
    PACKED_KEY,
    PER_EXPERT_KEY,
    moe_layout_of,
)
from mint_server.model.peft_archive import (  # archives' name, read as lm_head
    LM_HEAD_PREFIX,
    TINKER_UNEMBED_PREFIX,
)

DEFAULT_LORA_ALPHA = 32.0  # Tinker's default; PEFT scaling is lora_alpha / r

_KEY = re.compile(
    r"^base_model\.model\.(?:model\.(?:language_model\.)?layers\.(\d+)\.(?:self_attn|linear_attn|mlp)\.)?"
    r"(experts\.(?:(\d+)\.)?|shared_experts?\.|compressor\.)?"
    r"(\w+)\.lora_([AB])\.weight$"
)


@dataclass
class LoraWeights:
    """One adapter: weights[target] = (A [layers, (E,) r, in], B [layers, (E,) out, r]) on CPU or device
    (expert targets carry the expert axis E)."""

    weights: dict[str, tuple[torch.Tensor, torch.Tensor]]
    rank: int
    alpha: float = DEFAULT_LORA_ALPHA

    def non_finite_target(self) -> str | None:
        """The first target holding a NaN or inf (None: all finite). No adapter with one is ever
        written, published, installed or served."""
        if kernels.all_finite(x for pair in self.weights.values() for x in pair):
            return None
        return next(t for t, pair in self.weights.items() if not kernels.all_finite(pair))


def peft_key(target: str, layer: int, which: str, expert: int | None = None, decoder: str = "model.",
             shared: str = "shared_experts") -> str:
    """The PEFT tensor name; expert targets: packed without `expert`, per-expert with it. decoder: the
    module path of the decoder layers (`decoder_prefix`: a vision-language model's is nested). shared:
    the shared experts' module name (DeepSeek's `shared_experts`, Qwen3.5's `shared_expert`)."""
    if target == UNEMBED_TARGET:
        return f"base_model.model.lm_head.lora_{which}.weight"
    layers = f"base_model.model.{decoder}layers.{layer}"
    if target.startswith(EXPERT_PREFIX):
        proj = target[len(EXPERT_PREFIX):]
        experts = "experts." if expert is None else f"experts.{expert}."
        return f"{layers}.mlp.{experts}{proj}.lora_{which}.weight"
    if target.startswith(SHARED_PREFIX):
        return f"{layers}.mlp.{shared}.{target[len(SHARED_PREFIX):]}.lora_{which}.weight"
    if target in COMPRESSOR_TARGETS:  # DeepSeek-V4: csa_ / hca_ by the layer's kind, one module name
        return f"{layers}.self_attn.compressor.{target[4:]}.lora_{which}.weight"
    block = "self_attn" if target in ATTN_TARGETS + MLA_TARGETS + V4_TARGETS else \
        "linear_attn" if target in LINEAR_TARGETS else "mlp"
    return f"{layers}.{block}.{target}.lora_{which}.weight"


def shared_expert_module(cfg: ModelConfig | int) -> str:
    """The HF module name of a sparse layer's shared expert(s) (Qwen3.5: `shared_expert`)."""
    return family_spec(cfg).shared_expert_module if isinstance(cfg, ModelConfig) else "shared_experts"


def decoder_prefix(cfg: ModelConfig | int) -> str:
    """Where the decoder layers sit in the HF model: `model.`, or `model.language_model.` for a
    vision-language model (PEFT names its modules by that path, so transformers + PEFT load ours)."""
    return family_spec(cfg).decoder_prefix if isinstance(cfg, ModelConfig) else "model."


def _layers_of(cfg: ModelConfig | int, target: str) -> tuple[int, ...]:
    """The model layers a target's layer axis lists (a plain layer count: a dense model)."""
    if isinstance(cfg, ModelConfig):
        layers = target_layers(cfg).get(target)
        if layers is None:
            raise ModelError(f"adapter target {target!r} does not exist in this base model")
        return layers
    if target.startswith(EXPERT_PREFIX):
        raise ModelError("expert LoRA needs the base model's config (which layers are sparse)")
    return (0,) if target == UNEMBED_TARGET else tuple(range(cfg))


def peft_tensors(adapter: LoraWeights, cfg: ModelConfig | int, moe_layout: str = "packed") -> dict[str, torch.Tensor]:
    """The adapter's PEFT-named tensors (fp32, CPU, contiguous) in the given expert layout."""
    if moe_layout not in MOE_LAYOUTS:
        raise ModelError(f"moe_layout must be one of {list(MOE_LAYOUTS)}, got {moe_layout!r}")
    tensors = {}
    decoder = decoder_prefix(cfg)
    shared = shared_expert_module(cfg)
    for t, (a, b) in adapter.weights.items():
        a, b = a.detach().to("cpu", torch.float32), b.detach().to("cpu", torch.float32)
        per_expert = t.startswith(EXPERT_PREFIX) and moe_layout == "per-expert"
        for i, layer in enumerate(_layers_of(cfg, t)):
            if per_expert:
                for e in range(a.shape[1]):
                    tensors[peft_key(t, layer, "A", e, decoder)] = a[i, e].contiguous()
                    tensors[peft_key(t, layer, "B", e, decoder)] = b[i, e].contiguous()
            else:
                tensors[peft_key(t, layer, "A", decoder=decoder, shared=shared)] = a[i].contiguous()
                tensors[peft_key(t, layer, "B", decoder=decoder, shared=shared)] = b[i].contiguous()
    return tensors


def save_peft(
    adapter: LoraWeights, dest: str | Path, base_model: str, cfg: ModelConfig | None = None, moe_layout: str = "packed"
) -> None:
    """Write a PEFT adapter dir atomically (fp32 tensors on disk, whatever the compute dtype).

    cfg (needed for expert LoRA) maps each target's layer axis to model layers; without it the
    model is taken to be dense. Expert LoRA is written in `moe_layout` (packed by default).
    """
    if (bad := adapter.non_finite_target()) is not None:
        raise ModelError(f"adapter target {bad!r} holds NaN or inf; refusing to write it")
    tensors = peft_tensors(adapter, cfg if cfg is not None else _num_layers(adapter), moe_layout)
    modules = sorted({_module_name(t) for t in adapter.weights})
    config = {
        "peft_type": "LORA",
        "task_type": "CAUSAL_LM",
        "base_model_name_or_path": base_model,
        "r": adapter.rank,
        "lora_alpha": adapter.alpha,
        "lora_dropout": 0.0,
        "bias": "none",
        "target_modules": modules,
        "fan_in_fan_out": False,
        "use_rslora": False,
        "use_dora": False,
        "init_lora_weights": True,
        "inference_mode": True,
        "modules_to_save": None,
    }
    if any(t.startswith(EXPERT_PREFIX) for t in adapter.weights):
        config[MOE_LAYOUT_KEY] = moe_layout
    _write_dir(dest, tensors, config)


def _module_name(target: str) -> str:
    """The module name PEFT's target_modules lists for a target (experts / shared experts: the projection)."""
    for prefix in (EXPERT_PREFIX, SHARED_PREFIX):
        if target.startswith(prefix):
            return target[len(prefix):]
    return target[4:] if target in COMPRESSOR_TARGETS else target


def _num_layers(adapter: LoraWeights) -> int:
    return max((a.shape[0] for t, (a, _) in adapter.weights.items() if t != UNEMBED_TARGET), default=1)


def _write_dir(dest: str | Path, tensors: dict[str, torch.Tensor], config: dict) -> None:
    def fill(tmp: Path) -> None:
        save_file(tensors, str(tmp / "adapter_model.safetensors"), metadata={"format": "pt"})
        (tmp / "adapter_config.json").write_text(json.dumps(config, indent=2))

    atomic_write_dir(dest, fill)


def _read_dir(src: str | Path) -> tuple[dict, Path]:
    src = Path(src)
    cfg_file, weights_file = src / "adapter_config.json", src / "adapter_model.safetensors"
    for f in (cfg_file, weights_file):
        if not f.is_file():
            raise ModelError(f"PEFT adapter dir {str(src)!r} lacks {f.name}")
    try:
        return json.loads(cfg_file.read_text()), weights_file
    except json.JSONDecodeError as e:
        raise ModelError(f"{cfg_file} is not valid JSON: {e}") from None


def load_peft(src: str | Path, cfg: ModelConfig | int) -> LoraWeights:
    """Read a PEFT LoRA dir (expert LoRA packed or per-expert); clear errors for anything we cannot
    represent exactly. cfg: the base model's config (a plain layer count for a dense model)."""
    config, weights_file = _read_dir(src)
    return _parse(config, load_file(str(weights_file)), weights_file.name, cfg)


def load_peft_files(files: dict[str, bytes], cfg: ModelConfig | int) -> LoraWeights:
    """The same from a payload's files in memory (a catalog revision read straight from its blobs)."""
    from safetensors.torch import load as load_bytes

    for name in ("adapter_config.json", "adapter_model.safetensors"):
        if name not in files:
            raise ModelError(f"PEFT adapter payload lacks {name}")
    try:
        config = json.loads(files["adapter_config.json"])
    except json.JSONDecodeError as e:
        raise ModelError(f"adapter_config.json is not valid JSON: {e}") from None
    return _parse(config, load_bytes(files["adapter_model.safetensors"]), "adapter_model.safetensors", cfg)


def _parse(config: dict, tensors: dict[str, torch.Tensor], weights_name: str, cfg: ModelConfig | int) -> LoraWeights:
    if config.get("peft_type", "LORA") != "LORA":
        raise ModelError(f"adapter peft_type {config.get('peft_type')!r} is not supported (only LORA)")
    for flag in ("use_dora", "use_rslora", "fan_in_fan_out"):
        if config.get(flag):
            raise ModelError(f"adapter_config {flag}=true is not supported")
    rank = int(config["r"])
    alpha = float(config.get("lora_alpha", rank))
    if config.get("rank_pattern") or config.get("alpha_pattern"):
        raise ModelError("adapter_config rank_pattern/alpha_pattern are not supported")
    # target → layer → expert (None: dense or packed) → "A"/"B" → tensor
    found: dict[str, dict[int, dict[int | None, dict[str, torch.Tensor]]]] = {}
    for key, tensor in tensors.items():
        m = _KEY.match(key.replace(TINKER_UNEMBED_PREFIX, LM_HEAD_PREFIX))
        prefix = "" if m is None or not m.group(2) else (SHARED_PREFIX if m.group(2).startswith("shared_expert") else
                                                         _compressor_prefix(cfg, int(m.group(1) or 0))
                                                         if m.group(2) == "compressor." else EXPERT_PREFIX)
        target = None if m is None else prefix + m.group(4)
        if m is None and key.endswith(".base_layer.weight"):
            raise ModelError(f"{weights_name} holds a full base weight, {key!r} (PEFT's save_embedding_layers, "
                             "on by default when lm_head or embed_tokens is a target); LoRA adapters that change "
                             "base weights are not supported: re-save with save_embedding_layers=False")
        if m is None or target not in ALL_TARGETS:
            raise ModelError(f"unsupported tensor {key!r} in {weights_name}")
        layer, expert = int(m.group(1) or 0), (int(m.group(3)) if m.group(3) is not None else None)
        found.setdefault(target, {}).setdefault(layer, {}).setdefault(expert, {})[m.group(5)] = tensor.float()
    weights = {}
    for t, by_layer in found.items():
        layers = _layers_of(cfg, t)
        if sorted(by_layer) != list(layers):
            raise ModelError(f"adapter target {t!r} covers layers {sorted(by_layer)}, this base model has it "
                             f"in layers {list(layers)}")
        per_layer = [_layer_pair(t, layer, by_layer[layer], cfg) for layer in layers]
        weights[t] = (torch.stack([a for a, _ in per_layer]), torch.stack([b for _, b in per_layer]))
    out = LoraWeights(weights=weights, rank=rank, alpha=alpha)
    if (bad := out.non_finite_target()) is not None:
        raise ModelError(f"adapter target {bad!r} in {weights_name} holds NaN or inf")
    return out


def _compressor_prefix(cfg: ModelConfig | int, layer: int) -> str:
    """A DeepSeek-V4 compressor projection's target prefix: its layer's kind (csa_ / hca_; compressor_:
    no such target, refused below)."""
    return family_spec(cfg).compressor_prefix(cfg, layer) if isinstance(cfg, ModelConfig) else "compressor_"


def _layer_pair(
    target: str, layer: int, by_expert: dict[int | None, dict[str, torch.Tensor]], cfg: ModelConfig | int
) -> tuple[torch.Tensor, torch.Tensor]:
    """One layer's (A, B) of a target; per-expert tensors are stacked into the packed form."""
    where = f"adapter target {target!r} layer {layer}"
    if list(by_expert) == [None]:
        ab = by_expert[None]
        if len(ab) != 2:
            raise ModelError(f"{where} lacks lora_{'B' if 'A' in ab else 'A'}")
        expect = 3 if target.startswith(EXPERT_PREFIX) else 2
        if ab["A"].dim() != expect or ab["B"].dim() != expect:
            raise ModelError(f"{where}: lora_A/lora_B must be {expect}-D, got {list(ab['A'].shape)}/{list(ab['B'].shape)}")
        return ab["A"], ab["B"]
    E = cfg.num_experts if isinstance(cfg, ModelConfig) else 0
    if None in by_expert or sorted(by_expert) != list(range(E)) or any(len(ab) != 2 for ab in by_expert.values()):
        raise ModelError(f"{where} must hold lora_A and lora_B for each of experts 0..{E - 1} "
                         "(or one packed pair), not a mix")
    return (torch.stack([by_expert[e]["A"] for e in range(E)]), torch.stack([by_expert[e]["B"] for e in range(E)]))


def convert_moe_layout(tensors: dict[str, torch.Tensor], layout: str) -> dict[str, torch.Tensor]:
    """Re-lay a PEFT tensor dict's expert LoRA as `layout` (packed | per-expert); other tensors pass
    through. Bit-exact both ways: only slicing and stacking, no arithmetic."""
    if layout not in MOE_LAYOUTS:
        raise ModelError(f"moe_layout must be one of {list(MOE_LAYOUTS)}, got {layout!r}")
    out: dict[str, torch.Tensor] = {}
    stacks: dict[str, dict[int, torch.Tensor]] = {}
    for key, t in tensors.items():
        if layout == "per-expert" and (m := PACKED_KEY.match(key)):
            for e in range(t.shape[0]):
                out[f"{m.group(1)}.{e}.{m.group(2)}"] = t[e].contiguous()
        elif layout == "packed" and (m := PER_EXPERT_KEY.match(key)):
            stacks.setdefault(f"{m.group(1)}.{m.group(3)}", {})[int(m.group(2))] = t
        else:
            out[key] = t
    for key, by_expert in stacks.items():
        if sorted(by_expert) != list(range(len(by_expert))):
            raise ModelError(f"{key}: experts {sorted(by_expert)[:5]}... are not 0..{len(by_expert) - 1}")
        out[key] = torch.stack([by_expert[e] for e in range(len(by_expert))])
    return out


def convert_peft_dir(src: str | Path, dest: str | Path, layout: str) -> None:
    """Copy a PEFT adapter dir to dest (atomically) with its expert LoRA in `layout`; every other
    file, and the whole dir when it has no expert LoRA or is already in `layout`, is copied as is."""
    if layout not in MOE_LAYOUTS:
        raise ModelError(f"moe_layout must be one of {list(MOE_LAYOUTS)}, got {layout!r}")
    src = Path(src)
    config, weights_file = _read_dir(src)
    convert = moe_layout_of(src) not in (None, layout)
    tensors = convert_moe_layout(load_file(str(weights_file)), layout) if convert else {}
    if convert:
        config[MOE_LAYOUT_KEY] = layout

    def fill(tmp: Path) -> None:
        for f in src.iterdir():
            if f.is_file() and not (convert and f.name in (weights_file.name, "adapter_config.json")):
                shutil.copy2(f, tmp / f.name)
        if convert:
            save_file(tensors, str(tmp / weights_file.name), metadata={"format": "pt"})
            (tmp / "adapter_config.json").write_text(json.dumps(config, indent=2))

    atomic_write_dir(dest, fill)
