"""Tinker's built-in loss functions: which inputs each one takes, how those are checked, and the math.

Every loss is a *sum* over target positions (Tinker's convention: no mean anywhere), so the
gradients of several forward_backward calls add up exactly like one big call. A loss function sees
one request's rows as padded tensors:

    lp    [rows, T, K]  log-probabilities of the target tokens under the model being trained
                        (K = 1 except for cross_entropy with 2-D target_tokens)
    x     name → [rows, T] (or [rows, T, K] for 2-D weights): the datum's loss_fn_inputs, zero-padded
    mask  [rows, T] 1.0 on real positions, 0.0 on padding

and returns the elementwise loss [rows, T], zero on padding. `docs/losses.md` states each formula.

Also here: `TargetLogprobs` (lp from the logits) and the checking of reverse-KL rows.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

import numpy as np
import torch
from tinker import types
from torch import Tensor

from mint_server.engine.values import EngineError, NotSupportedError
from mint_server.model import invariant, kernels
from mint_server.model.images import PromptImages

LossFn = Callable[[Tensor, dict[str, Tensor], Tensor, dict[str, float]], Tensor]
THRESHOLDS = ("clip_low_threshold", "clip_high_threshold")
FLOAT_INPUTS = ("weights", "logprobs", "advantages", "sequence_ratio_mask", *THRESHOLDS)


class SamplingRecordsLike(Protocol):
    """What stable_reinforce needs from the sampler: per-sequence logprobs of the sampled tokens."""

    def get(self, sequence_id: str) -> list[float] | None: ...


@dataclass(frozen=True)
class LossSpec:
    name: str
    fn: LossFn
    required: tuple[str, ...]
    optional: tuple[str, ...] = ()
    # loss_fn_config key → default; None means the caller must give it.
    config: Mapping[str, float | None] = field(default_factory=dict)
    multi_target: bool = False  # accepts 2-D [N, K] target_tokens (and weights)

    @property
    def inputs(self) -> tuple[str, ...]:
        return self.required + self.optional


# --- the formulas ---------------------------------------------------------------------------------


def _log_ratio(lp: Tensor, x: dict[str, Tensor], mask: Tensor) -> Tensor:
    """log(π_θ / π_sampler), forced to 0 where nothing is learned (padding, zero advantage).

    Prompt positions carry sampling logprob 0 by convention; masking before exp() keeps an
    overflowing ratio there from turning 0·inf into NaN gradients.
    """
    active = (mask > 0) & (x["advantages"] != 0)
    return torch.where(active, lp[..., 0] - x["logprobs"], torch.zeros_like(x["logprobs"]))


def _thresholds(x: dict[str, Tensor], cfg: dict[str, float]) -> tuple[Tensor | float, Tensor | float]:
    """Per-token thresholds from loss_fn_inputs win over loss_fn_config, which wins over the default."""
    lo = x.get("clip_low_threshold", cfg["clip_low_threshold"])
    hi = x.get("clip_high_threshold", cfg["clip_high_threshold"])
    return lo, hi


def _clamp(t: Tensor, lo: Tensor | float, hi: Tensor | float) -> Tensor:
    lo_t = torch.as_tensor(lo, dtype=t.dtype, device=t.device)
    hi_t = torch.as_tensor(hi, dtype=t.dtype, device=t.device)
    return torch.minimum(torch.maximum(t, lo_t), hi_t)


def cross_entropy(lp: Tensor, x: dict[str, Tensor], mask: Tensor, cfg: dict[str, float]) -> Tensor:
    w = x.get("weights")
    w = mask[..., None] if w is None else (w if w.dim() == 3 else w[..., None])
    return -(w * lp).sum(-1) * mask


def importance_sampling(lp: Tensor, x: dict[str, Tensor], mask: Tensor, cfg: dict[str, float]) -> Tensor:
    ratio = torch.exp(_log_ratio(lp, x, mask))
    return -(ratio * x["advantages"]) * mask


def ppo(lp: Tensor, x: dict[str, Tensor], mask: Tensor, cfg: dict[str, float]) -> Tensor:
    ratio = torch.exp(_log_ratio(lp, x, mask))
    adv = x["advantages"]
    lo, hi = _thresholds(x, cfg)
    return -torch.minimum(ratio * adv, _clamp(ratio, lo, hi) * adv) * mask


def cispo(lp: Tensor, x: dict[str, Tensor], mask: Tensor, cfg: dict[str, float]) -> Tensor:
    ratio = torch.exp(_log_ratio(lp, x, mask))
    lo, hi = _thresholds(x, cfg)
    # The clipped ratio is a constant weight: the gradient only flows through log π_θ.
    return -(_clamp(ratio, lo, hi).detach() * lp[..., 0] * x["advantages"]) * mask


def dro(lp: Tensor, x: dict[str, Tensor], mask: Tensor, cfg: dict[str, float]) -> Tensor:
    target = lp[..., 0]
    quadratic = (target - x["logprobs"]) ** 2
    return -(target * x["advantages"] - 0.5 * cfg["beta"] * quadratic) * mask


def gspo(lp: Tensor, x: dict[str, Tensor], mask: Tensor, cfg: dict[str, float]) -> Tensor:
    """Sequence-level ratio s = exp(mean over sequence_ratio_mask of log π_θ − log π_sampler)."""
    m = x["sequence_ratio_mask"] * mask
    diff = torch.where(m > 0, lp[..., 0] - x["logprobs"], torch.zeros_like(m))
    log_s = (diff * m).sum(-1, keepdim=True) / m.sum(-1, keepdim=True).clamp(min=1.0)
    s = torch.exp(log_s).expand_as(m)
    adv = x["advantages"]
    lo, hi = _thresholds(x, cfg)
    return -torch.minimum(s * adv, _clamp(s, lo, hi) * adv) * mask


def stable_reinforce(lp: Tensor, x: dict[str, Tensor], mask: Tensor, cfg: dict[str, float]) -> Tensor:
    """REINFORCE with truncated importance weights against the sampler's own logprobs."""
    ratio = torch.exp(_log_ratio(lp, x, mask)).detach()
    lo, hi = _thresholds(x, cfg)
    return -(_clamp(ratio, lo, hi) * lp[..., 0] * x["advantages"]) * mask


