"""The optimizers of an adapter, in float32: decoupled AdamW (Tinker's AdamParams) and Dimuon
(DimuonParams). The family is chosen when the adapter is created and never mixed.

AdamW:

Per element, at step t (after optional global-norm clipping of the gradient g):

    m ← β1·m + (1 − β1)·g            v ← β2·v + (1 − β2)·g²
    p ← p · (1 − lr·weight_decay)                      (decoupled decay, as torch.optim.AdamW)
    p ← p − lr/(1 − β1ᵗ) · m / (√v / √(1 − β2ᵗ) + eps)

This is torch.optim.AdamW's arithmetic in the same order, so it matches it to the last bit on CPU.

Bias correction divides by 1 − β1ᵗ and 1 − β2ᵗ, which is right only for moments built with the
same betas at every step. So the betas are part of the state: a step whose (beta1, beta2) differ
from the ones the moments were built with starts the moments afresh (m = v = 0, t = 0) before it
runs, exactly as a new adapter's first step would. (A changed learning rate, eps or weight decay
needs nothing: they are not in the moments.) A state whose betas are not known (saved before they
were recorded) adopts the next step's.

Every step, of either family, is checked after it runs (`step_or_rollback`): a non-finite weight or
moment, or an update absurd against the weights — for any LoRA matrix M,

    rms(ΔM) > MAX_UPDATE_VS_WEIGHTS · rms(M) + MAX_UPDATE_VS_LR · learning_rate

— puts weights, moments and step count back exactly and refuses the step. A sound step stays far
below that: AdamW moves an element by at most ≈7.3·lr with the default betas (|m̂|/√v̂ by
Cauchy–Schwarz; 1·lr on the first step) plus its decay, at most |p|; Dimuon moves a matrix by lr·√r
in Frobenius norm, an RMS of at most lr.

Dimuon, as Tinker documents it (DimuonParams: learning_rate, grad_clip_norm, beta1; the matrix-sign
iteration count and normalization epsilon are internal constants), per LoRA matrix M of each layer
(A [r, in], B [out, r]):

    g ← clipped gradient (global norm, as AdamW)      μ ← β1·μ + (1 − β1)·g
    D ← msign(μ)  (Newton–Schulz iteration toward the orthogonal polar factor)
    D ← D · √r / ‖D‖_F                                 (a direction of Frobenius norm √rank)
    M ← M − lr · D

so every matrix moves by lr·√r in Frobenius norm whatever its gradient's scale. A zero momentum
(B's gradient is zero while A is still at its init, and vice versa) leaves the matrix unchanged.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import torch
from tinker import types
from torch import Tensor

from mint_server.engine.values import AdamState, EngineError, NotSupportedError
from mint_server.model import kernels
from mint_server.model.tp import split_dim as tp_split_dim

FAMILIES = ("adamw", "dimuon")


def family_named(optimizer: str) -> str:
    """An optimizer family by name ("adamw" | "dimuon"); EngineError naming the field otherwise."""
    if optimizer not in FAMILIES:
        raise EngineError(f"optimizer: {optimizer!r} is not supported (one of {list(FAMILIES)})")
    return optimizer


def family_of(params: Any) -> str:
    """The optimizer family a step's hyperparameters belong to."""
    return "dimuon" if isinstance(params, types.DimuonParams) else "adamw"


def check_family(params: Any, family: str) -> None:
    """EngineError unless `params` are of `family` (an adapter's family is fixed for its life)."""
    if family_of(params) != family:
        expected = "DimuonParams" if family == "dimuon" else "AdamParams"
        raise EngineError(f"optim_params: this model uses the {family!r} optimizer; pass {expected} "
                          "(optimizer families cannot be mixed)")
NS_STEPS = 5  # Newton–Schulz iterations of the matrix sign
NS_EPS = 1e-7
_NS_COEFFS = (3.4445, -4.7750, 2.0315)  # a quintic that pushes all singular values toward 1 fast

