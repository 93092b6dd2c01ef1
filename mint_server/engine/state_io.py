"""Training state on disk: adapter weights + AdamW state + step, so a resumed run is bit-identical.

Layout of a state dir (written atomically, so readers see all of it or nothing):

    state.json               format, version, base_model, rank, alpha, targets, step, has_optimizer
    weights.safetensors      "<target>.A" [layers, (E,) r, in], "<target>.B" [layers, (E,) out, r]; float32
    optimizer.safetensors    AdamW: "<target>.m_A|v_A|m_B|v_B"; Dimuon: "<target>.mu_A|mu_B"; float32
                             (only when saved with the optimizer; state.json names the family)
    grads.safetensors        "<target>.A|B" pending gradients (page dirs only, see `save_paged`)

Weights are the float32 master values: exactly the bank's on an fp32 bank, the fp32 masters of a
bf16 bank. Gradients accumulated since the last optim_step are not saved (Tinker neither).
`check_shapes` vets any weights read from disk (state or PEFT) against the running base model.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file, save_file
from torch import Tensor

from mint_server.engine.values import AdamState, EngineError
from mint_server.fsutil import atomic_write_dir
from mint_server.model.lora import LoraBank, lora_shapes
from mint_server.model.peft_io import LoraWeights

FORMAT, VERSION = "mint-train-state", 1
_MOMENTS = {"adamw": ("m_A", "v_A", "m_B", "v_B"), "dimuon": ("mu_A", "mu_B")}


@dataclass
class TrainState:
    weights: LoraWeights
    optim: AdamState | None  # None: saved without optimizer state
    base_model: str


@dataclass
class PagedState:
    """A whole adapter paged out of memory by the residency manager: nothing is left behind."""

    weights: LoraWeights
    optim: AdamState
    grads: dict[str, tuple[Tensor, Tensor]]


def save_paged(dest: str | Path, state: PagedState) -> None:
    save_state(dest, TrainState(state.weights, state.optim, "paged"), grads=state.grads)


def load_paged(src: str | Path) -> PagedState:
    st = load_state(src, include_optimizer=True)
    try:
        flat = load_file(str(Path(src) / "grads.safetensors"))
    except (OSError, SafetensorError) as e:
        raise EngineError(f"page dir {str(src)!r} has missing or corrupt gradients ({e})") from None
    grads = {t: (flat[f"{t}.A"], flat[f"{t}.B"]) for t in {k.rsplit(".", 1)[0] for k in flat}}
    assert st.optim is not None
    return PagedState(st.weights, st.optim, grads)


def save_state(dest: str | Path, state: TrainState, grads: dict[str, tuple[Tensor, Tensor]] | None = None) -> None:
    w = state.weights
    tensors = {f"{t}.{x}": v.detach().to("cpu", torch.float32).contiguous()
               for t, (a, b) in w.weights.items() for x, v in (("A", a), ("B", b))}
    moments: dict[str, Tensor] = {}
    if state.optim is not None:
        moments = {f"{t}.{name}": v.detach().to("cpu", torch.float32).contiguous()
                   for t, ms in state.optim.moments.items()
                   for name, v in zip(_MOMENTS[state.optim.family], ms, strict=True)}
    meta = {
        "format": FORMAT,
        "version": VERSION,
        "base_model": state.base_model,
        "rank": w.rank,
        "alpha": w.alpha,
        "targets": sorted(w.weights),
        "step": state.optim.step if state.optim is not None else 0,
        "has_optimizer": state.optim is not None,
        "optimizer": state.optim.family if state.optim is not None else None,
        "adam_betas": list(state.optim.betas) if state.optim is not None and state.optim.betas else None,
    }

    def fill(tmp: Path) -> None:
        save_file(tensors, str(tmp / "weights.safetensors"))
        if state.optim is not None:
            save_file(moments, str(tmp / "optimizer.safetensors"))
        if grads is not None:
            save_file({f"{t}.{x}": v.detach().to("cpu", torch.float32).contiguous()
                       for t, (a, b) in grads.items() for x, v in (("A", a), ("B", b))},
                      str(tmp / "grads.safetensors"))
        (tmp / "state.json").write_text(json.dumps(meta, indent=2))  # last: marks a complete dir

    atomic_write_dir(dest, fill)


def load_state(src: str | Path, include_optimizer: bool) -> TrainState:
    """Read a state dir; EngineError naming what is missing or inconsistent."""
    src = Path(src)
    try:
        meta = json.loads((src / "state.json").read_text())
    except (OSError, ValueError) as e:
        raise EngineError(f"path: {str(src)!r} is not a training-state dir ({e})") from None
    if meta.get("format") != FORMAT or meta.get("version") != VERSION:
        raise EngineError(f"path: {str(src)!r} has state format {meta.get('format')!r} "
                          f"v{meta.get('version')}, expected {FORMAT!r} v{VERSION}")
    if include_optimizer and not meta["has_optimizer"]:
        raise EngineError(f"path: {str(src)!r} was saved without optimizer state")
    targets = list(meta["targets"])
    try:
        flat = load_file(str(src / "weights.safetensors"))
        weights = {t: (flat[f"{t}.A"], flat[f"{t}.B"]) for t in targets}
        optim = None
        if include_optimizer:
            family = meta.get("optimizer") or "adamw"  # states from before Dimuon are AdamW's
            if family not in _MOMENTS:
                raise EngineError(f"path: {str(src)!r} holds state of unknown optimizer {family!r}")
            names = _MOMENTS[family]
            mflat = load_file(str(src / "optimizer.safetensors"))
            moments = {t: tuple(mflat[f"{t}.{n}"] for n in names) for t in targets if f"{t}.{names[0]}" in mflat}
            betas = meta.get("adam_betas")
            optim = AdamState(step=int(meta["step"]), moments=moments, family=family,
                              betas=(float(betas[0]), float(betas[1])) if betas else None)
    except (OSError, KeyError, SafetensorError) as e:
        raise EngineError(f"path: {str(src)!r} has missing or corrupt tensors ({e})") from None
    lora = LoraWeights(weights, int(meta["rank"]), float(meta["alpha"]))
    if (bad := lora.non_finite_target()) is not None or (optim is not None and (bad := next(
            (t for t, ms in optim.moments.items() if not all(bool(torch.isfinite(m).all()) for m in ms)), None))):
        raise EngineError(f"path: {str(src)!r} holds NaN or inf in {bad!r}; it cannot be loaded")
    return TrainState(lora, optim, str(meta["base_model"]))


def check_shapes(w: LoraWeights, bank: LoraBank, where: str) -> None:
    """EngineError unless `w` fits the bank's base model and max rank."""
    for t, (A, B) in w.weights.items():
        if t not in bank.full_shapes:
            raise EngineError(f"{where}: unknown LoRA target {t!r}")
        a_shape, b_shape = lora_shapes(bank.full_shapes[t], bank.experts.get(t, 0), w.rank)
        if tuple(A.shape) != a_shape or tuple(B.shape) != b_shape:
            raise EngineError(f"{where}: {t} LoRA shapes {list(A.shape)}/{list(B.shape)} do not fit this "
                              f"base model (expected {list(a_shape)}/{list(b_shape)})")
    if not 1 <= w.rank <= bank.max_rank:
        raise EngineError(f"{where}: rank {w.rank} is outside 1..{bank.max_rank} (the engine's max LoRA rank)")