_RL = ("target_tokens", "logprobs", "advantages")
_PPO_CLIP = {"clip_low_threshold": 0.8, "clip_high_threshold": 1.2}
LOSSES: dict[str, LossSpec] = {
    s.name: s
    for s in (
        LossSpec("cross_entropy", cross_entropy, ("target_tokens",), ("weights",), multi_target=True),
        LossSpec("importance_sampling", importance_sampling, _RL),
        LossSpec("ppo", ppo, _RL, THRESHOLDS, _PPO_CLIP),
        LossSpec("cispo", cispo, _RL, THRESHOLDS, _PPO_CLIP),
        LossSpec("dro", dro, _RL, (), {"beta": None}),
        # GSPO paper's ranges: ε_low = 3e-4, ε_high = 4e-4 around a sequence-level ratio.
        LossSpec("gspo", gspo, (*_RL, "sequence_ratio_mask"), THRESHOLDS,
                 {"clip_low_threshold": 1 - 3e-4, "clip_high_threshold": 1 + 4e-4}),
        # Truncated IS (weights capped at 2, none raised) on top of plain REINFORCE.
        LossSpec("stable_reinforce", stable_reinforce, ("target_tokens", "advantages"), ("logprobs", *THRESHOLDS),
                 {"clip_low_threshold": 0.0, "clip_high_threshold": 2.0}),
    )
}


# --- the model's log-probabilities of the targets --------------------------------------------------