Pairs = dict[str, tuple[Tensor, Tensor]]  # target → (A, B)


# The documented ranges of the step's hyperparameters (docs/training.md). A learning rate above
# MAX_LEARNING_RATE is no LoRA schedule anyone runs: 1e30 steps every weight by ~1e30, which stays
# finite in float32 and poisons the next forward instead.
MAX_LEARNING_RATE = 10.0


def check_adam_params(p: types.AdamParams) -> None:
    """EngineError naming the first AdamParams field outside its range."""
    checks = (
        ("learning_rate", 0 <= p.learning_rate <= MAX_LEARNING_RATE, f"in [0, {MAX_LEARNING_RATE:g}]"),
        ("beta1", 0 <= p.beta1 < 1, "in [0, 1)"),
        ("beta2", 0 <= p.beta2 < 1, "in [0, 1)"),
        ("eps", 0 < p.eps <= 1, "in (0, 1]"),  # 0 would divide 0 by 0 where a gradient was never seen
        ("weight_decay", p.weight_decay >= 0 and p.learning_rate * p.weight_decay <= 1,
         "≥ 0 with learning_rate × weight_decay ≤ 1 (decay multiplies weights by 1 − lr·wd)"),
        ("grad_clip_norm", p.grad_clip_norm >= 0, "≥ 0 (0 = no clipping)"),
    )
    for name, ok, allowed in checks:
        value = getattr(p, name)
        if not (math.isfinite(value) and ok):
            raise EngineError(f"adam_params.{name}: {value!r} is out of range; must be {allowed}")


# The bound on one step's update (see the module docstring): far above any sound step, far below
# what moments gone wrong produce (weights × 47 to × 4e12 in issue 52's probe).
MAX_UPDATE_VS_WEIGHTS = 10.0
MAX_UPDATE_VS_LR = 100.0


@torch.no_grad()
def update_within_bound(before: Pairs, after: Pairs, learning_rate: float) -> bool:
    """Whether every LoRA matrix's update is within rms(ΔM) ≤ 10·rms(M) + 100·lr (one host sync)."""
    ratios = []
    for t, (x0, y0) in before.items():
        for old, new in ((x0, after[t][0]), (y0, after[t][1])):
            if old.numel() == 0:
                continue
            old32 = old.float()
            moved = (new.float() - old32).pow(2).mean().sqrt()
            bound = MAX_UPDATE_VS_WEIGHTS * old32.pow(2).mean().sqrt() + MAX_UPDATE_VS_LR * learning_rate + 1e-12
            ratios.append(moved / bound)
    return not ratios or bool(torch.stack(ratios).max() <= 1.0)  # NaN (an inf update) compares False


def step_or_rollback(step: Callable[..., dict[str, float]], params: Pairs, grads: Pairs, state: AdamState,
                     hp: Any, agree: Callable[[bool], bool] = lambda ok: ok, **kw: Any) -> dict[str, float]:
    """Run one optimizer `step` in place; if any new weight or moment is non-finite, or the update is
    absurd against the weights (`update_within_bound`), put the weights, moments, step count and
    betas back exactly as they were and raise EngineError (the gradients stay). The caller publishes
    the weights only when this returns, so weights that failed the check are never served or saved.

    agree: tensor-parallel ranks combine their verdicts (all ranks roll back, or none); each rank
    bounds its own share of each matrix.
    """
    weights = {t: (x.clone(), y.clone()) for t, (x, y) in params.items()}
    moments = {t: tuple(m.clone() for m in ms) for t, ms in state.moments.items()}
    step_count, betas = state.step, state.betas
    metrics = step(params, grads, state, hp, **kw)
    finite = agree(kernels.all_finite([*(x for pair in params.values() for x in pair),
                                       *(m for ms in state.moments.values() for m in ms)]))
    bounded = finite and agree(update_within_bound(weights, params, float(hp.learning_rate)))
    if finite and bounded:
        return metrics
    with torch.no_grad():
        for t, (x, y) in weights.items():
            params[t][0].copy_(x)
            params[t][1].copy_(y)
    state.moments, state.step, state.betas = moments, step_count, betas  # type: ignore[assignment]
    if not finite:
        raise EngineError("optim_params: this step would make the adapter's weights or optimizer moments "
                          "non-finite (lower the learning rate, or clip gradients); the adapter and its gradients "
                          "are unchanged")
    raise EngineError(f"optim_params: this step's update is absurd against the weights (the RMS of some LoRA "
                      f"matrix's change exceeds {MAX_UPDATE_VS_WEIGHTS:g} × its RMS + {MAX_UPDATE_VS_LR:g} × "
                      "learning_rate), so it was refused; the adapter and its gradients are unchanged")


