"""Pre-quantized checkpoints: read their `quantization_config` and dequantize their weights at load.

Two layouts are read, both dequantized on every device to the engine's dtype (fp32 on CPU, bf16 on
CUDA) as the tensors are read, so the model, LoRA and every kernel see plain float weights:

- **fp8 block-scaled** (`quant_method: "fp8"`, DeepSeek-V3/V3.2, GLM-5, Qwen3 FP8 checkpoints): a
  quantized weight `W` [..., out, in] is float8_e4m3fn, with a companion `W_scale_inv`
  [..., ceil(out/b0), ceil(in/b1)] for `weight_block_size: [b0, b1]`; the weight is
  `W.float() · scale_inv` with each scale repeated over its b0 × b1 block (the last block of a row
  or column may be partial when b does not divide the shape, as transformers' and vLLM's
  dequantization crop it). Scales are float32 (or bf16), or powers of two stored as e8m0
  (`float8_e8m0fnu`, or uint8 with bias 127). Weights without a scale (embeddings, norms, the
  router, whatever `modules_to_not_convert` lists) are stored unquantized and read as they are.
- **MXFP4** (`quant_method: "mxfp4"`, gpt-oss): an expert stack `P` is stored as `P_blocks` [E, R,
  G, 16] uint8 — two fp4 e2m1 values per byte, the low nibble first — and `P_scales` [E, R, G] uint8,
  one e8m0 exponent (2^(s − 127)) per group of 32 values; dequantized it is [E, R, 32·G],
  transposed to transformers' [E, 32·G, R] (transformers' `convert_moe_packed_tensors`).

A config we cannot read is refused naming its field (`quantization_config.<key>`, prequant_spec.py); a checkpoint
whose tensors disagree with it (a quantized weight without its scale, a scale of the wrong shape,
quantized tensors without a quantization_config) is refused naming the tensor.
"""

from __future__ import annotations

import json
import math
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open
from torch import Tensor

from mint_server.model.config import ModelError
from mint_server.model.prequant_spec import Prequantized

FP8_SCALE_SUFFIX = "_scale_inv"
# Per-tensor activation scales of "static" checkpoints: not weights, never read.
FP8_SKIPPED_SUFFIXES = ("_scale_inv", ".activation_scale", ".input_scale")
MXFP4_BLOCKS, MXFP4_SCALES = "_blocks", "_scales"
# fp4 e2m1 codes 0..15: sign bit 3, then a 2-bit exponent and a 1-bit mantissa.
FP4_E2M1_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)
# byte → its two e2m1 values, the low nibble's first.
_BYTE_PAIRS = torch.stack([torch.tensor(FP4_E2M1_VALUES).repeat(16), torch.tensor(FP4_E2M1_VALUES).repeat_interleave(16)], -1)
_FLOAT8 = tuple(getattr(torch, n) for n in ("float8_e4m3fn", "float8_e5m2") if hasattr(torch, n))


def scale_values(scales: Tensor) -> Tensor:
    """float32 multipliers of stored scales: floats as they are; e8m0 exponents (uint8 or
    float8_e8m0fnu) as 2^(s − 127)."""
    if scales.dtype == torch.uint8:
        return torch.exp2(scales.float() - 127.0)
    return scales.float()  # float32 / bf16, and float8_e8m0fnu (torch casts it to its power of two)


def dequantize_fp8_blocks(weight: Tensor, scale_inv: Tensor, block: tuple[int, int], name: str = "weight") -> Tensor:
    """float32 weight · its block scales ([..., out, in] with scales [..., ceil(out/b0), ceil(in/b1)])."""
    if weight.dim() < 2:
        raise ModelError(f"fp8 tensor {name!r} has shape {tuple(weight.shape)}: block scaling needs a matrix")
    rows, cols = weight.shape[-2:]
    want = (*weight.shape[:-2], math.ceil(rows / block[0]), math.ceil(cols / block[1]))
    if tuple(scale_inv.shape) != want:
        raise ModelError(f"{name}{FP8_SCALE_SUFFIX} has shape {tuple(scale_inv.shape)}; weight {name!r} "
                         f"{tuple(weight.shape)} in blocks of {list(block)} needs {want}")
    # Scales are expanded over rows only and broadcast over each row's column blocks through a view,
    # so no second weight-sized tensor is made (as transformers' _dequantize_fp8_weight does).
    row_scales = scale_values(scale_inv).repeat_interleave(block[0], dim=-2)[..., :rows, :]
    out = weight.float()
    full, rest = divmod(cols, block[1])
    out[..., : full * block[1]].unflatten(-1, (full, block[1])).mul_(row_scales[..., :full, None])
    if rest:  # the partial last block of each row
        out[..., full * block[1]:].mul_(row_scales[..., full:])
    return out