class TargetLogprobs(torch.autograd.Function):
    """log_softmax(logits)[targets] in float32, with a lean backward over the [rows, T, vocab] logits.

    The log-softmax is written over the logits' own buffer (fp32 logits; nothing else reads them:
    the lm_head's backward needs its input, not its output), and backward's softmax is one exp pass
    over it, in place again, plus a scatter: no full-vocabulary temporary either way. Autograd's
    gather − logsumexp would make several passes and temporaries. (An op that did keep the logits
    would fail loudly on autograd's version check.)
    """

    @staticmethod
    def forward(ctx: Any, logits: Tensor, targets: Tensor) -> Tensor:
        ctx.in_dtype = logits.dtype
        logp = kernels.log_softmax_(logits.float())
        ctx.save_for_backward(logp, targets)
        return logp.gather(-1, targets)

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor, None]:
        logp, targets = ctx.saved_tensors
        # d/dx of Σ_k g_k·logp[t_k] = scatter(g) − softmax(x)·Σ_k g_k
        p = invariant.softmax_from_log(logp) if invariant.enabled() else logp.exp_()
        p = p.mul_(-grad.sum(-1, keepdim=True))
        p.scatter_add_(-1, targets, grad)
        return p.to(ctx.in_dtype), None


# --- checking and parsing one request's inputs ----------------------------------------------------


@dataclass
class ParsedDatum:
    """One datum, checked: token ids and its loss inputs as numpy arrays ([N] or [N, K])."""

    tokens: list[int]
    inputs: dict[str, np.ndarray]
    images: PromptImages | None = None  # a vision-language base's images in `tokens` (preparer.Preparer reads them)

    @property
    def width(self) -> int:  # K: targets per position
        t = self.inputs["target_tokens"]
        return 1 if t.ndim == 1 else t.shape[1]


def loss_spec(name: str) -> LossSpec:
    spec = LOSSES.get(name)
    if spec is None and name == "custom":
        raise NotSupportedError("loss_fn: 'custom' runs an uploaded loss graph (create_custom_loss), "
                                "through prepare_custom with its loss_fn_config.loss_id, not as a built-in loss")
    if spec is None:
        raise EngineError(f"loss_fn: unknown loss function {name!r}; supported: {sorted(LOSSES)}")
    return spec


def resolve_config(spec: LossSpec, config: Mapping[str, Any] | None) -> dict[str, float]:
    """loss_fn_config merged over the loss's defaults; unknown keys and non-finite values refused."""
    given = dict(config or {})
    for key in given:
        if key not in spec.config:
            raise EngineError(
                f"loss_fn_config: unknown key {key!r} for loss {spec.name!r} (accepted: {sorted(spec.config)})"
            )
    out: dict[str, float] = {}
    for key, default in spec.config.items():
        value = given.get(key, default)
        if value is None:
            raise EngineError(f"loss_fn_config.{key} is required for loss {spec.name!r}")
        if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value):
            raise EngineError(f"loss_fn_config.{key} must be a finite number, got {value!r}")
        out[key] = float(value)
    if "beta" in out and out["beta"] < 0:
        raise EngineError(f"loss_fn_config.beta must be >= 0, got {out['beta']}")
    for key in THRESHOLDS:  # bounds on a probability ratio, which is never negative
        if key in out and out[key] < 0:
            raise EngineError(f"loss_fn_config.{key} must be >= 0 (it bounds a probability ratio), got {out[key]}")
    if "clip_low_threshold" in out and out["clip_low_threshold"] > out["clip_high_threshold"]:
        raise EngineError("loss_fn_config: clip_low_threshold must not exceed clip_high_threshold")
    return out


