"""Which implementation of the hot tensor paths runs: `MINT_KERNELS=fast` (default) or `reference`.

fast: gather-free mixed-adapter LoRA (`lora.add_lora` reads each adapter's A/B straight from its
bank slot: one batched matmul over a contiguous range of slots, or one matmul per adapter segment),
fused/in-place elementwise ops in the model (RMSNorm, RoPE, SiLU·mul, residual adds).
reference: the plain formulations (per-row gather of A/B, out-of-place elementwise ops) that the
fast ones are tested against. Both give the same results to float rounding; CI runs the parity
suites on both (tests/conftest.py). The mode is read from the environment at import; `use` switches
it in-process (tests, benchmarks comparing the two side by side).

`linear` is every base projection's product. A decode step multiplies a few rows by each weight; on
CPUs BLAS often runs such a skinny product as one matrix-vector pass per row, or packs the weight
first (measured on an AMD EPYC with MKL: 1–8 rows through SmolLM2's weights at 5–11 GB/s), while the
same product taken as weight × xᵀ (the weight as the big operand, the rows as the small one) streams
the weight once (13–35 GB/s). Which is faster, and up to how many rows, is the machine's:
`calibrate_skinny` measures it on the model's own weights (the engine calls it at start-up).
"""

from __future__ import annotations

import os
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager

import torch
import torch.nn.functional as F
from torch import Tensor

MODES = ("fast", "reference")


def _from_env() -> str:
    value = os.environ.get("MINT_KERNELS", "fast").strip().lower() or "fast"
    if value not in MODES:
        raise ValueError(f"MINT_KERNELS must be one of {', '.join(MODES)}, got {value!r}")
    return value


_mode = _from_env()


def mode() -> str:
    return _mode


def fast() -> bool:
    return _mode == "fast"


def set_mode(value: str) -> None:
    global _mode
    if value not in MODES:
        raise ValueError(f"kernel mode must be one of {', '.join(MODES)}, got {value!r}")
    _mode = value


@contextmanager
def use(value: str) -> Iterator[None]:
    """Run a block with the given mode, then restore the previous one."""
    old = _mode
    set_mode(value)
    try:
        yield
    finally:
        set_mode(old)


# --- skinny products ---------------------------------------------------------------------------
_skinny_rows = 0  # products with at most this many rows take the weight × xᵀ form (0: never)
_skinny_calibrated = False  # once per process: it is the machine's, not the model's


def skinny_rows() -> int:
    return _skinny_rows


def set_skinny_rows(rows: int) -> None:
    global _skinny_rows
    _skinny_rows = max(0, int(rows))


def pin_skinny_rows(rows: int) -> None:
    """Fix skinny_rows for this process; start-up calibration then leaves it (MINT_SKINNY_ROWS does
    this at import; the tests pin it so every machine runs the same paths)."""
    global _skinny_calibrated
    set_skinny_rows(rows)
    _skinny_calibrated = True


if os.environ.get("MINT_SKINNY_ROWS", "").strip():
    pin_skinny_rows(int(os.environ["MINT_SKINNY_ROWS"]))


def linear(x: Tensor, weight: Tensor, bias: Tensor | None = None) -> Tensor:
    """F.linear(x, weight, bias); a product of at most `skinny_rows()` rows (outside autograd, fast
    kernels) is taken as weight × xᵀ, which reads the weight once whatever the row count."""
    k = x.shape[-1]
    rows = x.numel() // k if k else 0
    if (rows == 0 or rows > _skinny_rows or _mode != "fast"
            or (torch.is_grad_enabled() and (x.requires_grad or weight.requires_grad))):
        return F.linear(x, weight, bias)
    flat = x.reshape(rows, k)
    if rows == 1:  # one row would go to the matrix-vector path again
        flat = torch.cat((flat, flat))
    y = (weight @ flat.t())[:, :rows].t().contiguous()
    if bias is not None:
        y += bias
    return y.view(*x.shape[:-1], weight.shape[0])


def calibrate_skinny_once(weights: Sequence[Tensor], stream_bytes: int = 64 << 20) -> int:
    """calibrate_skinny on the first weights that add up to `stream_bytes` (more than a CPU cache
    holds, so they stream as a step's do), unless this process calibrated already."""
    global _skinny_calibrated
    if not _skinny_calibrated:
        chosen, total = [], 0
        for w in weights:
            if total >= stream_bytes:
                break
            chosen.append(w)
            total += w.numel() * w.element_size()
        calibrate_skinny(chosen)
        _skinny_calibrated = True
    return _skinny_rows


def calibrate_skinny(weights: Sequence[Tensor], candidates: Sequence[int] = (1, 2, 4, 8, 16, 32),
                     repeats: int = 3, margin: float = 0.9) -> int:
    """Time both forms of the product over `weights` (a decode step's worth, so they stream from
    memory as they do in a step) for each row count; skinny_rows becomes the largest count up to
    which the weight × xᵀ form is faster by `margin` at every count. Returns it. Run it on the
    thread (and its thread team) that computes."""
    if not weights or weights[0].device.type != "cpu":
        set_skinny_rows(0)
        return 0
    dtype = weights[0].dtype

    def seconds(rows: int, skinny: bool) -> float:
        xs = {w.shape[1]: torch.randn(rows, w.shape[1], dtype=dtype) for w in weights}
        set_skinny_rows(rows if skinny else 0)
        best = float("inf")
        with torch.no_grad():
            for _ in range(repeats):
                t0 = time.perf_counter()
                for w in weights:
                    linear(xs[w.shape[1]], w)
                best = min(best, time.perf_counter() - t0)
        return best

    old, chosen = _mode, 0
    set_mode("fast")
    try:
        for rows in candidates:
            if seconds(rows, True) > margin * seconds(rows, False):
                break
            chosen = rows
    finally:
        set_mode(old)
    set_skinny_rows(chosen)
    return chosen
