"""A LoRA adapter folded into its base model: a plain HF checkpoint dir (`mint export --merged`).

Every adapted weight becomes W + s·B·A (s = alpha / rank, PEFT's scaling), computed in float32 and
stored in the base tensor's own dtype; every other tensor and every non-weight file (config,
tokenizer, generation config, chat template) is copied as is. The result loads in transformers,
vLLM without LoRA, or any tool that reads HF checkpoints, and computes what the served adapter does.

- The output-layer LoRA (`lm_head`) of a base that ties its embeddings: we train it on the output
  projection only, so the merged dir unties them — it stores its own `lm_head.weight` (embedding +
  delta) and says `tie_word_embeddings: false`; the input embedding stays the base's. (PEFT's
  `merge_and_unload` would fold the delta into the shared matrix and change the inputs too.)
- Expert LoRA merges into a base that stores its experts one module per expert
  (`mlp.experts.{e}.{proj}.weight`, what `save_pretrained` writes). Fused expert tensors
  (`mlp.experts.gate_up_proj`, gpt-oss' interleaved layout) are refused with the reason, as is any
  adapter target whose base weight is not a plain [out, in] matrix under the name PEFT uses.
- A quantized base (`quantization_config` in config.json) is refused: the merged weights would need
  requantizing, which would not compute what the served adapter does.

Every check runs before anything is written; the dir is built in a staging dir and renamed into
place (fsutil.atomic_write_dir: fsync'd files, then one rename).
"""

from __future__ import annotations

import json
import shutil
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from mint_server.fsutil import atomic_write_dir
from mint_server.model.config import ModelConfig, ModelError
from mint_server.model.lora import EXPERT_PREFIX, UNEMBED_TARGET
from mint_server.model.peft_io import LoraWeights, decoder_prefix, peft_key, shared_expert_module

INDEX = "model.safetensors.index.json"
_WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".gguf")
_SKIPPED = {INDEX, "pytorch_model.bin.index.json", "mint_prepared.json"}


@dataclass(frozen=True)
class _Delta:
    """One base tensor's update: W += scale · B @ A (A [r, in], B [out, r])."""

    a: torch.Tensor
    b: torch.Tensor


def check_mergeable_base(base_dir: str | Path) -> dict:
    """The base's config.json, or ModelError when its weights cannot take a merged adapter."""
    base_dir = Path(base_dir)
    try:
        config = json.loads((base_dir / "config.json").read_text())
    except (OSError, ValueError) as e:
        raise ModelError(f"base model {str(base_dir)!r} has no readable config.json ({e})") from None
    quant = config.get("quantization_config") or (config.get("text_config") or {}).get("quantization_config")
    if quant:
        method = quant.get("quant_method", "unknown") if isinstance(quant, dict) else "unknown"
        raise ModelError(
            f"base model {str(base_dir)!r} is quantized (quant_method {method!r}): a merged checkpoint would "
            "need its weights requantized and would no longer compute what the adapter serves; export the "
            "adapter without --merged, or merge into an unquantized copy of the base (--base-model DIR)"
        )
    return config


def _weight_files(base_dir: Path) -> list[Path]:
    index = base_dir / INDEX
    if index.is_file():
        try:
            names = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        except (ValueError, KeyError, AttributeError) as e:
            raise ModelError(f"{index} is not a valid safetensors index: {e!r}") from None
        files = [base_dir / n for n in names]
    elif (base_dir / "model.safetensors").is_file():
        files = [base_dir / "model.safetensors"]
    else:
        raise ModelError(f"base model {str(base_dir)!r} has no model.safetensors (nor {INDEX}); "
                         "a merged export reads safetensors checkpoints only")
    for f in files:
        if not f.is_file():
            raise ModelError(f"base model {str(base_dir)!r} lacks weight file {f.name!r} listed in its index")
    return files