def model_input_tokens(model_input: Any, where: str, vocab: int, max_len: int) -> list[int]:
    """Token ids of a tinker ModelInput (or a plain list), checked against the vocab and context."""
    if isinstance(model_input, types.ModelInput):
        try:
            tokens = model_input.to_ints()
        except ValueError:
            kinds = sorted({type(c).__name__ for c in model_input.chunks})
            raise EngineError(f"{where}: only token chunks can be trained on (got {kinds})") from None
    elif isinstance(model_input, Sequence) and not isinstance(model_input, str | bytes):
        tokens = list(model_input)
    else:
        raise EngineError(f"{where}: expected a ModelInput, got {type(model_input).__name__}")
    if not tokens:
        raise EngineError(f"{where}: empty model input")
    if len(tokens) > max_len:
        raise EngineError(f"{where}: {len(tokens)} tokens exceed the model's context of {max_len}")
    _check_ids(np.asarray(tokens), where, vocab)
    return [int(t) for t in tokens]


def _check_ids(ids: np.ndarray, where: str, vocab: int) -> None:
    if ids.dtype.kind not in "iu" and (
        ids.dtype.kind != "f" or not np.all(np.isfinite(ids)) or not np.all(ids == np.round(ids))
    ):
        raise EngineError(f"{where}: token ids must be integers")
    if ids.size and (ids.min() < 0 or ids.max() >= vocab):
        bad = int(ids.max() if ids.max() >= vocab else ids.min())
        raise EngineError(f"{where}: token id {bad} is outside the vocabulary [0, {vocab})")


def tensor_array(value: Any, where: str) -> np.ndarray:
    """A TensorData (tinker's, or anything with .data/.shape, or a {data, shape} dict) or list → numpy."""
    try:
        if isinstance(value, types.TensorData):
            return np.asarray(value.to_numpy())
        if isinstance(value, Mapping):
            data, shape = value.get("data"), value.get("shape")
        elif hasattr(value, "data") and hasattr(value, "shape") and not isinstance(value, np.ndarray | Tensor):
            data, shape = value.data, value.shape
        else:
            data, shape = value, None
        arr = np.asarray(data.detach().cpu().numpy() if isinstance(data, Tensor) else data)
        return arr.reshape(shape) if shape is not None else arr
    except (TypeError, ValueError) as e:
        raise EngineError(f"{where}: not a numeric tensor ({e})") from None


def parse_datum(
    datum: types.Datum,
    i: int,
    spec: LossSpec,
    vocab: int,
    max_len: int,
    records: SamplingRecordsLike | None,
) -> ParsedDatum:
    """Check one datum against `spec` and return its arrays; EngineError names the offending field."""
    where = f"datums[{i}]"
    model_input = getattr(datum, "model_input", None)
    if model_input is None:
        raise EngineError(f"{where}: expected a Datum with model_input and loss_fn_inputs")
    tokens = model_input_tokens(model_input, f"{where}.model_input", vocab, max_len)
    n = len(tokens)
    given = dict(getattr(datum, "loss_fn_inputs", None) or {})
    for key in given:
        if key not in spec.inputs:
            raise EngineError(
                f"{where}.loss_fn_inputs: unexpected key {key!r} for loss {spec.name!r} (accepted: {list(spec.inputs)})"
            )
    for key in spec.required:
        if key not in given:
            raise EngineError(f"{where}.loss_fn_inputs.{key} is required for loss {spec.name!r}")
    inputs: dict[str, np.ndarray] = {}
    for key, value in given.items():
        field_where = f"{where}.loss_fn_inputs.{key}"
        arr = tensor_array(value, field_where)
        if arr.ndim == 0 or arr.shape[0] != n:
            raise EngineError(f"{field_where}: length {arr.shape[0] if arr.ndim else 'scalar'} "
                              f"does not match the model_input length {n}")
        two_d = spec.multi_target and key in ("target_tokens", "weights")
        if arr.ndim != (2 if two_d and arr.ndim == 2 else 1):
            raise EngineError(f"{field_where}: expected shape [{n}]" + (f" or [{n}, K]" if two_d else "")
                              + f", got {list(arr.shape)}")
        if key == "target_tokens":
            _check_ids(arr, field_where, vocab)
            arr = arr.astype(np.int64)
        else:
            arr = arr.astype(np.float32)
            if not np.all(np.isfinite(arr)):
                raise EngineError(f"{field_where}: contains NaN or inf")
        inputs[key] = arr
    if "weights" in inputs and inputs["weights"].shape != inputs["target_tokens"].shape:
        raise EngineError(f"{where}.loss_fn_inputs.weights: shape {list(inputs['weights'].shape)} "
                          f"differs from target_tokens {list(inputs['target_tokens'].shape)}")
    if "clip_low_threshold" in inputs or "clip_high_threshold" in inputs:
        lo, hi = inputs.get("clip_low_threshold"), inputs.get("clip_high_threshold")
        for key, bound in (("clip_low_threshold", lo), ("clip_high_threshold", hi)):
            if bound is not None and np.any(bound < 0):
                raise EngineError(f"{where}.loss_fn_inputs.{key}: must be >= 0 (it bounds a probability ratio)")
        if lo is not None and hi is not None and np.any(lo > hi):
            raise EngineError(f"{where}.loss_fn_inputs: clip_low_threshold exceeds clip_high_threshold")
    if spec.name == "stable_reinforce":
        inputs["logprobs"] = _sampling_logprobs(datum, where, inputs, records)
    return ParsedDatum(tokens, inputs)


