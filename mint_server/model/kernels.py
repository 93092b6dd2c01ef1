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
from collections.abc import Callable, Iterable, Iterator, Sequence
from contextlib import contextmanager
from typing import Protocol

import torch
import torch.nn.functional as F
from torch import Tensor


class OwnProduct(Protocol):
    """A weight that runs its own product (model/quantize.py's QuantizedWeight, `--quantize`); a
    protocol here, so that this leaf module imports none of the model's."""

    def linear(self, x: Tensor, bias: Tensor | None) -> Tensor: ...

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


# --- checks --------------------------------------------------------------------------------------
def all_finite(tensors: Iterable[Tensor]) -> bool:
    """Whether no tensor holds a NaN or inf, with one host sync. A sum with a NaN or inf in it is not
    finite, so a finite sum per tensor settles it in one reduction pass (no bool tensor as large as
    the weights: an adapter's or optimizer's bytes are checked on every load and step); only when a
    sum is not finite, which large finite values can also cause, does each element get checked."""
    ts = [t for t in tensors if t.numel()]
    if not ts:
        return True
    if bool(torch.isfinite(torch.stack([t.sum().float().to(ts[0].device) for t in ts])).all()):
        return True
    return all(bool(torch.isfinite(t).all()) for t in ts)


# --- log-softmax over a vocabulary ---------------------------------------------------------------
def log_softmax_(x: Tensor) -> Tensor:
    """log_softmax over the last dim, in place (x: contiguous). A training pass's [rows, T, vocab]
    logits are hundreds of MB: torch.logsumexp or an out-of-place log_softmax writes a temporary as
    big (fresh pages, one more pass over memory), where a block of rows at a time stays in cache (on
    CPU, SmolLM2's 8 × 256 logits: 35-50 ms against logsumexp's ~150 ms). Each row goes through
    torch.log_softmax whole, as it would in one call."""
    rows = x.view(-1, x.shape[-1])
    budget = 2 << 20 if x.device.type == "cpu" else 256 << 20  # an accelerator: fewer, bigger launches
    for block in rows.split(max(1, budget // (x.shape[-1] * x.element_size()))):
        block.copy_(torch.log_softmax(block, -1))
    return x


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


def linear(x: Tensor, weight: Tensor | OwnProduct, bias: Tensor | None = None) -> Tensor:
    """F.linear(x, weight, bias); a product of at most `skinny_rows()` rows (outside autograd, fast
    kernels) is taken as weight × xᵀ, which reads the weight once whatever the row count. A quantized
    base weight (model/quantize.py, `--quantize`) runs its own product."""
    if not isinstance(weight, Tensor):
        return weight.linear(x, bias)
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


def chunk_attention(q: Tensor, k: Tensor, v: Tensor, scale: float) -> Tensor:
    """Causal attention of a prefill chunk that continues a prefix: q [1, H, n, D] at the last n
    positions of k, v [1, Hkv, S, D] (S ≥ n; Hkv divides H).

    fast, on CPU: the prefix (every query sees all of it) and the chunk itself (causal) run as two
    flash-attention calls merged by their log-sum-exps. The prefix call needs no mask — SDPA turns a
    boolean mask into a float one of n × S per call — and takes the query heads that share a key head
    folded into its query length, so the keys are neither repeated nor read once per query head.
    Measured on SmolLM2's shape (9 query / 3 key heads, D 64), 256 queries against 6,000 keys:
    32 ms against 42 ms for one masked grouped call. reference (and other devices): the masked call.
    """
    n, S = q.shape[2], k.shape[2]
    prefix = S - n
    if _mode != "fast" or q.device.type != "cpu" or prefix <= 0 or torch.is_grad_enabled():
        mask = torch.arange(S, device=q.device)[None, :] <= torch.arange(prefix, S, device=q.device)[:, None]
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask[None, None], scale=scale,
                                              enable_gqa=q.shape[1] != k.shape[1])
    flash = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu
    B, H, _, D = q.shape
    Hkv = k.shape[1]
    groups = H // Hkv
    folded = q.reshape(B, Hkv, groups * n, D)  # query head h = key head h // groups
    out_p, lse_p = flash(folded, k[:, :, :prefix], v[:, :, :prefix], scale=scale)[:2]
    out_p, lse_p = out_p.reshape(B, H, n, D), lse_p.reshape(B, H, n)
    own_k, own_v = k[:, :, prefix:], v[:, :, prefix:]
    if groups > 1:
        own_k, own_v = own_k.repeat_interleave(groups, 1), own_v.repeat_interleave(groups, 1)
    out_c, lse_c = flash(q, own_k, own_v, is_causal=True, scale=scale)[:2]
    top = torch.maximum(lse_p, lse_c)
    w_p, w_c = (lse_p - top).exp_(), (lse_c - top).exp_()
    total = w_p + w_c
    merged = out_p.float() * (w_p / total).unsqueeze(-1) + out_c.float() * (w_c / total).unsqueeze(-1)
    return merged.to(q.dtype)


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


def fastest(runs: Sequence[Callable[[], object]], rounds: int = 3) -> list[float]:
    """Each run's least wall time over `rounds` rounds, the runs taken in turn within a round (after
    one warm-up round). A machine's noise only adds time, and comes in spells: taken in turn, a spell
    slows one run of each rather than every run of one, so the comparisons built on these times (a
    curve, a difference, a choice between two forms) hold where back-to-back repeats would not."""
    best = [float("inf")] * len(runs)
    for r in range(rounds + 1):
        for i, run in enumerate(runs):
            t0 = time.perf_counter()
            run()
            if r:
                best[i] = min(best[i], time.perf_counter() - t0)
    return best


def calibrate_skinny(weights: Sequence[Tensor], candidates: Sequence[int] = (1, 2, 4, 8, 16, 32),
                     repeats: int = 16, margin: float = 0.9) -> int:
    """Time both forms of the product over `weights` (a decode step's worth, so they stream from
    memory as they do in a step) at every row count, all of them in turn for `repeats` rounds
    (`fastest`: each run is a few ms, so only rounds spread over a longer span outlast a spell of
    noise); skinny_rows becomes the largest count up to which the weight × xᵀ form is faster by
    `margin` at every count. Returns it. Run it on the thread (and its thread team) that computes."""
    if not weights or weights[0].device.type != "cpu":
        set_skinny_rows(0)
        return 0
    dtype = weights[0].dtype

    def product(rows: int, skinny: bool) -> Callable[[], None]:
        xs = {w.shape[1]: torch.randn(rows, w.shape[1], dtype=dtype) for w in weights}

        def run() -> None:
            set_skinny_rows(rows if skinny else 0)
            with torch.no_grad():
                for w in weights:
                    linear(xs[w.shape[1]], w)

        return run

    old, chosen = _mode, 0
    set_mode("fast")
    try:
        times = fastest([product(rows, skinny) for rows in candidates for skinny in (True, False)], repeats)
    finally:
        set_mode(old)
    for rows, skinny, plain in zip(candidates, times[::2], times[1::2], strict=True):
        if skinny > margin * plain:
            break
        chosen = rows
    set_skinny_rows(chosen)
    return chosen


# --- grouped products (mixture-of-experts) ---------------------------------------------------------
# Which device types run `grouped_mm` as one torch._grouped_mm (the others, and any product whose
# layout or dtype it does not take, run one matmul per group). Default "cuda": on CPUs torch's
# grouped kernel is itself a per-group loop (benchmarks/moe.py --only grouped measures it).
# MINT_GROUPED_DEVICES is read at import ("cuda,cpu", or "" for none); `use_grouped_devices` switches it.
def _grouped_devices_from_env() -> frozenset[str]:
    return frozenset(d.strip().lower() for d in os.environ.get("MINT_GROUPED_DEVICES", "cuda").split(",") if d.strip())


_grouped_devices = _grouped_devices_from_env()
# torch._grouped_mm's fast kernel on CUDA (sm90) is bf16 only; its other dtypes fall back to a loop there.
_GROUPED_DTYPES = {"cuda": (torch.bfloat16,), "cpu": (torch.bfloat16, torch.float32)}
# The CUDA kernel takes fewer than 1024 groups per call (aten GroupMM.cu); (expert, adapter)
# segments can be more (128 experts × 16 bank slots), so they are split into calls (_grouped_in_calls).
GROUPED_MAX_GROUPS = 1023


def grouped_devices() -> frozenset[str]:
    return _grouped_devices


@contextmanager
def use_grouped_devices(devices: Sequence[str]) -> Iterator[None]:
    """Run a block with `grouped_mm`'s grouped kernel on these device types, then restore."""
    global _grouped_devices
    old = _grouped_devices
    _grouped_devices = frozenset(devices)
    try:
        yield
    finally:
        _grouped_devices = old


def grouped_mm(x: Tensor, w: Tensor, offsets: Tensor) -> Tensor:
    """y [P, out] with each row segment g of x [P, in] times w[g]ᵀ (w [G, out, in], any layout whose
    last two dims are row- or column-major). offsets: int32 [G] on x's device, the cumulative ends of
    the segments (offsets[-1] == P); empty segments are allowed. Differentiable in x and w."""
    if _grouped_kernel_takes(x, w):
        return _grouped_in_calls(x, w, offsets)
    sizes = _segment_sizes(offsets)
    ws = w.unbind(0)  # one backward (a stack) for all groups, not one scatter per group
    parts = [xg @ ws[g].transpose(0, 1) for g, xg in enumerate(x.split(sizes)) if sizes[g]]
    return torch.cat(parts) if parts else x.new_zeros(0, w.shape[-2])


def _grouped_in_calls(x: Tensor, w: Tensor, offsets: Tensor) -> Tensor:
    """One _GroupedMM per GROUPED_MAX_GROUPS groups, each over its own groups' rows only. Their
    bounds are read on the host once (one sync): a call padded to every row instead would redo the
    whole product, on zero weights, once per extra call."""
    G = w.shape[0]
    if G <= GROUPED_MAX_GROUPS:
        return _GroupedMM.apply(x, w, offsets)
    ends = offsets.tolist()
    parts = []
    for g0 in range(0, G, GROUPED_MAX_GROUPS):
        g1 = min(g0 + GROUPED_MAX_GROUPS, G)
        r0, r1 = ends[g0 - 1] if g0 else 0, ends[g1 - 1]
        if r1 > r0:  # a call with no rows has nothing to give (its groups' dw stays zero)
            parts.append(_GroupedMM.apply(x[r0:r1], w[g0:g1], offsets[g0:g1] - r0))
    return torch.cat(parts) if parts else x.new_zeros(0, w.shape[-2])


def _segment_sizes(offsets: Tensor) -> list[int]:
    ends = offsets.tolist()
    return [e - s for s, e in zip([0] + ends[:-1], ends, strict=True)]


def _aligned(t: Tensor) -> bool:
    """torch._grouped_mm's layout rule: the last two dims row- or column-major with the other
    stride a multiple of 16 bytes, and a 16-byte aligned start."""
    step = 16 // t.element_size()
    s_row, s_col = t.stride(-2), t.stride(-1)
    major = s_row if s_col == 1 else s_col if s_row == 1 else 0
    return major > 0 and major % step == 0 and t.data_ptr() % 16 == 0


def grouped_kernel_on(x: Tensor) -> bool:
    """Whether grouped_mm runs torch's grouped kernel for x's device and dtype (not a loop of matmuls)."""
    kind = x.device.type
    return kind in _grouped_devices and x.dtype in _GROUPED_DTYPES.get(kind, ())


def _grouped_kernel_takes(x: Tensor, w: Tensor) -> bool:
    if not grouped_kernel_on(x) or w.dtype != x.dtype:
        return False
    # x row-major: the CUDA kernel's dw (segments along the contracted dim) takes empty segments and
    # unaligned bounds only with dyᵀ column-major and x row-major (a device assert otherwise).
    step = 16 // x.element_size()  # the backward's dy [P, out] is row-major too
    return (w.shape[-1] % step == 0 and w.shape[-2] % step == 0 and x.stride(-1) == 1
            and _aligned(x) and _aligned(w))


class _GroupedMM(torch.autograd.Function):
    """torch._grouped_mm with an explicit backward: autograd's own derivative of it passes layouts
    the kernel refuses (e.g. an expanded ones-gradient), and its dw would not use grouped K offsets."""

    @staticmethod
    def forward(ctx, x: Tensor, w: Tensor, offsets: Tensor) -> Tensor:  # type: ignore[override]
        ctx.save_for_backward(x, w, offsets)
        return torch._grouped_mm(x, w.transpose(-2, -1), offs=offsets)

    @staticmethod
    def backward(ctx, dy: Tensor) -> tuple[Tensor | None, Tensor | None, None]:  # type: ignore[override]
        x, w, offsets = ctx.saved_tensors
        dy = dy.contiguous()
        dx = torch._grouped_mm(dy, w, offs=offsets) if ctx.needs_input_grad[0] else None
        # dw[g] = dy_gᵀ x_g: one grouped product with the segments along the contracted dim (zeros for empty ones)
        dw = torch._grouped_mm(dy.t(), x, offs=offsets) if ctx.needs_input_grad[1] else None
        return dx, dw, None
