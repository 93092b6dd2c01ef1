"""Weight-only quantization of the frozen base at load (`mint serve --quantize int8|int4`): QLoRA.

The base's linear projections (attention, MLP, lm_head) and its token embedding are held as
- int8: one int8 per weight, one scale per output row (symmetric, absmax / 127);
- int4: two weights per byte in groups of 64 along the input dim, a scale and a zero per group
  (asymmetric, min/max → 0..15), in the layout torch's CPU int4 kernel reads.
LoRA adapters stay in the compute dtype (fp32 on CPU, bf16 on GPU) and add their delta on top of the
base's product as before (transformer.project); gradients reach the adapters and the activations,
never the base (it holds no Parameters).

Which kernels, and why (measured on this project's CPU, Xeon with AVX-512/AMX, 1 thread, 40 weights of
SmolLM2's 1536 × 576; docs/quantization.md): torch's own `aten._weight_int8pack_mm` and
`aten._weight_int4pack_mm_for_cpu` — what torchao and gpt-fast call on CPU — read the packed weight
directly and are fast only with bf16 activations (1 row: int8 23.6 ms, int4 12.2 ms against fp32's
F.linear 49.1 ms; with fp32 or fp16 activations they take a scalar path, 5-25x slower than fp32).
torchao 0.18's Int8WeightOnlyConfig ran 2x slower than fp32 even on a bf16 module, and its CPU int4
layout is a prototype; so this is a thin wrapper over the two aten ops, with no new dependency.

So a product of few rows outside autograd (a decode step) runs the packed kernel on bf16 copies of
its rows (accumulating in fp32, rounding the output to bf16: the sampler's logits differ from the
dequantized model's by bf16 rounding, tests/model/test_quantize.py states the bound); a product of
many rows (a prompt chunk), and every product of a training pass, dequantizes the weight to the
compute dtype and runs the BLAS product, whose results equal the dequantized model's to float
rounding — and backward always multiplies by the dequantized weight in the compute dtype. On other devices every product
dequantizes (memory is saved; there is no faster kernel wired here).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn

KINDS = ("int8", "int4")
INT4_GROUP = 64  # weights sharing one int4 scale and zero (along the input dim)
INT4_BLOCK_ROWS = 64  # the CPU int4 kernel packs rows in blocks of 64: row j and j + 32 share a byte
# Products of at most this many rows take the packed kernel (bf16 activations); more rows
# dequantize the weight once and run the BLAS product (fp32 on CPU). See benchmarks/quantization.py.
PACKED_MAX_ROWS = 32


class QuantizedWeight(nn.Module):
    """A frozen [out, in] weight held quantized; `dtype` is the compute dtype its products return."""

    def __init__(self, kind: str, weight: Tensor) -> None:
        super().__init__()
        if kind not in KINDS:
            raise ValueError(f"quantize must be one of {', '.join(KINDS)}, got {kind!r}")
        out_features, in_features = weight.shape
        self.kind, self.shape, self.dtype = kind, torch.Size((out_features, in_features)), weight.dtype
        w = weight.detach().float()
        if kind == "int8":
            # The scale is rounded to bf16 first, as the packed kernel reads it with bf16 activations:
            # every path then multiplies by the same scale.
            scale = (w.abs().amax(1) / 127).clamp(min=1e-12).to(torch.bfloat16)
            self.register_buffer("qdata", torch.round(w / scale.float()[:, None]).clamp(-127, 127).to(torch.int8))
            self.register_buffer("scales", scale)
        else:
            rows = -(-out_features // INT4_BLOCK_ROWS) * INT4_BLOCK_ROWS  # padded: the packing's blocks
            if rows != out_features:
                w = torch.cat((w, w.new_zeros(rows - out_features, in_features)))
            g = w.view(rows, in_features // INT4_GROUP, INT4_GROUP)
            lo, hi = g.amin(-1), g.amax(-1)
            scale = ((hi - lo) / 15).clamp(min=1e-12).to(torch.bfloat16).float()
            # the kernel's dequantization: (q - 8) · scale + zero, so zero is the group's value at q = 8
            zero = (lo + 8 * scale).to(torch.bfloat16).float()
            q = torch.round((g - zero[..., None]) / scale[..., None] + 8).clamp(0, 15).to(torch.int32)
            packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(q.view(rows, in_features).cpu(), 1)
            self.register_buffer("qdata", packed.to(weight.device))
            # [in / group, rows, 2] (scale, zero) as the kernel takes them
            self.register_buffer("scales", torch.stack((scale, zero), -1).transpose(0, 1).contiguous().to(torch.bfloat16))

    @property
    def device(self) -> torch.device:
        return self.qdata.device

    def codes(self, rows: slice | None = None) -> Tensor:
        """int4: the 0..15 codes [out, in] (padded rows included) unpacked from the kernel's layout,
        whose bytes hold, per block of 64 rows and per input column, row j in the low nibble and row
        j + 32 in the high one."""
        n_rows, k = self.qdata.shape[0], self.shape[1]
        blocks = self.qdata.view(n_rows // INT4_BLOCK_ROWS, k, INT4_BLOCK_ROWS // 2)
        if rows is not None:
            blocks = blocks[rows]
        both = torch.cat((blocks & 15, blocks >> 4), -1)  # [blocks, in, 64]
        return both.transpose(1, 2).reshape(-1, k)

    def dequantize(self, dtype: torch.dtype | None = None) -> Tensor:
        """The weight [out, in] as the products see it, in `dtype` (default: the compute dtype)."""
        dtype = dtype or self.dtype
        if self.kind == "int8":
            return (self.qdata.to(dtype) * self.scales.to(dtype)[:, None])
        return _int4_values(self.codes(), self.scales, dtype)[: self.shape[0]]

    def dequantize_rows(self, r0: int, r1: int, dtype: torch.dtype) -> Tensor:
        """Rows r0:r1 of the dequantized weight (r0 a multiple of 64)."""
        if self.kind == "int8":
            return self.qdata[r0:r1].to(dtype) * self.scales[r0:r1].to(dtype)[:, None]
        b0 = r0 // INT4_BLOCK_ROWS
        b1 = -(-r1 // INT4_BLOCK_ROWS)
        codes = self.codes(slice(b0, b1))
        first = b0 * INT4_BLOCK_ROWS
        values = _int4_values(codes, self.scales[:, first : b1 * INT4_BLOCK_ROWS], dtype)
        return values[r0 - first : r1 - first]

    def rows(self, ids: Tensor) -> Tensor:
        """Rows `ids` of the weight (an embedding lookup), dequantized: a fresh tensor [*ids, in]."""
        flat = ids.reshape(-1)
        if self.kind == "int8":
            out = self.qdata[flat].to(self.dtype) * self.scales[flat].to(self.dtype)[:, None]
        else:  # each id's bytes in its block of 64 rows: row j of a block in byte j % 32, high nibble from 32
            k, within = self.shape[1], flat % INT4_BLOCK_ROWS
            half = INT4_BLOCK_ROWS // 2
            b = self.qdata.view(-1, k, half)[flat // INT4_BLOCK_ROWS, :, within % half]  # [n, in]
            codes = torch.where((within >= half)[:, None], b >> 4, b & 15)
            out = _int4_values(codes, self.scales[:, flat], self.dtype)
        return out.view(*ids.shape, self.shape[1])

    def packed_product(self, x2d: Tensor) -> Tensor:
        """x2d [rows, in] × weightᵀ through the packed CPU kernel, on bf16 activations."""
        xb = x2d.to(torch.bfloat16)
        if self.kind == "int8":
            y = torch.ops.aten._weight_int8pack_mm(xb, self.qdata, self.scales)
        else:
            y = torch.ops.aten._weight_int4pack_mm_for_cpu(xb, self.qdata, INT4_GROUP, self.scales)
            if y.shape[1] != self.shape[0]:
                y = y[:, : self.shape[0]].contiguous()
        return y.to(x2d.dtype)

    def linear(self, x: Tensor, bias: Tensor | None = None) -> Tensor:
        """F.linear(x, weight, bias) with the weight as stored; differentiable in x (never in the weight)."""
        k = x.shape[-1]
        flat = x.reshape(-1, k)
        # 2-D in, a fresh tensor out: callers add LoRA deltas into it in place, which autograd refuses
        # on a custom Function's output that is a view
        if torch.is_grad_enabled() and x.requires_grad:
            y = _QuantizedProduct.apply(flat, self)
        else:
            y = _product(flat, self, packed=not torch.is_grad_enabled())
        y = y.view(*x.shape[:-1], self.shape[0])
        return y if bias is None else y + bias

    def extra_repr(self) -> str:
        return f"{self.kind}, out={self.shape[0]}, in={self.shape[1]}, dtype={self.dtype}"


def _int4_values(codes: Tensor, scales: Tensor, dtype: torch.dtype) -> Tensor:
    """codes [n, in] (0..15) with their rows' (scale, zero) [in / group, n, 2] as the kernel computes
    them: (q - 8) · scale + zero, in fp32."""
    n = codes.shape[0]
    sz = scales.float()
    scale, zero = sz[..., 0].t()[..., None], sz[..., 1].t()[..., None]  # [n, groups, 1]
    return ((codes.view(n, -1, INT4_GROUP).float() - 8) * scale + zero).view(n, -1).to(dtype)


# Dequantized in blocks of rows of at most this many fp32 bytes: the lm_head's table (SmolLM2's
# 49152 × 576: 113 MB in fp32) is never materialised whole, in forward or backward.
DEQUANT_BLOCK_BYTES = 16 << 20


def _row_blocks(w: QuantizedWeight) -> list[tuple[int, int]]:
    rows = max(INT4_BLOCK_ROWS, DEQUANT_BLOCK_BYTES // (4 * w.shape[1]) // INT4_BLOCK_ROWS * INT4_BLOCK_ROWS)
    return [(r, min(r + rows, w.shape[0])) for r in range(0, w.shape[0], rows)]


def _product(x: Tensor, w: QuantizedWeight, packed: bool) -> Tensor:
    """x [rows, in] × Wᵀ: the packed kernel for a few rows on CPU where `packed` (outside autograd),
    else BLAS on the dequantized weight, a block of its rows at a time (a training pass's forward
    then matches its backward, which multiplies by the dequantized weight, whatever its row count)."""
    if packed and 0 < x.shape[0] <= PACKED_MAX_ROWS and x.device.type == "cpu":
        return w.packed_product(x)
    blocks = _row_blocks(w)
    if len(blocks) == 1:
        return F.linear(x, w.dequantize(x.dtype))
    y = x.new_empty(x.shape[0], w.shape[0])
    for r0, r1 in blocks:
        torch.mm(x, w.dequantize_rows(r0, r1, x.dtype).t(), out=y[:, r0:r1])
    return y


class _QuantizedProduct(torch.autograd.Function):
    """x × Wᵀ with W frozen and quantized: backward is grad × W in the compute dtype."""

    @staticmethod
    def forward(ctx: torch.autograd.function.FunctionCtx, x: Tensor, w: QuantizedWeight) -> Tensor:  # type: ignore[override]
        ctx.weight = w  # type: ignore[attr-defined]
        return _product(x, w, packed=False)

    @staticmethod
    def backward(ctx: torch.autograd.function.FunctionCtx, grad: Tensor) -> tuple[Tensor, None]:  # type: ignore[override]
        w: QuantizedWeight = ctx.weight  # type: ignore[attr-defined]
        blocks = _row_blocks(w)
        if len(blocks) == 1:
            return grad @ w.dequantize(grad.dtype), None
        out = grad.new_zeros(grad.shape[0], w.shape[1])
        for r0, r1 in blocks:
            out.addmm_(grad[:, r0:r1], w.dequantize_rows(r0, r1, grad.dtype))
        return out, None


class QuantizedLinear(nn.Module):
    """A frozen base projection with a QuantizedWeight; transformer.project (kernels.linear) runs it."""

    def __init__(self, weight: QuantizedWeight, bias: Tensor | None) -> None:
        super().__init__()
        self.weight = weight
        self.bias = None if bias is None else nn.Parameter(bias.detach(), requires_grad=False)
        self.out_features, self.in_features = weight.shape

    def forward(self, x: Tensor) -> Tensor:
        return self.weight.linear(x, self.bias)


class QuantizedEmbedding(nn.Module):
    """The token embedding from a QuantizedWeight (shared with lm_head where the base ties them)."""

    def __init__(self, weight: QuantizedWeight) -> None:
        super().__init__()
        self.weight = weight
        self.num_embeddings, self.embedding_dim = weight.shape

    def forward(self, tokens: Tensor) -> Tensor:
        return self.weight.rows(tokens)


def unsupported(model: nn.Module) -> str | None:
    """Why this model's base cannot be quantized here (None: it can): the dense families' standard
    blocks (Llama, Qwen3) on one rank; others keep weights in their own layouts (stacked experts,
    latent attention …)."""
    from mint_server.model.transformer import MLP, Attention, Block, Transformer

    if type(model) is not Transformer:
        return f"family {model.config.family.name}"  # type: ignore[union-attr]
    if getattr(model, "tp", None) is not None:
        return "tensor parallelism"
    for block in model.layers:  # type: ignore[union-attr]
        if type(block) is not Block or type(block.mlp) is not MLP or type(block.self_attn) is not Attention:
            return f"family {model.config.family.name} (its own layer kinds)"  # type: ignore[union-attr]
    return None


def quantize_model(model: nn.Module, kind: str) -> nn.Module:
    """Replace the base's linear projections, lm_head and embedding by quantized ones, in place.
    ValueError naming the flag where the family or a shape cannot be quantized."""
    if kind not in KINDS:
        raise ValueError(f"quantize must be one of {', '.join(KINDS)}, got {kind!r}")
    if (why := unsupported(model)) is not None:
        raise ValueError(f"--quantize {kind} is not supported for {why}")
    if kind == "int4":
        for name, m in model.named_modules():
            if isinstance(m, nn.Linear | nn.Embedding) and m.weight.shape[1] % INT4_GROUP:
                raise ValueError(f"--quantize int4 needs input widths divisible by {INT4_GROUP}; "
                                 f"{name} has {m.weight.shape[1]}")
    for block in model.layers:  # type: ignore[union-attr]
        for parent in (block.self_attn, block.mlp):
            for name, m in list(parent.named_children()):
                if isinstance(m, nn.Linear):
                    setattr(parent, name, QuantizedLinear(QuantizedWeight(kind, m.weight), m.bias))
    tied = model.lm_head.weight is model.embed_tokens.weight  # type: ignore[union-attr]
    table = QuantizedWeight(kind, model.embed_tokens.weight)  # type: ignore[union-attr]
    model.embed_tokens = QuantizedEmbedding(table)
    head = table if tied else QuantizedWeight(kind, model.lm_head.weight)  # type: ignore[union-attr]
    model.lm_head = QuantizedLinear(head, model.lm_head.bias)  # type: ignore[union-attr]
    # What stays in float (norms, biases, rotary tables) may still be views of the checkpoint's
    # memory map, which would keep every page of the fp32 weights the quantization just read resident
    # (as file pages: SmolLM2's int8 process held 950 MB, not 135 + 220): own copies release the map.
    with torch.no_grad():
        for t in [*model.parameters(), *model.buffers()]:
            if t.is_floating_point():
                t.data = t.data.clone()
    _return_freed_heap()
    model.quantized = kind  # type: ignore[assignment]
    return model


def _return_freed_heap() -> None:
    """Hand the heap the fp32 weights and the quantization's temporaries freed back to the kernel
    (glibc keeps it otherwise: 510 MB of SmolLM2's int8 process); a no-op off glibc."""
    try:
        import ctypes

        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):
        pass


def resident_bytes(model: nn.Module) -> int:
    """Bytes of the model's parameters and buffers, each storage counted once (a tied table once)."""
    seen: set[int] = set()
    total = 0
    for t in [*model.parameters(), *model.buffers()]:
        ptr = t.untyped_storage().data_ptr()
        if ptr not in seen:
            seen.add(ptr)
            total += t.untyped_storage().nbytes()
    return total