def _sampling_logprobs(
    datum: types.Datum, where: str, inputs: dict[str, np.ndarray], records: SamplingRecordsLike | None
) -> np.ndarray:
    """stable_reinforce's π_sampler per target position, from the sampler's records by provenance.

    Positions in a SampledProvenanceSpan take the logprob the sampler recorded for that sequence;
    positions in a PromptProvenanceSpan are not actions, so their advantage must be zero. Without
    provenance (or without a record), the datum's own `logprobs` input is used.
    """
    n = inputs["target_tokens"].shape[0]
    own = inputs.get("logprobs")
    spans = getattr(datum, "loss_fn_input_spans", None)
    if spans is None:
        if own is None:
            raise EngineError(f"{where}: loss 'stable_reinforce' needs loss_fn_input_spans (provenance from "
                              "sampling with record_stability_info) or loss_fn_inputs.logprobs")
        return own
    if sum(s.length for s in spans) != n:
        raise EngineError(f"{where}.loss_fn_input_spans: spans cover {sum(s.length for s in spans)} "
                          f"positions but target_tokens has {n}")
    out = np.zeros(n, dtype=np.float32) if own is None else own.copy()
    adv = inputs["advantages"]
    pos = 0
    for s in spans:
        span = slice(pos, pos + s.length)
        if isinstance(s, types.SampledProvenanceSpan):
            rec = records.get(s.sequence_id) if records is not None else None
            if rec is not None:
                if s.offset + s.length > len(rec):
                    raise EngineError(f"{where}.loss_fn_input_spans: sequence {s.sequence_id!r} has "
                                      f"{len(rec)} recorded tokens, span needs {s.offset + s.length}")
                out[span] = np.asarray(rec[s.offset : s.offset + s.length], dtype=np.float32)
            elif own is None and np.any(adv[span] != 0):
                raise EngineError(f"{where}: no sampling record for sequence {s.sequence_id!r} (expired, or "
                                  "not sampled with record_stability_info) and no loss_fn_inputs.logprobs")
        elif np.any(adv[span] != 0):
            raise EngineError(f"{where}.loss_fn_inputs.advantages: nonzero on prompt positions "
                              f"{pos}..{pos + s.length - 1}; stable_reinforce only trains sampled tokens")
        pos += s.length
    if not np.all(np.isfinite(out)):
        raise EngineError(f"{where}: recorded sampling logprobs contain NaN or inf")
    return out