def grad_norm(grads: Pairs) -> float:
    """Global L2 norm over all of the adapter's gradients (what grad_clip_norm bounds)."""
    sq = [g.float().pow(2).sum() for pair in grads.values() for g in pair]
    return math.sqrt(float(torch.stack(sq).sum())) if sq else 0.0


@torch.no_grad()
def adamw_step(params: Pairs, grads: Pairs, state: AdamState, hp: types.AdamParams,
               norm: float | None = None) -> dict[str, float]:
    """Update float32 `params` in place from `grads`; advances `state`. Returns optimizer metrics.

    Betas other than the ones `state`'s moments were built with reset the moments and step count
    first (m = v = 0, t = 0), so the bias correction is always that of the moments it divides.

    Targets without a gradient are left alone (like torch optimizers skip params whose .grad is None).
    norm: the gradient's global norm when `grads` is one tensor-parallel rank's share (tp.grad_norm).
    """
    norm = grad_norm(grads) if norm is None else norm
    # torch.nn.utils.clip_grad_norm_'s rule: scale by max_norm / (norm + 1e-6) when that is < 1.
    clip = hp.grad_clip_norm / (norm + 1e-6) if hp.grad_clip_norm > 0 else 1.0
    clip = min(clip, 1.0)
    betas = (float(hp.beta1), float(hp.beta2))
    if state.betas is not None and state.betas != betas:
        # Moments built under other betas cannot be bias-corrected under these: start them afresh
        # (a new dict: step_or_rollback's copy of the old one stays intact for a rollback).
        state.moments, state.step = {}, 0
    state.betas = betas
    state.step += 1
    bc1 = 1 - hp.beta1**state.step
    bc2_sqrt = (1 - hp.beta2**state.step) ** 0.5  # `** 0.5`, not math.sqrt: torch's exact arithmetic
    step_size = hp.learning_rate / bc1
    for t, (gA, gB) in grads.items():
        pA, pB = params[t]
        if t not in state.moments:
            state.moments[t] = (torch.zeros_like(pA), torch.zeros_like(pA), torch.zeros_like(pB), torch.zeros_like(pB))
        mA, vA, mB, vB = state.moments[t]
        for p, g, m, v in ((pA, gA, mA, vA), (pB, gB, mB, vB)):
            g = g.float() * clip if clip != 1.0 else g.float()
            if hp.weight_decay:
                p.mul_(1 - hp.learning_rate * hp.weight_decay)
            m.lerp_(g, 1 - hp.beta1)
            v.mul_(hp.beta2).addcmul_(g, g, value=1 - hp.beta2)
            denom = (v.sqrt() / bc2_sqrt).add_(hp.eps)
            p.addcdiv_(m, denom, value=-step_size)
    return {"grad_norm:mean": norm, "learning_rate:mean": hp.learning_rate}


