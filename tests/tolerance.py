"""The one tolerance policy for floating-point comparisons in the tests (docs/numerics.md).

Two computations of the same value that reduce in different orders — another batch composition,
the other MINT_KERNELS path, another CPU's BLAS kernels, transformers as the oracle — differ by
rounding. A sum of n terms in floating point is off by at most about n·u of the summed magnitudes
(u: the dtype's unit roundoff), and typically by √n·u, since the rounding errors are independent;
chained through `depth` layers the errors add up. So two results are "the same" when

    |actual − expected| ≤ SAFETY · u · √n · depth · max(1, max |expected|)

with n the longest reduction the value went through (hidden, intermediate, vocabulary: whichever
is largest), depth the number of layers, and SAFETY a fixed margin for what √n does not model
(softmax and RMSNorm amplifying an input error, the log of a sum). For relative comparisons (whole
gradient tensors, by norm) the bound is the same without the magnitude.

The margin was set once: the largest drift reported from other machines (1.9e-5 on a tiny MoE's
logits, AMD EPYC AVX2 and AVX-512) sits at about a quarter of that model's bound (6.9e-5 at
|logit| ≤ 1), the suites pass under MKL_CBWR=COMPATIBLE / AVX2 and OMP_NUM_THREADS=1 / 2, and every
real bug the tests look for (a wrong adapter, a wrong scale, a missed row: differences of 1e-3 and
more) stays an order of magnitude above it. Exact equality is asserted only where the code guarantees it (batch-invariant mode).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
import torch

SAFETY = 32.0


def unit_roundoff(dtype: torch.dtype = torch.float32) -> float:
    return torch.finfo(dtype).eps / 2


@dataclass(frozen=True)
class Tolerance:
    n: int  # the longest reduction on the path to the compared values
    depth: int = 1  # layers the error is carried through
    dtype: torch.dtype = torch.float32

    @property
    def rel(self) -> float:
        """Bound on a relative difference (‖a − b‖ / ‖b‖, or |a − b| / max(1, |b|))."""
        return SAFETY * unit_roundoff(self.dtype) * math.sqrt(self.n) * self.depth

    def bound(self, expected) -> float:
        """Bound on max |actual − expected| for these expected values."""
        return self.rel * max(1.0, _max_abs(expected))

    def check(self, actual, expected, what: object = "") -> None:
        """Assert max |actual − expected| is within the bound; the message shows both numbers."""
        diff = _max_abs(_as_array(actual) - _as_array(expected))
        bound = self.bound(expected)
        assert diff <= bound, f"{what}: max |Δ| {diff:.3g} > bound {bound:.3g} ({self})"

    def check_rel(self, actual: torch.Tensor, expected: torch.Tensor, what: object = "") -> None:
        """Assert ‖actual − expected‖ / ‖expected‖ is within the relative bound (gradients)."""
        err = ((actual - expected).norm() / expected.norm().clamp(min=1e-30)).item()
        assert err <= self.rel, f"{what}: relative error {err:.3g} > bound {self.rel:.3g} ({self})"

    def check_scalar(self, actual: float, expected: float, n_terms: int = 1, what: object = "") -> None:
        """A sum of n_terms values computed in two orders (a loss over tokens)."""
        bound = self.rel * math.sqrt(max(1, n_terms)) * max(1.0, abs(expected))
        assert abs(actual - expected) <= bound, f"{what}: |{actual} − {expected}| > {bound:.3g}"


def for_model(cfg, dtype: torch.dtype = torch.float32) -> Tolerance:
    """The tolerance for values computed by a model of this ModelConfig (logits, logprobs, grads)."""
    widths = [cfg.hidden_size, cfg.intermediate_size, cfg.vocab_size, cfg.num_heads * cfg.head_dim]
    if cfg.moe_intermediate_size:
        widths.append(cfg.moe_intermediate_size * max(1, cfg.num_experts_per_tok))
    return Tolerance(n=max(widths), depth=cfg.num_layers, dtype=dtype)


def _as_array(x) -> np.ndarray:
    if isinstance(x, torch.Tensor):
        return x.detach().double().cpu().numpy()
    return np.asarray(x, dtype=np.float64)


def _max_abs(x) -> float:
    a = _as_array(x)
    return float(np.abs(a).max()) if a.size else 0.0