def dequantize_mxfp4(blocks: Tensor, scales: Tensor, name: str = "weight") -> Tensor:
    """float32 [..., R, 32·G] of MXFP4 `blocks` [..., R, G, 16] and `scales` [..., R, G], with the
    last two dims swapped as transformers keeps gpt-oss experts ([E, 32·G, R])."""
    if blocks.dtype != torch.uint8 or scales.dtype != torch.uint8 or blocks.dim() < 3:
        raise ModelError(f"MXFP4 tensors of {name!r}: expected uint8 blocks [..., groups, 16] and uint8 scales, "
                         f"got {blocks.dtype} {tuple(blocks.shape)} and {scales.dtype} {tuple(scales.shape)}")
    if tuple(blocks.shape[:-1]) != tuple(scales.shape):
        raise ModelError(f"{name}{MXFP4_SCALES} has shape {tuple(scales.shape)}; {name}{MXFP4_BLOCKS} "
                         f"{tuple(blocks.shape)} needs {tuple(blocks.shape[:-1])}")
    values = _BYTE_PAIRS[blocks.int()].flatten(-2)  # [..., R, G, 32]: one lookup per byte
    values.mul_(scale_values(scales).unsqueeze(-1))
    return values.flatten(-2).transpose(-2, -1).contiguous()


class _Sliceable:
    """A dequantized tensor behind safetensors' `get_slice` interface (the tensor-parallel reads)."""

    def __init__(self, tensor: Tensor) -> None:
        self.tensor = tensor

    def get_shape(self) -> list[int]:
        return list(self.tensor.shape)

    def __getitem__(self, index: Any) -> Tensor:
        return self.tensor[index]


class DequantizingReader:
    """A safetensors handle whose quantized weights read as floats of `dtype`: `keys()` lists the
    checkpoint's weights without their scales (an MXFP4 stack `P` in place of `P_blocks` / `P_scales`),
    and `get_tensor` / `get_slice` dequantize (in float32, then cast: a bf16 engine's host copy of the
    experts stays bf16-sized). A companion stored in another shard is found through the checkpoint's
    other files."""

    def __init__(self, handle: Any, spec: Prequantized | None, files: list[Path],
                 dtype: torch.dtype = torch.float32) -> None:
        self.handle, self.spec, self.files, self.dtype = handle, spec, files, dtype
        self.names = set(handle.keys())
        self._elsewhere: dict[str, Path] | None = None
        if spec is None:
            packed = [n for n in self.names if n.endswith(FP8_SCALE_SUFFIX)
                      or (n.endswith(MXFP4_BLOCKS) and n.removesuffix(MXFP4_BLOCKS) + MXFP4_SCALES in self.names)]
            if packed:
                raise ModelError(f"the checkpoint holds quantized tensors ({sorted(packed)[0]!r}) but config.json "
                                 "has no quantization_config")

    def keys(self) -> Iterator[str]:
        for name in sorted(self.names):
            if self.spec is not None and self.spec.method == "fp8" and name.endswith(FP8_SKIPPED_SUFFIXES):
                continue
            if self.spec is not None and self.spec.method == "mxfp4":
                if name.endswith(MXFP4_SCALES) and name.removesuffix(MXFP4_SCALES) + MXFP4_BLOCKS in self.names:
                    continue
                if name.endswith(MXFP4_BLOCKS):
                    yield name.removesuffix(MXFP4_BLOCKS)
                    continue
            yield name

    def get_tensor(self, name: str) -> Tensor:
        if self.spec is not None and self.spec.method == "mxfp4" and name + MXFP4_BLOCKS in self.names:
            return dequantize_mxfp4(self.handle.get_tensor(name + MXFP4_BLOCKS), self._companion(name, MXFP4_SCALES),
                                    name).to(self.dtype)
        tensor = self.handle.get_tensor(name)
        if tensor.dtype in _FLOAT8:
            if self.spec is None or self.spec.method != "fp8":
                raise ModelError(f"tensor {name!r} is {tensor.dtype} but config.json's quantization_config "
                                 "does not say fp8")
            return dequantize_fp8_blocks(tensor, self._companion(name, FP8_SCALE_SUFFIX), self.spec.block,
                                         name).to(self.dtype)
        return tensor

    def get_slice(self, name: str) -> Any:
        """A tensor-parallel rank's read: a quantized weight is dequantized whole, then sliced (its scales
        follow whole blocks); any other tensor is sliced as it is stored."""
        if name + MXFP4_BLOCKS in self.names or self.handle.get_slice(name).get_dtype().startswith("F8"):
            return _Sliceable(self.get_tensor(name))
        return self.handle.get_slice(name)

    def _companion(self, name: str, suffix: str) -> Tensor:
        """`name + suffix` from this shard, or from whichever shard of the checkpoint holds it."""
        want = name + suffix
        if want in self.names:
            return self.handle.get_tensor(want)
        if self._elsewhere is None:
            self._elsewhere = _tensor_files(self.files)
        if want not in self._elsewhere:
            raise ModelError(f"quantized tensor {name!r} has no {want!r} in the checkpoint")
        with safe_open(str(self._elsewhere[want]), framework="pt", device="cpu") as other:
            return other.get_tensor(want)


def _tensor_files(files: list[Path]) -> dict[str, Path]:
    index = files[0].parent / "model.safetensors.index.json" if files else None
    if index is not None and index.is_file():
        return {k: index.parent / v for k, v in json.loads(index.read_text())["weight_map"].items()}
    out: dict[str, Path] = {}
    for f in files:
        with safe_open(str(f), framework="pt", device="cpu") as sf:
            out.update(dict.fromkeys(sf.keys(), f))
    return out