def check_dimuon_params(p: types.DimuonParams) -> None:
    checks = (("learning_rate", 0 <= p.learning_rate <= MAX_LEARNING_RATE, f"in [0, {MAX_LEARNING_RATE:g}]"),
              ("beta1", 0 <= p.beta1 < 1, "in [0, 1)"),
              ("grad_clip_norm", p.grad_clip_norm >= 0, "≥ 0 (0 = no clipping)"))
    for name, ok, allowed in checks:
        value = getattr(p, name)
        if not (math.isfinite(value) and ok):
            raise EngineError(f"dimuon_params.{name}: {value!r} is out of range; must be {allowed}")


def matrix_sign(m: Tensor, wide: bool | None = None, reduce: Callable[[Tensor], Tensor] | None = None) -> Tensor:
    """Approximately U·Vᵀ for m = U·S·Vᵀ, batched over leading dims; float32.

    Tensor-parallel (a split LoRA factor): m is this rank's slice along the matrix's long dim,
    `wide` is the whole matrix's orientation and `reduce` sums a tensor over the ranks — the Gram
    matrix and the norm contract the split dim, everything else is local to the slice.
    """
    x = m.float()
    wide = x.shape[-2] <= x.shape[-1] if wide is None else wide
    total = reduce or (lambda t: t)
    if not wide:
        x = x.mT
    x = x / (_fro(x, reduce) + NS_EPS)
    a, b, c = _NS_COEFFS
    for _ in range(NS_STEPS):
        gram = total(x @ x.mT)
        x = a * x + (b * gram + c * (gram @ gram)) @ x
    return x if wide else x.mT


def _fro(x: Tensor, reduce: Callable[[Tensor], Tensor] | None) -> Tensor:
    """Frobenius norm over the last two dims (keepdim); of the whole matrix when x is a slice."""
    if reduce is None:
        return torch.linalg.matrix_norm(x, keepdim=True)
    return reduce(x.pow(2).sum((-2, -1), keepdim=True)).sqrt()


@torch.no_grad()
def dimuon_step(params: Pairs, grads: Pairs, state: AdamState, hp: types.DimuonParams,
                norm: float | None = None, tp: Any = None) -> dict[str, float]:
    """Update float32 `params` in place from `grads` with Dimuon; advances `state` (family dimuon).

    tp: `params` / `grads` are this tensor-parallel rank's share (model/tp.py's split); `norm` is then
    the global gradient norm.
    """
    norm = grad_norm(grads) if norm is None else norm
    clip = min(hp.grad_clip_norm / (norm + 1e-6), 1.0) if hp.grad_clip_norm > 0 else 1.0
    state.step += 1
    for t, (gA, gB) in grads.items():
        pA, pB = params[t]
        if t not in state.moments:
            state.moments[t] = (torch.zeros_like(pA, dtype=torch.float32), torch.zeros_like(pB, dtype=torch.float32))
        for factor, p, g, mu in (("A", pA, gA, state.moments[t][0]), ("B", pB, gB, state.moments[t][1])):
            g = g.float() * clip if clip != 1.0 else g.float()
            mu.lerp_(g, 1 - hp.beta1)
            shape, reduce = list(p.shape), None
            if tp is not None and (dim := tp_split_dim(t, factor)) is not None:
                shape[dim] *= tp.world
                reduce = tp.all_reduce_sum
                if shape[dim] < min(shape[-2:]):
                    raise NotSupportedError(f"dimuon with tensor parallelism: {t}'s LoRA {factor} is split along "
                                            "its short side (rank above the layer's width)")
            d = matrix_sign(mu, wide=shape[-2] <= shape[-1], reduce=reduce)
            rank = min(shape[-2], shape[-1])
            fro = _fro(d, reduce)
            d = torch.where(fro > 0, d * (math.sqrt(rank) / fro.clamp_min(NS_EPS)), torch.zeros_like(d))
            p.sub_(d, alpha=hp.learning_rate)
    return {"grad_norm:mean": norm, "learning_rate:mean": hp.learning_rate}


STEP_OF: dict[str, Callable[..., dict[str, float]]] = {"adamw": adamw_step, "dimuon": dimuon_step}