def _shapes(files: list[Path]) -> dict[str, tuple[tuple[int, ...], Path]]:
    out: dict[str, tuple[tuple[int, ...], Path]] = {}
    for f in files:
        with safe_open(str(f), framework="pt", device="cpu") as sf:
            for name in sf.keys():
                out[name] = (tuple(sf.get_slice(name).get_shape()), f)
    return out


def _tied(config: dict) -> bool:
    text = config.get("text_config") or {}
    return bool(config.get("tie_word_embeddings", text.get("tie_word_embeddings", True)))


def plan_merge(adapter: LoraWeights, cfg: ModelConfig, base_dir: Path, config: dict,
               shapes: dict[str, tuple[tuple[int, ...], Path]]) -> tuple[dict[str, _Delta], str | None]:
    """Every base tensor the adapter changes and its delta; and, when the output layer must be
    untied, the embedding it starts from. ModelError naming the target when one cannot merge."""
    decoder = decoder_prefix(cfg)
    shared = shared_expert_module(cfg)
    layers_of = _target_layers(cfg)
    deltas: dict[str, _Delta] = {}
    untie_from = None
    for target, (a_all, b_all) in sorted(adapter.weights.items()):
        a_all, b_all = a_all.detach().to("cpu", torch.float32), b_all.detach().to("cpu", torch.float32)
        for i, layer in enumerate(layers_of(target)):
            a, b = a_all[i], b_all[i]
            key = peft_key(target, layer, "A", decoder=decoder, shared=shared)
            module = key[len("base_model.model."):-len(".lora_A.weight")]
            if target == UNEMBED_TARGET and (_tied(config) or "lm_head.weight" not in shapes):
                untie_from = _embedding_name(shapes, decoder)
                _check_shape(target, untie_from, shapes[untie_from][0], (b.shape[0], a.shape[1]))
                deltas["lm_head.weight"] = _Delta(a, b)
                continue
            if target.startswith(EXPERT_PREFIX):
                parent, proj = module.rsplit(".", 1)
                names = [f"{parent}.{e}.{proj}.weight" for e in range(a.shape[0])]
                if not all(n in shapes for n in names):
                    raise ModelError(_fused_reason(target, parent, shapes))
                for e, name in enumerate(names):
                    _check_shape(target, name, shapes[name][0], (b.shape[1], a.shape[2]))
                    deltas[name] = _Delta(a[e], b[e])
                continue
            name = f"{module}.weight"
            if name not in shapes:
                raise ModelError(f"adapter target {target!r} (layer {layer}) cannot be merged: the base checkpoint "
                                 f"has no tensor {name!r} to fold it into (this family stores that weight "
                                 "under another name or layout); export the adapter without --merged")
            _check_shape(target, name, shapes[name][0], (b.shape[0], a.shape[1]))
            deltas[name] = _Delta(a, b)
    return deltas, untie_from


def _target_layers(cfg: ModelConfig):
    from mint_server.model.lora import target_layers

    layers = target_layers(cfg)

    def of(target: str) -> tuple[int, ...]:
        if target not in layers:
            raise ModelError(f"adapter target {target!r} does not exist in this base model")
        return layers[target]

    return of


def _embedding_name(shapes: dict, decoder: str) -> str:
    for name in (f"{decoder}embed_tokens.weight", "model.embed_tokens.weight"):
        if name in shapes:
            return name
    raise ModelError("the adapter trains the output layer of a base that ties it to the embedding, but the "
                     "base checkpoint has no embed_tokens.weight to untie it from")


def _fused_reason(target: str, parent: str, shapes: dict) -> str:
    fused = sorted(n for n in shapes if n.startswith(parent + ".") and n.count(".") == parent.count(".") + 1)
    how = f"fused expert tensors ({', '.join(fused[:3])})" if fused else "no per-expert weights"
    return (f"adapter target {target!r} cannot be merged into this base: it stores its experts as {how}, "
            f"not one module per expert ({parent}.{{e}}.<proj>.weight); merging expert LoRA into fused or "
            "interleaved expert tensors is not supported. Export the adapter without --merged (vLLM and PEFT "
            "load it), or merge into a copy of the base saved with per-expert tensors")