def pad_inputs(
    datums: Sequence[ParsedDatum], width: int, device: torch.device, fill: Mapping[str, float]
) -> tuple[dict[str, Tensor], Tensor]:
    """Right-pad the rows' float inputs to [rows, width] ([rows, width, K] for 2-D weights), plus the mask.

    A row lacking an input some other row has gets `fill[key]` on its real positions (the config
    threshold, weight 1), so per-datum inputs can be mixed within a request.
    """
    rows = len(datums)
    mask = np.zeros((rows, width), dtype=np.float32)
    keys = {k for d in datums for k in d.inputs if k != "target_tokens"}
    k_max = max(d.width for d in datums)
    arrays = {
        k: np.zeros((rows, width, k_max) if k == "weights" and k_max > 1 else (rows, width), dtype=np.float32)
        for k in keys
    }
    for r, d in enumerate(datums):
        n = len(d.tokens)
        mask[r, :n] = 1.0
        for k, arr in arrays.items():
            a = d.inputs.get(k)
            if arr.ndim == 3:  # only this row's own K targets get weight; the padded ones stay 0
                arr[r, :n, : d.width] = fill.get(k, 0.0) if a is None else (a if a.ndim == 2 else a[:, None])
            else:
                arr[r, :n] = fill.get(k, 0.0) if a is None else a
    return {k: torch.from_numpy(a).to(device) for k, a in arrays.items()}, torch.from_numpy(mask).to(device)


# --- reverse KL inputs ----------------------------------------------------------------------------

@dataclass(frozen=True)
class ReverseKLDatum:
    """One row of MinT's forward_backward_reverse_kl (mindlab-toolkit's `ReverseKLDatum`).

    The student sees `student_input`, the reference `reference_input` (it may carry a different,
    e.g. privileged, prefix); the two are right-aligned, so their last tokens coincide.
    target_tokens/weights are per student position, like a Datum's loss_fn_inputs.
    """

    student_input: Any  # types.ModelInput | list[int]
    reference_input: Any
    target_tokens: Any  # TensorData | list[int]
    weights: Any  # TensorData | list[float]


@dataclass
class KLRow:
    student: list[int]
    reference: list[int]
    targets: np.ndarray
    weights: np.ndarray


def parse_kl_datum(d: Any, i: int, vocab: int, max_len: int) -> KLRow:
    """Check one reverse-KL datum (a ReverseKLDatum, or a mapping with its fields)."""
    where = f"datums[{i}]"
    get = d.get if isinstance(d, Mapping) else lambda k: getattr(d, k, None)
    s_in, r_in, tt, w = get("student_input"), get("reference_input"), get("target_tokens"), get("weights")
    for name, value in (("student_input", s_in), ("reference_input", r_in), ("target_tokens", tt),
                        ("weights", w)):
        if value is None:
            raise EngineError(f"{where}.{name} is required")
    student = model_input_tokens(s_in, f"{where}.student_input", vocab, max_len)
    reference = model_input_tokens(r_in, f"{where}.reference_input", vocab, max_len)
    n = len(student)
    targets, weights = tensor_array(tt, f"{where}.target_tokens"), tensor_array(w, f"{where}.weights")
    for name, arr in (("target_tokens", targets), ("weights", weights)):
        if arr.shape != (n,):
            raise EngineError(f"{where}.{name}: shape {list(arr.shape)} does not match the student_input "
                              f"length {n}")
    model_input_tokens(targets.tolist(), f"{where}.target_tokens", vocab, max_len)
    weights = weights.astype(np.float32)
    if not np.all(np.isfinite(weights)):
        raise EngineError(f"{where}.weights: contains NaN or inf")
    missing = n - len(reference)  # leading student positions with no reference position
    if missing > 0 and np.any(weights[:missing] != 0):
        raise EngineError(f"{where}.weights: nonzero on student positions 0..{missing - 1}, which have no "
                          f"reference position (inputs are right-aligned; reference_input is shorter)")
    return KLRow(student, reference, targets.astype(np.int64), weights)