def _check_shape(target: str, name: str, have: tuple[int, ...], want: tuple[int, int]) -> None:
    if have != tuple(want):
        raise ModelError(f"adapter target {target!r} does not fit base tensor {name!r}: its delta is "
                         f"{list(want)}, the base stores {list(have)}")


def merge_adapter(adapter: LoraWeights, base_dir: str | Path, dest: str | Path) -> dict:
    """Write base + adapter as one HF checkpoint dir at `dest` (absent or empty), atomically.
    Returns a summary: tensors merged, untied (bool), dtype(s) of the merged tensors."""
    base_dir, dest = Path(base_dir), Path(dest)
    if dest.exists() and (not dest.is_dir() or any(dest.iterdir())):
        raise ModelError(f"dest {str(dest)!r} exists and is not an empty directory")
    config = check_mergeable_base(base_dir)
    cfg = ModelConfig.from_hf_dir(base_dir)
    files = _weight_files(base_dir)
    shapes = _shapes(files)
    deltas, untie_from = plan_merge(adapter, cfg, base_dir, config, shapes)
    scale = adapter.alpha / adapter.rank
    by_file: dict[Path, list[str]] = {}
    for name in deltas:
        if name == "lm_head.weight" and untie_from is not None:
            by_file.setdefault(shapes[untie_from][1], []).append(name)
        else:
            by_file.setdefault(shapes[name][1], []).append(name)
    dtypes: set[str] = set()
    lm_head_bytes = 0

    def fill(tmp: Path) -> None:
        nonlocal lm_head_bytes
        for f in sorted(base_dir.iterdir()):
            if f.is_file() and f.name not in _SKIPPED and not f.name.endswith(_WEIGHT_SUFFIXES):
                shutil.copy2(f, tmp / f.name)
        for f in files:
            tensors = load_file(str(f))
            for name in by_file.get(f, []):
                d = deltas[name]
                w = tensors[untie_from] if name == "lm_head.weight" and untie_from is not None else tensors[name]
                merged = w.to(torch.float32) + scale * (d.b @ d.a)
                tensors[name] = merged.to(w.dtype).contiguous()
                if name == "lm_head.weight" and untie_from is not None:
                    lm_head_bytes = tensors[name].numel() * tensors[name].element_size()
                dtypes.add(str(w.dtype).removeprefix("torch."))
            save_file(tensors, str(tmp / f.name), metadata={"format": "pt"})
            del tensors
        if untie_from is not None:
            new_config = dict(config)
            new_config["tie_word_embeddings"] = False
            if isinstance(new_config.get("text_config"), dict):
                new_config["text_config"] = {**new_config["text_config"], "tie_word_embeddings": False}
            (tmp / "config.json").write_text(json.dumps(new_config, indent=2))
        if (base_dir / INDEX).is_file():
            index = json.loads((base_dir / INDEX).read_text())
            if untie_from is not None:
                index["weight_map"]["lm_head.weight"] = index["weight_map"][untie_from]
                meta = index.get("metadata")
                if isinstance(meta, dict) and isinstance(meta.get("total_size"), int):
                    meta["total_size"] += lm_head_bytes
            (tmp / INDEX).write_text(json.dumps(index, indent=2))

    atomic_write_dir(dest, fill)
    return {"merged_tensors": len(deltas), "untied_embeddings": untie_from is not None, "dtypes": sorted(dtypes)}


def merge_peft_dir(peft_dir: str | Path, base_dir: str | Path, dest: str | Path) -> dict:
    """merge_adapter for a PEFT adapter dir (any layout load_peft reads)."""
    from mint_server.model.peft_io import load_peft

    check_mergeable_base(base_dir)
    cfg = ModelConfig.from_hf_dir(base_dir)
    return merge_adapter(load_peft(peft_dir, cfg), base_dir, dest)
